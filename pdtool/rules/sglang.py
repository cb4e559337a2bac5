"""What the `pdtool` SGLang transfer backend (transfer/sglang) can and cannot do, for validate.

Only for `engine.kind=sglang`. SGLang 0.5.23 keeps its own KV pools, NHD per layer buffer with
separate K and V buffers (MLA: one latent buffer), whatever `transfer.layout` says. The backend
writes one write per (page, layer buffer, source shard) in every case: with equal attention TP
(or MLA's replicated latent) a page is contiguous, and with different MHA/GQA attention TP it
gathers each page's head slice into a registered staging buffer first
(`transfer/sglang/staging_plane.py`), so there is no per-token write count to warn about; the
plan shows the count (`transfer.geometry`). SGLang flags for state the backend does not carry
(draft KV, PP, CP, KV sharding) are errors.
Speculative decoding runs when the algorithm needs nothing but the metadata buffers (its draft
hidden state and top-k travel in them): NGRAM, UNO and FROZEN_KV_MTP; those whose draft model
keeps its own KV pool (EAGLE/NEXTN/MTP, EAGLE3, STANDALONE, DFLASH, DSPARK) are refused.
"""

from __future__ import annotations

from pdtool.plan import (
    SGLANG_SPECULATIVE_FLAG,
    sglang_flag_value,
    sglang_speculative,
)
from pdtool.rules.finding import Finding, error
from pdtool.schema import Config
from transfer.geometry import (
    SGLANG_SPEC_ALGORITHMS,
    SGLANG_SPEC_DRAFT_KV,
    SGLANG_SPEC_HIDDEN_STATES,
)

#: SGLang flags whose extra KV state the backend does not carry (its start-up error says the
#: same); flag -> what it enables. Size flags count only when set above 1.
UNSUPPORTED_FLAGS = {
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


#: What to do instead of an algorithm the backend cannot serve.
SPEC_FIX = ("use --speculative-algorithm NGRAM (UNO or FROZEN_KV_MTP where the model has them: "
            "no draft KV), or transfer.backend=mooncake / nixl for this algorithm")


def _spec_key(cfg: Config, rname: str) -> str:
    """The key naming where a role's `--speculative-algorithm` comes from."""
    own = sglang_flag_value(list(getattr(cfg, rname).extra_args), SGLANG_SPECULATIVE_FLAG)
    return "engine.extra_args" if own is None else f"{rname}.extra_args"


def check_sglang_speculative(cfg: Config) -> list[Finding]:
    """engine=sglang: speculative decoding only where the backend carries what it needs.

    The metadata buffers (hidden state, top-k) always travel; a draft model's own KV pool
    (SGLang appends it to the KV buffers, `KVArgs.num_draft_entries`) does not, and the
    workers would stop at start-up. A draft hidden state is produced by the prefill, so both
    roles must run the same algorithm (the rows must be the same size on both sides)."""
    if cfg.engine.kind != "sglang" or cfg.transfer.backend != "pdtool":
        return []
    algs = {r: sglang_speculative(cfg, r) for r in ("prefill", "decode")}
    out, seen = [], set()
    for rname, alg in algs.items():
        key = _spec_key(cfg, rname)
        if alg is None or (key, alg) in seen:
            continue  # engine.extra_args: said once for both roles
        seen.add((key, alg))
        if alg not in SGLANG_SPEC_ALGORITHMS:
            out.append(error(
                key,
                f"--speculative-algorithm {alg}: not one of SGLang 0.5.23's algorithms "
                f"{sorted(SGLANG_SPEC_ALGORITHMS)}, so what it transfers is unknown to the "
                "pdtool SGLang transfer backend", SPEC_FIX))
        elif alg in SGLANG_SPEC_DRAFT_KV:
            out.append(error(
                key,
                f"--speculative-algorithm {alg}: speculative decoding whose draft model keeps "
                "its own KV pool, which SGLang sends beside the target's (draft-model KV); the "
                "pdtool SGLang transfer backend does not carry it and the workers would stop "
                "at start-up", SPEC_FIX))
    hidden = {r: a for r, a in algs.items() if a in SGLANG_SPEC_HIDDEN_STATES}
    if hidden and algs["prefill"] != algs["decode"]:
        out.append(error(
            _spec_key(cfg, "decode" if "decode" in hidden else "prefill"),
            f"--speculative-algorithm: prefill runs {algs['prefill'] or 'none'}, decode "
            f"{algs['decode'] or 'none'}; the draft's hidden state and top-k come from the "
            "prefill, whose metadata rows must match the decode's",
            "give both roles the same --speculative-algorithm (engine.extra_args)"))
    return out


ALL = (check_sglang_unsupported_args, check_sglang_speculative)
