"""Shard routes: which prefill rank sends which KV-head slice to which decode rank.

Pure functions shared by `pdtool plan` (to show and check a deployment) and by the messenger
(to issue writes and to know how many to count), so both always agree on the arithmetic.

Sharding model (docs/sharding.md). A side has `tp` GPUs per instance and `dp` attention replicas;
attention is sharded over `attn_tp = tp // dp` ranks. With `H` KV heads (MLA: one latent head):
  * `H % attn_tp == 0`: rank r holds heads [r*H/attn_tp, (r+1)*H/attn_tp) (head-sharded);
  * `attn_tp % H == 0`: rank r holds head r // (attn_tp/H), so every head has attn_tp/H
    replicas and any replica may send it (MLA is the case H == 1).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

LAYOUTS = ("HND", "NHD")


class RouteError(ValueError):
    """A sharding that no route can serve (the validator reports these as config errors)."""


@dataclass(frozen=True)
class ShardSpec:
    """How one side (prefill or decode) shards its KV cache."""

    num_kv_heads: int
    tp: int
    dp: int = 1

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp

    @property
    def replicated(self) -> bool:
        """True when each head lives on more than one rank (MLA, or GQA with tp > heads)."""
        return self.attn_tp > self.num_kv_heads

    def check(self) -> None:
        if self.num_kv_heads < 1 or self.tp < 1 or self.dp < 1:
            raise RouteError(f"heads, tp and dp must be >= 1, got {self}")
        if self.tp % self.dp:
            raise RouteError(f"tp={self.tp} is not a multiple of dp={self.dp}")
        h, t = self.num_kv_heads, self.attn_tp
        if h % t and t % h:
            raise RouteError(
                f"{h} KV heads cannot be split over attention TP {t}: "
                f"need heads % tp == 0 or tp % heads == 0"
            )

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.attn_tp)

    def heads_of(self, rank: int) -> range:
        """Global KV heads held by attention rank `rank`."""
        if self.replicated:
            head = rank // (self.attn_tp // self.num_kv_heads)
            return range(head, head + 1)
        n = self.heads_per_rank
        return range(rank * n, (rank + 1) * n)

    def holders(self, head: int) -> list[int]:
        """Attention ranks that hold `head` (one unless replicated)."""
        if self.replicated:
            r = self.attn_tp // self.num_kv_heads
            return list(range(head * r, (head + 1) * r))
        return [head // self.heads_per_rank]


@dataclass(frozen=True)
class Slice:
    """One contiguous run of KV heads sent from one prefill rank to one decode rank.

    `src_head_off` / `dst_head_off` are offsets in the local head dimension of each side's
    page; `num_heads` heads starting there are copied.
    """

    src_rank: int
    dst_rank: int
    head_lo: int
    num_heads: int
    src_head_off: int
    dst_head_off: int


def _check_pair(src: ShardSpec, dst: ShardSpec) -> None:
    src.check()
    dst.check()
    if src.num_kv_heads != dst.num_kv_heads:
        raise RouteError(
            f"prefill has {src.num_kv_heads} KV heads, decode {dst.num_kv_heads}: must match"
        )


def candidate_sources(src: ShardSpec, dst: ShardSpec, dst_rank: int) -> list[list[int]]:
    """For each head run a decode rank needs, the prefill ranks that could send it.

    Returns one list of candidate ranks per distinct source group, in head order: a decode rank
    that needs heads held by two different prefill ranks gets two entries.
    """
    _check_pair(src, dst)
    groups: list[list[int]] = []
    for head in dst.heads_of(dst_rank):
        cands = src.holders(head)
        if not groups or groups[-1] != cands:
            groups.append(cands)
    return groups


def routes_for(
    src: ShardSpec,
    dst: ShardSpec,
    dst_rank: int,
    rng: random.Random | None = None,
) -> list[Slice]:
    """The slices decode rank `dst_rank` receives for one request.

    Where a head is replicated on several prefill ranks, one replica is drawn with `rng` (so
    requests spread over every prefill GPU and its NIC); without `rng` the first replica is used,
    which keeps plans deterministic.
    """
    _check_pair(src, dst)
    dst_heads = dst.heads_of(dst_rank)
    out: list[Slice] = []
    for cands in candidate_sources(src, dst, dst_rank):
        rank = rng.choice(cands) if rng is not None else cands[0]
        src_heads = src.heads_of(rank)
        lo = max(src_heads.start, dst_heads.start)
        hi = min(src_heads.stop, dst_heads.stop)
        out.append(
            Slice(
                src_rank=rank,
                dst_rank=dst_rank,
                head_lo=lo,
                num_heads=hi - lo,
                src_head_off=lo - src_heads.start,
                dst_head_off=lo - dst_heads.start,
            )
        )
    return out


def all_routes(src: ShardSpec, dst: ShardSpec) -> list[Slice]:
    """Deterministic routes for every decode attention rank (first replica where replicated)."""
    return [s for d in range(dst.attn_tp) for s in routes_for(src, dst, d)]


def writes_per_page(
    sl: Slice, src: ShardSpec, dst: ShardSpec, layout: str, page_size: int
) -> int:
    """RMA writes one slice needs per page and per layer buffer.

    HND keeps heads outermost, so any head run is one contiguous range on both sides. NHD
    interleaves heads inside each token, so a partial head run is one write per token; a slice
    covering every local head on both sides is still one contiguous page.
    """
    if layout not in LAYOUTS:
        raise RouteError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "HND":
        return 1
    whole = sl.num_heads == src.heads_per_rank == dst.heads_per_rank
    return 1 if whole else page_size


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages prefill sends for a prompt of `num_tokens`: it stops one token short
    (docs/messenger.md, step 4)."""
    return math.ceil(max(num_tokens - 1, 0) / page_size)


