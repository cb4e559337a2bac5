"""What the `pdtool` SGLang transfer backend (transfer/sglang) can and cannot do, for validate.

Only for `engine.kind=sglang` (`pdtool.rules.ENGINE_STAGES`). SGLang 0.5.23 keeps its own KV
pools, NHD per layer buffer with separate K and V buffers (MLA: one latent buffer), whatever
`transfer.layout` says. The backend writes one write per (page, layer buffer, source shard) in
every case: with equal attention TP (or MLA's replicated latent) a page is contiguous, and with
different MHA/GQA attention TP it gathers each page's head slice into a registered staging
buffer first (`transfer/sglang/staging_plane.py`), so there is no per-token write count to warn
about; the plan shows the count (`transfer.geometry`). SGLang flags for state the backend does
not carry (PP, CP, KV sharding) are errors.
Speculative decoding: the draft's hidden state and top-k travel in the metadata buffers (NGRAM,
UNO and FROZEN_KV_MTP need nothing else); a draft model with a KV pool of its own (EAGLE/NEXTN/
MTP, EAGLE3, STANDALONE) is sent as more layer buffers, which the plan counts from
`model.draft_layers` (required with them). DFLASH and DSPARK, whose draft pools follow rules of
their own, are refused.
Also SGLang's own limits: its KV dtypes, DeepEP on EFA, `launcher.verify`'s pair check, and what
its mooncake and nixl backends do with a TP mismatch.
"""

from __future__ import annotations

from pdtool.adapters.sglang import SGLANG_SPECULATIVE_FLAG, sglang_flag_value, sglang_speculative
from pdtool.memory import uses_deepep
from pdtool.plan import sglang_draft
from pdtool.rules.finding import Finding, error, warning
from pdtool.schema import ROLES, Config, TransferConfig, attn_tp, role
from transfer.geometry import (
    SGLANG_SPEC_ALGORITHMS,
    SGLANG_SPEC_DRAFT_KV,
    SGLANG_SPEC_DRAFT_KV_CARRIED,
    SGLANG_SPEC_HIDDEN_STATES,
)
from transfer.routes import RouteError
from transfer.sglang import SGLANG_VERSION

#: pdtool KV dtype names -> SGLang 0.5.23 --kv-cache-dtype choices (it has no fp16/fp32 cache:
#: validate refuses those, check_sglang_kv_dtype); pdtool.launch.sglang writes them
SGLANG_KV_DTYPES = {"bf16": "bfloat16", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}

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


#: SGLang 0.5.23 flags pdtool.launch.sglang renders from typed keys (and their aliases) -> the
#: key ("{role}": the role whose extra_args hold it). SGLang keeps the last value of a repeated
#: flag, so one in extra_args silently replaced the plan's: `decode.extra_args=[--page-size,32]`
#: validated clean and the backend counted writes for the plan's page size.
RENDERED_FLAGS = {
    "--model-path": "model.path", "--model": "model.path",
    "--served-model-name": "model.name",
    "--disaggregation-mode": "mode (each instance's role)",
    "--disaggregation-transfer-backend": "transfer.backend",
    "--disaggregation-bootstrap-port": "prefill.bootstrap_port",
    "--disaggregation-ib-device": "cluster.nics",
    "--port": "{role}.http_port", "--host": "the plan's node addresses",
    "--tp-size": "{role}.tp", "--tp": "{role}.tp", "--tensor-parallel-size": "{role}.tp",
    "--dp-size": "{role}.dp", "--dp": "{role}.dp", "--data-parallel-size": "{role}.dp",
    "--attn-dp-size": "{role}.dp with {role}.dp_attention",
    "--enable-dp-attention": "{role}.dp_attention",
    "--ep-size": "{role}.ep", "--ep": "{role}.ep", "--expert-parallel-size": "{role}.ep",
    "--page-size": "{role}.page_size",
    "--mem-fraction-static": "{role}.mem_fraction (on cluster.device=cpu: 0.9 of free RAM)",
    "--chunked-prefill-size": "{role}.chunked_prefill_size",
    "--max-running-requests": "{role}.max_running_requests",
    "--kv-cache-dtype": "{role}.kv_dtype",
    "--context-length": "model.context_length",
    "--dtype": "model.dtype",
    "--dist-init-addr": "{role}.nodes and {role}.dist_init_port",
    "--nnodes": "{role}.nodes", "--node-rank": "{role}.nodes",
    "--nccl-port": "{role}.dist_init_port",
    "--base-gpu-id": "the plan's GPU placement",
    "--numa-node": "cluster.gpu_numa",
    "--device": "cluster.device",
    "--max-total-tokens": "the plan's KV tokens ({role}.mem_fraction; cluster.device=cpu)",
}


