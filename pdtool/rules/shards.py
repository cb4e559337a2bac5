"""Shard compatibility between prefill and decode (docs/sharding.md).

* Each side: KV heads split over attention TP (`heads % tp == 0`) or replicated in groups
  (`tp % heads == 0`; MLA is the one-head case).
* Across sides (MHA/GQA): attention TP degrees may differ only when one divides the other.
* Page size, KV dtype and page layout must match on both sides (pages are copied byte for byte).
* Chunked prefill must cut on page boundaries (`chunked_prefill_size % page_size == 0`), so the
  messenger can ship whole pages per chunk.
* NHD pages with unequal head sharding need one write per token instead of two per page (HND's
  K and V runs): warn with the count (the route arithmetic is transfer.routes', the
  messenger's own).
"""

from __future__ import annotations

from pdtool.adapters import adapter
from pdtool.plan import DEFAULT_TOKENS, request_writes, route_plans, shard_spec
from pdtool.rules.finding import Finding, error, warning
from pdtool.schema import ROLES, Config, kv_dtype, role_dims
from transfer import routes as R
from transfer.geometry import messenger_pool, writes_per_page


def check_head_split(cfg: Config) -> list[Finding]:
    """Each side's heads must shard or replicate over its attention TP
    (`transfer.parallel.ParallelDims.head_problems`, which shows every factor)."""
    what = "MLA latent head" if cfg.model.attention == "mla" else "KV heads"
    m = cfg.model

    def fits(t: int) -> bool:  # the query heads shard too; the reference engine's MLP as well
        return m.num_q_heads % t == 0 and (not adapter(cfg).shards_mlp
                                           or m.intermediate_size % t == 0)

    out: list[Finding] = []
    for r in ROLES:
        d = role_dims(cfg, r)
        out += [error(d.key(p.field), p.message, p.fix) for p in d.head_problems(what, fits)]
    return out


def check_tp_pair(cfg: Config) -> list[Finding]:
    """MHA/GQA only: MLA's latent is whole on every rank, so any TP pair works there."""
    pd, dd = role_dims(cfg, "prefill"), role_dims(cfg, "decode")
    p, d = pd.attn_tp, dd.attn_tp
    if cfg.model.attention == "mla" or p % d == 0 or d % p == 0:
        return []
    return [
        error(
            dd.tp_key,
            f"prefill {pd.attn_tp_text()} and decode {dd.attn_tp_text()}: one "
            f"must divide the other ({p} % {d} = {p % d}, {d} % {p} = {d % p}), or a decode "
            "rank's heads would straddle prefill ranks unevenly",
            f"set decode's attention TP to a divisor or multiple of {p}",
        )
    ]


def check_page_match(cfg: Config) -> list[Finding]:
    pr, de = cfg.prefill, cfg.decode
    out: list[Finding] = []
    if pr.page_size != de.page_size:
        out.append(
            error(
                "decode.page_size",
                f"pages are copied whole: prefill.page_size={pr.page_size} != "
                f"decode.page_size={de.page_size}",
                f"set decode.page_size={pr.page_size}",
            )
        )
    pk, dk = kv_dtype(cfg.model, pr), kv_dtype(cfg.model, de)
    if pk != dk:
        out.append(
            error(
                "decode.kv_dtype",
                f"KV bytes are copied as they are: prefill KV dtype {pk} != decode {dk} "
                f"(prefill.kv_dtype={pr.kv_dtype}, decode.kv_dtype={de.kv_dtype})",
                f"set decode.kv_dtype={pk}",
            )
        )
    for r, rc in (("prefill", pr), ("decode", de)):
        if rc.kv_layout != cfg.transfer.layout:
            out.append(
                error(
                    f"{r}.kv_layout",
                    f"{r} pages are {rc.kv_layout} but transfer.layout={cfg.transfer.layout}: "
                    "both sides and the messenger must agree on the page layout",
                    f"set {r}.kv_layout={cfg.transfer.layout} (or change transfer.layout)",
                )
            )
    return out


def check_chunking(cfg: Config) -> list[Finding]:
    pr = cfg.prefill
    if pr.chunked_prefill_size % pr.page_size == 0:
        return []
    down = max(pr.page_size, pr.chunked_prefill_size // pr.page_size * pr.page_size)
    return [
        error(
            "prefill.chunked_prefill_size",
            f"chunks must end on page boundaries: {pr.chunked_prefill_size} % "
            f"prefill.page_size={pr.page_size} = {pr.chunked_prefill_size % pr.page_size}",
            f"set prefill.chunked_prefill_size={down}",
        )
    ]


def check_nhd_writes(cfg: Config, tokens: int = DEFAULT_TOKENS) -> list[Finding]:
    """Warn when NHD pages force per-token writes, with the op count for a request."""
    if cfg.transfer.layout != "NHD" or adapter(cfg).own_pools:  # rules.sglang says it
        return []
    routes = route_plans(cfg, tokens)
    if all(r.writes_per_page == len(r.slices) for r in routes):
        return []
    worst = max(routes, key=lambda r: r.writes_per_request)
    src, dst = shard_spec(cfg, "prefill"), shard_spec(cfg, "decode")
    hnd_pool = messenger_pool("HND", cfg.model.attention == "mla")
    slices = R.routes_for(src, dst, worst.dst_rank)
    hnd = sum(writes_per_page(s, src, dst, hnd_pool, cfg.decode.page_size) for s in slices)
    hnd_total = request_writes(cfg, tokens, slices, src, dst, hnd_pool)
    return [
        warning(
            "transfer.layout",
            f"NHD pages with prefill attention TP {src.attn_tp} -> decode {dst.attn_tp}: a head "
            f"slice is not contiguous, so decode rank {worst.dst_rank} needs "
            f"{worst.writes_per_page} writes per page and layer (HND: {hnd}); a {tokens}-token "
            f"request costs {worst.writes_per_request} writes instead of {hnd_total}",
            "set transfer.layout=HND (a head slice of a page is two contiguous writes, its K "
            "and its V run)",
        )
    ]


ALL = (check_head_split, check_tp_pair, check_page_match, check_chunking)
"""Rules that need only sane values; `check_nhd_writes` runs after these pass."""
