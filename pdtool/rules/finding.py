"""The value every validation step returns: what is wrong, where, and how to fix it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Finding:
    """One problem in a config.

    `key` is the dotted config key the user would change (`prefill.tp`, `cluster.nics`), so the
    message can be acted on from the command line; `fix` says how (often a `key=value`).
    """

    severity: Severity
    key: str
    message: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def error(key: str, message: str, fix: str = "") -> Finding:
    return Finding("error", key, message, fix)


def warning(key: str, message: str, fix: str = "") -> Finding:
    return Finding("warning", key, message, fix)


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)
