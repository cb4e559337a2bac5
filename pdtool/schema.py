"""Typed configuration schema: the dataclasses every YAML file under conf/ and recipes/ fills in.

They are registered in Hydra's ConfigStore (`register()`) as `base_<group>` entries, and each
YAML option starts with `defaults: [base_<group>]`, so a misspelt key or a value of the wrong
type fails at compose time with the key's full name instead of surfacing later as odd behaviour.
Value *ranges and choices* (tp >= 1, `attention` in mha|gqa|mla, ...) are checked by the rules in
`pdtool.rules`, which can name the key and suggest a fix; OmegaConf only knows types.

Keys are short and stable because users type them on the command line:
`model.attention`, `prefill.tp`, `decode.instances`, `transfer.layout`, `launcher.partition`, ...

Nothing here imports torch, SGLang or the libfabric binding: `pdtool validate` must stay fast.
The parallelism arithmetic (GPUs per instance, attention TP, heads per rank, node span) is
`transfer.parallel.ParallelDims`'; `role_dims` builds it from a role's keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from transfer import timers
from transfer.parallel import ParallelDims

ATTENTION_KINDS = ("mha", "gqa", "mla")
WEIGHT_DTYPES = ("fp32", "bf16", "fp16", "fp8")
KV_DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
LAYOUTS = ("HND", "NHD")
PROVIDERS = ("efa", "verbs;ofi_rxm", "tcp;ofi_rxm", "shm")
NIC_KINDS = ("efa", "connectx", "tcp", "shm")
DEVICES = ("cuda", "cpu")
MAX_LANES = 8  # transfer.lanes (the messenger's DecodeConfig takes 0..8)
LAUNCHERS = ("local", "slurm")
ENGINES = ("reference", "sglang")
MODES = ("disaggregated", "aggregated")  # aggregated: every instance runs whole requests
TRANSFER_BACKENDS = ("pdtool", "mooncake", "nixl")
ROLES = ("prefill", "decode")

#: Bytes per element of each dtype name used above.
DTYPE_BYTES = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}


@dataclass
class ModelConfig:
    """The model's architecture, as far as sharding, KV size and memory fit need it.

    `num_kv_heads` counts KV-cache heads: for MLA the cache holds one latent "head" of
    `kv_lora_rank + qk_rope_head_dim` values per token, so it must be 1. `head_dim` is the
    per-head dimension of K and V for MHA/GQA (ignored for the MLA cache).
    MoE: `expert_params_b` is the parameter count (billions) in routed experts, which are
    sharded over every GPU of an instance; the rest (attention, dense and shared-expert MLPs,
    embeddings) is sharded over the attention TP group and replicated across DP-attention groups.
    `hidden_size`, `num_q_heads`, `intermediate_size`, `vocab_size` and `seed` are what the
    reference CPU engine builds its random-weight transformer from.
    `draft_layers`: the KV layers of a speculative draft model with a KV pool of its own
    (`--speculative-algorithm` EAGLE/NEXTN, EAGLE3, STANDALONE with engine=sglang and
    transfer.backend=pdtool), which SGLang sends beside the target's; the plan counts their
    writes, taking the draft's attention and KV heads to be the target's, and the backend stops
    at start-up when the draft pool it is given has another number of layers.
    """

    name: str = MISSING  # the served model id (the OpenAI `model` field)
    path: str = ""  # HF id or local folder the engine loads ("" for the reference engine)
    attention: str = "gqa"  # mha | gqa | mla
    num_layers: int = MISSING  # transformer layers (each has its KV cache)
    hidden_size: int = MISSING  # residual stream width
    num_q_heads: int = MISSING  # attention query heads
    num_kv_heads: int = MISSING  # KV-cache heads (GQA groups; 1 for MLA's latent)
    head_dim: int = MISSING  # K/V width per head (MHA/GQA)
    kv_lora_rank: int = 0  # MLA latent width
    qk_rope_head_dim: int = 0  # MLA decoupled RoPE key width
    intermediate_size: int = MISSING  # dense MLP width (MoE: per-expert width in moe_*)
    vocab_size: int = MISSING  # tokens in the vocabulary
    context_length: int = 4096  # prompt + new tokens one request may span
    dtype: str = "bf16"  # weight dtype: fp32 | bf16 | fp16 | fp8
    num_params_b: float = MISSING  # total parameters, billions (for memory fit)
    num_experts: int = 0  # routed experts per MoE layer (0: dense model)
    moe_intermediate_size: int = 0  # one expert's MLP width (FP8 block check, rules.moe)
    expert_params_b: float = 0.0  # billions of parameters in routed experts (all layers)
    experts_per_token: int = 0  # routed experts per token (top-k: pdtool size; dense: unused)
    seed: int = 0  # reference engine: weights are generated from this seed
    draft_layers: int = 0  # speculative draft model's own KV layers (0: no draft KV pool)


@dataclass
class NicConfig:
    """One network interface (libfabric domain) of a node.

    `gpus` are the local GPU ids on the same PCIe switch (the NIC those ranks should use);
    empty means the NIC is equally close to every GPU (a host NIC: shm, loopback TCP).
    """

    name: str = MISSING  # the RDMA device or interface name (e.g. rdmap79s0, mlx5_0, lo)
    kind: str = MISSING  # efa | connectx | tcp | shm
    numa: int = 0  # the NUMA node the NIC hangs off
    gpus: list[int] = field(default_factory=list)  # GPUs on its PCIe switch (empty: a host NIC)
    gbps: int = 0  # link speed: the shared-host-NIC warning shows each GPU's share (rules.launch)


@dataclass
class ClusterConfig:
    """The nodes a deployment runs on: all nodes are alike.

    `gpus_per_node` counts accelerators (on `device: cpu`, worker slots of the local machine).
    `gpu_numa[g]` is GPU g's NUMA node; `numa_cpus[n]` is NUMA node n's CPU list ("0-47,96-143").
    `nodes` is how many nodes the deployment may use (Slurm requests only what the plan needs).
    """

    name: str = MISSING  # the preset's name (local, p5, p5en, dgx-h100, dgx-h200)
    nodes: int = 1  # nodes the deployment may use
    gpus_per_node: int = MISSING  # GPUs per node (on device=cpu: worker slots)
    gpu_type: str = ""  # the GPU model, for the plan's header
    gpu_memory_gb: float = MISSING  # memory per GPU in GiB (what the memory fit checks)
    device: str = "cuda"  # cuda | cpu
    gpu_numa: list[int] = field(default_factory=list)  # the NUMA node of each GPU, by GPU index
    # the CPU list of each NUMA node (e.g. 0-47,96-143)
    numa_cpus: list[str] = field(default_factory=list)
    # the node's NICs (a list of {name, kind, numa, gpus, gbps})
    nics: list[NicConfig] = field(default_factory=list)
    # the host interface for NCCL/Gloo bootstrap sockets of instances spanning nodes
    # (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME); "" leaves NCCL's own choice
    socket_ifname: str = ""
    # every "node" is this one machine (an emulated Slurm cluster): loopback reaches them all
    one_host: bool = False


@dataclass
class RoleConfig:
    """One side of the disaggregated deployment (prefill or decode).

    GPUs per instance: `tp` with `dp_attention` (SGLang `--tp N --dp D --enable-dp-attention`:
    D attention replicas of TP N/D inside the instance, experts sharded over all N GPUs),
    otherwise `tp * dp` (D independent TP-N replicas). `nodes` is nodes per instance.
    Ports are bases: instance i uses base + i. `bootstrap_port` is used by prefill only.
    """

    tp: int = 1  # tensor parallel degree (GPUs per instance with dp_attention)
    dp: int = 1  # data parallel degree inside an instance
    dp_attention: bool = False  # DP attention: dp attention replicas inside tp GPUs
    ep: int = 1  # expert parallelism over the instance's TP GPUs (SGLang --ep-size), divides tp
    nodes: int = 1  # nodes per instance
    instances: int = 1  # instances of this role (the prefill:decode ratio)
    page_size: int = 64  # tokens per KV page (both roles must agree)
    kv_dtype: str = "auto"  # auto follows model.dtype (bf16 for fp8 weights)
    kv_layout: str = "${transfer.layout}"  # page layout: HND | NHD (follows transfer.layout)
    mem_fraction: float = 0.85  # share of GPU memory for weights and KV cache
    chunked_prefill_size: int = 8192  # tokens per prefill chunk (a multiple of page_size)
    max_running_requests: int = 0  # 0: engine default
    http_port: int = 30000  # HTTP port base (instance i: base + i x spacing)
    bootstrap_port: int = 8998  # prefill: the KV bootstrap / control port base
    dist_init_port: int = 20000  # dist-init (NCCL/Gloo) port base
    extra_args: list[str] = field(default_factory=list)  # appended to the engine's launch line


@dataclass
class TransferConfig:
    """The KV messenger: libfabric provider, page layout, timeouts. Completions are counted
    from the immediate data every KV write carries (the only mode the messenger has)."""

    provider: str = "shm"  # efa | verbs;ofi_rxm | tcp;ofi_rxm | shm
    layout: str = "HND"  # HND | NHD
    timeout_s: float = timers.TIMEOUT_S  # one transfer's time limit (SGLang's waiting timeout too)
    # reference engine: decode ranks wait this long for a prefill lead's /health (its control
    # addresses) at start; engine=sglang: SGLang's bootstrap timeout
    connect_timeout_s: float = timers.CONNECT_TIMEOUT_S
    peer_timeout_s: float = timers.PEER_TIMEOUT_S  # a messenger peer silent this long is dead
    heartbeat_s: float = timers.HEARTBEAT_S  # messenger liveness pings; < peer_timeout_s
    lanes: int = 0  # receive endpoints per decode rank, each copying on its own thread (0: 2 on
    # shm, where the receiver does every copy; 1 elsewhere)
    # how KV in GPU memory reaches the fabric: auto | direct (FI_HMEM) | staged (host bounce
    # buffers); transfer.gpu_memory has the rule (engine=sglang; the reference engine's KV is
    # in host memory)
    gpu_memory: str = "auto"
    # engine=sglang: who moves the KV: pdtool's messenger (its plugin, registered as
    # `pdtool`, transfer.sglang.BACKEND_NAME), or SGLang's own mooncake / nixl backends on the
    # plan's per-GPU NICs
    backend: str = "pdtool"
    # `pdtool launch --preflight`: each prefill rank writes this many MiB to every decode rank
    # it may send KV to, over each NIC pair, before the run reports healthy (0: no fabric
    # check; pdtool.fabric_check, docs/fabric-check.md)
    preflight_mib: int = 256
    # a NIC pair measured under this many Gbit/s stops the preflight, naming the pair; -1: a
    # quarter of the slower NIC's `cluster.nics` gbps (no floor where that is 0); 0: report only
    preflight_min_gbps: float = -1.0


@dataclass
class EnvConfig:
    """Environment variables per process kind; `all` goes to every process."""

    all: dict[str, str] = field(default_factory=dict)  # variables for every process
    prefill: dict[str, str] = field(default_factory=dict)  # variables for prefill workers
    decode: dict[str, str] = field(default_factory=dict)  # variables for decode workers
    router: dict[str, str] = field(default_factory=dict)  # variables for the router


@dataclass
class LauncherConfig:
    """How the deployment is started. Slurm fields are ignored by the local launcher."""

    kind: str = "local"  # local | slurm
    job_name: str = "pdtool"  # the Slurm job name and the job folder's prefix
    output_dir: str = "outputs"  # one folder per job below it: script, config, plan, logs
    partition: str = ""  # Slurm --partition
    account: str = ""  # Slurm --account
    qos: str = ""  # Slurm --qos
    time: str = "01:00:00"  # Slurm --time limit
    exclusive: bool = True  # Slurm: whole nodes (--exclusive --mem=0)
    sbatch_extra: list[str] = field(default_factory=list)  # extra "#SBATCH ..." option lines
    container_image: str = ""  # pyxis/enroot --container-image
    container_mounts: list[str] = field(default_factory=list)  # "src:dst[:ro]"
    # a folder every node sees: the registry image is imported there once as squashfs and
    # every job's nodes start from that file (pdtool.launch.containers); "": from the registry
    container_cache: str = ""
    venv: str = ""  # virtualenv to activate before starting workers
    setup: list[str] = field(default_factory=list)  # shell lines run before workers start
    env: EnvConfig = field(default_factory=EnvConfig)
    health_timeout_s: int = 900  # seconds to wait for every instance's health
    # Slurm: GPUs asked per node (conf/launcher/slurm.yaml follows cluster.gpus_per_node; only
    # on device=cuda) and memory ("" = all of an exclusive node, --mem=0; e.g. "480G")
    gpus_per_node: int = 0
    # Slurm: how the job asks for them: gpus-per-node (#SBATCH --gpus-per-node=N) | gres
    # (--gres=gpu:N, for sites and Slurm versions that refuse the former) | none (the
    # site's partition, or a GPU option in sbatch_extra, gives them); steps inherit the job's
    gpu_directive: str = "gpus-per-node"
    mem: str = ""  # Slurm --mem when not exclusive
    # a folder every node sees: with model.path a Hub id (org/name), the job downloads it
    # there once (or finds it) and every worker reads it offline (HF_HOME, HF_HUB_OFFLINE=1:
    # pdtool.launch.weights); "" lets each worker download it itself
    model_cache: str = ""
    # a folder on each node's own disk: the model_cache snapshot is copied there by one task
    # per node before the workers start, verified, and the workers read it ("": they read
    # model_cache)
    stage_to: str = ""
    # variables that are secrets besides the secret-looking names (pdtool.launch.secrets):
    # they reach the processes through 0600 files, from launcher.env or the submitting shell
    secret_env: list[str] = field(default_factory=list)
    # once ready, every instance and the router are probed this often; 3 misses in a row
    # (a hung engine) are a failure of its instance, naming it: see `restart` (0: off)
    watchdog_s: float = 10.0
    # a watchdog probe (and sglang-router's check of its workers) unanswered this long is a
    # miss (SGLang's /health is made to answer without queueing behind a long prompt:
    # pdtool.launch.backends.LIVENESS)
    probe_timeout_s: float = 5.0
    # Slurm: `pdtool bench` arguments (e.g. [--concurrency, "1,4", --requests, "64"]) run
    # inside the job once the deployment is healthy, against its router; results.json and
    # latency.png land in logs/<jobid>/bench/ and the job then ends with the benchmark's
    # status. Empty: no benchmark, the deployment serves until stopped.
    benchmark: list[str] = field(default_factory=list)
    # once the deployment is healthy, before it serves or benchmarks: this many greedy prompts
    # through every prefill->decode pair, each pair's tokens compared with the other pairs'
    # (SGLang) or with the model computed in the launcher (reference engine); a difference
    # stops the deployment, naming the prompt, the pair and the token (pdtool.launch.verify;
    # 0: off)
    verify: int = 0
    # a process that exits or hangs while the deployment serves: on-failure restarts its
    # instance (all its processes, its srun steps on Slurm) up to max_restarts times per
    # instance, waiting restart_backoff_s before the first restart and twice as long before
    # each next one; never ends the deployment (benchmarks and --smoke always use never)
    restart: str = "on-failure"  # on-failure | never
    max_restarts: int = 3  # restarts per instance before the deployment stops
    restart_backoff_s: float = 5.0  # first wait before a restart (doubled each time)
    # a stop (the end of the run, a restart, the time limit) sends SIGTERM to each group
    # (router, decode, prefill) and SIGKILLs what still runs this many seconds later; on Slurm
    # the batch script is signalled 3 x this + 30 s before the time limit
    stop_grace_s: int = 30


@dataclass
class EngineConfig:
    """The serving engine each worker runs."""

    kind: str = "reference"  # reference (CPU, torch) | sglang
    # engine=sglang: the SGLang release the launch lines and transfer backend are written for
    # (validate: transfer.sglang.SGLANG_VERSION; the worker checks the installed one at start)
    version: str = ""
    python: str = "python3"  # the interpreter workers run (a venv's or container's)
    extra_args: list[str] = field(default_factory=list)  # appended for both roles


@dataclass
class RouterConfig:
    """The request router in front of the instances (runs on the job's first node)."""

    port: int = 8000  # the router's (OpenAI front's) HTTP port
    policy: str = "round_robin"  # sglang-router --policy; the reference front: round_robin only
    # a request still unanswered this long is cut with an error (sglang-router
    # --request-timeout-secs, whose default this is; the reference front's limit too)
    request_timeout_s: float = 1800.0


@dataclass
class Config:
    """The whole deployment. `recipe`/`description` are set by a recipe (or the default)."""

    recipe: str = ""  # the recipe's name (set by +recipe=NAME)
    description: str = ""  # the recipe's one-line description
    model: ModelConfig = MISSING
    cluster: ClusterConfig = MISSING
    prefill: RoleConfig = MISSING
    decode: RoleConfig = MISSING
    transfer: TransferConfig = MISSING
    launcher: LauncherConfig = MISSING
    engine: EngineConfig = MISSING
    router: RouterConfig = field(default_factory=RouterConfig)
    # disaggregated: prefill instances send KV pages to decode instances; aggregated: every
    # instance (both roles' GPUs, each with its role's sharding) runs prefill and decode of
    # its own requests, batched together, behind the same router: the baseline `pdtool bench
    # --compare aggregated` measures against. Without a KV transfer, `transfer.*` and the
    # bootstrap ports are not used then.
    mode: str = "disaggregated"


#: group name -> schema class; YAML options in conf/<group>/ inherit `base_<group>`.
GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelConfig,
    "cluster": ClusterConfig,
    "prefill": RoleConfig,
    "decode": RoleConfig,
    "transfer": TransferConfig,
    "launcher": LauncherConfig,
    "engine": EngineConfig,
}


