"""Launcher settings that must agree with the placement: what a Slurm job asks for.

The job asks `launcher.gpus_per_node` GPUs per node (device=cuda), the way
`launcher.gpu_directive` says or through the site's own option in `launcher.sbatch_extra`
(never both), and every step sees all of them, so the plan's GPU ids are CUDA ordinals:
fewer GPUs than the highest id a node uses would leave a rank without its device. A job that
does not take whole nodes (`launcher.exclusive=false`) gets only the memory it asks for, so it
must ask (`launcher.mem`); Slurm's own size syntax is checked here so sbatch does not refuse
it later.
The KV dtypes an SGLang launch line can carry are checked here too.
"""

from __future__ import annotations

import re

from pdtool.adapters import adapter
from pdtool.plan import placements
from pdtool.rules.finding import Finding, error, warning
from pdtool.schema import Config

_MEM = re.compile(r"^[0-9]+[KMGT]?$")


def check_slurm_gpus(cfg: Config) -> list[Finding]:
    """launcher.gpus_per_node covers every GPU id the plan uses on a node (with
    gpu_directive=none the site's own option asks, and check_gpu_directive speaks)."""
    lc = cfg.launcher
    if lc.kind != "slurm" or cfg.cluster.device != "cuda" or lc.gpu_directive == "none":
        return []
    used = max((gpu + 1 for ranks in placements(cfg).values() for _, _, gpu in ranks),
               default=0)
    if lc.gpus_per_node < used:
        return [error(
            "launcher.gpus_per_node",
            f"the job would ask {lc.gpus_per_node} GPU(s) per node, but the plan places ranks "
            f"on GPUs 0..{used - 1} of a node",
            f"set launcher.gpus_per_node={used} (or more; cluster.gpus_per_node="
            f"{cfg.cluster.gpus_per_node})",
        )]
    if lc.gpus_per_node > cfg.cluster.gpus_per_node:
        return [error(
            "launcher.gpus_per_node",
            f"{lc.gpus_per_node} GPUs per node asked, the cluster's nodes have "
            f"{cfg.cluster.gpus_per_node}: Slurm would never start the job",
            f"set launcher.gpus_per_node to at most {cfg.cluster.gpus_per_node}",
        )]
    return []


def check_slurm_memory(cfg: Config) -> list[Finding]:
    """launcher.mem in Slurm's syntax, and present when the nodes are shared."""
    lc = cfg.launcher
    if lc.kind != "slurm":
        return []
    if lc.mem and not _MEM.match(lc.mem):
        return [error("launcher.mem", f"{lc.mem!r} is not a Slurm memory size",
                      "write a number with an optional K, M, G or T suffix, e.g. 480G")]
    if not lc.exclusive and not lc.mem:
        return [error(
            "launcher.mem",
            "launcher.exclusive=false: the job shares its nodes and gets only the memory it "
            "asks for, which is none here",
            "set launcher.mem to what the processes of one node need (e.g. 480G), or "
            "launcher.exclusive=true for whole nodes",
        )]
    return []


#: sbatch options that ask for GPUs (sbatch(1)); `-G` is --gpus' short form
_GPU_OPTION = re.compile(r"^(--gres(=|$).*\bgpu\b|--gpus(-per-node|-per-task|-per-socket)?(=|$)"
                        r"|-G)")


def check_gpu_directive(cfg: Config) -> list[Finding]:
    """One GPU request in the job's header: launcher.gpu_directive's, or the site's own in
    launcher.sbatch_extra (then the directive is `none`); and on device=cuda, some request."""
    lc = cfg.launcher
    if lc.kind != "slurm" or cfg.cluster.device != "cuda":
        return []
    own = [(i, o) for i, o in enumerate(lc.sbatch_extra) if _GPU_OPTION.match(o.strip())]
    if own and lc.gpu_directive != "none":
        i, opt = own[0]
        return [error(f"launcher.sbatch_extra.{i}",
                      f"{opt!r} asks for GPUs, and launcher.gpu_directive={lc.gpu_directive} "
                      f"asks again in the job's header: Slurm refuses or combines the two",
                      "keep your option and set launcher.gpu_directive=none, or drop it "
                      "(launcher.gpu_directive=gres asks --gres=gpu:N)")]
    if not own and lc.gpu_directive == "none":
        return [warning("launcher.gpu_directive",
                        "none: the job asks for no GPUs; its steps get GPUs only if the "
                        "partition gives every job some (Slurm allocates no GRES to a job "
                        "that did not ask, exclusive or not)",
                        "set launcher.gpu_directive=gres or gpus-per-node, or add your site's "
                        "GPU option to launcher.sbatch_extra")]
    return []


