"""What the `pdtool` SGLang transfer backend (transfer/sglang) can and cannot do, for validate.

Only for `engine.kind=sglang`. SGLang 0.5.23 keeps its own KV pools, NHD per layer buffer with
separate K and V buffers (MLA: one latent buffer), whatever `transfer.layout` says. The backend
therefore writes:
  * one contiguous write per (page, layer buffer) when prefill and decode shard heads alike
    (equal attention TP, or MLA whose latent every rank holds);
  * one write per token per (page, layer buffer, source rank) for MHA/GQA with different
    attention TP: a head slice of an NHD page is not contiguous. It works, but costs
    `page_size` times the ops; the warning shows the count so the user can pick equal TP.
The counts are the plan's (`pdtool.plan.route_plans`, in SGLang's pools and metadata buffers as
`transfer.geometry` describes them), so the warning and `pdtool plan` always show the same number.
SGLang flags for state the backend does not carry (draft KV, PP, CP, KV sharding) are errors.
"""

from __future__ import annotations

from pdtool.plan import DEFAULT_TOKENS, equal_sharding_writes, route_plans, shard_spec
from pdtool.rules.finding import Finding, error, warning
from pdtool.schema import Config


def sglang_writes_per_request(cfg: Config, tokens: int = DEFAULT_TOKENS) -> tuple[int, int]:
    """(worst decode rank's writes for a `tokens` request, same with equal sharding).

    Both are `transfer.geometry.expected_writes` in SGLang's pools, as the plan counts them.
    """
    worst = max(r.writes_per_request for r in route_plans(cfg, tokens))
    return worst, equal_sharding_writes(cfg, tokens)


def check_sglang_nhd_tp_mismatch(cfg: Config) -> list[Finding]:
    """Warn when SGLang's NHD pools make the backend write token by token."""
    if cfg.engine.kind != "sglang":
        return []
    if all(r.writes_per_page == len(r.slices) for r in route_plans(cfg, DEFAULT_TOKENS)):
        return []  # whole pages (equal sharding, MLA's latent): one write per page and buffer
    src, dst = shard_spec(cfg, "prefill"), shard_spec(cfg, "decode")
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


#: SGLang flags whose extra KV state the backend does not carry (its start-up error says the
#: same); flag -> what it enables. Size flags count only when set above 1.
UNSUPPORTED_FLAGS = {
    "--speculative-algorithm": "speculative decoding (draft-model KV)",
    "--pp-size": "pipeline parallelism",
    "--pipeline-parallel-size": "pipeline parallelism",
    "--attn-cp-size": "attention context parallelism",
    "--dcp-size": "decode context parallelism",
    "--enable-kv-cache-sharding": "KV cache sharding",
}


def _flag_values(argv: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in UNSUPPORTED_FLAGS:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            out[name] = value if eq else ("" if nxt.startswith("--") else nxt)
    return out


def check_sglang_unsupported_args(cfg: Config) -> list[Finding]:
    """engine=sglang: refuse extra SGLang flags the pdtool transfer backend cannot serve."""
    if cfg.engine.kind != "sglang":
        return []
    out = []
    for key, argv in (("engine.extra_args", cfg.engine.extra_args),
                      ("prefill.extra_args", cfg.prefill.extra_args),
                      ("decode.extra_args", cfg.decode.extra_args)):
        for flag, value in _flag_values(list(argv)).items():
            if flag.endswith("-size") and value.isdigit() and int(value) <= 1:
                continue
            out.append(error(
                key,
                f"{flag} {value}".strip() + f": the pdtool SGLang transfer backend does not "
                f"carry {UNSUPPORTED_FLAGS[flag]}; the workers would stop at start-up",
                f"remove {flag} from {key}",
            ))
    return out


ALL = (check_sglang_nhd_tp_mismatch, check_sglang_unsupported_args)
