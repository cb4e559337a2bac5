"""One place for the parallelism arithmetic of a serving instance (GPUs, attention TP/DP, heads).

Modelled on torchtitan's `ParallelDims`: one frozen record of the degrees, every derived figure
a property of it, and `problems()` that says, with every factor shown, why a combination cannot
run. The config schema, the planner, the memory fit, the shard rules, `transfer.routes.ShardSpec`
and the SGLang backend all ask this object instead of re-deriving `tp // dp` on their own.

Terms (SGLang's): an instance runs `--tp N`; with `--enable-dp-attention --dp D` its N GPUs
form D attention groups of N/D ranks each (experts stay sharded over all N); without DP attention
`dp` means D independent TP-N replicas, so the instance holds N*D GPUs. Attention is sharded
over `attn_tp` ranks; with H KV-cache heads (MLA: one latent head):
  * `H % attn_tp == 0`: rank r holds heads [r*H/attn_tp, (r+1)*H/attn_tp) (heads sharded);
  * `attn_tp % H == 0`: rank r holds head r // (attn_tp/H): each head has attn_tp/H replicas.

This module is pure arithmetic; it lives in `transfer/` because `transfer/` never imports
`pdtool/`, and both need it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """Why a set of degrees cannot run. `field` is the degree to change (`tp`, `dp`, `nodes`,
    `num_kv_heads`); callers prefix it with their own key (`prefill.tp`)."""

    field: str
    message: str
    fix: str


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of one instance (one prefill or decode server).

    `kv_heads` counts KV-cache heads (1 for MLA's latent). `nodes` is nodes per instance and
    `gpus_per_node` the node size (0 when unknown: no node arithmetic). `role` only names the
    keys in messages (`prefill` -> `prefill.tp`); empty names the bare degrees.
    """

    tp: int
    dp: int = 1
    dp_attention: bool = False
    kv_heads: int = 1
    nodes: int = 1
    gpus_per_node: int = 0
    role: str = ""

    # -- degrees ---------------------------------------------------------------------------
    @property
    def gpus(self) -> int:
        """GPUs one instance occupies: `tp` with DP attention, else `tp * dp` replicas."""
        return self.tp if self.dp_attention else self.tp * self.dp

    @property
    def attn_dp(self) -> int:
        """Attention groups sharing one TP group (DP attention), 1 without it."""
        return self.dp if self.dp_attention else 1

    @property
    def replicas(self) -> int:
        """Attention replicas per instance, each `attn_tp` GPUs wide (DP groups or TP copies)."""
        return self.dp

    @property
    def attn_tp(self) -> int:
        """Ranks one attention replica shards its heads over."""
        return self.tp // max(self.attn_dp, 1)

    # -- heads -----------------------------------------------------------------------------
    @property
    def replicated(self) -> bool:
        """True when each head lives on more than one rank (MLA, or GQA with tp > heads)."""
        return self.attn_tp > self.kv_heads

    @property
    def replication(self) -> int:
        """Ranks holding each head: attn_tp / heads when replicated, else 1."""
        return self.attn_tp // self.kv_heads if self.replicated else 1

    @property
    def heads_per_rank(self) -> int:
        """KV heads one attention rank stores (a replicated head counts once per rank)."""
        return max(1, self.kv_heads // max(self.attn_tp, 1))

    def heads_of(self, rank: int) -> range:
        """Global KV heads held by attention rank `rank`."""
        if self.replicated:
            head = rank // self.replication
            return range(head, head + 1)
        n = self.heads_per_rank
        return range(rank * n, (rank + 1) * n)

    def holders(self, head: int) -> list[int]:
        """Attention ranks that hold `head` (one unless replicated)."""
        if self.replicated:
            r = self.replication
            return list(range(head * r, (head + 1) * r))
        return [head // self.heads_per_rank]

    # -- nodes -----------------------------------------------------------------------------
    def node_span(self) -> tuple[int, int]:
        """(nodes one instance spans, instances packed per node).

        A multi-node instance takes whole nodes; single-node instances are packed
        `gpus_per_node // gpus` to a node.
        """
        if self.nodes > 1 or self.gpus > self.gpus_per_node:
            return self.nodes, 1
        return 1, max(1, self.gpus_per_node // max(self.gpus, 1))

    def node_count(self, instances: int) -> int:
        """Nodes `instances` instances occupy on a multi-node placement."""
        span, per_node = self.node_span()
        if span > 1:
            return span * instances
        return math.ceil(instances / per_node)

    # -- text ------------------------------------------------------------------------------
    def key(self, name: str) -> str:
        return f"{self.role}.{name}" if self.role else name

    @property
    def tp_key(self) -> str:
        """The key that sets attention TP: `dp` under DP attention, else `tp`."""
        return self.key("dp" if self.dp_attention and self.dp > 1 else "tp")

    def attn_tp_text(self) -> str:
        """'attention TP 4 (prefill.tp=8 / prefill.dp=2)': the figure and its factors."""
        if self.dp_attention and self.dp > 1:
            return (f"attention TP {self.attn_tp} ({self.key('tp')}={self.tp} / "
                    f"{self.key('dp')}={self.dp})")
        return f"attention TP {self.tp} ({self.key('tp')})"

    def gpus_text(self) -> str:
        """'prefill.tp=8 x prefill.dp=2': the factors of `gpus`."""
        if self.dp_attention or self.dp == 1:
            return f"{self.key('tp')}={self.tp}"
        return f"{self.key('tp')}={self.tp} x {self.key('dp')}={self.dp}"

    # -- checks ----------------------------------------------------------------------------
    def degree_problems(self) -> list[Problem]:
        """Degrees below 1, or DP attention groups that do not divide the TP group."""
        low = [(n, v) for n, v in (("tp", self.tp), ("dp", self.dp), ("num_kv_heads",
                                                                     self.kv_heads))
               if v < 1]
        if low:
            return [Problem(n, f"{self.key(n)}={v}: must be >= 1", f"set {self.key(n)} >= 1")
                    for n, v in low]
        if self.dp_attention and self.tp % self.dp:
            return [Problem(
                "dp",
                f"DP attention splits the {self.tp} GPUs of {self.key('tp')} into "
                f"{self.key('dp')}={self.dp} groups: {self.tp} % {self.dp} = "
                f"{self.tp % self.dp}",
                f"set {self.key('dp')} to a divisor of {self.tp} (e.g. {self.key('dp')}="
                f"{self.tp})",
            )]
        return []

    def head_problems(self, what: str = "KV heads",
                      fits: Callable[[int], bool] | None = None) -> list[Problem]:
        """The heads must shard (`H % attn_tp == 0`) or replicate (`attn_tp % H == 0`).
        `fits`: what else the caller knows an attention TP must satisfy (the query heads),
        so the degrees suggested are ones the next check does not refuse."""
        h, t = self.kv_heads, self.attn_tp
        if h % t == 0 or t % h == 0:
            return []
        ok = sorted({x for x in range(1, 65) if (h % x == 0 or x % h == 0)
                     and (fits is None or fits(x))})
        more = ", ..." if len(ok) > 8 or fits is None else ""
        ok = ok[:8]
        return [Problem(
            "dp" if self.dp_attention and self.dp > 1 else "tp",
            f"{h} {what} (model.num_kv_heads) cannot be split over {self.attn_tp_text()}: "
            f"need {h} % {t} == 0 (heads sharded) or {t} % {h} == 0 (heads replicated)",
            f"choose an attention TP in {{{', '.join(map(str, ok))}{more}}}",
        )]

    def node_problems(self) -> list[Problem]:
        """The instance's GPUs must fill whole nodes when it spans several, or fit in one."""
        g, n, gpn = self.gpus, self.nodes, self.gpus_per_node
        if gpn < 1 or n < 1:
            return []
        if n > 1:
            if g % n:
                return [Problem(
                    "nodes",
                    f"{g} GPUs per instance ({self.gpus_text()}) cannot be spread evenly over "
                    f"{self.key('nodes')}={n}",
                    f"set {self.key('nodes')} to a divisor of {g}",
                )]
            per = g // n
            if per != gpn:
                idle = f"{gpn - per} GPUs idle on each node" if per < gpn else "too few GPUs"
                return [Problem(
                    "tp",
                    f"an instance spanning {self.key('nodes')}={n} nodes uses whole nodes: "
                    f"{self.gpus_text()} -> {g} / {n} = {per} GPUs per node, nodes have "
                    f"cluster.gpus_per_node={gpn} ({idle})",
                    f"set {self.key('tp')}={n * gpn}"
                    + (f" or {self.key('nodes')}={math.ceil(g / gpn)}" if g % gpn == 0 else ""),
                )]
            return []
        if g > gpn:
            return [Problem(
                "nodes",
                f"an instance needs {g} GPUs ({self.gpus_text()}), one node has "
                f"cluster.gpus_per_node={gpn}",
                f"set {self.key('nodes')}={math.ceil(g / gpn)}"
                + ("" if g % gpn == 0 else f" and {self.key('tp')} to a multiple of {gpn}"),
            )]
        return []

    def problems(self, what: str = "KV heads") -> list[Problem]:
        """Every reason these degrees cannot run, each message showing its factors. Head and
        node checks only run once the degrees themselves are sane."""
        found = self.degree_problems()
        if found:
            return found
        return self.head_problems(what) + self.node_problems()
