"""What the Slurm job and each of its steps ask for: GPUs, CPUs (and their binding), memory.

Pure functions of the config and plan. The shape (docs/slurm.md, "The job's shape"):

* the job asks one task per node (every step is one task) and, per node, the GPUs
  (device=cuda only, as `launcher.gpu_directive` says: `--gpus-per-node=N`, `--gres=gpu:N`,
  or nothing when the site's partition or `launcher.sbatch_extra` asks) and memory the
  processes use:
  an exclusive job takes whole nodes with all their memory (`--exclusive --mem=0`; without
  `--mem` Slurm gives an exclusive job only its default memory), a shared one
  (`launcher.exclusive=false`) asks `--cpus-per-task` for the busiest node's CPUs and
  `--mem=launcher.mem`;
* every step is `--overlap` (they all share the node) and sees all GPUs of the job on its node
  (it asks for none itself: a step inherits the job's), so the plan's GPU ids are CUDA
  ordinals on every site, with or without device cgroups (SGLang picks its GPUs with
  `--base-gpu-id` and indexes `--numa-node` by that absolute id);
* on an exclusive node a step takes every CPU of the node (`--whole`, `--cpu-bind=none`) and
  its worker binds itself to its ranks' share of the node's own NUMA CPU lists, read on the
  node (`pdtool.nodecheck.cpus_from_node`): a preset's CPU lists are a forecast there, never
  a request Slurm could refuse; on a shared node Slurm chose which CPUs the job has, so a step
  asks for its ranks' CPU count and Slurm binds it to CPUs of its own choosing.
"""

from __future__ import annotations

from pdtool.plan import Plan, RankPlan, compress_cpus, expand_cpus
from pdtool.schema import Config


def node_cpus(cfg: Config) -> list[int]:
    """Every CPU of a node, from the cluster preset's NUMA CPU lists (empty when unknown)."""
    return sorted({c for spec in cfg.cluster.numa_cpus for c in expand_cpus(spec)})


def rank_cpu_list(ranks: list[RankPlan]) -> list[int]:
    """The CPUs the plan gave these ranks (a per-node engine process drives several)."""
    return sorted({c for r in ranks for c in expand_cpus(r.cpus)}) if ranks else []


def numactl_binding(ranks: list[RankPlan], cpus: bool = True) -> list[str]:
    """`numactl` prefix binding a process to its ranks' CPUs and NUMA nodes (none when the
    cluster preset lists no CPUs). It wraps each reference engine rank, on both launchers, and
    a per-node engine's process under launcher=local, where no srun binds it. `cpus=False`
    binds memory only: the worker takes its CPUs from the node (`cpus_from_node`)."""
    cpus_text = compress_cpus(rank_cpu_list(ranks))
    if not cpus_text:
        return []
    nodes = ",".join(str(n) for n in sorted({r.numa for r in ranks}))
    return ["numactl", *([f"--physcpubind={cpus_text}"] if cpus else []), f"--membind={nodes}"]


def cpus_from_node(cfg: Config, launcher: str) -> bool:
    """Exclusive Slurm nodes: workers bind themselves to the node's CPUs, not the preset's."""
    return launcher == "slurm" and cfg.launcher.exclusive


def gpus_requested(cfg: Config) -> int:
    """GPUs the job asks per node: none on device=cpu (worker slots, not devices)."""
    return cfg.launcher.gpus_per_node if cfg.cluster.device == "cuda" else 0


def gpus_used(plan: Plan) -> dict[int, int]:
    """Allocation node -> GPUs its processes address (highest plan GPU id + 1)."""
    out: dict[int, int] = {}
    for inst in plan.instances:
        for r in inst.ranks:
            out[r.node] = max(out.get(r.node, 0), r.gpu + 1)
    return out


def cpus_used(plan: Plan) -> dict[int, int]:
    """Allocation node -> CPUs its ranks were given (the union of their lists)."""
    per: dict[int, set[int]] = {}
    for inst in plan.instances:
        for r in inst.ranks:
            per.setdefault(r.node, set()).update(expand_cpus(r.cpus))
    return {n: len(c) for n, c in per.items()}


def step_options(cfg: Config, ranks: list[RankPlan]) -> list[str]:
    """srun options of one step: its CPUs and binding, its GPUs. `ranks` empty: the router."""
    lc = cfg.launcher
    out: list[str] = []
    mine = rank_cpu_list(ranks)
    if lc.exclusive:
        # every CPU the node has, however many that is (srun(1) --whole), not the preset's
        # count; the worker then binds itself to its share of them (cpus_from_node) and the
        # router floats over the node, as its threads expect
        out += ["--whole", "--cpu-bind=none"]
    elif mine:
        out.append(f"--cpus-per-task={len(mine)}")
    # no GPU option: a step is given every GPU of the job on its node (srun(1) --gres: "By
    # default, a job step is allocated all of the generic resources that have been
    # requested by the job"), which --overlap lets concurrent steps share; asking again
    # per step is what some Slurm versions refuse beside the job's --gpus-per-node
    return out


def job_options(cfg: Config, plan: Plan) -> list[str]:
    """sbatch options for the resources (beside --nodes and --ntasks-per-node)."""
    lc = cfg.launcher
    out: list[str] = []
    if lc.exclusive:
        out += ["--exclusive", f"--mem={lc.mem or 0}"]
    else:
        cpus = max(cpus_used(plan).values(), default=0)
        if cpus:
            out.append(f"--cpus-per-task={cpus}")
        if lc.mem:
            out.append(f"--mem={lc.mem}")
    gpus = gpus_requested(cfg)
    if gpus and lc.gpu_directive == "gpus-per-node":
        out.append(f"--gpus-per-node={gpus}")
    elif gpus and lc.gpu_directive == "gres":
        out.append(f"--gres=gpu:{gpus}")
    return out


def describe_cpus(ranks: list[RankPlan]) -> str:
    """The CPU list of a process, for its comment line."""
    return compress_cpus(rank_cpu_list(ranks)) or "any"
