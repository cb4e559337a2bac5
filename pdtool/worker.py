"""Worker entry: `python -m pdtool.worker --plan plan.json --role R --instance I [--rank N |
--node-rank N] [--host ADDR] [-- ENGINE ARGV...]`.

Every process of a deployment starts here, on Slurm (one `srun` step each) or locally:
1. load the plan saved beside the job script;
2. resolve which ranks this process is: from the arguments, else from Slurm's task variables
   (`SLURM_PROCID` for per-rank engines, `SLURM_NODEID` for per-node engines, counted within
   the step that spans the instance), else `PDTOOL_RANK` / `PDTOOL_NODE_RANK`;
3. check it landed on the node the plan chose (`--expect-node` against `SLURMD_NODENAME`);
4. set the fabric environment of its ranks (libfabric provider, NIC domains) and its identity:
   the `PDTOOL_*` variables of `transfer.workerenv` (the one list of them, with their meaning,
   writer and readers; docs/worker-environment.md), which the reference engine and pdtool's
   SGLang backend read;
5. start the engine: one function per engine (`ENGINES`). SGLang is exec'd with the rendered
   line after `--`; the reference engine runs in this process.

Errors (bad plan path, rank out of range, wrong node) print one clear line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from transfer import workerenv
from transfer.fabric import FabricError
from transfer.workerenv import RankPlace, WorkerEnvError

if TYPE_CHECKING:
    from pdtool.adapters import EngineAdapter


class WorkerError(RuntimeError):
    """A start-up problem the user must fix; printed as one line, exit status 2."""


@dataclass
class WorkerContext:
    """What an engine function receives: the plan and this process's place in it."""

    plan: Any  # pdtool.plan.Plan
    plan_path: Path
    role: str  # prefill | decode | router
    instance: Any  # InstancePlan (None for the router)
    ranks: list[Any]  # RankPlan records this process drives (empty for the router)
    host: str  # address to bind (the node's address in the allocation)
    port: int | None  # HTTP port this process serves, if any (instance head / router)
    engine_argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # what was added to os.environ

    @property
    def name(self) -> str:
        if self.instance is None:
            return "router"
        return f"{self.instance.name}.ranks{'-'.join(str(r.rank) for r in self.ranks)}"


def _env_int(slurm: str | None, var: workerenv.Var) -> int | None:
    """Slurm's task variable `slurm` when set (it counts within the step), else `var`."""
    raw = os.environ.get(slurm, "") if slurm else ""
    try:
        if raw:
            return int(raw)
        return workerenv.integer(var)
    except WorkerEnvError as e:
        raise WorkerError(str(e)) from None
    except ValueError:
        raise WorkerError(f"{slurm}={raw!r} is not an integer") from None


def load_plan(path: Path) -> Any:
    from pdtool.plan import PlanError, from_json

    try:
        return from_json(path.read_text())
    except OSError as e:
        raise WorkerError(f"cannot read the plan {path}: {e.strerror}") from None
    except (ValueError, TypeError, KeyError, PlanError) as e:
        raise WorkerError(f"{path} is not a pdtool plan: {e}") from None


def plan_adapter(plan: Any) -> EngineAdapter:
    """The adapter of the plan's engine (`pdtool.adapters`)."""
    from pdtool.adapters import UnknownEngine, engine_adapter

    try:
        return engine_adapter(plan.engine)
    except UnknownEngine as e:
        raise WorkerError(f"the plan's {e}") from None


