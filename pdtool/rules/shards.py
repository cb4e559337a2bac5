"""Shard compatibility between prefill and decode (docs/sharding.md).

* Each side: KV heads split over attention TP (`heads % tp == 0`) or replicated in groups
  (`tp % heads == 0`; MLA is the one-head case).
* Across sides (MHA/GQA): attention TP degrees may differ only when one divides the other.
* Page size, KV dtype and page layout must match on both sides (pages are copied byte for byte).
* Chunked prefill must cut on page boundaries (`chunked_prefill_size % page_size == 0`), so the
  messenger can ship whole pages per chunk.
* NHD pages with unequal head sharding need one write per token instead of one per page: warn
  with the count (the route arithmetic is transfer.routes', the messenger's own).
"""

from __future__ import annotations

from pdtool.planner import DEFAULT_TOKENS, route_plans, shard_spec
from pdtool.rules.finding import Finding, error, warning
from pdtool.schema import ROLES, Config, attn_tp, kv_dtype, kv_heads, role


def _tp_key(cfg: Config, r: str) -> str:
    rc = role(cfg, r)
    return f"{r}.tp" if not rc.dp_attention or rc.dp == 1 else f"{r}.dp"


def _tp_text(cfg: Config, r: str) -> str:
    rc = role(cfg, r)
    if rc.dp_attention and rc.dp > 1:
        return f"attention TP {attn_tp(rc)} ({r}.tp={rc.tp} / {r}.dp={rc.dp})"
    return f"attention TP {rc.tp} ({r}.tp)"


def _divisors_and_multiples(h: int, limit: int = 64) -> list[int]:
    return sorted({t for t in range(1, limit + 1) if h % t == 0 or t % h == 0})


def check_head_split(cfg: Config) -> list[Finding]:
    out: list[Finding] = []
    h = kv_heads(cfg.model)
    what = "MLA latent head" if cfg.model.attention == "mla" else "KV heads"
    for r in ROLES:
        t = attn_tp(role(cfg, r))
        if h % t and t % h:
            ok = ", ".join(str(x) for x in _divisors_and_multiples(h)[:8])
            out.append(
                error(
                    _tp_key(cfg, r),
                    f"{h} {what} (model.num_kv_heads) cannot be split over {_tp_text(cfg, r)}: "
                    f"need {h} % {t} == 0 (heads sharded) or {t} % {h} == 0 (heads replicated)",
                    f"choose an attention TP in {{{ok}, ...}}",
                )
            )
    return out


def check_tp_pair(cfg: Config) -> list[Finding]:
    """MHA/GQA only: MLA's latent is whole on every rank, so any TP pair works there."""
    p, d = attn_tp(cfg.prefill), attn_tp(cfg.decode)
    if cfg.model.attention == "mla" or p % d == 0 or d % p == 0:
        return []
    return [
        error(
            _tp_key(cfg, "decode"),
            f"prefill {_tp_text(cfg, 'prefill')} and decode {_tp_text(cfg, 'decode')}: one "
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
    if cfg.transfer.layout != "NHD" or cfg.engine.kind == "sglang":  # rules.sglang says it
        return []
    routes = route_plans(cfg, tokens)
    if all(r.writes_per_page == len(r.slices) for r in routes):
        return []
    worst = max(routes, key=lambda r: r.writes_per_request)
    hnd = len(worst.slices)
    src, dst = shard_spec(cfg, "prefill"), shard_spec(cfg, "decode")
    pages = -(-max(tokens - 1, 0) // cfg.decode.page_size)
    hnd_total = pages * cfg.model.num_layers * hnd + cfg.transfer.aux_writes
    return [
        warning(
            "transfer.layout",
            f"NHD pages with prefill attention TP {src.attn_tp} -> decode {dst.attn_tp}: a head "
            f"slice is not contiguous, so decode rank {worst.dst_rank} needs "
            f"{worst.writes_per_page} writes per page and layer (HND: {hnd}); a {tokens}-token "
            f"request costs {worst.writes_per_request} writes instead of {hnd_total}",
            "set transfer.layout=HND (one contiguous write per head slice of a page)",
        )
    ]


ALL = (check_head_split, check_tp_pair, check_page_match, check_chunking)
"""Rules that need only sane values; `check_nhd_writes` runs after these pass."""
