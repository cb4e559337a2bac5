"""SGLang 0.5.23: its own NHD pools (separate K and V, or MLA's latent), one row of each of
its `MetadataBuffers` per request, a draft model's KV pool beside the target's, one server
process per node, sglang-router as the front (with its own metrics port), DP attention, and
two timers per request (bootstrap, then waiting).

The SGLang switches read here come from the launch line pdtool renders: `engine.extra_args`,
then the role's own `extra_args`, and the decode workers' environment."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdtool.adapters.base import EngineAdapter
from pdtool.schema import (
    DTYPE_BYTES,
    TRANSFER_BACKENDS,
    Config,
    RoleConfig,
    kv_head_width,
    role,
)
from transfer import geometry as G
from transfer import routes as R
from transfer.workerenv import DRAFT_LAYERS

if TYPE_CHECKING:
    from pdtool.memory import Headroom

#: SGLang switches that add metadata buffers (`geometry.sglang_metadata_buffers`).
SGLANG_SAMPLING_MASK_ENV = "SGLANG_ENABLE_DISAGG_SAMPLING_MASK"
SGLANG_KV_CHECKSUM_FLAG = "--disaggregation-enable-kv-checksum"
#: SGLang's speculative decoding switch (it sizes the hidden-state metadata row).
SGLANG_SPECULATIVE_FLAG = "--speculative-algorithm"
#: sglang-router's Prometheus exporter, relative to router.port
ROUTER_METRICS_OFFSET = 1
#: --mem-fraction-static on cluster.device=cpu. There SGLang takes the fraction of the
#: machine's free RAM when the server starts, and refuses to start when the RAM its weights
#: took leaves less than the rest free (mem_cache/kv_cache_configurator.py,
#: _profile_available_bytes): a load by any other process meanwhile counts as its own weights,
#: so at the plan's small fraction (0.05 of a 2 GB "GPU") four servers starting together
#: stopped one ("Loaded weights leave no GPU memory for the KV cache"). The pool is sized by
#: --max-total-tokens from the plan instead (`{role}.mem_fraction` of cluster.gpu_memory_gb,
#: pdtool.engines.sglang.cpu), so this only says how much free RAM SGLang keeps aside: 10 %.
CPU_MEM_FRACTION_STATIC = 0.9
#: SGLang's sizing is written for data-center GPUs; below this it picks smaller chunks and
#: batches itself, and a made-up small "GPU" (tests, emulated sites) is no such case
HEADROOM_MIN_GPU_GB = 20


def sglang_flag_value(argv: list[str] | tuple[str, ...], flag: str) -> str | None:
    """The value argparse would give `flag` in `argv` (`--flag V` or `--flag=V`, the last one
    wins); None when absent, "" when it has no value."""
    out = None
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name == flag:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            out = value if eq else ("" if nxt.startswith("--") else nxt)
    return out


def sglang_speculative(cfg: Config, rname: str) -> str | None:
    """`--speculative-algorithm` of a role's SGLang workers, upper-cased (engine.extra_args,
    then the role's own extra_args, as they follow each other on its launch line)."""
    value = sglang_flag_value([*cfg.engine.extra_args, *role(cfg, rname).extra_args],
                              SGLANG_SPECULATIVE_FLAG)
    return value.upper() if value else None


def sglang_hidden_itemsize(cfg: Config) -> int:
    """Bytes per element of the draft hidden state: SGLang's model dtype (fp8 weights run
    bf16 activations)."""
    return 2 if cfg.model.dtype.startswith("fp8") else DTYPE_BYTES[cfg.model.dtype]


def _decode_env_true(cfg: Config, name: str) -> bool:
    """SGLang's EnvBool reading of `name` in the decode workers' environment."""
    env = {**cfg.launcher.env.all, **cfg.launcher.env.decode}
    return str(env.get(name, "")).lower() in ("true", "1", "yes", "y")


def _decode_flag(cfg: Config, flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=")
               for a in (*cfg.engine.extra_args, *cfg.decode.extra_args))


