"""Single-process greedy generation: the oracle disaggregated serving must match token for token.

Deliberately the plain path (whole prompt in one pass, TP=1, one request at a time), sharing
nothing with the serving schedulers but the model definition.
"""

from __future__ import annotations

import torch

from .cache import PagedKV
from .model import EOS, Batch, TinyConfig, TinyModel
from .tokens import decode, encode

__all__ = ["decode", "encode", "generate"]


@torch.no_grad()
def generate(
    cfg: TinyConfig,
    prompt: list[int],
    max_tokens: int,
    model: TinyModel | None = None,
    page_size: int = 16,
) -> list[int]:
    """Greedy tokens after `prompt` (EOS ends generation and is not returned)."""
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    model = model or TinyModel(cfg)
    total = len(prompt) + max_tokens
    kv = PagedKV(cfg, cfg.cache_heads, -(-total // page_size), page_size)
    pages = kv.pages.alloc(kv.pages.num_pages)
    out: list[int] = []
    run, start = list(prompt), 0
    while len(out) < max_tokens:
        hidden = model.forward(Batch.build([(run, start, pages)], page_size), kv.layers, page_size)
        tok = int(model.logits(hidden[-1:]).argmax(-1))
        if tok in getattr(model, "eos_ids", (EOS,)):
            break
        out.append(tok)
        start += len(run)
        run = [tok]
    return out
