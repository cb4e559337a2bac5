"""Byte-level tokens (no torch import, so the front starts fast): any text is a valid prompt."""

from __future__ import annotations

EOS = 256  # the one token beyond the bytes; generation stops there


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