def resolve(args: argparse.Namespace) -> WorkerContext:
    """Load the plan and find this process's ranks, host and port in it."""
    plan_arg = args.plan or workerenv.PLAN.get()
    if not plan_arg:
        raise WorkerError(f"no plan: pass --plan PATH or set {workerenv.PLAN.name}")
    plan_path = Path(plan_arg).resolve()
    plan = load_plan(plan_path)
    role = args.role or workerenv.ROLE.get() or ""
    if role == "router":
        return WorkerContext(plan=plan, plan_path=plan_path, role=role, instance=None, ranks=[],
                             host=args.host or "127.0.0.1", port=plan.router.port,
                             engine_argv=args.engine_argv)
    if role not in ("prefill", "decode"):
        raise WorkerError(f"--role: {role!r} is not prefill, decode or router")
    index = args.instance if args.instance is not None else _env_int(None, workerenv.INSTANCE)
    insts = plan.role_instances(role)
    if index is None or not 0 <= index < len(insts):
        raise WorkerError(f"--instance: {index!r} is not one of the plan's {len(insts)} "
                          f"{role} instances")
    inst = insts[index]
    if plan_adapter(plan).per_node:
        node_rank = (args.node_rank if args.node_rank is not None
                     else _env_int("SLURM_NODEID", workerenv.NODE_RANK))
        ranks = [r for r in inst.ranks if r.node_rank == node_rank]
        if not ranks:
            raise WorkerError(f"--node-rank: {node_rank!r} is not a node of {inst.name} "
                              f"(it spans {len(inst.nodes)} node(s))")
    else:
        rank = args.rank if args.rank is not None else _env_int("SLURM_PROCID", workerenv.RANK)
        if rank is None or not 0 <= rank < len(inst.ranks):
            raise WorkerError(f"--rank: {rank!r} is not a rank of {inst.name} "
                              f"(ranks 0-{len(inst.ranks) - 1})")
        ranks = [inst.ranks[rank]]
    port = inst.http_port if ranks[0].rank == 0 else None
    return WorkerContext(plan=plan, plan_path=plan_path, role=role, instance=inst, ranks=ranks,
                         host=args.host or "127.0.0.1", port=port,
                         engine_argv=args.engine_argv)


def check_node(expect: str | None) -> str:
    """This node's Slurm name; WorkerError if Slurm put us elsewhere than the plan said."""
    actual = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if expect and os.environ.get("SLURMD_NODENAME") and actual != expect:
        raise WorkerError(f"started on node {actual}, but the plan put this process on {expect}")
    return actual


def check_node_matches_plan(ctx: WorkerContext) -> None:
    """GPUs, NICs, NUMA nodes and CPUs of this node against the plan's (pdtool.nodecheck),
    before anything loads: a mismatch stops the job naming the preset key. On an exclusive
    Slurm node (PDTOOL_CPUS_FROM_NODE) the worker then binds itself, and so the engine it
    starts, to its share of the node's own CPUs."""
    from pdtool.nodecheck import cpus_from_node, node_problems
    from pdtool.plan import compress_cpus, expand_cpus

    from_node = workerenv.flag(workerenv.CPUS_FROM_NODE) and bool(ctx.ranks)
    problems = node_problems(list(ctx.ranks), ctx.plan.cluster.device,
                             check_plan_cpus=not from_node)
    cpus: list[int] = []
    if from_node:
        cpus, more = cpus_from_node(ctx.plan, list(ctx.ranks))
        problems += more
    if problems:
        raise WorkerError("this node does not match the plan:\n  - " + "\n  - ".join(problems))
    if cpus:
        os.sched_setaffinity(0, cpus)
        bound = compress_cpus(sorted(os.sched_getaffinity(0)))
        print(f"pdtool-worker: CPUs from the node: {bound} (the preset gave "
              f"{compress_cpus([c for r in ctx.ranks for c in expand_cpus(r.cpus)]) or 'none'})",
              flush=True)


def worker_env(ctx: WorkerContext) -> dict[str, str]:
    """Environment for this process: its ranks' fabric variables plus its identity and NICs
    (`transfer.workerenv.worker_env`, the one writer of the worker environment)."""
    places = [RankPlace(rank=r.rank, node_rank=r.node_rank, gpu=r.gpu, nics=tuple(r.nics),
                        env=r.env) for r in ctx.ranks]
    return workerenv.worker_env(
        plan=str(ctx.plan_path), role=ctx.role,
        instance=ctx.instance.index if ctx.instance is not None else None, ranks=places,
        per_rank=not plan_adapter(ctx.plan).per_node)


def check_engine_version(ctx: WorkerContext) -> None:
    """An external engine (SGLang): the release installed for this worker's python (which also
    runs the engine) must be the one `engine.version` names, whose disaggregation interface
    pdtool's backend is written for; read from the package metadata, without importing it."""
    package = plan_adapter(ctx.plan).package
    if package is None or ctx.instance is None:
        return
    from importlib import metadata

    want = ctx.plan.engine_version
    try:
        have = metadata.version(package)
    except metadata.PackageNotFoundError:
        raise WorkerError(f"engine.version={want}: {package} is not installed for "
                          f"{sys.executable}; install {package}=={want} (or point engine.python"
                          " / launcher.venv / launcher.container_image at an environment that "
                          "has it)") from None
    if have != want:
        raise WorkerError(f"engine.version={want}, but {sys.executable} has {package}=={have}; "
                          f"install {package}=={want}, or use the environment that has it")


