"""SGLang launch lines (docs/sglang.md), checked against SGLang 0.5.23's own parser in the tests.

Pure functions of the config and plan; hosts are shell variables (`HOSTS[k]`) because node
addresses exist only inside the allocation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

from pdtool.checkpoints import local_path
from pdtool.engines.sglang import cpu
from pdtool.launch.backends import rdma_provider
from pdtool.launch.health import WATCHDOG_MISSES
from pdtool.launch.shell import Var, Word, word
from pdtool.plan import InstancePlan, Plan, RankPlan, gpu_numa
from pdtool.rules.sglang import SGLANG_KV_DTYPES
from pdtool.schema import Config
from transfer.sglang import BACKEND_NAME

#: model.dtype -> SGLang's --dtype (fp8 checkpoints keep SGLang's own choice: their
#: quantization config says how the weights are stored)
SGLANG_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def transfer_backend(cfg: Config, plan: Plan) -> str:
    """SGLang's --disaggregation-transfer-backend: pdtool's plugin under the name it registers,
    or one of SGLang's own (transfer.backend)."""
    return BACKEND_NAME if cfg.transfer.backend == "pdtool" else cfg.transfer.backend


def server_argv(cfg: Config, plan: Plan, inst: InstancePlan, ranks: list[RankPlan],
                node_host: Var, head_host: Var) -> list[str | Word]:
    """`python -m sglang.launch_server ...` for the ranks of `inst` on one node. With
    mode=aggregated the instance is a plain server (no --disaggregation-* flag: SGLang's
    default mode prefills and decodes its own requests) with its role's sharding."""
    rc = cfg.prefill if inst.role == "prefill" else cfg.decode
    model = cfg.model
    disaggregated = not plan.aggregated
    argv: list[str | Word] = [
        cfg.engine.python, "-m", "sglang.launch_server",
        "--model-path", local_path(model.path) or model.name,
        "--served-model-name", model.name,
    ]
    if disaggregated:
        argv += ["--disaggregation-mode", inst.role,
                 "--disaggregation-transfer-backend", transfer_backend(cfg, plan)]
    argv += [
        "--host", node_host,
        "--port", str(inst.http_port),
        "--tp-size", str(inst.tp),
        "--page-size", str(inst.page_size),
        "--mem-fraction-static", str(inst.mem_fraction),
        "--chunked-prefill-size", str(inst.chunked_prefill_size),
        "--context-length", str(model.context_length),
    ]
    if inst.bootstrap_port is not None:
        argv += ["--disaggregation-bootstrap-port", str(inst.bootstrap_port)]
    if inst.dp > 1:
        # 0.5.23: DP attention is its own width (--attn-dp-size D inside --tp-size N, as
        # --dp-size D --enable-dp-attention was, now deprecated); --dp-size D is D replicas
        argv += ["--attn-dp-size" if inst.dp_attention else "--dp-size", str(inst.dp)]
    if rc.ep > 1:
        argv += ["--ep-size", str(rc.ep)]
    if len(inst.nodes) > 1:
        argv += ["--dist-init-addr", word(head_host, f":{inst.dist_init_port}"),
                 "--nnodes", str(len(inst.nodes)), "--node-rank", str(ranks[0].node_rank)]
    else:
        # several single-node instances may share a node: keep their NCCL ports apart
        argv += ["--nccl-port", str(inst.dist_init_port)]
    first_gpu = min(r.gpu for r in ranks)
    if first_gpu:
        argv += ["--base-gpu-id", str(first_gpu)]
    if model.dtype in SGLANG_DTYPES:
        argv += ["--dtype", SGLANG_DTYPES[model.dtype]]
    if rc.kv_dtype != "auto":
        argv += ["--kv-cache-dtype", SGLANG_KV_DTYPES[inst.kv_dtype]]
    if rc.max_running_requests:
        argv += ["--max-running-requests", str(rc.max_running_requests)]
    # one entry per GPU of this process, from the plan's GPU -> NIC choice (SGLang's
    # get_ib_devices_for_gpu reads it for pdtool, mooncake and nixl's UCX alike). SGLang
    # checks the names against /sys/class/infiniband for its own backends, which over tcp
    # and shm use no RDMA device (backends.py): none is given then
    ib = {str(r.gpu): ",".join(r.nics) for r in ranks if r.nics}
    if ib and disaggregated and (cfg.transfer.backend == "pdtool" or rdma_provider(cfg)):
        argv += ["--disaggregation-ib-device", json.dumps(ib, separators=(",", ":"))]
    if cfg.cluster.device == "cuda" and cfg.cluster.gpu_numa:
        # SGLang reads numa_node[gpu_id] with the absolute GPU id (base_gpu_id + local index,
        # utils/numa_utils.py): one entry per GPU of the node, not per GPU of this instance
        argv += ["--numa-node",
                 *(str(gpu_numa(cfg.cluster, g)) for g in range(cfg.cluster.gpus_per_node))]
    if cfg.cluster.device != "cuda":
        argv += ["--device", cfg.cluster.device]
    if cfg.cluster.device == "cpu":
        mem = next(m for m in plan.memory if m.role == inst.role)
        argv += cpu.server_flags(inst.role, disaggregated, mem.kv_tokens)
    argv += [*cfg.engine.extra_args, *rc.extra_args]
    return argv


def router_argv(cfg: Config, plan: Plan, host: Callable[[int], Var]) -> list[str | Word]:
    """`python -m sglang_router.launch_router --pd-disaggregation ...`: every prefill URL with
    its bootstrap port, every decode URL. With mode=aggregated: `--worker-urls` with every
    instance's URL (both roles'), each a regular worker taking whole requests."""
    rp = plan.router
    argv: list[str | Word] = [cfg.engine.python, "-m", "sglang_router.launch_router"]
    if plan.aggregated:
        argv += ["--worker-urls", *(word("http://", host(t.node), f":{t.http_port}")
                                    for t in rp.targets)]
    else:
        argv.append("--pd-disaggregation")
        for t in rp.prefill:
            argv += ["--prefill", word("http://", host(t.node), f":{t.http_port}"),
                     str(t.bootstrap_port)]
        for t in rp.decode:
            argv += ["--decode", word("http://", host(t.node), f":{t.http_port}")]
    argv += ["--host", host(rp.node), "--port", str(rp.port), "--policy", rp.policy,
             "--request-timeout-secs", str(math.ceil(rp.request_timeout_s))]
    if rp.metrics_port is not None:
        argv += ["--prometheus-host", host(rp.node), "--prometheus-port", str(rp.metrics_port)]
    if not plan.aggregated:
        # a request whose decode server died fails on the prefill (after
        # transfer.connect_timeout_s, waiting for the page list that never comes); the breaker
        # counts that against the healthy prefill and, 10 such failures later, refused every
        # request for a minute (measured: tests/test_sglang_servers_faults.py). Dead workers
        # are found by the health checks below instead
        argv.append("--disable-circuit-breaker")
    if cfg.launcher.watchdog_s > 0:
        # the router probes its workers as the launcher's watchdog does: its default (every
        # 60 s, 3 misses) kept sending requests to a dead decode server for 3 minutes, each
        # waiting on the prefill for transfer.connect_timeout_s
        argv += ["--health-check-interval-secs", str(math.ceil(cfg.launcher.watchdog_s)),
                 "--health-check-timeout-secs", str(math.ceil(cfg.launcher.probe_timeout_s)),
                 "--health-failure-threshold", str(WATCHDOG_MISSES)]
    return argv
