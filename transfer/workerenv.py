"""The worker environment: every `PDTOOL_*` variable of a deployment, listed once.

A deployment's processes learn what the launcher and the plan decided about them through their
environment: the job script (or `pdtool launch` on one machine) sets the launch variables for
every process, `python -m pdtool.worker` adds its identity and fabric variables before it starts
the engine, and the engine side (the reference engine, pdtool's SGLang backend, the messenger)
reads them here. The names, their meaning and who writes and reads each are in `VARIABLES`
below and in docs/worker-environment.md; the typed readers (`integer`, `provider`,
`domain_for`, ...) and the worker's writer (`worker_env`) are the only code that parses or
composes them, so a variable's format lives in one place.

This module is in `transfer/` because the SGLang backend and the messenger read it and
`transfer/` never imports `pdtool/`; pdtool imports it from here.

  launch (pdtool's supervisor, every process):
    PDTOOL_RUN_DIR            the job folder (the scripts' RUN_DIR; marks the job's processes)
    PDTOOL_PYTHON             interpreter of the supervisor and its helpers (default: engine.python)
    PDTOOL_SECRET_FILE        the 0600 per-deployment secret file (control-plane HMAC key)
    PDTOOL_HOSTS              the allocation's node addresses, space separated, by node index
    PDTOOL_PREFLIGHT          "1": workers serve /health without starting the engine
    PDTOOL_CPUS_FROM_NODE     "1": the worker binds itself to its share of the node's CPUs
    PDTOOL_EXIT_WHEN_HEALTHY  "1": the job ends once every process is healthy (script only)
  identity (pdtool.worker, from its arguments or Slurm's task variables):
    PDTOOL_PLAN               the plan.json this process runs from
    PDTOOL_ROLE               prefill | decode | router
    PDTOOL_INSTANCE           instance index within the role
    PDTOOL_RANK               rank within the instance (per-rank engines)
    PDTOOL_NODE_RANK          node within the instance (per-node engines)
  fabric (pdtool.worker, from the plan's ranks):
    PDTOOL_FI_PROVIDER        libfabric provider string (`shm`, `tcp;ofi_rxm`, `efa`, ...)
    PDTOOL_FI_DOMAIN          the libfabric domain (NIC) of all of this process's ranks
    PDTOOL_NICS               JSON {gpu id: "nic,nic"}: each rank's NICs, by its local GPU
                              (the SGLang backend opens every one, the reference engine the first)
    PDTOOL_GPU_MEMORY         auto | direct | staged: transfer.gpu_memory as resolved here
  model (the plan's ranks[].env):
    PDTOOL_DRAFT_LAYERS       model.draft_layers: the draft model's KV layers the plan counted
  switches (the user, optional):
    PDTOOL_LAYER_STREAM       auto | on | off: per-layer KV streaming of the SGLang prefill
  fallback and test hooks:
    PDTOOL_SECRET             the secret itself, only when no secret file is given (tests,
                              hand-run SGLang workers); never set by pdtool
    PDTOOL_CONTROL_FAULTS     drop/delay outgoing control messages (transfer.wire, tests)
    PDTOOL_REFERENCE_ALLOW_FAULTS  "1": the reference engine honours test fault hooks
    PDTOOL_REFERENCE_CORRUPT_PAGE  "LAYER,INDEX": with them, damage that page of every request
    PDTOOL_SGLANG_CORRUPT_INSTANCE "N": SGLang decode instance N damages every request's first
                              KV page once it landed (host pools; what launcher.verify catches)
    PDTOOL_HOPS               file the TTFT hop profiler's hooks append timestamps to (bench)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class WorkerEnvError(ValueError):
    """A variable is set to something its reader cannot use; the text names the variable."""


@dataclass(frozen=True)
class Var:
    """One variable of the contract: its name, who sets it, who reads it, what it means."""

    name: str
    writer: str
    reader: str
    meaning: str

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value, or None when unset or empty (an empty variable means "not given")."""
        value = (os.environ if environ is None else environ).get(self.name, "")
        return value or None


# -- launch: set by pdtool's supervisor (pdtool.launch.supervisor) for every process -----------
RUN_DIR = Var("PDTOOL_RUN_DIR", "pdtool.launch.supervisor",
              "process lookup (a job's processes by folder)",
              "the job folder; every process of the job carries it, so its processes can be "
              "found by folder (the script itself never reads it: its folder is the one it was "
              "rendered into)")
PYTHON = Var("PDTOOL_PYTHON", "the user (optional)", "job script, pdtool.launch.supervisor",
             "interpreter the job script runs pdtool's supervisor with, and the supervisor its "
             "helpers (the weights fetch, the job's benchmark); default: engine.python")
