"""SGLang 0.5.23's own transfer classes around pdtool's backend, one OS process per rank.

Real pieces only: the pinned SGLang (bootstrap HTTP server, rank mapping, KVPoll bookkeeping,
heartbeats), libfabric (shm / tcp;ofi_rxm) and separate OS processes per rank. KV and aux buffers
are SGLang's own classes on the CPU: `MHATokenToKVPool` (`[slots, heads, head_dim]` per layer,
separate K and V buffers), `MLATokenToKVPool` (`[slots, 1, kv_lora_rank + rope]`) and
`MetadataBuffers`; the KVArgs are filled from them the way SGLang's scheduler does.

Every rank's buffers are slices of one global tensor per buffer seeded from its index, so a
test recomputes what each decode page must hold and compares bytes (`check_bytes`). Used by
tests/test_sglang_backend.py and the tests of the backend's NICs, send order, staging, layer
streaming and speculative decoding.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import time
from typing import Any

import numpy as np
import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)

from transfer import geometry, workerenv

PAGE = 4
SLOTS = 16 * PAGE  # 16 pages per buffer
LAYERS = 3
HEAD_DIM = 8
N_AUX = 10  # SGLang 0.5.23's MetadataBuffers registers 10 buffers without optional ones
KV_LORA, ROPE = 48, 16  # MLA latent width 64
AUX_ROWS = 8  # MetadataBuffers(size=8, hidden_size=32, ...): 10 buffers on this SGLang
PER_OP = 4  # writes per RMA operation: the iov limit of shm and tcp;ofi_rxm on libfabric 1.17


def ops(writes: int) -> int:
    """Operations (completions counted) that `writes` consecutive writes of one (room, decode
    rank, layer buffer) make: the prefill groups them PER_OP to an operation."""
    return -(-writes // PER_OP)


#: The third-party modules every rank process imports (torch and SGLang: several seconds of
#: CPU each, which with 12 ranks on 2 cores was most of a test's time). The ranks fork from
#: one server process that imported these once ("forkserver"); each rank is still its own OS
#: process that sets its environment and then imports pdtool's backend (`transfer`, never
#: preloaded: it reads PDTOOL_* at import) itself.
RANK_PRELOAD = [
    "numpy", "torch", "pytest", "sglang.srt.environ", "sglang.srt.server_args",
    "sglang.srt.runtime_context", "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.disaggregation.base", "sglang.srt.disaggregation.utils",
    "sglang.srt.disaggregation.common.conn", "sglang.srt.utils.network",
]


def rank_context() -> Any:
    """The multiprocessing context that starts rank processes (see RANK_PRELOAD)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def global_buffers(mla: bool, heads: int, draft: dict[str, Any] | None = None
                   ) -> list[np.ndarray]:
    """All heads of every layer buffer, [slots, heads, dim] as raw bf16 words (uint16); a
    draft model's buffers (`draft`: its mla, layers, heads, head_dim) after the target's."""
    n = LAYERS if mla else 2 * LAYERS  # SGLang order: K of every layer, then V of every layer
    shape = (SLOTS, 1, KV_LORA + ROPE) if mla else (SLOTS, heads, HEAD_DIM)
    out = [np.random.default_rng(100 + i).integers(0, 1 << 16, shape, dtype=np.uint16)
           for i in range(n)]
    if draft:
        n = draft["layers"] * (1 if draft["mla"] else 2)
        shape = (SLOTS, 1, KV_LORA + ROPE) if draft["mla"] else \
            (SLOTS, draft["heads"], draft["head_dim"])
        out += [np.random.default_rng(300 + i).integers(0, 1 << 16, shape, dtype=np.uint16)
                for i in range(n)]
    return out


def buffer_heads(cfg: dict[str, Any], tp: int, rank: int) -> list[slice]:
    """The global heads rank `rank` of a TP `tp` side holds in each buffer (target, draft)."""
    mla, draft = cfg["mla"], cfg.get("draft")
    n = LAYERS if mla else 2 * LAYERS
    out = [slice(0, 1) if mla else _rank_heads(cfg["heads"], tp, rank)] * n
    if draft:
        n = draft["layers"] * (1 if draft["mla"] else 2)
        out += [slice(0, 1) if draft["mla"] else _rank_heads(draft["heads"], tp, rank)] * n
    return out


