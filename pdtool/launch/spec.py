"""The launch spec: which processes a deployment runs and their exact command lines (pure data).

Built from the config and the plan at render time and written to the job folder as
launch.json (`spec_to_dict`); pdtool's supervisor runs it (`spec_from_dict`, when a rendered
script hands over), `--dry-run` shows it. Command lines are lists of shell words
(`pdtool.launch.shell`): literals are quoted when rendered, and the few values that exist only at
run time are shell variables: `RUN_DIR` (the job folder), `LOG_DIR` (this run's logs),
`HOSTS[k]` (address of allocation node k) and `NODE_NAMES[k]` (its Slurm name).

Process granularity follows the engine:
* SGLang spawns one scheduler per GPU itself, so there is one process per (instance, node),
  with `--disaggregation-ib-device` mapping each GPU to its NICs and `--numa-node` per GPU;
* the reference engine runs one process per rank (one "GPU" each), bound with `numactl`.
Every worker starts through `python -m pdtool.worker`, which loads the plan, resolves its rank,
NIC and fabric environment, then starts the engine (exec for SGLang).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from pdtool.adapters import UnknownEngine, adapter
from pdtool.budgets import stop_lead_s
from pdtool.launch import secrets
from pdtool.launch.containers import cached_image
from pdtool.launch.engines import engine_launch
from pdtool.launch.resources import (
    cpus_from_node,
    describe_cpus,
    job_options,
    numactl_binding,
    step_options,
)
from pdtool.launch.shell import Var, Word, word
from pdtool.launch.weights import cached_model
from pdtool.plan import InstancePlan, Plan, RankPlan
from pdtool.schema import Config, LauncherConfig
from transfer import workerenv

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RUN_DIR = Var("RUN_DIR")
LOG_DIR = Var("LOG_DIR")


def host(node: int) -> Var:
    return Var(f"HOSTS[{node}]")


def node_name(node: int) -> Var:
    return Var(f"NODE_NAMES[{node}]")


@dataclass
class Proc:
    """One process of the deployment."""

    name: str  # file-name safe: "prefill-0.n0", "decode-1.r3", "router"
    role: str  # prefill | decode | router
    instance: int
    node: int  # allocation node index (plan)
    ranks: tuple[int, ...]  # instance ranks this process drives (empty for the router)
    comment: str  # one line for the script, built from numbers and config names only
    argv: list[str | Word] = field(default_factory=list)  # full command, launcher wrapping incl.
    engine_argv: list[str | Word] = field(default_factory=list)  # the engine's own line
    health: Word | None = None  # URL polled by the watchdog (and the wait, unless `ready`)
    # URL the wait polls when readiness is more than health (pdtool.launch.health.check): the
    # SGLang router is ready once its worker list holds every instance
    ready: Word | None = None

    @property
    def log(self) -> Word:
        return word(LOG_DIR, f"/{self.name}.log")


@dataclass
class JobSpec:
    """The Slurm allocation (ignored by the local launcher)."""

    name: str
    nodes: int
    ntasks_per_node: int
    time: str
    batch_log: str
    sbatch_options: list[str]
    sbatch_extra: list[str]
    node_roles: list[str]  # one log line per node: what the plan put there
    container_setup: list[str | Word] = field(default_factory=list)  # see container_setup()
    container_import: list[str | Word] = field(default_factory=list)  # see container_import()
    # Slurm signals the batch script this long before the time limit (--signal=B:TERM@S), time
    # for the ordered stop of its three groups (router, decode, prefill)
    stop_signal_s: int = stop_lead_s(LauncherConfig.stop_grace_s)


@dataclass
class LaunchSpec:
    launcher: str  # local | slurm
    engine: str
    python: str
    procs: list[Proc]
    router: list[Proc]
    job: JobSpec
    router_url: Word
    # launcher=local: launcher.setup's shell lines, run once before any process starts, and
    # the virtualenv activated after them; their environment is every process's (the rendered
    # run_local.sh and the supervisor alike)
    setup: list[str] = field(default_factory=list)
    venv_activate: str = ""
    # launcher.model_cache: the one-off fetch of a Hub model before any worker starts (the
    # supervisor runs it), with the prefill role's secrets (a gated model's HF_TOKEN) when it
    # has any ([]: none)
    fetch: list[str | Word] = field(default_factory=list)
    # launcher.stage_to: the fetched snapshot copied to the node's disk (Slurm: one task per
    # node)
    stage: list[str | Word] = field(default_factory=list)
    # the roles whose processes load a secret-<role>.env (pdtool.launch.secrets)
    secret_roles: tuple[str, ...] = ()

    def all(self) -> list[Proc]:
        return self.procs + self.router


class LaunchError(ValueError):
    """The config cannot be turned into launch artifacts; the message names the key."""


# -- launch.json: the spec as data, and back --------------------------------------------------
def _encode(v: object) -> object:
    if isinstance(v, Word):
        return {"word": [_encode(p) for p in v.parts]}
    if isinstance(v, Var):
        return {"var": v.name}
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    return v


def _decode(v: object) -> object:
    if isinstance(v, dict) and "word" in v:
        return Word(tuple(_decode(p) for p in v["word"]))  # type: ignore[misc]
    if isinstance(v, dict) and "var" in v:
        return Var(v["var"])
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


def _proc_dict(p: Proc) -> dict[str, object]:
    return {"name": p.name, "role": p.role, "instance": p.instance, "node": p.node,
            "ranks": list(p.ranks), "comment": p.comment, "argv": _encode(p.argv),
            "engine_argv": _encode(p.engine_argv),
            "health": _encode(p.health) if p.health else None,
            "ready": _encode(p.ready) if p.ready else None}


def spec_to_dict(spec: LaunchSpec) -> dict[str, object]:
    """The launch spec as JSON data (the job folder's launch.json); shell variables appear as
    {"var": NAME}, words made of parts as {"word": [...]}. What the scripts' supervisor runs:
    `spec_from_dict` gives the very spec back."""
    job = {f.name: _encode(getattr(spec.job, f.name)) for f in fields(spec.job)}
    return {"launcher": spec.launcher, "engine": spec.engine, "python": spec.python,
            "nodes": spec.job.nodes, "processes": [_proc_dict(p) for p in spec.procs],
            "router": [_proc_dict(p) for p in spec.router], "router_url": _encode(spec.router_url),
            "job": job, "setup": list(spec.setup), "venv_activate": spec.venv_activate,
            "fetch": _encode(spec.fetch), "stage": _encode(spec.stage),
            "secret_roles": list(spec.secret_roles)}


def spec_from_dict(d: dict) -> LaunchSpec:
    """Inverse of `spec_to_dict`; KeyError or TypeError on data it did not write."""
    def proc(p: dict) -> Proc:
        return Proc(name=p["name"], role=p["role"], instance=p["instance"], node=p["node"],
                    ranks=tuple(p["ranks"]), comment=p["comment"], argv=_decode(p["argv"]),
                    engine_argv=_decode(p["engine_argv"]), health=_decode(p["health"]),
                    ready=_decode(p["ready"]))  # type: ignore[arg-type]

    return LaunchSpec(
        launcher=d["launcher"], engine=d["engine"], python=d["python"],
        procs=[proc(p) for p in d["processes"]], router=[proc(p) for p in d["router"]],
        job=JobSpec(**{k: _decode(v) for k, v in d["job"].items()}),  # type: ignore[arg-type]
        router_url=_decode(d["router_url"]), setup=list(d["setup"]),  # type: ignore[arg-type]
        venv_activate=d["venv_activate"], fetch=_decode(d["fetch"]),  # type: ignore[arg-type]
        stage=_decode(d["stage"]),  # type: ignore[arg-type]
        secret_roles=tuple(d["secret_roles"]))


def _url(node: int, port: int, path: str = "/health") -> Word:
    return word("http://", host(node), f":{port}{path}")


def multi_node_env(cfg: Config) -> dict[str, str]:
    """What NCCL and Gloo need between the nodes of one instance: the bootstrap interface
    (cluster.socket_ifname; rules.launch refuses a GPU site without it), and on ConnectX
    clusters the compute NICs for NCCL's IB transport, by exact name (`=`): left to itself
    NCCL also takes the storage and management mlx5 ports a DGX node has."""
    cl = cfg.cluster
    env = {}
    if cl.socket_ifname:
        env = {"NCCL_SOCKET_IFNAME": cl.socket_ifname, "GLOO_SOCKET_IFNAME": cl.socket_ifname}
    compute = [n.name for n in cl.nics if n.kind == "connectx" and n.gpus]
    if cl.device == "cuda" and compute:
        env["NCCL_IB_HCA"] = "=" + ",".join(compute)
    return env


def _role_env(cfg: Config, rname: str) -> dict[str, str]:
    """The role's launcher.env without its secrets (those come from a 0600 file)."""
    return secrets.split(cfg, rname)[0]


def _common_env(ranks: list[RankPlan]) -> dict[str, str]:
    """Fabric variables that are the same for every rank of a process (per-node engines)."""
    first = dict(ranks[0].env)
    return {k: v for k, v in first.items() if all(r.env.get(k) == v for r in ranks[1:])}


def _env_words(env: dict[str, str], key_prefix: str) -> list[str]:
    for k in env:
        if not _ENV_NAME.match(k):
            raise LaunchError(f"{key_prefix}: {k!r} is not a valid environment variable name")
    return [f"{k}={v}" for k, v in env.items()]


def _worker_argv(cfg: Config, spec_launcher: str, inst: InstancePlan, node: int,
                 select: list[str], engine_argv: list[str | Word]) -> list[str | Word]:
    argv: list[str | Word] = [
        cfg.engine.python, "-m", "pdtool.worker",
        "--plan", word(RUN_DIR, "/plan.json"),
        "--role", inst.role, "--instance", str(inst.index), *select,
        "--host", host(node),
    ]
    if spec_launcher == "slurm":
        argv += ["--expect-node", node_name(node)]
    if engine_argv:
        argv += ["--", *engine_argv]
    return argv


def _srun(cfg: Config, p: Proc, ranks: list[RankPlan]) -> list[str | Word]:
    """srun prefix placing one process on allocation node `p.node` as its own job step, with
    its CPUs, binding and GPUs (pdtool.launch.resources)."""
    argv: list[str | Word] = [
        # --export=ALL: the step gets this script's environment even in a job submitted with
        # --export=NONE (srun would inherit NONE through SLURM_EXPORT_ENV)
        "srun", "--export=ALL", "--nodes=1", "--ntasks=1", f"--relative={p.node}", "--overlap",
        "--kill-on-bad-exit=1", f"--job-name={p.name}", word("--output=", *p.log.parts),
        *step_options(cfg, ranks),
    ]
    return argv + _container_options(cfg)


#: the job's container on every node (pyxis --container-name), named after the job
CONTAINER_NAME = word("pdtool-", Var("SLURM_JOB_ID"))


def _container_options(cfg: Config, image: bool = False) -> list[str | Word]:
    """pyxis options of a step: the job's named container (imported once per node by the
    setup step, `image=True`), the job folder and launcher.container_mounts mounted, the
    home directory not (a site's dotfiles and caches stay out of the engine's container)."""
    lc = cfg.launcher
    if not lc.container_image:
        return []
    out: list[str | Word] = [
        f"--container-image={cached_image(cfg) or lc.container_image}"] if image else []
    return [*out, word("--container-name=", *CONTAINER_NAME.parts),
            word("--container-mounts=", RUN_DIR, ":", RUN_DIR,
                 "".join("," + m for m in lc.container_mounts)),
            "--no-container-mount-home"]


def container_setup(cfg: Config, plan: Plan) -> list[str | Word]:
    """The step that imports launcher.container_image once on every node, naming it for the
    job's steps, and runs launcher.setup inside it (e.g. installing pdtool there); empty
    without a container image (launcher.setup then runs in the batch script)."""
    lc = cfg.launcher
    if not lc.container_image:
        return []
    script = "\n".join(["set -euo pipefail", *lc.setup]) if lc.setup else "true"
    # setup lines install packages into the image's system paths: as root inside it
    # (pyxis --container-remap-root, enroot's ENROOT_REMAP_ROOT), the user outside
    remap = ["--container-remap-root"] if lc.setup else []
    return ["srun", "--export=ALL", f"--nodes={plan.nodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1", "--job-name=container-setup",
            *_container_options(cfg, image=True), *remap, "bash", "-c", script]


def container_import(cfg: Config) -> list[str | Word]:
    """launcher.container_cache: the batch shell's one-off import of the image (none when the
    cache holds it), before the setup step unpacks it on every node."""
    lc = cfg.launcher
    if cached_image(cfg) is None:
        return []
    return [Var("PDTOOL_PYTHON"), "-m", "pdtool.launch.containers", "--cache",
            lc.container_cache, lc.container_image]


def _wrap(cfg: Config, launcher: str, p: Proc, ranks: list[RankPlan], env: dict[str, str],
          numa: list[str], argv: list[str | Word], secret_roles: frozenset[str] = frozenset(),
          ) -> list[str | Word]:
    inner: list[str | Word] = []
    if p.role in secret_roles:
        inner += secrets.wrapper(RUN_DIR, p.role)
    if env:
        inner += ["env", *_env_words(env, f"launcher.env.{p.role}")]
    inner += numa + argv
    return (_srun(cfg, p, ranks) if launcher == "slurm" else []) + inner


def _ranks_text(ranks: list[RankPlan]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0].rank}"
    return f"ranks {ranks[0].rank}-{ranks[-1].rank}"