SECRET_FILE = Var("PDTOOL_SECRET_FILE", "pdtool.launch.supervisor",
                  "pdtool.worker, reference engine, SGLang backend",
                  "path of the 0600 per-deployment secret the control plane signs with; the "
                  "secret itself never travels in the environment")
HOSTS = Var("PDTOOL_HOSTS", "pdtool.launch.supervisor", "reference engine",
            "the allocation's node addresses, space separated, indexed by the plan's node number")
PREFLIGHT = Var("PDTOOL_PREFLIGHT", "pdtool.launch.supervisor (the script's --preflight)",
                "pdtool.worker",
                '"1": every worker resolves plan, rank and NIC and serves /health, without '
                "starting the engine")
CPUS_FROM_NODE = Var("PDTOOL_CPUS_FROM_NODE", "job script (exclusive Slurm steps)", "pdtool.worker",
                     '"1": the worker binds itself to its share of the node\'s own CPUs '
                     "(pdtool.nodecheck.cpus_from_node) instead of the preset's lists, which "
                     "srun's --cpu-bind would take")
EXIT_WHEN_HEALTHY = Var("PDTOOL_EXIT_WHEN_HEALTHY",
                        "job script (its --exit-when-healthy argument)", "job script",
                        '"1": the job stops once every process answered /health (a variable of '
                        "the script, not exported)")

# -- identity: set by pdtool.worker (and read back by it, so a worker started inside another
# worker's environment, e.g. by hand for debugging, resolves the same place) -----------------
PLAN = Var("PDTOOL_PLAN", "pdtool.worker", "pdtool.worker (--plan default)",
           "the plan.json this process runs from")
ROLE = Var("PDTOOL_ROLE", "pdtool.worker", "pdtool.worker (--role default)",
           "prefill | decode | router")
INSTANCE = Var("PDTOOL_INSTANCE", "pdtool.worker", "pdtool.worker (--instance default)",
               "instance index within the role")
RANK = Var("PDTOOL_RANK", "pdtool.worker (per-rank engines)",
           "pdtool.worker (--rank default after SLURM_PROCID)",
           "rank within the instance of a per-rank engine (the reference engine)")
NODE_RANK = Var("PDTOOL_NODE_RANK", "pdtool.worker",
                "pdtool.worker (--node-rank default after SLURM_NODEID)",
                "node within the instance (per-node engines such as SGLang)")

# -- fabric: set by pdtool.worker from the plan's ranks -----------------------------------------
FI_PROVIDER = Var("PDTOOL_FI_PROVIDER", "the plan (ranks[].env), via pdtool.worker",
                  "SGLang backend", "libfabric provider string: shm, tcp;ofi_rxm, efa, "
                  "verbs;ofi_rxm (the reference engine takes it from the plan itself)")
FI_DOMAIN = Var("PDTOOL_FI_DOMAIN", "pdtool.worker", "SGLang backend, reference engine",
                "the libfabric domain (NIC) of this process's ranks, set when they all share "
                "their NICs")
NICS = Var("PDTOOL_NICS", "pdtool.worker", "SGLang backend, reference engine",
           'JSON {"<local gpu id>": "nic,nic"}: each rank\'s NICs by its GPU (the plan\'s '
           "GPU->NIC map: the NICs on its PCIe switch); the SGLang backend opens an endpoint on "
           "every one of them, the reference engine on the first")

GPU_MEMORY = Var("PDTOOL_GPU_MEMORY", "pdtool.worker (its transfer.gpu_memory decision)",
                 "SGLang backend", "auto | direct | staged: how KV in GPU memory reaches the "
                 "fabric on this node (transfer.gpu_memory, as the worker resolved it and "
                 "printed in its start line): `direct` registers SGLang's pools or fails, "
                 "`staged` moves KV through registered host bounce and landing buffers, `auto` "
                 "tries direct and goes staged when the pools do not register; unset: `auto`")

# -- model: set by the plan (ranks[].env), via pdtool.worker ---------------------------------
DRAFT_LAYERS = Var("PDTOOL_DRAFT_LAYERS", "the plan (ranks[].env, from model.draft_layers), via "
                   "pdtool.worker", "SGLang backend",
                   "the KV layers of the speculative draft model's own pool that the plan "
                   "counted; the backend stops at start-up when SGLang registers a different "
                   "number of draft KV buffers (KVArgs.num_draft_entries), since every write "
                   "count the plan printed would be off")
LAYER_STREAM = Var("PDTOOL_LAYER_STREAM", "the user (optional)", "SGLang backend",
                   "auto | on | off: the SGLang prefill posts each layer's KV writes as soon "
                   "as that layer's attention ran (transfer/sglang/layer_stream.py) instead "
                   "of all of them after the forward; auto (unset): on for KV pools in host "
                   "memory, off for CUDA pools (that branch has not run on a GPU yet)")