ALL = (check_slurm_gpus, check_gpu_directive, check_slurm_memory)


def check_cross_node_loopback(cfg: Config) -> list[Finding]:
    """A loopback NIC carries no traffic between two machines: refuse it for ranks on
    different nodes (unless every node is this one machine, cluster.one_host)."""
    if cfg.launcher.kind != "slurm" or cfg.cluster.one_host:
        return []
    places = placements(cfg)
    nodes = {node for ranks in places.values() for node, _, _ in ranks}
    if len(nodes) < 2:
        return []
    loop = sorted({n.name for n in cfg.cluster.nics
                   if n.name == "lo" or n.name.startswith("lo:")}
                  & set(_nics_used(cfg)))
    if not loop:
        return []
    return [error(
        "transfer.provider",
        f"KV would travel over the loopback interface {loop[0]} between different nodes "
        f"(FI_TCP_IFACE={loop[0]}): nothing leaves the machine, prefill and decode on "
        f"{len(nodes)} nodes cannot reach each other",
        "list the nodes' real network interface in cluster.nics (kind tcp), use a cluster "
        "preset with RDMA NICs, or set cluster.one_host=true for a cluster emulated on one "
        "machine",
    )]


def _nics_used(cfg: Config) -> list[str]:
    from pdtool.plan import choose_nics

    out = []
    for ranks in placements(cfg).values():
        for _, _, gpu in ranks:
            out += list(choose_nics(cfg.cluster, cfg.transfer.provider, gpu)[0])
    return out


def check_shared_host_nic(cfg: Config) -> list[Finding]:
    """Warn when every GPU of a node sends through one host NIC: show each GPU's share."""
    from pdtool.plan import choose_nics

    if cfg.launcher.kind != "slurm" or cfg.cluster.device != "cuda":
        return []
    picks = {choose_nics(cfg.cluster, cfg.transfer.provider, g)
             for g in range(cfg.cluster.gpus_per_node)}
    if len(picks) != 1 or cfg.cluster.gpus_per_node < 2:
        return []
    ((names, _, affinity),) = picks
    if affinity != "host" or len(names) != 1:
        return []
    nic = next((n for n in cfg.cluster.nics if n.name == names[0]), None)
    gbps = nic.gbps if nic else 0
    share = (f"{gbps / cfg.cluster.gpus_per_node:g} Gb/s per GPU of {gbps} Gb/s"
             if gbps else "an equal share each (cluster.nics gives no gbps)")
    # keyed on the transport: cluster.nics is right as written (one host NIC is a valid node)
    return [warning(
        "transfer.provider",
        f"all {cfg.cluster.gpus_per_node} GPUs of a node send KV through one host NIC "
        f"{names[0]}: {share}",
        "list the nodes' per-GPU RDMA NICs (with their gpus) in cluster.nics, or accept the "
        "shared bandwidth",
    )]


def check_multi_node_bootstrap(cfg: Config) -> list[Finding]:
    """An instance over several GPU nodes bootstraps NCCL and Gloo over sockets; left to
    choose, they take the first interface that is up, which on GPU nodes is often a container
    bridge or a storage network: the instance hangs at start. The interface is site-specific,
    so no preset can carry it."""
    from pdtool.schema import ROLES, role

    cl = cfg.cluster
    if cfg.launcher.kind != "slurm" or cl.device != "cuda" or cl.one_host or cl.socket_ifname:
        return []
    return [error("cluster.socket_ifname",
                  f"{r}.nodes={role(cfg, r).nodes}: each {r} instance spans nodes, and NCCL and "
                  f"Gloo need the interface that reaches the other nodes (their own pick is "
                  f"the first one up: often a container bridge or a storage network)",
                  "set cluster.socket_ifname to the nodes' routable interface (`ip -br addr` "
                  "on a node: e.g. enp71s0 on EC2 p5, bond0 on many DGX sites)")
            for r in ROLES if role(cfg, r).nodes > 1][:1]


