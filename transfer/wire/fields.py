"""Field checkers for message bodies: each returns the checked value or raises `WireError`
naming the field by its path (`REQUEST.layout.page_size: expected int >= 1, got 'x'`).

Schemas are plain compositions of these (`map_field({...})`), so a body is validated in one
pass with no trust in its shape: a signed sender can still be buggy, and a receiver must drop
its message with a reason instead of raising a KeyError into a serving loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class WireError(ValueError):
    """A message or wire setting that is refused; the text names the offending field."""


Check = Callable[[str, Any], Any]


def _type_name(v: Any) -> str:
    return type(v).__name__


def int_field(lo: int = 0, hi: int = (1 << 64) - 1) -> Check:
    def check(path: str, v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise WireError(f"{path}: expected int, got {_type_name(v)}")
        if not lo <= v <= hi:
            raise WireError(f"{path}: expected int in [{lo}, {hi}], got {v}")
        return v
    return check


def optional(item: Check) -> Check:
    """`item` or None (msgpack nil)."""
    def check(path: str, v: Any) -> Any:
        return None if v is None else item(path, v)
    return check


def float_field(lo: float = 0.0, hi: float = 1e9) -> Check:
    def check(path: str, v: Any) -> float:
        if not isinstance(v, int | float) or isinstance(v, bool) or not lo <= v <= hi:
            raise WireError(f"{path}: expected a number in [{lo}, {hi}], got {v!r}")
        return float(v)
    return check


def bool_field() -> Check:
    def check(path: str, v: Any) -> bool:
        if not isinstance(v, bool):
            raise WireError(f"{path}: expected bool, got {_type_name(v)}")
        return v
    return check


def str_field(max_len: int = 256, choices: tuple[str, ...] | None = None,
              min_len: int = 0) -> Check:
    def check(path: str, v: Any) -> str:
        if not isinstance(v, str):
            raise WireError(f"{path}: expected str, got {_type_name(v)}")
        if not min_len <= len(v) <= max_len:
            raise WireError(f"{path}: expected {min_len}..{max_len} characters, got {len(v)}")
        if choices is not None and v not in choices:
            raise WireError(f"{path}: expected one of {choices}, got {v!r}")
        return v
    return check


def bytes_field(max_len: int, multiple_of: int = 1, min_len: int = 0) -> Check:
    """Raw bytes (e.g. a little-endian uint32 array, decoded by the receiver with numpy)."""
    def check(path: str, v: Any) -> bytes:
        if not isinstance(v, bytes):
            raise WireError(f"{path}: expected bytes, got {_type_name(v)}")
        if not min_len <= len(v) <= max_len or len(v) % multiple_of:
            raise WireError(f"{path}: expected {min_len}..{max_len} bytes in multiples of "
                            f"{multiple_of}, got {len(v)}")
        return v
    return check


def list_field(item: Check, max_items: int, min_items: int = 0) -> Check:
    def check(path: str, v: Any) -> list[Any]:
        if not isinstance(v, list):
            raise WireError(f"{path}: expected a list, got {_type_name(v)}")
        if not min_items <= len(v) <= max_items:
            raise WireError(f"{path}: expected {min_items}..{max_items} items, got {len(v)}")
        return [item(f"{path}[{i}]", x) for i, x in enumerate(v)]
    return check


def map_field(schema: dict[str, Check], optional_keys: frozenset[str] = frozenset()) -> Check:
    """A map with exactly these keys (missing and unknown keys are both refused; keys in
    `optional_keys` may be absent)."""
    def check(path: str, v: Any) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise WireError(f"{path}: expected a map, got {_type_name(v)}")
        for k in v:
            if k not in schema:
                raise WireError(f"{path}.{k}: unknown field")
        out = {}
        for k, c in schema.items():
            if k not in v:
                if k in optional_keys:
                    continue
                raise WireError(f"{path}.{k}: missing field")
            out[k] = c(f"{path}.{k}", v[k])
        return out
    return check