def _instance_procs(cfg: Config, plan: Plan, inst: InstancePlan, launcher: str,
                    secret_roles: frozenset[str]) -> list[Proc]:
    env_user = _role_env(cfg, inst.role)
    procs: list[Proc] = []
    per_node = adapter(cfg).per_node
    engine = engine_launch(cfg)
    from_node = cpus_from_node(cfg, launcher)
    groups: list[tuple[str, list[RankPlan]]]
    if per_node:
        by_node: dict[int, list[RankPlan]] = {}
        for r in inst.ranks:
            by_node.setdefault(r.node_rank, []).append(r)
        groups = [(f"n{k}", rs) for k, rs in sorted(by_node.items())]
    else:
        groups = [(f"r{r.rank}", [r]) for r in inst.ranks]
    for tag, ranks in groups:
        node = ranks[0].node
        name = f"{inst.name}.{tag}"
        is_head = ranks[0].rank == 0
        gpus = ",".join(str(r.gpu) for r in ranks)
        names = sorted({n for r in ranks for n in r.nics})
        nics = ",".join(names) if len(names) <= 4 else f"{len(names)} ({names[0]}, ...)"
        nics = nics or "none"
        p = Proc(
            name=name, role=inst.role, instance=inst.index, node=node,
            ranks=tuple(r.rank for r in ranks),
            comment=(f"{inst.name}: node {node} (instance node {ranks[0].node_rank}), "
                     f"{_ranks_text(ranks)}, GPUs {gpus}, NICs {nics}, "
                     f"NUMA {','.join(sorted({str(r.numa) for r in ranks}))}, "
                     f"CPUs {describe_cpus(ranks)}"),
            health=_url(node, inst.http_port) if is_head else None,
        )
        p.engine_argv = engine.server_argv(cfg, plan, inst, ranks, host(node),
                                           host(inst.head_node))
        if per_node:
            select = ["--node-rank", str(ranks[0].node_rank)]
            # on Slurm, srun binds the step to the same CPUs (resources.step_options)
            numa = numactl_binding(ranks) if launcher == "local" else []
            env = _common_env(ranks)
        else:
            select = ["--rank", str(ranks[0].rank)]
            numa = numactl_binding(ranks, cpus=not from_node)
            env = dict(ranks[0].env)
        env = {**env, **engine.server_env(cfg), **env_user}
        if len(inst.nodes) > 1:
            env = {**multi_node_env(cfg), **env}  # launcher.env still overrides
        if from_node:
            env = {workerenv.CPUS_FROM_NODE.name: "1", **env}
        p.argv = _wrap(cfg, launcher, p, ranks, env, numa,
                       _worker_argv(cfg, launcher, inst, node, select, p.engine_argv),
                       secret_roles)
        procs.append(p)
    return procs