def kv_in_gpu_memory(plan: Any) -> bool:
    """The KV cache lives in GPU memory only on a GPU cluster and with an engine that keeps it
    there (SGLang); the reference engine keeps it in host memory, where `transfer.gpu_memory`
    has no say."""
    return plan_adapter(plan).kv_on_gpu and plan.cluster.device == "cuda"


def gpu_memory_choice(ctx: WorkerContext) -> Any:
    """The path KV in GPU memory takes on this node (`transfer.gpu_memory.GpuMemoryChoice`),
    or None when the KV is in host memory, nothing moves it (mode=aggregated), or SGLang's own
    backend (transfer.backend) moves it and registers the GPU memory itself. `direct` asks the
    node's libfabric (`transfer.fabric.gpu_direct_support`, on the rank's NIC: one endpoint,
    no GPU and no CUDA needed), so a node that cannot is a WorkerError with the probe's reason
    before any engine starts; the engine replaces this process (exec), so nothing the probe
    left in the provider's process-wide state (EFA marks dma-buf off after a failed one) is
    there for the real registration. `auto` probes nothing: the backend tries to register the
    pools themselves and goes staged when they are refused (a CUDA registration of a host page
    answers yes whether or not GPUDirect works); `staged`, or a provider that never has
    FI_HMEM, needs no probe."""
    if ctx.instance is None or not kv_in_gpu_memory(ctx.plan) \
            or ctx.plan.aggregated or ctx.plan.transfer.backend != "pdtool":
        return None
    from transfer.gpu_memory import NO_HMEM_PROVIDERS, choose_gpu_memory

    t = ctx.plan.transfer
    probe = None
    if t.gpu_memory == "direct" and t.provider not in NO_HMEM_PROVIDERS:
        probe = _gpu_direct_probe(t.provider, ctx.ranks[0].nics)
    try:
        return choose_gpu_memory(t.gpu_memory, t.provider, probe)
    except ValueError as e:
        raise WorkerError(str(e)) from None


def backend_gpu_memory(choice: Any) -> str:
    """PDTOOL_GPU_MEMORY for the SGLang backend: the decided path, or `auto` (try direct at
    registration, staged when refused) where the worker left it undecided."""
    return choice.path if choice.path in ("direct", "staged") else "auto"


def _gpu_direct_probe(provider: str, nics: Any) -> tuple[bool, str]:
    """`gpu_direct_support` on the rank's first NIC (EFA's RDM domain carries `-rdm`), else on
    the provider's default domain (shm has one per host)."""
    try:
        from transfer.fabric import gpu_direct_support
    except ImportError as e:
        raise WorkerError(f"transfer.gpu_memory: cannot load the libfabric binding to ask "
                          f"whether {provider} registers GPU memory ({e})") from None
    nic = nics[0] if nics and provider != "shm" else None
    answer = (False, "no domain tried")
    for domain in ([nic, f"{nic}-rdm"] if nic else []) + [None]:
        answer = gpu_direct_support(provider, domain=domain)
        if answer[0]:
            return answer
    return answer


def cudart_problem() -> str | None:
    """Why `libcudart.so` cannot be loaded here, or None when it can. libfabric's CUDA support
    dlopens that unversioned name (not libcudart.so.12), and a node whose CUDA runtime came
    with pip has only the versioned file: that libfabric then has no CUDA, `direct` fails
    with -FI_ENOSYS and `auto` goes staged, with nothing in the start line saying why."""
    import ctypes

    try:
        ctypes.CDLL("libcudart.so")
    except OSError as exc:
        return str(exc)
    return None


def _gpu_memory_field(plan: Any, choice: Any) -> str:
    """The start line's `gpu_memory=`: direct | staged | auto (pdtool's backend; `auto`: the
    ranks decide when they register their pools), the SGLang backend that registers it itself
    (`sglang-mooncake`), `host` (KV in host memory), or `none` (mode=aggregated: the KV stays
    where it was computed)."""
    if choice is not None:
        return backend_gpu_memory(choice)
    if plan.aggregated:
        return "none"
    if kv_in_gpu_memory(plan):
        return f"sglang-{plan.transfer.backend}"
    return "host"