def slice_ops(
    sl: Slice,
    src: ShardSpec,
    dst: ShardSpec,
    *,
    layout: str,
    page_size: int,
    num_pages: int,
    writes_per_op: int = 1,
) -> int:
    """Completions one slice produces per layer buffer for a request of `num_pages` pages.

    Its writes, in page order, go `writes_per_op` to an operation (one fi_writemsg with an iov
    per write, one CQ entry on each side); operation boundaries sit at multiples of
    `writes_per_op` from the first write, so the count does not depend on how the prompt was
    chunked. 1 = one operation per write.
    """
    if writes_per_op < 1:
        raise RouteError(f"writes_per_op must be >= 1, got {writes_per_op}")
    writes = num_pages * writes_per_page(sl, src, dst, layout, page_size)
    return -(-writes // writes_per_op)


def sendable(sent: int, ready: int, total: int, writes_per_op: int) -> int:
    """How far a sender may go in a slice's write sequence: writes [sent, ready) are in the
    cache, `total` make the request. Only whole operations leave before the end (operations
    start at multiples of `writes_per_op`), so the count the decoder expects (`slice_ops`)
    holds for any chunking; at the end the last, shorter operation goes too."""
    if ready >= total:
        return total
    return sent + (ready - sent) // writes_per_op * writes_per_op


def expected_writes(
    slices: Sequence[Slice],
    src: ShardSpec,
    dst: ShardSpec,
    *,
    layout: str,
    page_size: int,
    num_pages: int,
    num_layers: int,
    buffers_per_layer: int = 1,
    aux_writes: int = 0,
    writes_per_op: int = 1,
) -> int:
    """Completions a decode rank counts before a request is complete.

    With one write per operation: pages × layers × layer buffers × Σ_slices(writes per page) +
    context/metadata copies. `buffers_per_layer` is 1 for a fused K/V page (or MLA's latent),
    2 for separate K and V. With `writes_per_op` > 1 each slice's writes per layer buffer are
    grouped (`slice_ops`); context copies stay one operation each.
    """
    per_buffer = sum(slice_ops(s, src, dst, layout=layout, page_size=page_size,
                               num_pages=num_pages, writes_per_op=writes_per_op)
                     for s in slices)
    return num_layers * buffers_per_layer * per_buffer + aux_writes