ALL = (*ALL, check_cross_node_loopback, check_shared_host_nic, check_multi_node_bootstrap)


def _mounted(path: str, mounts: list[str], same_path: bool = False) -> bool:
    """Whether a `launcher.container_mounts` entry (SRC[:DST[:FLAGS]]) puts `path` in the
    container; with `same_path`, at the host's own path."""
    for m in mounts:
        src, _, rest = m.partition(":")
        dest = rest.split(":")[0] if rest else src
        if (path == dest or path.startswith(dest.rstrip("/") + "/")) and (
                not same_path or src.rstrip("/") == dest.rstrip("/")):
            return True
    return False


def check_container_model_path(cfg: Config) -> list[Finding]:
    """A model folder on the host must be mounted into the container to be loaded there."""
    lc = cfg.launcher
    path = cfg.model.path
    if lc.kind != "slurm" or not lc.container_image or not path.startswith("/"):
        return []
    if _mounted(path, lc.container_mounts):
        return []
    return [error(
        "model.path",
        f"{path} is a host folder, but no launcher.container_mounts entry puts it in the "
        "container, where the engine loads it",
        f"add a mount such as '{path}:{path}:ro' to launcher.container_mounts",
    )]


#: Hub organisations whose checkpoints ask each user to accept terms (a token is needed)
GATED_ORGS = ("meta-llama", "google", "mistralai")


def _not_absolute(key: str, folder: str, example: str) -> list[Finding]:
    """A folder key that must be an absolute path (every node and container resolves it)."""
    if folder.startswith("/"):
        return []
    return [error(key, f"{folder!r} is not an absolute folder path",
                  f"give an absolute folder, e.g. {key}={example}")]


def _not_in_container(cfg: Config, key: str, folder: str) -> list[Finding]:
    """A folder the host fills and the workers read: in a container, mounted at its path."""
    lc = cfg.launcher
    if lc.kind != "slurm" or not lc.container_image or _mounted(
            folder, lc.container_mounts, same_path=True):
        return []
    return [error(key, f"{folder} is filled on the host, but no launcher.container_mounts "
                  "entry puts it at the same path in the container, where the workers read it",
                  f"add '{folder}:{folder}' to launcher.container_mounts")]


def check_model_cache(cfg: Config) -> list[Finding]:
    """launcher.model_cache is a folder every node sees, for a Hub model SGLang loads."""
    from pdtool.arch import is_hub_id

    cache = cfg.launcher.model_cache
    if not cache:
        return []
    if bad := _not_absolute("launcher.model_cache", cache, "/fsx/hf-cache"):
        return bad
    if not adapter(cfg).loads_checkpoints:
        return [error("launcher.model_cache", f"the {cfg.engine.kind} engine downloads nothing "
                      "(a Hub id builds its random-weight model): nothing would read the cache",
                      "download the checkpoint to a folder and set model.path to it, or drop "
                      "launcher.model_cache")]
    lc = cfg.launcher
    if bad := _not_in_container(cfg, "launcher.model_cache", cache):
        return bad
    org = cfg.model.path.split("/")[0]
    token = "HF_TOKEN" in lc.secret_env or "HF_TOKEN" in {**lc.env.all, **lc.env.prefill}
    if org in GATED_ORGS and not token:
        return [warning("launcher.model_cache",
                        f"{cfg.model.path}: {org}'s models are gated on the Hub, and the job "
                        "has no HF_TOKEN to fetch it with",
                        "export HF_TOKEN in the shell that submits and add "
                        "launcher.secret_env=[HF_TOKEN] (it reaches the job through a 0600 "
                        "file), or fetch it into the cache beforehand")]
    if not is_hub_id(cfg.model.path):
        return [warning("launcher.model_cache",
                        f"model.path={cfg.model.path!r} is not a Hub id (org/name): there is "
                        "nothing to fetch, and the workers load the folder as given",
                        "drop launcher.model_cache, or set model.path to the Hub id")]
    return []