def startup_line(ctx: WorkerContext, node: str, gpu_memory: Any = None) -> str:
    """One greppable line saying what this process resolved (tests read it from the logs).
    `gpu_memory`: `gpu_memory_choice(ctx)` (None: the KV is in host memory)."""
    parts = [f"role={ctx.role}", f"node={node}", f"host={ctx.host}", f"engine={ctx.plan.engine}"]
    if ctx.instance is not None:
        rs = ctx.ranks
        parts += [
            f"instance={ctx.instance.index}",
            f"plan_node={rs[0].node}",
            f"node_rank={rs[0].node_rank}",
            f"ranks={','.join(str(r.rank) for r in rs)}",
            f"gpus={','.join(str(r.gpu) for r in rs)}",
            f"nics={';'.join(','.join(r.nics) or '-' for r in rs)}",
            f"numa={','.join(str(r.numa) for r in rs)}",
            f"cpus={rs[0].cpus or '-'}",
            f"FI_PROVIDER={os.environ.get('FI_PROVIDER', '-')}",
            f"gpu_memory={_gpu_memory_field(ctx.plan, gpu_memory)}",
        ]
    else:
        parts.append(f"plan_node={ctx.plan.router.node}")
    if ctx.port is not None:
        parts.append(f"port={ctx.port}")
    return "pdtool-worker: start " + " ".join(parts)


# --- engines ---------------------------------------------------------------------------------


def run_sglang(ctx: WorkerContext) -> int:
    """Replace this process with the SGLang line rendered after `--` (server, or the router for
    the router role); the plan and fabric environment are already in os.environ for pdtool's
    SGLang transfer backend."""
    from pdtool.rules.sglang import HND_POOLS_ENV, asks_hnd_pools

    if ctx.instance is not None and not ctx.plan.aggregated \
            and asks_hnd_pools(os.environ.get(HND_POOLS_ENV)):
        # inherited from the shell that ran pdtool (validate checks launcher.env only)
        raise WorkerError(f"{HND_POOLS_ENV}={os.environ[HND_POOLS_ENV]}: SGLang 0.5.23 does not "
                          "support PD transfer from HND KV pools (it asserts NHD slot rows at "
                          f"start-up); unset {HND_POOLS_ENV} for this deployment")
    if not ctx.engine_argv:
        raise WorkerError("engine=sglang needs its launch line after `--`")
    # pdtool's SGLang backend signs its control frames with the secret it reads from the 0600
    # file named by PDTOOL_SECRET_FILE (the secret itself never goes into the environment);
    # check it here so a missing or world-readable file fails before SGLang starts
    secret_file = workerenv.secret_file()
    if secret_file:
        from transfer.wire import WireError, read_secret

        try:
            read_secret(secret_file)
        except WireError as e:
            raise WorkerError(f"{workerenv.SECRET_FILE.name}: {e}") from None
    if ctx.instance is not None and ctx.plan.cluster.device == "cpu":
        from pdtool.engines.sglang import cpu

        env = cpu.environment(ctx.host, [(r.gpu, r.cpus) for r in ctx.ranks],
                              ctx.plan.cluster.gpus_per_node, os.environ.get("PYTHONPATH", ""))
        os.environ.update(env)
        print("pdtool-worker: SGLang on CPU: " + " ".join(f"{k}={v}" for k, v in env.items()),
              flush=True)
    print("pdtool-worker: exec " + " ".join(ctx.engine_argv[:3]) + " ...", flush=True)
    try:
        os.execvp(ctx.engine_argv[0], ctx.engine_argv)
    except OSError as e:
        raise WorkerError(f"cannot start {ctx.engine_argv[0]!r}: {e.strerror}") from None
    return 1  # not reached


def run_reference(ctx: WorkerContext) -> int:
    """The reference CPU engine (pdtool.engines.reference): prefill/decode ranks and, for the
    router role, its OpenAI-style front; serves until SIGTERM."""
    try:
        from pdtool.engines.reference.serve import run_worker
    except ImportError as e:
        raise WorkerError(f"the reference engine cannot be imported ({e}); install pdtool "
                          "with its engine extra: pip install 'pdtool[engine]'") from None
    return run_worker(ctx)


def run_preflight(ctx: WorkerContext) -> int:
    """The worker's own start-up path without an engine (`pdtool launch --preflight`): once
    plan, rank, NIC and environment are resolved, serve `GET /health` on this process's port
    (instance head or router) and stay up until SIGTERM/SIGINT. Checks a cluster's placement,
    ports and reachability in seconds, before loading a large model; with the fabric check
    (pdtool.fabric_check) the KV bandwidth of every NIC pair too, before health is served."""
    from pdtool import fabric_check
    from transfer.sglang.rails import RailError

    server = claim_health_port(ctx)  # a taken port fails here, before peers count on this rank
    try:
        fabric_check.run(ctx, lambda msg: print(f"pdtool-worker: {msg}", flush=True))
    except (fabric_check.FabricCheckError, FabricError, RailError) as e:
        raise WorkerError(f"fabric check: {e}") from None
    return serve_health_until_stopped(ctx, server)