class SGLangAdapter(EngineAdapter):
    kind = "sglang"
    own_pools = True
    per_node = True
    prompts_as_text = True  # sglang-router's /v1/completions takes a string
    package = "sglang"
    loads_checkpoints = True
    expert_parallel = True
    transfer_backends = TRANSFER_BACKENDS
    front_job = "sglang-router"
    instances_job = "sglang-instances"
    metrics_flag = "--enable-metrics"

    def engine_mem_fraction(self, cfg: Config, rc: RoleConfig) -> float:
        """--mem-fraction-static: the role's share of each GPU; on CPU, CPU_MEM_FRACTION_STATIC
        (the role's share sizes the pool through --max-total-tokens there)."""
        return CPU_MEM_FRACTION_STATIC if cfg.cluster.device == "cpu" else rc.mem_fraction

    def headroom(self, cfg: Config, rname: str) -> Headroom | None:
        """What SGLang 0.5.23 keeps outside mem_fraction on a data-center GPU (activations,
        CUDA graphs, parallel slack, DeepEP buffers: `pdtool.memory.sglang_headroom`)."""
        if cfg.cluster.device != "cuda" or cfg.cluster.gpu_memory_gb < HEADROOM_MIN_GPU_GB:
            return None
        from pdtool.memory import sglang_headroom  # pdtool.memory asks the adapters too

        return sglang_headroom(cfg, rname)

    def kv_pool(self, cfg: Config) -> G.PagePool:
        return G.sglang_pool(cfg.model.attention == "mla")

    def aux_buffers(self, cfg: Config) -> tuple[G.AuxBuffer, ...]:
        hidden, itemsize = G.sglang_hidden_row(sglang_speculative(cfg, "decode"),
                                               cfg.model.hidden_size, sglang_hidden_itemsize(cfg))
        return G.sglang_metadata_buffers(
            sampling_mask=_decode_env_true(cfg, SGLANG_SAMPLING_MASK_ENV),
            kv_checksum=_decode_flag(cfg, SGLANG_KV_CHECKSUM_FLAG),
            hidden_size=hidden, hidden_itemsize=itemsize,
        )

    def draft_group(self, cfg: Config, src: R.ShardSpec, dst: R.ShardSpec) -> G.KVGroup | None:
        """The draft model's KV pool (`model.draft_layers`), grouped as geometry groups it:
        the draft's attention and KV heads are taken to be the target's (EAGLE, EAGLE3 and
        NEXTN drafts share them), so its token bytes follow the target's shards. Raises
        RouteError where the backend could not slice it."""
        if cfg.model.draft_layers <= 0:
            return None
        mla = cfg.model.attention == "mla"
        width = kv_head_width(cfg.model)
        group, _ = G.sglang_draft_group(cfg.model.draft_layers * (1 if mla else 2),
                                        src.heads_per_rank * width, dst.heads_per_rank * width,
                                        src.attn_tp, dst.attn_tp, target_mla=mla)
        return group

    def worker_env(self, cfg: Config) -> dict[str, str]:
        """The draft KV layers the plan counted, which pdtool's backend checks against the
        pool SGLang gives it."""
        if cfg.model.draft_layers > 0:
            return {DRAFT_LAYERS.name: str(cfg.model.draft_layers)}
        return {}

    def router_metrics_port(self, cfg: Config) -> int | None:
        return cfg.router.port + ROUTER_METRICS_OFFSET

    def dp_attention(self, rc: RoleConfig) -> bool:
        return rc.dp_attention and rc.dp > 1

    def transfer_timers(self, cfg: Config) -> tuple[tuple[str, float], ...]:
        """SGLang's bootstrap timer (transfer.connect_timeout_s), then its waiting timer
        (transfer.timeout_s, pdtool.launch.backends)."""
        t = cfg.transfer
        return (("transfer.connect_timeout_s", t.connect_timeout_s),
                ("transfer.timeout_s", t.timeout_s))