def check_stage_to(cfg: Config) -> list[Finding]:
    """launcher.stage_to copies the model_cache snapshot of a Hub model: it needs both, its own
    folder, and in a container the same path mounted (the copy is made on the host)."""
    from pdtool.arch import is_hub_id

    lc = cfg.launcher
    stage = lc.stage_to
    if not stage:
        return []
    if bad := _not_absolute("launcher.stage_to", stage, "/local_nvme/hf-cache"):
        return bad
    if not lc.model_cache or not is_hub_id(cfg.model.path):
        return [error("launcher.stage_to", "it copies the snapshot launcher.model_cache holds "
                      "for a Hub model.path, and this job has none",
                      "set launcher.model_cache and model.path=org/name, or drop "
                      "launcher.stage_to")]
    if stage.rstrip("/") == lc.model_cache.rstrip("/"):
        return [error("launcher.stage_to", f"{stage} is launcher.model_cache itself",
                      "give a folder on each node's own disk")]
    return _not_in_container(cfg, "launcher.stage_to", stage)


def check_container_cache(cfg: Config) -> list[Finding]:
    """launcher.container_cache holds a registry image's squashfs: it needs a registry image
    and a folder every node sees."""
    lc = cfg.launcher
    cache = lc.container_cache
    if not cache:
        return []
    if bad := _not_absolute("launcher.container_cache", cache, "/fsx/enroot"):
        return bad
    if lc.kind != "slurm" or not lc.container_image:
        return [error("launcher.container_cache", "it caches launcher.container_image for "
                      "the Slurm job's steps, and this job runs none",
                      "set launcher=slurm and launcher.container_image, or drop "
                      "launcher.container_cache")]
    if lc.container_image.startswith(("/", "./")) or lc.container_image.endswith(".sqsh"):
        return [error("launcher.container_cache", f"launcher.container_image="
                      f"{lc.container_image} is a file already: there is nothing to import",
                      "drop launcher.container_cache")]
    return []


def check_container_gets_pdtool(cfg: Config) -> list[Finding]:
    """Every process step runs `python -m pdtool.worker` inside the image; unless the image
    ships pdtool, launcher.setup installs it or a mount brings a virtualenv that has it."""
    lc = cfg.launcher
    if lc.kind != "slurm" or not lc.container_image:
        return []
    if any("pdtool" in s for s in [lc.container_image, *lc.setup, *lc.container_mounts]):
        return []
    return [warning(
        "launcher.setup",
        f"the workers run `python -m pdtool.worker` inside {lc.container_image}, and neither "
        "launcher.setup nor launcher.container_mounts mentions pdtool: unless the image has "
        "it, every step fails at once",
        "add launcher.setup='[pip install /shared/wheels/pdtool.whl]' (with its dependencies), "
        "or mount a virtualenv that has pdtool")]


ALL = (*ALL, check_container_model_path, check_container_gets_pdtool, check_container_cache,
       check_model_cache, check_stage_to)


def check_transfer_backend(cfg: Config) -> list[Finding]:
    """transfer.backend is one SGLang 0.5.23 has (with pdtool's plugin), for engine=sglang."""
    from pdtool.schema import TRANSFER_BACKENDS

    be = cfg.transfer.backend
    if be not in TRANSFER_BACKENDS:
        return [error("transfer.backend", f"unknown transfer backend {be!r}",
                      f"choose one of {', '.join(TRANSFER_BACKENDS)}")]
    if be not in adapter(cfg).transfer_backends:
        return [error("transfer.backend",
                      f"transfer.backend={be} is SGLang's own backend; the {cfg.engine.kind} "
                      "engine moves KV with pdtool's messenger only",
                      "set transfer.backend=pdtool, or engine=sglang")]
    return []


ALL = (*ALL, check_transfer_backend)


def check_verify(cfg: Config) -> list[Finding]:
    """launcher.verify is a number of prompts (what each engine compares: its own rules)."""
    n = cfg.launcher.verify
    if n < 0:
        return [error("launcher.verify", f"{n} prompts", "give 0 (off) or a number of prompts, "
                      "e.g. launcher.verify=3")]
    return []


ALL = (*ALL, check_verify)