def _router_proc(cfg: Config, plan: Plan, launcher: str, secret_roles: frozenset[str]) -> Proc:
    rp = plan.router
    serves = (f"{len(rp.targets)} aggregated instances" if plan.aggregated else
              f"{len(rp.prefill)} prefill + {len(rp.decode)} decode instances")
    p = Proc(name="router", role="router", instance=0, node=rp.node, ranks=(),
             comment=f"router: node {rp.node}, port {rp.port}, {serves}",
             health=_url(rp.node, rp.port))
    env = _role_env(cfg, "router")
    # the router starts through the worker entry too (SGLang's router line after `--`), so
    # placement checks and --preflight cover it like every other process
    engine = engine_launch(cfg)
    p.engine_argv = engine.router_argv(cfg, plan, host)
    if (ready := engine.router_ready(plan)) is not None:
        p.ready = _url(rp.node, rp.port, ready)
    inner: list[str | Word] = [cfg.engine.python, "-m", "pdtool.worker",
                               "--plan", word(RUN_DIR, "/plan.json"),
                               "--role", "router", "--host", host(rp.node)]
    if launcher == "slurm":
        inner += ["--expect-node", node_name(rp.node)]
    if p.engine_argv:
        inner += ["--", *p.engine_argv]
    p.argv = _wrap(cfg, launcher, p, [], env, [], inner, secret_roles)
    return p