def check_sglang_version(cfg: Config) -> list[Finding]:
    """`engine.version` pins the SGLang release: pdtool's launch lines and transfer backend are
    written for `transfer.sglang.SGLANG_VERSION`, and the worker refuses to start another
    installed release."""
    v = cfg.engine.version
    if v != SGLANG_VERSION:
        return [error("engine.version", f"{v!r}: pdtool's SGLang launch lines and transfer "
                      f"backend are written for SGLang {SGLANG_VERSION}",
                      f"set engine.version={SGLANG_VERSION} (and install "
                      f"sglang=={SGLANG_VERSION} where the workers run)")]
    return []


def check_sglang_rendered_flags(cfg: Config) -> list[Finding]:
    """engine=sglang: refuse extra_args flags pdtool renders from typed keys, naming the key."""
    out = []
    for key, argv, rname in (("engine.extra_args", cfg.engine.extra_args, "prefill/decode"),
                             ("prefill.extra_args", cfg.prefill.extra_args, "prefill"),
                             ("decode.extra_args", cfg.decode.extra_args, "decode")):
        for arg in argv:
            flag = str(arg).split("=", 1)[0]
            if flag in RENDERED_FLAGS:
                typed = RENDERED_FLAGS[flag].format(role=rname)
                out.append(error(
                    key, f"{flag} is rendered from {typed}: SGLang keeps the last value, so "
                    f"the plan (and the transfer backend's write counts) would describe "
                    f"another deployment", f"remove {flag} from {key} and set {typed}"))
    return out


def check_sglang_unsupported_args(cfg: Config) -> list[Finding]:
    """engine=sglang: refuse extra SGLang flags the pdtool transfer backend cannot serve."""
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
SPEC_FIX = ("use --speculative-algorithm EAGLE/NEXTN, EAGLE3 or STANDALONE (with "
            "model.draft_layers), NGRAM, UNO or FROZEN_KV_MTP, or transfer.backend=mooncake / "
            "nixl for this algorithm")
#: How to give the plan the draft's KV layers.
DRAFT_LAYERS_FIX = ("set model.draft_layers to the draft model's KV layers (its config's "
                    "num_hidden_layers; 1 for the usual EAGLE/EAGLE3 drafts and DeepSeek's "
                    "NEXTN layer)")


def _spec_key(cfg: Config, rname: str) -> str:
    """The key naming where a role's `--speculative-algorithm` comes from."""
    own = sglang_flag_value(list(getattr(cfg, rname).extra_args), SGLANG_SPECULATIVE_FLAG)
    return "engine.extra_args" if own is None else f"{rname}.extra_args"


def draft_layers_unread(cfg: Config) -> list[Finding]:
    """model.draft_layers where nothing reads it (another engine, or SGLang's own backends)."""
    if cfg.model.draft_layers <= 0:
        return []
    return [error("model.draft_layers",
                  f"model.draft_layers={cfg.model.draft_layers}: only pdtool's SGLang "
                  "transfer backend reads it (engine.kind=sglang, "
                  "transfer.backend=pdtool); here it would change nothing",
                  "remove model.draft_layers")]


