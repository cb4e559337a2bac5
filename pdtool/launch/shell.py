"""Shell words built in Python, rendered by Jinja: every literal is quoted, nothing is spliced.

A command line in a rendered script is a list of *words*. A word is usually a plain `str` (a
literal, always passed through `shlex.quote`), or a `Word` made of literal parts and references
to shell variables that only exist when the script runs (`$RUN_DIR`, `${HOSTS[2]}`), such as
`--dist-init-addr=${HOSTS[0]}:20000` where the host is known only inside the Slurm allocation.
Rendering a `Word` concatenates `'quoted literal'` and `"${VAR}"` pieces into ONE shell word,
so a hostile value (spaces, quotes, `$()`, `;`, backticks, newlines) stays a single literal
argument whatever it contains.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_VAR_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\[[0-9]+\])?$")


@dataclass(frozen=True)
class Var:
    """A reference to a shell variable (`RUN_DIR`, `HOSTS[2]`) expanded when the script runs."""

    name: str

    def __post_init__(self) -> None:
        if not _VAR_RE.match(self.name):
            raise ValueError(f"not a shell variable reference: {self.name!r}")


@dataclass(frozen=True)
class Word:
    """One shell word made of literal strings and `Var` references."""

    parts: tuple[str | Var, ...]

    def resolve(self, variables: Mapping[str, str]) -> str:
        """The word's value once the script's variables are known (for tests and dry runs)."""
        return "".join(p if isinstance(p, str) else variables[p.name] for p in self.parts)


def word(*parts: str | Var) -> Word:
    return Word(tuple(parts))


def q(value: object) -> str:
    """Jinja filter: a value as one quoted shell word (a `Word` keeps its variable parts)."""
    if isinstance(value, Word):
        out = []
        for part in value.parts:
            if isinstance(part, Var):
                out.append('"${' + part.name + '}"')
            elif part:
                out.append(shlex.quote(part))
        return "".join(out) or "''"
    if isinstance(value, Var):
        return '"${' + value.name + '}"'
    if isinstance(value, bool):
        value = "true" if value else "false"
    if isinstance(value, (list, tuple)):
        raise TypeError("q: use the `words` filter for a list of words")
    return shlex.quote(str(value))


def words(values: Iterable[object]) -> str:
    """Jinja filter: a list of words as a quoted command line."""
    return " ".join(q(v) for v in values)


def resolve(argv: Iterable[object], variables: Mapping[str, str]) -> list[str]:
    """A word list as the argv a process would receive, given the script's variables."""
    out = []
    for a in argv:
        if isinstance(a, Word):
            out.append(a.resolve(variables))
        elif isinstance(a, Var):
            out.append(variables[a.name])
        else:
            out.append(str(a))
    return out


def display(argv: Iterable[object]) -> str:
    """A word list as a copy-pasteable command (what `--dry-run` prints)."""
    return words(argv)
