"""Every config key with its type and one line of meaning, read from the schema.

The schema's dataclasses (`pdtool.schema`) are the one home of the keys: their types are the
fields' (their values come from the config groups, so `pdtool config --keys` shows the
resolved value instead of a schema default), and the meaning of a key is the comment written
beside its field (or just above it). validate's "did you mean" uses the same schema, so what
is listed here is exactly what composes.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize
import types
import typing
from dataclasses import dataclass
from functools import cache

from pdtool.schema import Config


@dataclass(frozen=True)
class KeyDoc:
    key: str
    type: str
    meaning: str


def _type_name(hint: typing.Any) -> str:
    if typing.get_origin(hint) is list:
        return f"list[{_type_name(typing.get_args(hint)[0])}]"
    if typing.get_origin(hint) is dict:
        k, v = typing.get_args(hint)
        return f"dict[{_type_name(k)}, {_type_name(v)}]"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))


@cache
def _comments(cls: type) -> dict[str, str]:
    """Field name -> its comment: the one on its line (continued on the comment lines below
    while it has not ended: an open parenthesis, no closing punctuation), or else the comment
    lines right above it."""
    lines = inspect.getsource(cls).splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    above: list[str] = []
    open_field = ""  # a field whose trailing comment may go on below
    for line in lines:
        text = line.strip()
        if text.startswith("#"):
            said = text.lstrip("#").strip()
            if open_field and _goes_on(out[open_field]):
                out[open_field] += " " + said
            else:
                open_field = ""
                above.append(said)
            continue
        name = text.split(":", 1)[0].strip()
        open_field = ""
        if name in names and ":" in text:
            hashed, comment = _split_comment(line)
            out[name] = comment.strip() if hashed else " ".join(above)
            open_field = name if hashed else ""
        above = []
    return out


def _split_comment(line: str) -> tuple[bool, str]:
    """(whether a comment ends the source line, the comment): a `#` inside a string is not
    one."""
    for tok in tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline):
        if tok.type == tokenize.COMMENT:
            return True, tok.string.lstrip("#")
    return False, ""


def _goes_on(text: str) -> bool:
    """A trailing comment goes on below while a parenthesis it opened is not closed (longer
    ones are written above their field)."""
    return text.count("(") > text.count(")")


def _first_sentence(text: str, limit: int = 160) -> str:
    cut = text.replace("e.g. ", "e.g._").replace("i.e. ", "i.e._").find(". ")
    text = text if cut < 0 else text[:cut + 1]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def schema_keys(cls: type = Config, prefix: str = "") -> list[KeyDoc]:
    """Every leaf key under `cls` (the whole config by default), in schema order. A list of
    dataclasses (cluster.nics) lists its items' keys as `cluster.nics[].name`."""
    hints = typing.get_type_hints(cls)
    meanings = _comments(cls)
    out: list[KeyDoc] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        key = f"{prefix}{f.name}"
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out += schema_keys(hint, f"{key}.")
            continue
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
        out.append(KeyDoc(key, _type_name(hint), _first_sentence(meanings.get(f.name, ""))))
        if isinstance(item, type) and dataclasses.is_dataclass(item):
            out += schema_keys(item, f"{key}[].")
    return out
