"""`pdtool bench --verify N`: a correctness gate before any figure is measured.

A deployment that answers HTTP 200 with wrong tokens (a faulty NIC, a page-size mismatch, a
page written to the wrong place) passes a load test; published benchmark runs have shipped
exactly that. The gate sends N greedy prompts to every target and compares the texts with a
reference: the model itself, computed in this process, where pdtool can (the reference engine:
`client.oracle_texts`), and otherwise the first target, where `--compare aggregated` gives one
with no KV transfer at all. Any difference stops the bench, naming the prompt, the target and
the first differing character.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class VerifyError(RuntimeError):
    """The deployment's outputs differ from the reference (or cannot be checked)."""


@dataclass(frozen=True)
class Mismatch:
    prompt: int  # index among the verify prompts
    target: str
    reference: str  # what it was compared with
    position: int  # first differing character
    got: str
    want: str

    def __str__(self) -> str:
        lo = max(0, self.position - 10)
        return (f"prompt {self.prompt} on {self.target}: differs from {self.reference} at "
                f"character {self.position}: got {self.got[lo:self.position + 20]!r}, want "
                f"{self.want[lo:self.position + 20]!r}")


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """Index of the first character (or token) where `a` and `b` differ (None: equal)."""
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


async def texts(api: Any, model: str, prompts: Sequence[Any], max_tokens: Sequence[int]
                ) -> list[str]:
    """Each prompt's greedy completion, one request at a time (non-streamed)."""
    import openai

    out = []
    for i, (prompt, limit) in enumerate(zip(prompts, max_tokens, strict=True)):
        try:
            resp = await api.completions.create(model=model, prompt=prompt, max_tokens=limit,
                                                temperature=0.0)
        except openai.APIError as exc:
            raise VerifyError(f"--verify: prompt {i} failed: {exc}") from None
        out.append(resp.choices[0].text)
    return out


def compare(got: dict[str, list[str]], reference: tuple[str, list[str]]) -> list[Mismatch]:
    """Every target's texts against the reference's, prompt by prompt."""
    name, want = reference
    out = []
    for target, texts_ in got.items():
        if target == name:
            continue
        for i, (g, w) in enumerate(zip(texts_, want, strict=True)):
            pos = first_difference(g, w)
            if pos is not None:
                out.append(Mismatch(i, target, name, pos, g, w))
    return out