def check_sglang_speculative(cfg: Config) -> list[Finding]:
    """engine=sglang: speculative decoding only where the backend carries what it needs.

    The metadata buffers (hidden state, top-k) always travel; a draft model's own KV pool
    (SGLang appends it to the KV buffers, `KVArgs.num_draft_entries`) travels for EAGLE/NEXTN,
    EAGLE3 and STANDALONE, counted by the plan from `model.draft_layers`; DFLASH's and DSPARK's
    do not, and the workers would stop at start-up. A draft hidden state is produced by the
    prefill, and the draft pool is registered on both sides, so both roles must run the same
    algorithm (the rows and buffers must be the same on both sides)."""
    if cfg.transfer.backend != "pdtool":
        return draft_layers_unread(cfg)
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
        elif alg in SGLANG_SPEC_DRAFT_KV and alg not in SGLANG_SPEC_DRAFT_KV_CARRIED:
            out.append(error(
                key,
                f"--speculative-algorithm {alg}: its draft model's KV pool follows rules of its "
                "own in SGLang 0.5.23 (DFLASH's may run on a TP group of its own, DSPARK needs "
                "DeepSeek-V4's hybrid pools); the pdtool SGLang transfer backend does not carry "
                "that draft-model KV and the workers would stop at start-up", SPEC_FIX))
        elif alg in SGLANG_SPEC_DRAFT_KV and cfg.model.draft_layers < 1:
            out.append(error(
                "model.draft_layers",
                f"--speculative-algorithm {alg} ({key}): its draft model keeps a KV pool of its "
                "own, which the pdtool SGLang transfer backend sends beside the target's; the "
                "plan needs its layers to count the writes a decoder waits for",
                DRAFT_LAYERS_FIX))
    drafts = {r: a for r, a in algs.items() if a in SGLANG_SPEC_DRAFT_KV_CARRIED}
    if cfg.model.draft_layers > 0 and not drafts:
        out.append(error(
            "model.draft_layers",
            f"model.draft_layers={cfg.model.draft_layers} without a --speculative-algorithm "
            f"whose draft keeps a KV pool ({', '.join(sorted(SGLANG_SPEC_DRAFT_KV_CARRIED))}): "
            "it would change nothing", "remove model.draft_layers, or add the algorithm to "
            "engine.extra_args"))
    elif drafts and cfg.model.draft_layers > 0:
        try:
            sglang_draft(cfg)
        except RouteError as exc:
            out.append(error("model.draft_layers", f"{exc}", "give prefill and decode the "
                             "same attention TP"))
    if drafts and len(drafts) == 1:
        one = next(iter(drafts))
        out.append(error(
            _spec_key(cfg, one),
            f"--speculative-algorithm: {one} runs {drafts[one]}, whose draft KV pool SGLang "
            f"registers beside the target's, and the other role does not; both must register "
            "the same KV buffers", "give both roles the same --speculative-algorithm "
            "(engine.extra_args)"))
    hidden = {r: a for r, a in algs.items() if a in SGLANG_SPEC_HIDDEN_STATES}
    if hidden and algs["prefill"] != algs["decode"] and len(drafts) != 1:
        out.append(error(
            _spec_key(cfg, "decode" if "decode" in hidden else "prefill"),
            f"--speculative-algorithm: prefill runs {algs['prefill'] or 'none'}, decode "
            f"{algs['decode'] or 'none'}; the draft's hidden state and top-k come from the "
            "prefill, whose metadata rows must match the decode's",
            "give both roles the same --speculative-algorithm (engine.extra_args)"))
    return out


def check_sglang_aggregated_args(cfg: Config) -> list[Finding]:
    """engine=sglang, mode=aggregated: every instance runs both phases with its role's
    extra_args, which were chosen for one phase (DeepSeek's DP-attention recipe runs DeepEP
    `normal` on prefill and `low_latency` on decode); said once, so the baseline is not
    compared without knowing."""
    if cfg.mode != "aggregated":
        return []
    pre, dec = list(cfg.prefill.extra_args), list(cfg.decode.extra_args)
    if pre == dec:
        return []
    return [warning(
        "mode",
        f"mode=aggregated: every instance prefills and decodes with its role's extra_args "
        f"(prefill-side instances {pre}, decode-side {dec}), flags chosen for one phase",
        "give both roles the same flags for a like-for-like baseline (DeepEP: "
        "--deepep-mode auto), or accept the difference")]


