"""What SGLang 0.5.23 needs to serve on CPU (`cluster.device=cpu`), set by pdtool from the plan.

SGLang's CPU engine serves real checkpoints on a machine without a GPU, prefill/decode
disaggregation and tensor parallelism (over gloo) included. It takes a handful of flags and
variables that a GPU deployment never needs; each one below names the SGLang 0.5.23 line it
answers (paths under `sglang/`). The user sets none of them: `server_flags` is added to the
rendered launch line, `environment` by `pdtool.worker` just before it execs SGLang.
"""

from __future__ import annotations

from pathlib import Path

from pdtool.plan.placement import compress_cpus, expand_cpus

#: prepended to PYTHONPATH: a torch stand-in for the two `sgl_kernel` CPU ops SGLang calls
#: (`shim/sgl_kernel/__init__.py` says which and why)
SHIM_DIR = Path(__file__).resolve().parent / "shim"


def server_flags(role: str, disaggregated: bool, max_total_tokens: int) -> list[str]:
    """Flags of one SGLang server on CPU. `role`: prefill | decode (aggregated instances keep
    their role's name); `max_total_tokens`: the KV tokens the plan gives one rank."""
    flags = [
        # the attention backend SGLang's CPU path runs without Intel AMX (its `intel_amx`
        # backend needs sgl_kernel's compiled ops)
        "--attention-backend", "torch_native",
        # no server warm-up request (CUDA graphs are not captured on CPU, and 0.5.23 deprecates
        # --disable-cuda-graph)
        "--skip-server-warmup",
        # xgrammar's compiled backend is not needed for plain completions
        "--grammar-backend", "none",
        # an idle scheduler otherwise spins a core (managers/scheduler.py's event loop)
        "--sleep-on-idle",
        # on CPU, --mem-fraction-static is taken of the machine's free RAM (the plan renders
        # pdtool.adapters.sglang.CPU_MEM_FRACTION_STATIC): the pool is sized from the plan's
        # figure instead
        "--max-total-tokens", str(max_total_tokens),
    ]
    if disaggregated and role == "decode":
        # the default retraction backup pins host memory with cudaHostRegister
        # (srt/arg_groups/hicache_hook.py:63)
        flags += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    return flags


def environment(host: str, rank_cpus: list[tuple[int, str]], gpus_per_node: int,
                pythonpath: str = "") -> dict[str, str]:
    """Variables of one SGLang server process on CPU. `rank_cpus`: (GPU slot, CPU list) of each
    rank the process drives; `pythonpath`: the PYTHONPATH it would otherwise have."""
    return {
        # srt/utils/common.py is_cpu(): the CPU engine is opt-in
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": ":".join(p for p in (str(SHIM_DIR), pythonpath) if p),
        # the address the disaggregation bootstrap advertises (srt/utils/network.py)
        "SGLANG_HOST_IP": host,
        # a prefix-cache hit records a CUDA event on the prefill, whatever the backend
        # (srt/disaggregation/prefill.py:1493)
        "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
        # one CPU group per rank, indexed by the rank's GPU id (srt/utils/numa_utils.py:463)
        "SGLANG_CPU_OMP_THREADS_BIND": omp_bind(rank_cpus, gpus_per_node),
        # the CUDA torch wheel ships libnccl, and SGLang would build PyNccl for its CPU group
        # (device_communicators/pynccl.py:116): point it at no library
        "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so",
        # a ~20 s torch.compile on each rank's first forward
        # (layers/vocab_parallel_embedding.py:138)
        "TORCHDYNAMO_DISABLE": "1",
    }


def omp_bind(rank_cpus: list[tuple[int, str]], gpus_per_node: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND: one `|`-separated CPU list per GPU id of the node, SGLang
    indexing it with the rank's GPU id. Ranks of this process that the plan put on the same
    CPUs split them (two ranks each spinning every core of a 2-core box halve each other);
    GPU ids of other processes get the first rank's list, which nothing reads."""
    cpus = dict(rank_cpus)
    shared = len(set(cpus.values())) == 1 and len(cpus) > 1
    if shared:
        parts = _split(next(iter(cpus.values())), len(cpus))
        cpus = {gpu: part for (gpu, _), part in zip(rank_cpus, parts, strict=True)}
    fill = cpus[rank_cpus[0][0]]
    return "|".join(cpus.get(g, fill) for g in range(max(gpus_per_node, max(cpus) + 1)))


def _split(spec: str, n: int) -> list[str]:
    """`spec`'s CPUs in `n` equal runs (every run all of them when there are fewer than n)."""
    ids = expand_cpus(spec)
    if len(ids) < n:
        return [spec] * n
    per = len(ids) // n
    return [compress_cpus(ids[k * per:(k + 1) * per]) for k in range(n)]