# -- fallback and test hooks ------------------------------------------------------------------
SECRET = Var("PDTOOL_SECRET", "tests, hand-run SGLang workers (never pdtool)", "SGLang backend",
             "the secret itself, read only when PDTOOL_SECRET_FILE is not set")
CONTROL_FAULTS = Var("PDTOOL_CONTROL_FAULTS", "tests (transfer.testing.loopback)",
                     "transfer.wire.channel", "drops or delays outgoing control messages by type "
                     "(`drop=REQUEST:0.5,delay=PONG:1.5,seed=3`); off when unset")
REFERENCE_ALLOW_FAULTS = Var("PDTOOL_REFERENCE_ALLOW_FAULTS", "tests (launcher.env.decode.*)",
                             "reference engine",
                             '"1": the reference engine honours the fault hooks of its tests')
REFERENCE_CORRUPT_PAGE = Var("PDTOOL_REFERENCE_CORRUPT_PAGE", "tests (launcher.env.decode.*)",
                             "reference engine",
                             '"LAYER,INDEX": with PDTOOL_REFERENCE_ALLOW_FAULTS=1, a decode rank '
                             "damages that received page of every request (what `pdtool bench "
                             "--verify` must catch)")
SGLANG_CORRUPT_INSTANCE = Var("PDTOOL_SGLANG_CORRUPT_INSTANCE", "tests (launcher.env.decode.*)",
                              "SGLang backend",
                              '"N": the SGLang backend of decode instance N damages the first KV '
                              "page of every request once it landed (host KV pools only): a "
                              "faulty pair that `launcher.verify` must catch")

HOPS = Var("PDTOOL_HOPS", "bench/ttft_hops.py", "bench/hops/sitecustomize.py",
           "file every deployment process appends its request hop timestamps to, when set "
           "(the TTFT hop profiler's hooks, loaded through PYTHONPATH)")

VARIABLES: tuple[Var, ...] = (
    RUN_DIR, PYTHON, SECRET_FILE, HOSTS, PREFLIGHT, CPUS_FROM_NODE, EXIT_WHEN_HEALTHY,
    PLAN, ROLE, INSTANCE, RANK, NODE_RANK,
    FI_PROVIDER, FI_DOMAIN, NICS, GPU_MEMORY, DRAFT_LAYERS, LAYER_STREAM,
    SECRET, CONTROL_FAULTS, REFERENCE_ALLOW_FAULTS, REFERENCE_CORRUPT_PAGE,
    SGLANG_CORRUPT_INSTANCE, HOPS,
)
BY_NAME: dict[str, Var] = {v.name: v for v in VARIABLES}

#: `PDTOOL_*` names that are not part of a deployment's environment: they steer the command-line
#: tool or the build on the user's machine.
TOOL_VARIABLES: dict[str, str] = {
    "PDTOOL_CACHE": "where pdtool.checkpoints builds builtin:NAME checkpoints (default "
                    "$XDG_CACHE_HOME/pdtool, else ~/.cache/pdtool)",
    "PDTOOL_DEBUG": "pdtool's CLI prints the traceback of an internal error instead of one line",
    "PDTOOL_FABRIC_INCLUDE": "where transfer/_fabric_build.py looks for rdma/fabric.h",
    "PDTOOL_FABRIC_WERROR": "set: transfer/_fabric_build.py compiles the C with -Werror",
}


# -- readers ----------------------------------------------------------------------------------


def integer(var: Var, environ: Mapping[str, str] | None = None) -> int | None:
    """An integer variable, or None when unset; WorkerEnvError naming it when not a number."""
    value = var.get(environ)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise WorkerEnvError(f"{var.name}={value!r} is not an integer") from None


def flag(var: Var, environ: Mapping[str, str] | None = None) -> bool:
    """A "1" switch (anything else, or unset, is off)."""
    return var.get(environ) == "1"


def provider(default: str, environ: Mapping[str, str] | None = None) -> str:
    """The libfabric provider string (PDTOOL_FI_PROVIDER), or `default` when unset."""
    return FI_PROVIDER.get(environ) or default


def nics(environ: Mapping[str, str] | None = None) -> dict[int, tuple[str, ...]]:
    """PDTOOL_NICS as {local gpu id: NIC names}; WorkerEnvError naming it when malformed."""
    raw = NICS.get(environ)
    if raw is None:
        return {}
    bad = WorkerEnvError(f'{NICS.name}={raw!r} is not a JSON object {{"<gpu id>": "nic,..."}}')
    try:
        data = json.loads(raw)
    except ValueError:
        raise bad from None
    if not isinstance(data, dict):
        raise bad
    out: dict[int, tuple[str, ...]] = {}
    for gpu, names in data.items():
        if not isinstance(names, str) or not str(gpu).isdigit():
            raise bad
        out[int(gpu)] = tuple(n for n in names.split(",") if n)
    return out