def register(cs: Any) -> None:
    """Store the schemas in a Hydra ConfigStore (`base_config` and `base_<group>`)."""
    cs.store(name="base_config", node=Config)
    for group, cls in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=cls)


def role(cfg: Config, name: str) -> RoleConfig:
    """The RoleConfig of `name` ('prefill' or 'decode')."""
    return cfg.prefill if name == "prefill" else cfg.decode


def headline(cfg: Config) -> str:
    """What was resolved, in one line (a recipe's description is written for its own values:
    with `-m decode.instances=1,2` both runs said "2 decode")."""

    def side(name: str) -> str:
        rc = role(cfg, name)
        shape = f"TP{rc.tp}" + (f" DP{rc.dp}" + (" attn" if rc.dp_attention else "")
                                if rc.dp > 1 else "") + (f" EP{rc.ep}" if rc.ep > 1 else "")
        return f"{rc.instances} {name} ({shape})"

    where = f"{cfg.engine.kind} engine, cluster {cfg.cluster.name}, {cfg.launcher.kind} launcher"
    if cfg.mode == "aggregated":
        n = cfg.prefill.instances + cfg.decode.instances
        return f"{cfg.model.name}, {n} aggregated instances (no KV transfer), {where}"
    return (f"{cfg.model.name}, {side('prefill')} : {side('decode')}, {where}, KV over "
            f"{cfg.transfer.provider}")


