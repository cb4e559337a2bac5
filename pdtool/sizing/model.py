"""The sizing model: predicted TTFT, TPOT and throughput of a deployment at a load.

Pure arithmetic on the typed config, its plan and a `Hardware` entry; every formula is written
out in docs/sizing.md with its constants. In short:

* prefill of S tokens on an instance: FLOPs (2 x active parameters x S, plus causal attention
  2 x layers x query heads x head width x S^2) at `prefill_mfu` of the instance's peak, plus
  its collectives (TP all-reduce, MoE all-to-all) at `comm_eff` of the link, plus
  `prefill_overhead_ms`;
* a decode step of B requests at context C: the larger of the bytes every GPU reads (its
  weights, the experts B tokens touch, its share of B x C KV tokens) at `decode_mbu` of HBM
  bandwidth and the step's FLOPs at `decode_mfu`, plus collectives, plus `step_overhead_ms`;
* the KV transfer: the plan's bytes and writes per request over each prefill rank's NICs
  (`nic_eff` of line rate, `write_us` per write); streamed layer by layer, only what outlasts
  the prefill shows in TTFT;
* queueing: each prefill instance an M/G/1 server (Pollaczek-Khinchine over the input-length
  distribution); each decode instance's batch the fixed point of Little's law, B = arrival rate
  x output tokens x step time(B), within its KV capacity; an aggregated instance does both,
  its decode slowed by the share of time it prefills.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from pdtool.memory import deployment_memory
from pdtool.schema import DTYPE_BYTES, Config, dims, role
from pdtool.sizing.hardware import Hardware

#: bytes of an activation element in a TP all-reduce (bf16)
ACT_BYTES = 2
#: bytes one token's activation moves per routed expert in a MoE layer: dispatched in fp8 and
#: combined in bf16 (DeepEP's default for DeepSeek)
MOE_BYTES = 1 + 2


class SizingError(ValueError):
    pass


@dataclass(frozen=True)
class Workload:
    """Request lengths: the input length as a weighted grid (a fixed length is one point), the
    output length's mean."""

    isl: tuple[tuple[int, float], ...]
    osl: int

    @property
    def mean_isl(self) -> float:
        return sum(n * w for n, w in self.isl)


def parse_lengths(text: str, flag: str) -> tuple[tuple[int, float], ...]:
    """`N` (every request N tokens) or `LO-HI` (uniform, as an 8-point grid)."""
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
            if not 1 <= lo <= hi:
                raise ValueError
            pts = sorted({round(lo + (hi - lo) * (i + 0.5) / 8) for i in range(8)})
            return tuple((p, 1 / len(pts)) for p in pts)
        n = int(text)
        if n < 1:
            raise ValueError
        return ((n, 1.0),)
    except ValueError:
        raise SizingError(f"{flag}: expected N or LO-HI token counts (>= 1), got {text!r}"
                          ) from None


@dataclass(frozen=True)
class Side:
    """One instance of a role, as the model sees it."""

    role: str
    instances: int
    gpus: int  # GPUs of one instance
    attn_tp: int  # GPUs one attention group shards its heads over
    groups: int  # attention groups working side by side (DP attention or TP replicas)
    nodes: int  # nodes of one instance
    kv_bytes_per_token: int  # on one attention rank, all layers
    kv_tokens: int  # tokens one attention rank's KV pool holds
    max_running: int  # the engine's limit on requests per instance (0: none)
    chunk_tokens: int  # tokens one prefill forward pass takes (chunked_prefill_size)
    dense_bytes: float  # non-expert weights, all of them (sharded over attn_tp)
    expert_bytes: float  # routed experts, all of them (sharded over gpus)


def sides(cfg: Config) -> dict[str, Side]:
    out = {}
    for mem in deployment_memory(cfg):
        rc = role(cfg, mem.role)
        d = dims(rc, cfg.model)
        b = DTYPE_BYTES[cfg.model.dtype]
        experts = max(cfg.model.expert_params_b, 0.0) * 1e9 * b
        out[mem.role] = Side(
            role=mem.role, instances=rc.instances, gpus=d.gpus, attn_tp=d.attn_tp,
            groups=d.replicas, nodes=rc.nodes,
            kv_bytes_per_token=mem.kv_bytes_per_token, kv_tokens=mem.kv_tokens,
            max_running=rc.max_running_requests, chunk_tokens=rc.chunked_prefill_size,
            dense_bytes=cfg.model.num_params_b * 1e9 * b - experts, expert_bytes=experts)
    return out


