"""Shard routes: which prefill rank sends which KV-head slice to which decode rank.

Pure functions shared by `pdtool plan` (to show and check a deployment), the messenger and the
SGLang backend (to issue writes), so all agree on who sends what. How many writes a slice costs
in an engine's pages is `transfer.geometry`'s; the degrees arithmetic is `transfer.parallel`'s.

Sharding model (docs/sharding.md): `transfer.parallel` (which heads a rank holds, and replicas).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Collection
from dataclasses import dataclass

from .parallel import ParallelDims

LAYOUTS = ("HND", "NHD")


class RouteError(ValueError):
    """A sharding that no route can serve (the validator reports these as config errors)."""


@dataclass(frozen=True)
class ShardSpec:
    """How one side (prefill or decode) shards its KV cache: `dp` attention groups in a TP
    group of `tp` ranks. The arithmetic is `transfer.parallel.ParallelDims`' (`dims`)."""

    num_kv_heads: int
    tp: int
    dp: int = 1

    @functools.cached_property
    def dims(self) -> ParallelDims:
        """Built once per spec: the messengers route every request through it."""
        return ParallelDims(tp=self.tp, dp=self.dp, dp_attention=True,
                            kv_heads=self.num_kv_heads)

    @property
    def attn_tp(self) -> int:
        return self.dims.attn_tp

    @property
    def replicated(self) -> bool:
        """True when each head lives on more than one rank (MLA, or GQA with tp > heads)."""
        return self.dims.replicated

    def check(self) -> None:
        """Raise RouteError with every problem of the degrees (`ParallelDims.problems`)."""
        if self._problems:
            raise RouteError(self._problems)

    @functools.cached_property
    def _problems(self) -> str:
        """The degrees never change: checked once per spec, not once per routed request."""
        return "; ".join(p.message for p in self.dims.problems())

    @property
    def heads_per_rank(self) -> int:
        return self.dims.heads_per_rank

    def heads_of(self, rank: int) -> range:
        """Global KV heads held by attention rank `rank`."""
        return self.dims.heads_of(rank)

    def holders(self, head: int) -> list[int]:
        """Attention ranks that hold `head` (one unless replicated)."""
        return self.dims.holders(head)


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
    allowed: Collection[int] | None = None,
) -> list[Slice]:
    """The slices decode rank `dst_rank` receives for one request.

    Where a head is replicated on several prefill ranks, one replica is drawn with `rng` (so
    requests spread over every prefill GPU and its NIC); without `rng` the first replica is used,
    which keeps plans deterministic. `allowed`: only these prefill ranks may send (the ones a
    decode rank is connected to, as SGLang connects them); a head none of them holds is a
    RouteError.
    """
    _check_pair(src, dst)
    dst_heads = dst.heads_of(dst_rank)
    out: list[Slice] = []
    for cands in candidate_sources(src, dst, dst_rank):
        if allowed is not None:
            cands = [c for c in cands if c in allowed]
            if not cands:
                raise RouteError(f"decode rank {dst_rank}: none of the prefill ranks it is "
                                 f"connected to ({sorted(allowed)}) holds its heads")
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


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages prefill sends for a prompt of `num_tokens`: it stops one token short
    (docs/messenger.md, step 4)."""
    return math.ceil(max(num_tokens - 1, 0) / page_size)


def sendable(sent: int, ready: int, total: int, writes_per_op: int) -> int:
    """How far a sender may go in a slice's write sequence: writes [sent, ready) are in the
    cache, `total` make the request. Only whole operations leave before the end (operations
    start at multiples of `writes_per_op`), so the count the decoder expects (`slice_ops`)
    holds for any chunking; at the end the last, shorter operation goes too."""
    if ready >= total:
        return total
    return sent + (ready - sent) // writes_per_op * writes_per_op