def dims(rc: RoleConfig, model: ModelConfig | None = None) -> ParallelDims:
    """The ParallelDims of a role's degrees (KV heads from `model` when given)."""
    return ParallelDims(tp=rc.tp, dp=rc.dp, dp_attention=rc.dp_attention,
                        kv_heads=kv_heads(model) if model is not None else 1, nodes=rc.nodes)


def role_dims(cfg: Config, name: str) -> ParallelDims:
    """Everything `transfer.parallel.ParallelDims` knows about role `name` of a deployment:
    degrees, KV-cache heads, nodes per instance and node size; messages name `<name>.tp`..."""
    rc = role(cfg, name)
    return ParallelDims(tp=rc.tp, dp=rc.dp, dp_attention=rc.dp_attention,
                        kv_heads=kv_heads(cfg.model), nodes=rc.nodes,
                        gpus_per_node=cfg.cluster.gpus_per_node, role=name)


def gpus_per_instance(rc: RoleConfig) -> int:
    """GPUs one instance occupies (see RoleConfig)."""
    return dims(rc).gpus


def deployment_gpus(cfg: Config) -> int:
    """GPUs the whole deployment occupies, both roles' instances (on cluster.device=cpu: the
    worker slots they take): what per-GPU figures divide by."""
    return sum(gpus_per_instance(role(cfg, name)) * role(cfg, name).instances for name in ROLES)


def attn_tp(rc: RoleConfig) -> int:
    """Attention TP degree of one attention replica."""
    return dims(rc).attn_tp


def kv_heads(model: ModelConfig) -> int:
    """KV-cache heads: one latent head for MLA."""
    return 1 if model.attention == "mla" else model.num_kv_heads


def kv_parts(model: ModelConfig) -> int:
    """Per-head KV parts in a page: K and V fused (2), or MLA's single latent (1)."""
    return 1 if model.attention == "mla" else 2


def kv_head_width(model: ModelConfig) -> int:
    """Elements per head and part in a page row."""
    if model.attention == "mla":
        return model.kv_lora_rank + model.qk_rope_head_dim
    return model.head_dim


def kv_dtype(model: ModelConfig, rc: RoleConfig) -> str:
    """The KV dtype a role really uses ('auto' resolved: fp8 weights keep a bf16 cache)."""
    if rc.kv_dtype != "auto":
        return rc.kv_dtype
    return "bf16" if model.dtype == "fp8" else model.dtype