def aux_row(buffer: int, item_len: int) -> bytes:
    """The bytes the prefill puts in its metadata row of aux buffer `buffer`."""
    return np.random.default_rng(7 + buffer).integers(0, 256, item_len, dtype=np.uint8).tobytes()


def words(t: Any) -> np.ndarray:
    """A writable uint16 numpy view of a CPU bf16 tensor."""
    import torch

    return t.view(torch.int16).numpy().view(np.uint16)


def _rank_heads(heads: int, tp: int, rank: int) -> slice:
    per = max(1, heads // tp)
    first = rank * per if heads >= tp else rank // (tp // heads)
    return slice(first, first + per)


def setup_rank(role: str, cfg: dict[str, Any], rank: int) -> tuple[Any, Any, list, list]:
    """Publish SGLang's config for this rank; build its KV pool and metadata buffers with
    SGLang's own classes (on the CPU) and the KVArgs its scheduler would fill (child process)."""
    import ctypes

    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    tp = cfg[f"{role}_tp"]
    sa = ServerArgs(model_path="dummy", disaggregation_mode=role,
                    disaggregation_transfer_backend="pdtool",
                    disaggregation_bootstrap_port=cfg["bootstrap_port"], host="127.0.0.1",
                    port=cfg["http_port"], tp_size=tp, device="cpu", page_size=PAGE)
    publish(sa, role="test", ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(pp_group=None)  # no torch.distributed groups here

    mla, heads = cfg["mla"], cfg["heads"]

    def make_pool(mla: bool, heads: int, head_dim: int, layers: int) -> tuple[Any, list]:
        common = {"size": SLOTS - PAGE, "page_size": PAGE, "dtype": torch.bfloat16,
                  "layer_num": layers, "device": "cpu", "enable_memory_saver": False}
        if mla:  # [size + page, 1, kv_lora_rank + rope] per layer
            p = MLATokenToKVPool(kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE, **common)
            return p, list(p.kv_buffer)
        # [size + page, heads, head_dim] per layer, K and V apart; a rank holds
        # max(1, heads / tp) of them (SGLang's get_num_kv_heads)
        p = MHATokenToKVPool(head_num=max(1, heads // tp), head_dim=head_dim,
                             enable_alt_stream=False, **common)
        return p, list(p.k_buffer) + list(p.v_buffer)

    pool, bufs = make_pool(mla, heads, HEAD_DIM, LAYERS)
    # cfg["draft"]: a speculative draft model with a KV pool of its own (EAGLE/NEXTN, EAGLE3,
    # STANDALONE), over the same attention TP, its buffers appended after the target's
    draft, draft_pool = cfg.get("draft"), None
    if draft:
        draft_pool, draft_bufs = make_pool(draft["mla"], draft.get("heads", 1),
                                           draft.get("head_dim", HEAD_DIM), draft["layers"])
        bufs += draft_bufs
    # cfg["metadata"]: MetadataBuffers' sizes as the scheduler picks them (speculative: the
    # draft's hidden state); cfg["fill_metadata"](meta, row): the prefill's rows, set_buf-like
    meta = MetadataBuffers(AUX_ROWS, **cfg.get("metadata", {
        "hidden_size": 32, "hidden_states_dtype": torch.bfloat16, "max_sampling_mask_tokens": 16}))

    args = _kv_args(role, pool, meta, tp, rank, heads, mla, draft_pool)
    assert args.kv_data_ptrs == [b.data_ptr() for b in bufs]  # K of every layer, then V
    if role == "prefill":
        for b, g, sl in zip(bufs, global_buffers(mla, heads, draft),
                            buffer_heads(cfg, tp, rank), strict=True):
            words(b)[...] = g[:, sl]
        for j, (ptr, ilen) in enumerate(zip(args.aux_data_ptrs, args.aux_item_lens,
                                            strict=True)):
            for row in range(AUX_ROWS):
                ctypes.memmove(ptr + row * ilen, aux_row(j, ilen), ilen)
        for row in range(AUX_ROWS) if cfg.get("fill_metadata") else ():
            cfg["fill_metadata"](meta, row)
    else:
        for b in bufs:
            b.zero_()
        for ptr, n in zip(args.aux_data_ptrs, args.aux_data_lens, strict=True):
            ctypes.memset(ptr, 0, n)
    aux = list(zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, strict=True))
    return sa, args, (pool, meta, bufs), aux


def _kv_args(role: str, pool: Any, meta: Any, tp: int, rank: int, total_heads: int,
             mla: bool, draft_pool: Any = None) -> Any:
    """KVArgs filled field by field as SGLang 0.5.23's `_init_kv_manager` fills them
    (prefill.py `PrefillBootstrapQueue`, decode.py `DecodePreallocQueue`), with SGLang's own
    helpers. Only the prefill sets the KV head counts (the decode sets them only with
    SGLANG_DISAGG_STAGING_BUFFER, after its manager is built); a draft model's pool
    (`draft_pool`, the scheduler's `draft_worker.primary_draft_kv_pool`) is appended after the
    target's with `num_draft_entries`; a CPU pool has no hybrid/state pools and no host
    receive buffers."""
    from sglang.srt.disaggregation.base import KVArgs
    from sglang.srt.disaggregation.utils import (
        build_kv_layer_ids,
        get_kv_transfer_buf_infos,
        get_pd_kv_layout,
        setup_state_kv_args,
    )

    args = KVArgs()
    args.engine_rank = rank if role == "prefill" else rank % tp  # decode: tp_rank % attn_tp
    args.pp_rank = 0
    args.system_dp_rank = 0
    if role == "prefill":
        args.rust_http_port = None
    args.kv_cache_dtype_str = "bfloat16"
    args.kv_layout = get_pd_kv_layout(pool)
    ptrs, lens, item_lens = get_kv_transfer_buf_infos(pool)
    if role == "prefill":
        args.prefill_start_layer = pool.start_layer  # _transfer_start_layer, non-hybrid pool
        args.prefill_end_layer = getattr(pool, "end_layer", None)
    num_draft_entries = 0
    if draft_pool is not None:  # prefill: transfer_draft_cache (no layer sharding here)
        dptrs, dlens, ditems = draft_pool.get_contiguous_buf_infos()
        ptrs += dptrs
        lens += dlens
        item_lens += ditems
        num_draft_entries = len(dptrs)
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = ptrs, lens, item_lens
    args.num_draft_entries = num_draft_entries
    args.kv_layer_ids = build_kv_layer_ids(token_to_kv_pool=pool,
                                           draft_token_to_kv_pool=draft_pool,
                                           num_draft_entries=num_draft_entries,
                                           num_hidden_layers=LAYERS)
    if role == "prefill" and not mla:  # prefill.py: `if not self.is_mla_backend:`
        args.kv_head_num = pool.head_num
        args.total_kv_head_num = total_heads  # model_config.get_total_num_kv_heads()
    args.page_size = pool.page_size
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = meta.get_buf_infos()
    if role == "prefill":
        args.ib_device, args.gpu_id = None, 0
    setup_state_kv_args(args, pool, draft_pool, total_kv_layers=LAYERS, req_to_token_pool=None)
    if role == "decode":
        args.ib_device, args.gpu_id = None, 0
    return args


def thread_cpu_s(name: str) -> float:
    """CPU seconds this process's live thread `name` has used so far (nan: it died)."""
    from transfer.testing.loopback import thread_cpu

    return thread_cpu().get(name, float("nan"))


def _wait_writer_idle(mgr: Any, seconds: float = 60) -> None:
    """Until the prefill's writer has taken every chunk and none of its writes is queued or in
    flight (twice in a row, 50 ms apart), however long a loaded box makes that take."""
    def idle() -> bool:
        queues = list(mgr.plane.queues.values())  # one step under the GIL: the writer edits it
        return not mgr.plane.chunks and not any(q.batches for q in queues) and \
            not any(ep.inflight for ep in mgr.rails.eps)

    deadline = time.monotonic() + seconds
    while not (idle() and (time.sleep(0.05) or idle())):
        assert time.monotonic() < deadline, "the writer never drained the earlier chunks"
        time.sleep(0.01)


def poll_until(objs: dict[int, Any], done: Any, seconds: float) -> None:
    """Poll every sender/receiver like the scheduler does until `done(state)` holds for all
    (or `seconds` pass)."""
    deadline = time.time() + seconds
    while time.time() < deadline and not all(done(int(o.poll())) for o in objs.values()):
        time.sleep(0.005)


def reason_of(obj: Any) -> str:
    try:
        obj.failure_exception()
    except Exception as exc:  # SGLang's KVTransferError
        return f"{type(exc).__name__}: {exc}"
    return ""


def _metrics_mode(cfg: dict[str, Any]) -> None:
    """`cfg["metrics_dir"]`: prometheus-client's multiprocess files go there, as SGLang's
    --enable-metrics sets PROMETHEUS_MULTIPROC_DIR before its schedulers start (the forkserver
    imported prometheus_client before: its value class follows the variable)."""
    if cfg.get("metrics_dir"):
        from prometheus_client import values

        os.environ["PROMETHEUS_MULTIPROC_DIR"] = cfg["metrics_dir"]
        values.ValueClass = values.MultiProcessValue()


def collected_metrics(folder: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """What a /metrics over a run's multiprocess files would show: sample name ->
    [(labels, value)]."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=folder)
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def prefill_rank(cfg: dict[str, Any], rank: int, conn: Any) -> None:
    """One prefill scheduler rank: (rank 0) bootstrap server, manager, one sender per room,
    the rooms of each wave (one per decode run) handled together as the scheduler does."""
    os.environ.update(cfg["env"])
    _metrics_mode(cfg)
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from transfer.sglang.conn import PdtoolKVBootstrapServer, PdtoolKVManager, PdtoolKVSender

    server = None
    if rank == 0:
        server = PdtoolKVBootstrapServer("127.0.0.1", cfg["bootstrap_port"])
    sa, args, _keep, _aux = setup_rank("prefill", cfg, rank)
    mgr = PdtoolKVManager(args, DisaggregationMode.PREFILL, sa, cfg["mla"])
    conn.send("ready")
    results: dict[int, Any] = {}
    terminal = (KVPoll.Success, KVPoll.Failed)
    for wave in cfg["waves"]:
        senders = {room: PdtoolKVSender(mgr, f"127.0.0.1:{cfg['bootstrap_port']}", room)
                   for room in wave}
        poll_until(senders, lambda st: st != KVPoll.Bootstrapping, 60)
        if cfg.get("hold"):
            conn.send(("waiting",))
            time.sleep(3600)  # the test kills this process here
        sending: dict[int, Any] = {}
        for later in (False, True):
            if later and cfg.get("go_after"):  # the test acts on the decode side first
                poll_until(sending, lambda st: st in terminal, cfg.get("wait", 60))
                conn.send(("waiting",))
                conn.recv()
            sending.update(_send_rooms(cfg, senders, results, later))
        poll_until(sending, lambda st: st in terminal, cfg.get("prefill_wait",
                                                                cfg.get("wait", 60)))
        for room, sender in sending.items():
            results[room] = int(sender.poll())
            if results[room] == KVPoll.Failed:
                results[room] = reason_of(sender)
    time.sleep(cfg.get("settle_s", 0))  # let late completions and peer upkeep run
    stats = {**getattr(mgr, "stats", dict)(), "held_writer_cpu_s": cfg.get("held_cpu_s")}
    conn.send(("done", results, mgr.ep.remote_writes, stats))
    conn.recv()  # keep the endpoint and bootstrap server alive until decode finished
    mgr.teardown()
    del server
    os._exit(0)  # skip interpreter teardown (SGLang's ZMQ contexts make it slow)


def _send_rooms(cfg: dict[str, Any], senders: dict[int, Any], results: dict[int, Any],
                later: bool) -> dict[int, Any]:
    """Prefill: send every room of `senders` (those marked `after_go` when `later`) in
    chunks; an aborted room is only watched until its sender fails."""
    from sglang.srt.disaggregation.base import KVPoll

    sending = {}
    for room, sender in senders.items():
        req = cfg["rooms"][room]
        if bool(req.get("after_go")) != later:
            continue
        if req.get("abort"):  # decode aborts it: the sender must see Failed with a reason
            poll_until({room: sender}, lambda st: st == KVPoll.Failed, 60)
            results[room] = reason_of(sender)
            continue
        src = np.asarray(req["src_pages"], dtype=np.int32)
        sender.init(len(src), req["aux_index"])
        for lo in range(0, len(src), req["chunk"]):  # chunked prefill: one send per chunk
            if cfg.get("hold_last_s") and lo + req["chunk"] >= len(src):
                # the engine computes the last chunk: the room is open, nothing in flight
                _wait_writer_idle(sender.kv_mgr)
                before = thread_cpu_s("pdtool-prefill-writer")
                time.sleep(cfg["hold_last_s"])
                cfg["held_cpu_s"] = thread_cpu_s("pdtool-prefill-writer") - before
            sender.send(src[lo: lo + req["chunk"]])
        sending[room] = sender
        if later and cfg.get("first_alone") and len(sending) == 1:
            # the rest is sent once this room ended (its writes failed: the provider knows)
            poll_until(sending, lambda st: st in (KVPoll.Success, KVPoll.Failed),
                       cfg.get("wait", 60))
    return sending


def decode_rank(cfg: dict[str, Any], rank: int, conn: Any) -> None:
    """One decode scheduler rank: manager + one receiver per room, polled like the scheduler."""
    os.environ.update(cfg["env"])
    _metrics_mode(cfg)
    import ctypes
    import threading

    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from transfer.sglang.conn import PdtoolKVManager, PdtoolKVReceiver

    sa, args, (_pool, _meta, bufs), aux = setup_rank("decode", cfg, rank)
    mgr = PdtoolKVManager(args, DisaggregationMode.DECODE, sa, cfg["mla"])
    addr = f"127.0.0.1:{cfg['bootstrap_port']}"
    deadline = time.time() + 180  # the prefill ranks start at the same time
    while not mgr.try_ensure_parallel_info(addr):
        assert time.time() < deadline, "prefill never registered with the bootstrap server"
        time.sleep(0.2)
    out: dict[int, Any] = {}
    recvs: dict[int, Any] = {}
    blocked = []
    for room, req in cfg["rooms"].items():
        recv = PdtoolKVReceiver(mgr, addr, room)
        recv.init(0)
        meta = (np.asarray(req["dst_pages"], dtype=np.int32), req["dst_aux"])
        if cfg.get("hold_ep_lock"):
            # as if the progress thread sat in a long poll(): the scheduler must not wait
            with mgr.ep._lock:
                t = threading.Thread(target=recv.send_metadata, args=meta, daemon=True)
                t.start()
                t.join(30)
                blocked.append(t.is_alive())
            t.join()
        else:
            recv.send_metadata(*meta)
        if req.get("abort"):  # the user cancelled: SGLang's scheduler calls abort()
            recv.abort()
            deadline = time.time() + 30
            while not mgr.is_abort_release_safe(room, 1) and time.time() < deadline:
                time.sleep(0.01)  # deferred KV release: pages held until prefill ACKs
            out[room] = {"released": mgr.is_abort_release_safe(room, 1),
                         "states": [int(recv.poll())]}
            recv.clear()
            continue
        recvs[room] = recv
    if cfg.get("die_after_meta"):  # once the rooms sent first landed (fabric connected)
        first = {r: v for r, v in recvs.items() if not cfg["rooms"][r].get("after_go")}
        poll_until(first, lambda st: st in (KVPoll.Success, KVPoll.Failed), 60)
        conn.send(("sent",))
        time.sleep(3600)  # the test kills this process here
    if cfg.get("close_endpoint"):  # the progress thread's next poll fails: it dies
        mgr.ep.close()
    states = {room: [int(r.poll())] for room, r in recvs.items()}
    counting_since, counting_cpu = time.monotonic(), thread_cpu_s("pdtool-decode-progress")
    deadline = time.time() + cfg.get("wait", 60)
    while time.time() < deadline and any(s[-1] not in (KVPoll.Success, KVPoll.Failed)
                                         for s in states.values()):
        time.sleep(0.005)
        for room, r in recvs.items():
            st = int(r.poll())
            if st != states[room][-1]:
                states[room].append(st)
    # while its slots counted: the progress thread's CPU share
    counting = (thread_cpu_s("pdtool-decode-progress") - counting_cpu) / \
        max(time.monotonic() - counting_since, 1e-3)
    for room, recv in recvs.items():
        error = reason_of(recv) if states[room][-1] == KVPoll.Failed else None
        out[room] = {"states": states[room], "error": error, "counting_cpu_share": counting,
                     "per_op": [g.writes_per_op for g in
                                getattr(mgr, "prefill_geometry", {}).values()],
                     "count": int(mgr.ep.recv_counts[recv.slot]) if recv.slot is not None
                     else 0}
        recv.clear()
    if cfg.get("close_endpoint"):  # a request after the death fails at once, with the reason
        late = PdtoolKVReceiver(mgr, addr, 99)
        late.init(0)
        late.send_metadata(np.asarray([0], dtype=np.int32), 0)
        out[99] = {"states": [int(late.poll())], "error": reason_of(late)}
        conn.send(("done", out, [], [], 0, 0, blocked))
    else:
        conn.send(("done", out, [words(b).copy() for b in bufs],
                   [(ctypes.string_at(p, n), ilen) for p, n, ilen in aux],
                   mgr.ep.remote_writes, mgr.ep.stale_writes, blocked))
    conn.recv()
    mgr.teardown()
    os._exit(0)


def run_pair(cfg: dict[str, Any], kill_prefill: bool = False,
             kill_decode: bool = False, targets: tuple[Any, Any] | None = None
             ) -> dict[str, Any]:
    """Start every rank at once (decode waits for the bootstrap registry), collect what each
    saw; always reap the children. `cfg["waves"]`: rooms per decode run; each run is a fresh
    set of decode processes (a restarted decode instance), started once the previous exited.
    `kill_decode`: SIGKILL the decode ranks once they sent their metadata, then let the
    prefill (`go_after`) write to them. `targets`: other (prefill, decode) rank functions
    (picklable, wrapping these)."""
    ctx = rank_context()
    cfg = {"bootstrap_port": free_port(), "http_port": free_port(), **cfg}
    cfg.setdefault("waves", [list(cfg["rooms"])])
    cfg["die_after_meta"] = kill_decode
    cfg["env"] = {"PDTOOL_FI_PROVIDER": cfg.get("provider", "shm"),
                  "PDTOOL_SECRET": "t0p-secret-of-16+bytes",
                  "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
                  "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
                  "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60", **cfg.get("extra_env", {})}
    procs, pre = [], []

    def start(target: Any, c: dict[str, Any], r: int) -> tuple[Any, Any]:
        a, b = ctx.Pipe()
        p = ctx.Process(target=target, args=(c, r, b), daemon=True)
        p.start()
        procs.append(p)
        return p, a

    try:
        pre_fn, dec_fn = targets or (prefill_rank, decode_rank)
        for r in range(cfg["prefill_tp"]):
            pre.append(start(pre_fn, cfg, r))
        dec_out, dec = [], []
        for wave in cfg["waves"]:
            run_cfg = {**cfg, "rooms": {room: cfg["rooms"][room] for room in wave}}
            dec = [start(dec_fn, run_cfg, r) for r in range(cfg["decode_tp"])]
            if not dec_out:
                for _, a in pre:
                    assert a.poll(cfg.get("start_s", 180)), "prefill rank did not start"
                    assert a.recv() == "ready"
            if kill_prefill:
                for p, a in pre:
                    assert a.poll(120) and a.recv()[0] == "waiting"
                    os.kill(p.pid, signal.SIGKILL)
                    p.join(10)
            if kill_decode:
                for p, a in dec:
                    assert a.poll(120) and a.recv()[0] == "sent"
                    os.kill(p.pid, signal.SIGKILL)
                    p.join(10)
            if cfg.get("go_after") and not kill_decode:
                dec_out += [a.recv() for _, a in dec if a.poll(180)]
            if cfg.get("go_after"):
                for _, a in pre:
                    assert a.poll(120) and a.recv()[0] == "waiting"
                    a.send("go")
            if not kill_decode and not cfg.get("go_after"):
                for _, a in dec:
                    assert a.poll(180), "decode rank did not finish"
                    dec_out.append(a.recv())
            if len(cfg["waves"]) > 1:  # this decode run exits before the next one starts
                for p, a in dec:
                    with contextlib.suppress(OSError):
                        a.send("bye")
                    p.join(20)
        pre_out = [] if kill_prefill else [a.recv() for _, a in pre if a.poll(180)]
        for _, a in pre + ([] if kill_decode else dec):
            with contextlib.suppress(OSError):
                a.send("bye")
        return {"prefill": pre_out, "decode": dec_out, "pids": [p.pid for p in procs]}
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join(5)
        from transfer.fabric import shm_leftovers

        for f in shm_leftovers([p.pid for p in procs]):  # a SIGKILLed shm peer leaves one
            with contextlib.suppress(OSError):
                os.unlink(f)


def expected_decode(cfg: dict[str, Any], rank: int, room: int) -> list[np.ndarray]:
    """What decode rank `rank` must hold in each buffer's destination pages after `room`."""
    req = cfg["rooms"][room]
    glob = global_buffers(cfg["mla"], cfg["heads"], cfg.get("draft"))
    out = []
    for g, hs in zip(glob, buffer_heads(cfg, cfg["decode_tp"], rank), strict=True):
        pages = g[:, hs].reshape(SLOTS // PAGE, PAGE, *g[:, hs].shape[1:])
        out.append(pages[np.asarray(req["src_pages"])])
    return out


def check_bytes(cfg: dict[str, Any], res: dict[str, Any]) -> None:
    for rank, (tag, out, bufs, aux, _writes, _stale, _blocked) in enumerate(res["decode"]):
        assert tag == "done"
        for room, req in cfg["rooms"].items():
            assert out[room]["states"][-1] == 4, out[room]  # KVPoll.Success
            # every prefill rank answered the registration with the grouping both can do
            assert set(out[room]["per_op"]) == {PER_OP}, out[room]
            for buf, want in zip(bufs, expected_decode(cfg, rank, room), strict=True):
                got = buf.reshape(SLOTS // PAGE, PAGE, *buf.shape[1:])[req["dst_pages"]]
                assert np.array_equal(got, want), f"room {room} rank {rank}: pages differ"
            for j, (data, ilen) in enumerate(aux):
                row = req["dst_aux"]
                assert data[row * ilen: (row + 1) * ilen] == aux_row(j, ilen), f"aux {j}"


#: two requests' pages: scattered, non-monotonic, chunked
ROOMS = {
    # scattered, non-monotonic pages; chunked prefill sends 3 pages at a time
    11: {"src_pages": [3, 9, 4, 12, 5, 1, 7], "dst_pages": [14, 2, 8, 6, 1, 11, 10],
         "aux_index": 2, "dst_aux": 5, "chunk": 3},
    12: {"src_pages": [0, 15], "dst_pages": [3, 4], "aux_index": 6, "dst_aux": 0, "chunk": 2},
}


#: the worker environment that sends the backend down its staged path (bounce buffers)
STAGED_ENV = {workerenv.GPU_MEMORY.name: "staged"}


def plan_ops(cfg: dict[str, Any], rank: int, pages: int, per_op: int = PER_OP) -> int:
    """What the geometry owner (and so `pdtool plan`) counts for this decode rank."""
    return geometry.sglang_decode_writes(
        is_mla=cfg["mla"], total_heads=cfg["heads"], prefill_tp=cfg["prefill_tp"],
        decode_tp=cfg["decode_tp"], decode_rank=rank, page_size=PAGE, num_pages=pages,
        num_buffers=(1 if cfg["mla"] else 2) * LAYERS, num_aux=N_AUX,
        writes_per_op=per_op)