def _job(cfg: Config, plan: Plan, run_dir: str, procs: list[Proc]) -> JobSpec:
    lc = cfg.launcher
    opts = []
    for key, flag in (("partition", "--partition"), ("account", "--account"), ("qos", "--qos")):
        val = getattr(lc, key)
        if val:
            opts.append(f"{flag}={val}")
    opts += job_options(cfg, plan)
    for key, val in (("launcher.job_name", lc.job_name), ("launcher.time", lc.time),
                     *((f"launcher.{k}", getattr(lc, k)) for k in ("partition", "account", "qos")),
                     *(("launcher.sbatch_extra", x) for x in lc.sbatch_extra)):
        if any(c in str(val) for c in "\n\r\0"):
            raise LaunchError(f"{key}: a line break cannot go into an #SBATCH line: {val!r}")
    for x in lc.sbatch_extra:
        if not x.strip().startswith("-"):
            raise LaunchError(f"launcher.sbatch_extra: {x!r} is not an sbatch option "
                              "(write e.g. '--constraint=h200')")
    roles: dict[int, list[str]] = {}
    for p in procs:
        roles.setdefault(p.node, [])
        if p.name.split(".")[0] not in roles[p.node]:
            roles[p.node].append(p.name.split(".")[0])
    # every step is one task sharing its node (--overlap): the job holds one task per node
    return JobSpec(
        name=lc.job_name, nodes=plan.nodes, ntasks_per_node=1, time=lc.time,
        batch_log=f"{run_dir}/logs/slurm-%j.out", sbatch_options=opts,
        sbatch_extra=list(lc.sbatch_extra),
        node_roles=[f"node {n}: {' '.join(roles.get(n, []))}" for n in range(plan.nodes)],
        container_setup=container_setup(cfg, plan), container_import=container_import(cfg),
        stop_signal_s=stop_lead_s(lc.stop_grace_s),
    )


