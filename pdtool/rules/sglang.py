"""What the `pdtool` SGLang transfer backend (transfer/sglang) can and cannot do, for validate.

Only for `engine.kind=sglang`. SGLang 0.5.23 keeps its own KV pools, NHD per layer buffer with
separate K and V buffers (MLA: one latent buffer), whatever `transfer.layout` says. The backend
writes one write per (page, layer buffer, source shard) in every case: with equal attention TP
(or MLA's replicated latent) a page is contiguous, and with different MHA/GQA attention TP it
gathers each page's head slice into a registered staging buffer first
(`transfer/sglang/staging_plane.py`), so there is no per-token write count to warn about; the
plan shows the count (`transfer.geometry`). SGLang flags for state the backend does not carry
(draft KV, PP, CP, KV sharding) are errors.
"""

from __future__ import annotations

from pdtool.rules.finding import Finding, error
from pdtool.schema import Config

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


ALL = (check_sglang_unsupported_args,)
