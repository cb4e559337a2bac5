"""Prompt and output lengths drawn from a seeded distribution, and prompts of those lengths.

A length spec is `N` (always N), `A-B` (uniform integers in [A, B]) or `A-B:log` (log-uniform,
many short and a few long, as chat traffic is). Prompts are token ids, which an OpenAI
completions endpoint takes as a list of integers: for the reference engine's byte-level
vocabulary an N-token prompt is N byte ids (0..255), for a model with a Hugging Face tokenizer N
ids below its `vocab_size`; either way the server sees exactly N prompt tokens, which a text
prompt would not guarantee.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

_SPEC = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*(?::\s*(log|uniform)\s*)?)?$")


class SpecError(ValueError):
    """A length spec that does not parse; the text names the option and the expected form."""


@dataclass(frozen=True)
class Lengths:
    """A distribution of token counts (inclusive bounds)."""

    low: int
    high: int
    log: bool = False

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.low == self.high:
            return [self.low] * n
        if self.log:
            x = np.exp(rng.uniform(np.log(self.low), np.log(self.high + 1), n))
            return [min(self.high, int(v)) for v in x]
        return [int(v) for v in rng.integers(self.low, self.high + 1, n)]

    def __str__(self) -> str:
        if self.low == self.high:
            return str(self.low)
        return f"{self.low}-{self.high}" + (":log" if self.log else "")


def parse_lengths(text: str, option: str, minimum: int = 1) -> Lengths:
    m = _SPEC.match(text)
    if not m:
        raise SpecError(f"{option}: expected N, A-B or A-B:log (token counts), got {text!r}")
    low = int(m.group(1))
    high = int(m.group(2)) if m.group(2) else low
    if low < minimum or high < low:
        raise SpecError(f"{option}: expected {minimum} <= A <= B, got {text!r}")
    return Lengths(low, high, m.group(3) == "log")


def prompts(rng: np.random.Generator, lengths: list[int], vocab: int,
            shared: int = 0) -> list[list[int]]:
    """One random prompt of token ids per length (ids in [0, vocab)), the first `shared` of
    them the same in every prompt (drawn once)."""
    if vocab < 2:
        raise SpecError(f"model.vocab_size: expected at least 2 token ids, got {vocab}")
    if shared and shared >= min(lengths):
        raise SpecError(f"--shared-prefix: {shared} tokens leave nothing of the shortest "
                        f"prompt ({min(lengths)} tokens) to differ; use fewer, or longer --isl")
    prefix = rng.integers(0, vocab, shared).tolist()
    return [prefix + rng.integers(0, vocab, n - shared).tolist() for n in lengths]