def active_params(cfg: Config) -> float:
    """Parameters one token's forward pass multiplies by: every dense weight and its top-k
    share of the routed experts."""
    m = cfg.model
    if m.num_experts <= 0:
        return m.num_params_b * 1e9
    if m.experts_per_token <= 0:
        raise SizingError(f"model.experts_per_token: the model has {m.num_experts} routed "
                          "experts and no top-k: set model.experts_per_token")
    return (m.num_params_b - m.expert_params_b + m.expert_params_b * m.experts_per_token /
            m.num_experts) * 1e9


def _attn_width(cfg: Config) -> int:
    """Per-head width the attention FLOPs run over (MLA: the query's nope + rope width)."""
    m = cfg.model
    return m.head_dim + m.qk_rope_head_dim if m.attention == "mla" else m.head_dim


def _collectives(cfg: Config, side: Side, hw: Hardware, tokens: float, nic_gbps: float
                 ) -> float:
    """Seconds of one attention group's collectives over `tokens` of its tokens (every group
    runs its own at the same time, each GPU over its own links), at `comm_eff` of the link:

    * two ring all-reduces per layer over the attention TP group (NVLink, or the NICs when
      the group spans nodes);
    * a MoE layer's dispatch and combine of each GPU's share of the tokens: one copy per
      other node holding its top-k experts (min(k, nodes) nodes, (nodes - 1)/nodes of them
      remote) over the GPU's NICs, and the copies to its experts on the GPU's own node
      (k/nodes of them, on the node's other GPUs) over NVLink.
    """
    m = cfg.model
    nvlink = hw.link_gbps * 1e9 * hw.comm_eff
    nic = nic_gbps / 8 * 1e9 * hw.comm_eff
    a, g, n = side.attn_tp, side.gpus, max(side.nodes, 1)
    per_node = max(g // n, 1)
    t = 0.0
    if a > 1:
        bw = nic if a > per_node else nvlink
        t += 2 * m.num_layers * 2 * (a - 1) / a * tokens * m.hidden_size * ACT_BYTES / bw
    if m.num_experts > 0 and g > 1:
        k = m.experts_per_token
        volume = m.num_layers * tokens / a * m.hidden_size * MOE_BYTES
        if n > 1:
            t += volume * min(k, n) * (n - 1) / n / nic
        t += volume * k / n * (per_node - 1) / per_node / nvlink
    return t


def prefill_seconds(cfg: Config, side: Side, hw: Hardware, tokens: int, nic_gbps: float
                    ) -> tuple[float, float]:
    """(service time, its compute part) of one S-token prefill: the instance's GPUs share the
    work of its attention groups, so an instance prefills at its whole FLOP rate."""
    m = cfg.model
    flops = 2 * active_params(cfg) * tokens + 2 * m.num_layers * m.num_q_heads * \
        _attn_width(cfg) * tokens * tokens
    compute = flops / (side.gpus * hw.peak(m.dtype) * hw.prefill_mfu)
    comm = _collectives(cfg, side, hw, tokens, nic_gbps) / max(side.groups, 1)
    # the engine's fixed cost is per forward pass: one per chunk of the prompt, shared (as
    # the collectives) by the attention groups' passes running side by side
    chunks = math.ceil(tokens / max(side.chunk_tokens, 1))
    fixed = hw.prefill_overhead_ms / 1e3 * chunks / max(side.groups, 1)
    return _overlapped(compute, comm, hw) + fixed, compute


def decode_step_seconds(cfg: Config, side: Side, hw: Hardware, batch: float, context: float,
                        nic_gbps: float) -> float:
    """One decode step of `batch` requests (the instance's) at mean context `context`."""
    m = cfg.model
    per_group = batch / max(side.groups, 1)
    touched = 1.0
    if m.num_experts > 0:
        touched = 1 - (1 - m.experts_per_token / m.num_experts) ** max(batch, 1.0)
    weights = side.dense_bytes / side.attn_tp + side.expert_bytes * touched / side.gpus
    kv = per_group * context * side.kv_bytes_per_token
    memory = (weights + kv) / (hw.hbm_tbps * 1e12 * hw.decode_mbu)
    flops = 2 * active_params(cfg) * batch + 4 * m.num_layers * m.num_q_heads * \
        _attn_width(cfg) * context * batch
    compute = flops / (side.gpus * hw.peak(m.dtype) * hw.decode_mfu)
    comm = _collectives(cfg, side, hw, per_group, nic_gbps)
    return _overlapped(max(memory, compute), comm, hw) + hw.step_overhead_ms / 1e3


def _overlapped(work: float, comm: float, hw: Hardware) -> float:
    """Work and collectives, `overlap` of the shorter hidden behind the longer (an engine
    that splits a batch in two overlaps one half's collectives with the other's compute)."""
    return work + comm - hw.overlap * min(work, comm)


@dataclass(frozen=True)
class Transfer:
    """What one request moves from its prefill group to its decode group (the plan's)."""

    bytes: float  # over every decode attention rank of the group
    writes: float
    sources: int  # prefill attention ranks sending
    nics: int  # NICs of one sending rank
    streamed: bool  # sent layer by layer while the prefill runs


def transfer_seconds(t: Transfer, hw: Hardware, nic_gbps: float, prefill_compute: float,
                     layers: int) -> float:
    """The part of the KV transfer a request waits for after its prefill: the sources send in
    parallel, each over its NICs (`nic_gbps` together); a streamed transfer overlaps the
    prefill's compute but for the last layer's share."""
    if t.bytes <= 0:
        return 0.0
    per_src = t.bytes / t.sources
    wire = per_src * 8 / (nic_gbps * 1e9 * hw.nic_eff)
    posting = t.writes / t.sources / max(t.nics, 1) * hw.write_us / 1e6
    whole = wire + posting
    if not t.streamed:
        return whole
    return max(whole - prefill_compute * (layers - 1) / layers, whole / layers)


@dataclass
class Prediction:
    rate: float  # requests/s offered to the deployment
    ttft_ms: float = math.inf
    tpot_ms: float = math.inf
    transfer_ms: float = 0.0
    prefill_utilization: float = 0.0
    decode_batch: float = 0.0  # requests in one decode instance's batch
    gpus: int = 0
    osl: int = 0
    why: list[str] = field(default_factory=list)  # empty: the load is sustained

    @property
    def feasible(self) -> bool:
        return not self.why

    @property
    def tokens_per_s(self) -> float:
        return self.rate * self.osl if self.feasible else 0.0

    @property
    def tokens_per_s_gpu(self) -> float:
        return self.tokens_per_s / self.gpus if self.gpus else 0.0

    @property
    def tokens_per_s_user(self) -> float:
        return 1e3 / self.tpot_ms if self.feasible and self.tpot_ms > 0 else 0.0

    def to_dict(self) -> dict[str, float | int | list[str]]:
        return {"rate": self.rate, "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms,
                "transfer_ms": self.transfer_ms, "prefill_utilization": self.prefill_utilization,
                "decode_batch": self.decode_batch, "tokens_per_s_gpu": self.tokens_per_s_gpu,
                "tokens_per_s_user": self.tokens_per_s_user, "why": list(self.why)}


def _fixed_point_batch(arrival: float, steps: float, step, limit: float) -> float | None:
    """The decode batch B = arrival x steps x step(B) (Little's law), or None above `limit`."""
    if arrival <= 0:
        return 0.0
    lo, hi = 0.0, max(limit, 1e-9)
    if arrival * steps * step(hi) > hi:
        return None
    for _ in range(80):
        mid = (lo + hi) / 2
        if arrival * steps * step(mid) > mid:
            lo = mid
        else:
            hi = mid
    return hi


def _mg1_wait(arrival: float, s1: float, s2: float) -> float:
    """Pollaczek-Khinchine mean wait of an M/G/1 server (service moments s1, s2)."""
    rho = arrival * s1
    return math.inf if rho >= 1 else arrival * s2 / (2 * (1 - rho))


@dataclass(frozen=True)
class Deployment:
    """A config with what the model needs from its plan (built for the mean input length)."""

    cfg: Config
    sides: dict[str, Side]
    transfer: Transfer | None  # None: aggregated, nothing moves
    nics: dict[str, tuple[float, ...]]  # role -> line rate of each NIC one GPU rank uses (0: ?)
    gpus: int
    tokens: int  # the input length the transfer figures are for

    @property
    def aggregated(self) -> bool:
        return self.transfer is None


def deployment(cfg: Config, tokens: int) -> Deployment:
    from pdtool.plan import build_plan
    from pdtool.schema import deployment_gpus

    plan = build_plan(cfg, tokens=max(int(tokens), 1))
    sd = sides(cfg)
    nics: dict[str, tuple[float, ...]] = {}
    for name in ("prefill", "decode"):
        rank = plan.role_instances(name)[0].ranks[0]
        nics[name] = tuple(plan.transfer.nic_gbps.get(n, 0.0) for n in rank.nics)
    transfer = None
    if not plan.aggregated:
        d, t = sd["decode"], plan.transfer
        transfer = Transfer(
            bytes=tokens * d.kv_bytes_per_token * d.attn_tp,
            writes=float(sum(r.writes_per_request for r in t.routes)),
            sources=sd["prefill"].attn_tp, nics=max(len(nics["prefill"]), 1),
            streamed=t.backend == "pdtool")
    return Deployment(cfg=cfg, sides=sd, transfer=transfer, nics=nics,
                      gpus=deployment_gpus(cfg), tokens=max(int(tokens), 1))


def _nic_gbps(dep: Deployment, role_name: str, hw: Hardware) -> float:
    rates = dep.nics[role_name] or (0.0,)
    return sum(r or hw.default_nic_gbps for r in rates)


def _prefill_moments(dep: Deployment, side: Side, wl: Workload, hw: Hardware
                     ) -> tuple[float, float, float]:
    """(E[service], E[service^2], E[transfer wait]) over the input-length grid."""
    nic = _nic_gbps(dep, side.role, hw)
    s1 = s2 = xfer = 0.0
    for n, w in wl.isl:
        s, compute = prefill_seconds(dep.cfg, side, hw, n, nic)
        s1 += w * s
        s2 += w * s * s
        if dep.transfer is not None:
            scale = n / dep.tokens
            t = dataclasses.replace(dep.transfer, bytes=dep.transfer.bytes * scale,
                                    writes=dep.transfer.writes * scale)
            xfer += w * transfer_seconds(t, hw, nic, compute, dep.cfg.model.num_layers)
    return s1, s2, xfer


def _decode_limit(side: Side, wl: Workload) -> float:
    """Requests one instance can hold: its KV pools' tokens over a request's, and the
    engine's limit."""
    per_request = wl.mean_isl + wl.osl
    cap = side.groups * side.kv_tokens / per_request
    return min(cap, side.max_running) if side.max_running else cap


def predict(dep: Deployment, wl: Workload, hw: Hardware, rate: float) -> Prediction:
    """The deployment's mean figures at `rate` requests/s arriving at random (Poisson)."""
    out = Prediction(rate=rate, gpus=dep.gpus, osl=wl.osl)
    ctx = wl.mean_isl + wl.osl / 2
    if dep.aggregated:
        worst_ttft = worst_tpot = 0.0
        n = sum(s.instances for s in dep.sides.values())
        for side in dep.sides.values():
            arrival = rate / n
            s1, s2, _ = _prefill_moments(dep, side, wl, hw)
            share = arrival * s1
            out.prefill_utilization = max(out.prefill_utilization, share)
            if share >= 1:
                out.why.append(f"{side.role} instances spend all their time prefilling")
                return out
            nic = _nic_gbps(dep, side.role, hw)

            def step(b: float, side: Side = side, nic: float = nic, share: float = share
                     ) -> float:
                return decode_step_seconds(dep.cfg, side, hw, b, ctx, nic) / (1 - share)

            batch = _fixed_point_batch(arrival, wl.osl, step, _decode_limit(side, wl))
            if batch is None:
                out.why.append(f"{side.role} instances cannot hold the decode batch this rate "
                               "needs (KV capacity or step time)")
                return out
            out.decode_batch = max(out.decode_batch, batch)
            worst_ttft = max(worst_ttft, _mg1_wait(arrival, s1, s2) + step(batch) / 2 + s1)
            worst_tpot = max(worst_tpot, step(batch))
        out.ttft_ms, out.tpot_ms = worst_ttft * 1e3, worst_tpot * 1e3
        return out
    p, d = dep.sides["prefill"], dep.sides["decode"]
    arrival = rate / p.instances
    s1, s2, xfer = _prefill_moments(dep, p, wl, hw)
    out.prefill_utilization = arrival * s1
    if out.prefill_utilization >= 1:
        out.why.append("the prefill instances are saturated")
        return out
    out.transfer_ms = xfer * 1e3
    out.ttft_ms = (_mg1_wait(arrival, s1, s2) + s1 + xfer) * 1e3
    nic = _nic_gbps(dep, "decode", hw)

    def decode_step(b: float) -> float:
        return decode_step_seconds(dep.cfg, d, hw, b, ctx, nic)

    batch = _fixed_point_batch(rate / d.instances, wl.osl, decode_step, _decode_limit(d, wl))
    if batch is None:
        out.why.append("the decode instances cannot hold the batch this rate needs (KV "
                       "capacity or step time)")
        return out
    out.decode_batch = batch
    out.tpot_ms = decode_step(batch) * 1e3
    return out


def saturation_rate(dep: Deployment, wl: Workload, hw: Hardware) -> float:
    """The highest rate the deployment sustains (to 0.1 %)."""
    hi = 1.0
    while predict(dep, wl, hw, hi).feasible:
        hi *= 2
        if hi > 1e9:
            return hi
    lo = 0.0
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predict(dep, wl, hw, mid).feasible else (lo, mid)
    return lo


def goodput(dep: Deployment, wl: Workload, hw: Hardware, ttft_ms: float, tpot_ms: float
            ) -> Prediction:
    """The prediction at the highest rate whose mean TTFT and TPOT meet the SLO (rate 0 and
    a reason when even a trickle misses it)."""
    top = saturation_rate(dep, wl, hw)

    def meets(p: Prediction) -> bool:
        return p.feasible and p.ttft_ms <= ttft_ms and p.tpot_ms <= tpot_ms

    low = predict(dep, wl, hw, top * 1e-6)
    if not meets(low):
        miss = Prediction(rate=0.0, gpus=dep.gpus, osl=wl.osl, ttft_ms=low.ttft_ms,
                          tpot_ms=low.tpot_ms, transfer_ms=low.transfer_ms)
        miss.why.append(f"misses the SLO unloaded (TTFT {low.ttft_ms:.0f} ms, TPOT "
                        f"{low.tpot_ms:.1f} ms)")
        return miss
    lo, hi = top * 1e-6, top
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(predict(dep, wl, hw, mid)) else (lo, mid)
    return predict(dep, wl, hw, lo)


def closed_loop(dep: Deployment, wl: Workload, hw: Hardware, concurrency: int) -> Prediction:
    """`concurrency` users each sending their next request when the last one ends (what
    `pdtool bench --concurrency` does): the rate X with X x (TTFT + (OSL - 1) x TPOT) = users."""
    top = saturation_rate(dep, wl, hw)

    def cycle(x: float) -> float:
        p = predict(dep, wl, hw, x)
        return math.inf if not p.feasible else \
            x * (p.ttft_ms + (wl.osl - 1) * p.tpot_ms) / 1e3
    lo, hi = 0.0, top
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cycle(mid) < concurrency else (lo, mid)
    return predict(dep, wl, hw, lo)