def build_launch(cfg: Config, plan: Plan, run_dir: str,
                 secret_roles: frozenset[str] = frozenset()) -> LaunchSpec:
    """The launch spec of a planned deployment; `run_dir` is the absolute job folder.
    Processes of `secret_roles` load their role's secret file first (pdtool.launch.secrets)."""
    launcher = cfg.launcher.kind
    if launcher == "slurm" and "%" in run_dir:
        raise LaunchError(f"launcher.output_dir: {run_dir!r} contains '%', which Slurm expands "
                          "in --output file names; choose a folder without it")
    if launcher not in ("local", "slurm"):
        raise LaunchError(f"launcher.kind: unknown launcher {launcher!r} (local | slurm)")
    try:
        adapter(cfg)
    except UnknownEngine as e:
        raise LaunchError(str(e)) from None
    procs = [p for inst in plan.instances
             for p in _instance_procs(cfg, plan, inst, launcher, secret_roles)]
    router = _router_proc(cfg, plan, launcher, secret_roles)
    job = _job(cfg, plan, run_dir, [*procs, router])
    lc = cfg.launcher
    for i, line in enumerate(lc.setup):
        if "\n" in line or "\r" in line:
            raise LaunchError(f"launcher.setup.{i}: one shell line per entry, no line breaks")
    model = cached_model(cfg)
    weights_cmd = [Var("PDTOOL_PYTHON"), "-m", "pdtool.launch.weights", "--cache", lc.model_cache]
    fetch: list[str | Word] = [] if model is None else [
        *(secrets.wrapper(RUN_DIR, "prefill") if "prefill" in secret_roles else []),
        *weights_cmd, model]
    stage: list[str | Word] = []
    if model is not None and lc.stage_to:
        # after the fetch, offline (the snapshot is in the shared cache); on Slurm every node
        # at once
        stage = ["env", "HF_HUB_OFFLINE=1", *weights_cmd, "--stage-to", lc.stage_to, model]
        if launcher == "slurm":
            stage = ["srun", "--export=ALL", f"--nodes={plan.nodes}", "--ntasks-per-node=1",
                     "--overlap", "--kill-on-bad-exit=1", "--job-name=stage-weights", *stage]
    return LaunchSpec(launcher=launcher, engine=cfg.engine.kind, python=cfg.engine.python,
                      procs=procs, router=[router], job=job, fetch=fetch, stage=stage,
                      router_url=word("http://", host(plan.router.node), f":{plan.router.port}"),
                      setup=list(lc.setup), secret_roles=tuple(sorted(secret_roles)),
                      venv_activate=str(Path(lc.venv) / "bin" / "activate") if lc.venv else "")