ENGINES: dict[str, Callable[[WorkerContext], int]] = {
    "sglang": run_sglang,
    "reference": run_reference,
}


class _Health(BaseHTTPRequestHandler):
    info: ClassVar[dict[str, Any]] = {}

    def do_GET(self) -> None:
        if self.path.split("?")[0] not in ("/health", "/"):
            self.send_error(404)
            return
        body = json.dumps({"status": "ok", **self.info}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: Any) -> None:  # keep the log to start-up lines
        pass


def claim_health_port(ctx: WorkerContext) -> ThreadingHTTPServer | None:
    """Bind this rank's health port without listening yet: the port is this process's from
    now on, and a health probe is refused (not left hanging) until the server listens."""
    if ctx.port is None:
        return None
    handler = type("Health", (_Health,), {"info": {"role": ctx.role, "name": ctx.name}})
    server = ThreadingHTTPServer((ctx.host, ctx.port), handler, bind_and_activate=False)
    try:
        server.server_bind()
    except OSError as e:
        server.server_close()
        raise WorkerError(f"cannot serve health on {ctx.host}:{ctx.port}: {e.strerror}"
                          " (is another process using that port?)") from None
    return server


def serve_health_until_stopped(ctx: WorkerContext, server: ThreadingHTTPServer | None) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if server is not None:
        server.server_activate()
        threading.Thread(target=server.serve_forever, daemon=True).start()
        print(f"pdtool-worker: healthy: http://{ctx.host}:{ctx.port}/health", flush=True)
    else:
        print("pdtool-worker: ready (no HTTP port on this rank)", flush=True)
    stop.wait()
    if server is not None:
        server.shutdown()
        server.server_close()
    print("pdtool-worker: stopped", flush=True)
    return 0


# --- entry -----------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    engine_argv: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, engine_argv = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m pdtool.worker",
                                 description="Start one pdtool worker from a rendered plan.")
    ap.add_argument("--plan", help=f"plan.json of the job (default: ${workerenv.PLAN.name})")
    ap.add_argument("--role",
                    help=f"prefill | decode | router (default: ${workerenv.ROLE.name})")
    ap.add_argument("--instance", type=int, help="instance index within the role")
    ap.add_argument("--rank", type=int, help="rank within the instance (per-rank engines)")
    ap.add_argument("--node-rank", type=int, help="node within the instance (per-node engines)")
    ap.add_argument("--host", help="address to bind (this node's address)")
    ap.add_argument("--expect-node", help="Slurm node name the plan put this process on")
    args = ap.parse_args(argv)
    args.engine_argv = engine_argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        ctx = resolve(args)
        node = check_node(args.expect_node)
        check_node_matches_plan(ctx)
        ctx.env = worker_env(ctx)
        os.environ.update(ctx.env)
        check_engine_version(ctx)
        choice = gpu_memory_choice(ctx)
        print(startup_line(ctx, node, choice), flush=True)
        if choice is not None:  # on host-memory KV the start line says gpu_memory=host
            print(f"pdtool-worker: {choice.line()}", flush=True)
            problem = cudart_problem() if choice.path != "staged" else None
            if problem:
                print(f"pdtool-worker: transfer.gpu_memory={choice.mode}: libcudart.so cannot "
                      f"be loaded here ({problem}); a libfabric whose CUDA support dlopens it "
                      f"cannot register GPU memory, so direct fails and auto goes staged; "
                      f"fix: put the CUDA toolkit's lib64 (or a libcudart.so link to "
                      f"libcudart.so.12) on LD_LIBRARY_PATH", flush=True)
            # the SGLang backend moves KV the way this line says (transfer/sglang)
            path = backend_gpu_memory(choice)
            ctx.env[workerenv.GPU_MEMORY.name] = os.environ[workerenv.GPU_MEMORY.name] = path
        if workerenv.flag(workerenv.PREFLIGHT):
            print("pdtool-worker: preflight: not starting the engine", flush=True)
            return run_preflight(ctx)
        return ENGINES[plan_adapter(ctx.plan).kind](ctx)
    except WorkerError as e:
        print(f"pdtool-worker: ERROR: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