def domain_for(gpu: int | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The libfabric domain (NIC) a rank on local GPU `gpu` opens: PDTOOL_FI_DOMAIN when the
    worker set one for all its ranks, else the first NIC PDTOOL_NICS lists for that GPU; None
    when neither says (the provider's default domain)."""
    shared = FI_DOMAIN.get(environ)
    if shared:
        return shared
    own = nics(environ).get(int(gpu or 0), ())
    return own[0] if own else None


def gpu_memory(environ: Mapping[str, str] | None = None) -> str | None:
    """PDTOOL_GPU_MEMORY (`auto`, `direct` or `staged`), or None when unset; WorkerEnvError
    naming it for anything else."""
    from transfer.gpu_memory import GPU_MEMORY_MODES

    value = GPU_MEMORY.get(environ)
    if value is not None and value not in GPU_MEMORY_MODES:
        raise WorkerEnvError(f"{GPU_MEMORY.name}={value!r}: expected auto, direct or staged")
    return value


def layer_stream(environ: Mapping[str, str] | None = None) -> str:
    """PDTOOL_LAYER_STREAM (`auto` when unset); WorkerEnvError naming it for anything but
    auto, on or off."""
    value = LAYER_STREAM.get(environ) or "auto"
    if value not in ("auto", "on", "off"):
        raise WorkerEnvError(f"{LAYER_STREAM.name}={value!r}: expected auto, on or off")
    return value


def nics_for(gpu: int | None, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Every NIC a rank on local GPU `gpu` may open an endpoint on, the one `domain_for` names
    first: its GPU's PDTOOL_NICS entry (the plan lists every NIC on the GPU's PCIe switch),
    else PDTOOL_FI_DOMAIN alone; () when neither says. A PDTOOL_FI_DOMAIN that the GPU's
    entry does not list wins alone (a hand-set override)."""
    first = domain_for(gpu, environ)
    own = nics(environ).get(int(gpu or 0), ())
    if first is None:
        return ()
    if first not in own:
        return (first,)
    return (first, *(n for n in own if n != first))


def hosts(environ: Mapping[str, str] | None = None) -> list[str]:
    """The allocation's node addresses (PDTOOL_HOSTS), by node index; [] when not exported."""
    return (HOSTS.get(environ) or "").split()


def secret_file(environ: Mapping[str, str] | None = None) -> str | None:
    """Path of the deployment secret file (PDTOOL_SECRET_FILE), or None."""
    return SECRET_FILE.get(environ)


# -- writers ----------------------------------------------------------------------------------


def launch_env(*, run_dir: str, secret_file: str, hosts: Iterable[str],
               preflight: bool) -> dict[str, str]:
    """The launch variables `pdtool launch` (launcher=local) gives every process it starts, as
    the rendered job scripts export them (templates/*.j2 write the same names in bash)."""
    env = {RUN_DIR.name: run_dir, SECRET_FILE.name: secret_file, HOSTS.name: " ".join(hosts)}
    if preflight:
        env[PREFLIGHT.name] = "1"
    return env


@dataclass(frozen=True)
class RankPlace:
    """What the writer needs of one rank the process drives (pdtool's RankPlan, as plain data)."""

    rank: int
    node_rank: int
    gpu: int
    nics: tuple[str, ...]
    env: Mapping[str, str]  # the plan's fabric variables for this rank (ranks[].env)


def worker_env(*, plan: str, role: str, instance: int | None, ranks: Iterable[RankPlace],
               per_rank: bool) -> dict[str, str]:
    """The variables `pdtool.worker` adds to its environment before it starts the engine.

    The plan's per-rank fabric variables (provider, `FI_*` restrictions) that all of this
    process's ranks share, then the identity, then the NICs: PDTOOL_NICS always (one entry per
    GPU), PDTOOL_FI_DOMAIN when every rank has the same NICs (the common case: one rank per
    process, or a host NIC shared by all GPUs). `per_rank`: the engine runs one process per
    rank (PDTOOL_RANK is then this process's rank).
    """
    places = list(ranks)
    env: dict[str, str] = {}
    if places:
        first = places[0].env
        env.update({k: v for k, v in first.items()
                    if all(p.env.get(k) == v for p in places)})
    env[PLAN.name] = plan
    env[ROLE.name] = role
    if instance is not None and places:
        env[INSTANCE.name] = str(instance)
        env[NODE_RANK.name] = str(places[0].node_rank)
        if per_rank and len(places) == 1:
            env[RANK.name] = str(places[0].rank)
        env[NICS.name] = json.dumps({str(p.gpu): ",".join(p.nics) for p in places},
                                    separators=(",", ":"))
        if len({p.nics for p in places}) == 1 and places[0].nics:
            env[FI_DOMAIN.name] = places[0].nics[0]
    return env