#: transfer.* keys only pdtool's messenger reads (the reference engine's), and what governs
#: the same thing with engine=sglang: the backend keeps SGLang's bootstrap and heartbeats (SGLang
#: 0.5.23 environ.py) and pools, and receives on one lane per NIC of the rank. (timeout_s and
#: connect_timeout_s are read: pdtool.launch.backends sets SGLang's timers from them.)
#: key -> (what governs it, the environment variable to set instead or None)
SGLANG_OWN: dict[str, tuple[str, str | None]] = {
    "peer_timeout_s": ("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL x "
                       "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE (default 5 s x 2)",
                       "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"),
    "heartbeat_s": ("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL (seconds, at least 2)",
                    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"),
    "lanes": ("cluster.nics: one receive lane per NIC of the rank", None),
    "layout": ("SGLang's own KV pools, NHD per layer buffer with K and V apart (MLA: one "
               "latent buffer); `pdtool plan` shows the layout written", None),
}


def check_sglang_unread_transfer_keys(cfg: Config) -> list[Finding]:
    """engine=sglang: a messenger-only transfer key set away from its default would be read
    by nothing; refused, naming what governs it under SGLang."""
    defaults = TransferConfig()
    out = []
    for name, (own, env) in SGLANG_OWN.items():
        value, default = getattr(cfg.transfer, name), getattr(defaults, name)
        if value != default:
            fix = f"leave transfer.{name} at its default ({default})"
            if env:
                fix += f" and set +launcher.env.all.{env}=... instead"
            out.append(error(
                f"transfer.{name}",
                f"transfer.{name}={value}: with engine=sglang nothing reads it (the reference "
                f"engine's messenger does); SGLang's own setting governs it: {own}", fix))
    return out


#: SGLang 0.5.23's switch to HND KV pools (`mem_cache/memory_pool.py`): its PD transfer path,
#: `get_contiguous_buf_infos`, asserts NHD slot rows, so no transfer backend starts with it
HND_POOLS_ENV = "SGLANG_USE_HND_KVCACHE"


def asks_hnd_pools(value: str | None) -> bool:
    """Whether an SGLANG_USE_HND_KVCACHE value turns HND pools on (SGLang's EnvBool reading)."""
    return (value or "").strip().lower() in ("true", "1", "yes", "y")


def check_sglang_hnd_pools(cfg: Config) -> list[Finding]:
    """engine=sglang, disaggregated: SGLang refuses PD transfer from HND pools (an assertion
    in the scheduler's start, whatever the backend); say so before the servers start."""
    if cfg.mode == "aggregated":
        return []
    env = cfg.launcher.env
    return [error(f"launcher.env.{group}.{HND_POOLS_ENV}",
                  f"{HND_POOLS_ENV}={values[HND_POOLS_ENV]} gives SGLang HND KV pools, whose "
                  "PD transfer SGLang 0.5.23 does not support (memory_pool.py asserts NHD slot "
                  "rows at start-up, for every transfer backend)",
                  f"remove launcher.env.{group}.{HND_POOLS_ENV}, or use mode=aggregated")
            for group, values in (("all", env.all), ("prefill", env.prefill),
                                  ("decode", env.decode))
            if asks_hnd_pools(values.get(HND_POOLS_ENV))]


def check_sglang_model_seed(cfg: Config) -> list[Finding]:
    """engine=sglang: model.seed draws the reference engine's built-in weights; SGLang loads
    model.path's checkpoint and nothing reads the seed."""
    if not cfg.model.seed:
        return []
    return [error(
        "model.seed",
        f"model.seed={cfg.model.seed}: with engine=sglang nothing reads it (it draws the "
        "reference engine's built-in weights; SGLang loads the checkpoint in model.path)",
        "drop model.seed; for SGLang's sampling seed pass "
        "+engine.extra_args=[--random-seed,N]")]


#: KV dtypes an SGLang line can carry: `auto` (the model's) or one --kv-cache-dtype renders
SGLANG_CACHE_DTYPES = ("auto", *SGLANG_KV_DTYPES)


def check_sglang_kv_dtype(cfg: Config) -> list[Finding]:
    """Only KV dtypes SGLang's --kv-cache-dtype has (no fp16/fp32 cache)."""
    out = []
    for r in ("prefill", "decode"):
        dt = getattr(cfg, r).kv_dtype
        if dt not in SGLANG_CACHE_DTYPES:
            out.append(error(f"{r}.kv_dtype",
                             f"SGLang 0.5.23 has no {dt} KV cache (--kv-cache-dtype takes "
                             f"{', '.join(SGLANG_CACHE_DTYPES)} here)",
                             f"set {r}.kv_dtype=auto (the model's dtype) or bf16"))
    return out


def _deepep_mode(args: list[str]) -> str:
    args = [str(a) for a in args]
    for i, a in enumerate(args):
        if a.startswith("--deepep-mode="):
            return a.split("=", 1)[1]
        if a == "--deepep-mode" and i + 1 < len(args):
            return args[i + 1]
    return "auto"  # SGLang's default


def check_deepep_on_efa(cfg: Config) -> list[Finding]:
    """DeepEP's low-latency kernels (used by decode under `auto`) drive the NICs from the GPU
    through NVSHMEM's IBGDA transport, which needs ConnectX (mlx5) NICs; EFA has none."""
    if not any(n.kind == "efa" for n in cfg.cluster.nics):
        return []
    out = []
    for r in ROLES:
        args = [*cfg.engine.extra_args, *role(cfg, r).extra_args]
        mode = _deepep_mode(args)
        if uses_deepep(args) and mode in ("low_latency", "auto"):
            out.append(warning(
                f"{r}.extra_args",
                f"DeepEP --deepep-mode {mode} on EFA ({cfg.cluster.name}): its low-latency "
                f"kernels need NVSHMEM's IBGDA transport, i.e. ConnectX (mlx5) NICs",
                "use --deepep-mode normal on EFA, or another --moe-a2a-backend"))
    return out


def check_sglang_verify_pairs(cfg: Config) -> list[Finding]:
    """launcher.verify compares prefill->decode pairs with each other on SGLang (its kernels
    are not recomputed here): two at least, and an aggregated deployment moves no KV."""
    if cfg.launcher.verify <= 0:
        return []
    if cfg.mode != "disaggregated":
        return [error("launcher.verify", "compares prefill->decode pairs; an aggregated "
                      "deployment has none", "set launcher.verify=0, or check an aggregated "
                      "twin with pdtool bench --verify N --compare")]
    npairs = cfg.prefill.instances * cfg.decode.instances
    if npairs < 2:
        return [error("launcher.verify", f"compares prefill->decode pairs with each other; "
                      f"this deployment has {npairs}",
                      "run two decode (or prefill) instances, or check against a deployment "
                      "without KV transfer: pdtool bench --verify N --compare aggregated")]
    return []


#: SGLang 0.5.23's staging buffer for heterogeneous TP (mooncake and nixl), and its pool size
STAGING_ENV, STAGING_POOL_ENV = "SGLANG_DISAGG_STAGING_BUFFER", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB"


def check_backend_limits(cfg: Config) -> list[Finding]:
    """What SGLang 0.5.23's mooncake and nixl backends do with a prefill/decode attention TP
    mismatch (read in disaggregation/mooncake/conn.py and nixl/conn.py): MLA keeps one latent
    head replicated on every rank, so each decode rank takes whole pages from one prefill rank
    (`send_kvcache`); other attention sends each page's KV heads as slices, one write per token
    and head run (`send_kvcache_slice`), unless the staging buffer is on (`SGLANG_DISAGG_
    STAGING_BUFFER=1`, a GPU pool of `SGLANG_DISAGG_STAGING_POOL_SIZE_MB`, 4096 by default),
    where pages are gathered into it and sent whole. Neither path is pdtool's (no HND gather,
    no transfer.gpu_memory)."""
    be = cfg.transfer.backend
    if be not in ("mooncake", "nixl"):
        return []
    p, d = attn_tp(cfg.prefill), attn_tp(cfg.decode)
    if p == d or cfg.model.attention == "mla":
        return []
    env = {**cfg.launcher.env.all, **cfg.launcher.env.prefill}
    if str(env.get(STAGING_ENV, "")).lower() in ("1", "true"):
        pool = env.get(STAGING_POOL_ENV, "4096")
        return [warning("transfer.backend",
                        f"transfer.backend={be}: prefill attention TP {p} != decode attention "
                        f"TP {d}: SGLang 0.5.23 stages the KV heads through a {pool} MB GPU "
                        f"buffer per transfer queue ({STAGING_ENV}=1; {STAGING_POOL_ENV} sizes it)"
                        ", which the memory plan does not count",
                        f"lower {STAGING_POOL_ENV} if the KV pool no longer fits")]
    return [warning("transfer.backend",
                    f"transfer.backend={be}: prefill attention TP {p} != decode attention TP "
                    f"{d} with {cfg.model.attention.upper()} attention: SGLang 0.5.23's {be} "
                    "backend sends each page's KV heads as slices, one write per token and head "
                    "run (send_kvcache_slice), far more writes than whole pages",
                    f"set +launcher.env.all.{STAGING_ENV}=1 (SGLang's staging buffer for "
                    "heterogeneous TP), equal attention TP on both sides, or "
                    "transfer.backend=pdtool")]



VALUES = (check_sglang_version,)
SHAPES = ()
PLACED = (check_sglang_unsupported_args, check_sglang_rendered_flags, check_sglang_speculative,
       check_sglang_aggregated_args, check_sglang_unread_transfer_keys, check_sglang_model_seed,
       check_sglang_hnd_pools, check_sglang_kv_dtype, check_deepep_on_efa,
       check_sglang_verify_pairs, check_backend_limits)
