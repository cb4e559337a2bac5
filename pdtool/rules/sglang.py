"""What the `pdtool` SGLang transfer backend (transfer/sglang) can and cannot do, for validate.

Only for `engine.kind=sglang`. SGLang 0.5.23 keeps its own KV pools, NHD per layer buffer with
separate K and V buffers (MLA: one latent buffer), whatever `transfer.layout` says. The backend
therefore writes:
  * one contiguous write per (page, layer buffer) when prefill and decode shard heads alike
    (equal attention TP, or MLA whose latent every rank holds);
  * one write per token per (page, layer buffer, source rank) for MHA/GQA with different
    attention TP: a head slice of an NHD page is not contiguous. It works, but costs
    `page_size` times the ops; the warning shows the count so the user can pick equal TP.
"""

from __future__ import annotations

from pdtool.planner import DEFAULT_TOKENS, shard_spec
from pdtool.rules.finding import Finding, warning
from pdtool.schema import Config
from transfer import routes as R


def sglang_writes_per_request(cfg: Config, tokens: int = DEFAULT_TOKENS) -> tuple[int, int]:
    """(worst decode rank's writes for a `tokens` request, same with equal sharding)."""
    src, dst = shard_spec(cfg, "prefill"), shard_spec(cfg, "decode")
    mla = cfg.model.attention == "mla"
    buffers = cfg.model.num_layers * (1 if mla else 2)  # SGLang: separate K and V buffers
    pages = -(-max(tokens - 1, 0) // cfg.decode.page_size)
    aux = cfg.transfer.aux_writes
    worst = 0
    for d in range(dst.attn_tp):
        slices = R.routes_for(src, dst, d)
        per_page = 1 if mla else sum(
            R.writes_per_page(s, src, dst, "NHD", cfg.decode.page_size) for s in slices
        )
        worst = max(worst, pages * buffers * per_page + aux)
    return worst, pages * buffers + aux


def check_sglang_nhd_tp_mismatch(cfg: Config) -> list[Finding]:
    """Warn when SGLang's NHD pools make the backend write token by token."""
    if cfg.engine.kind != "sglang" or cfg.model.attention == "mla":
        return []
    src, dst = shard_spec(cfg, "prefill"), shard_spec(cfg, "decode")
    if src.heads_per_rank == dst.heads_per_rank:
        return []
    worst, equal = sglang_writes_per_request(cfg)
    return [
        warning(
            "decode.tp",
            f"engine=sglang keeps NHD KV pools (transfer.layout does not apply): with prefill "
            f"attention TP {src.attn_tp} -> decode {dst.attn_tp} each {cfg.model.attention} "
            f"head slice is one write per token, {cfg.decode.page_size} per page and layer "
            f"buffer; a {DEFAULT_TOKENS}-token request costs {worst} writes instead of {equal}",
            "give prefill and decode the same attention TP (prefill.tp / decode.tp), "
            "or use engine=reference with transfer.layout=HND",
        )
    ]


ALL = (check_sglang_nhd_tp_mismatch,)
