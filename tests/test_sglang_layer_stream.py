"""Per-layer KV streaming (`transfer/sglang/layer_stream.py`) driven through SGLang 0.5.23's own
attention backend, KV pool and send path.

The prefill rank runs a chunked prefill of one request per room as SGLang's scheduler would:
the plugin's hooks applied by SGLang's `HookRegistry`, `TorchNativeAttnBackend` (SGLang's
CPU-capable backend, built from the pools as `ModelRunner` builds it) called through the real
`AttentionBackend.forward` per layer, its `forward_extend` writing K and V with the real
`MHATokenToKVPool.set_kv_buffer`, and after each forward SGLang's own
`_send_kv_chunk(req, ...)` (the scheduler's post-forward send) on a real `Req`. What stands
in: the scheduler object (the fields `_send_kv_chunk` and the plan read: pools, allocator,
metadata buffers, the prefill manager) and the model around the attention calls (q/k/v are
the test's data). The forward is launched through the plugin's `run_batch` hook.

Room 41 streams: between two layers the test waits until the first layer's writes are posted,
so an implementation that posts only after the forward never gets there. Room 42 is the
captured-graph fallback: its forwards write the pool without an attention call, nothing streams,
and the post-forward sends carry it all. Both land byte-exact on a real decode rank over shm,
counted as `geometry.sglang_decode_writes` says.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
import types
from array import array
from typing import Any

import numpy as np
import pytest
import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)
from helpers.sglang_pair import (
    HEAD_DIM,
    LAYERS,
    N_AUX,
    PAGE,
    PER_OP,
    SLOTS,
    decode_rank,
    expected_decode,
    poll_until,
    run_pair,
    setup_rank,
)

from transfer.geometry import sglang_decode_writes

pytestmark = [pytest.mark.fabric, pytest.mark.sglang]

HEADS = 2
# two rooms on disjoint pages of both pools (16 each); prompts end 2 tokens into a page
ROOMS = {
    # streamed: chunk 1 ends in page 4 (sent in chunk 2), chunk 2 is the last
    41: {"src_pages": [3, 9, 4, 12, 5, 1, 7, 14, 2, 8, 6],
         "dst_pages": [14, 2, 8, 6, 1, 11, 10, 0, 3, 4, 9],
         "aux_index": 2, "dst_aux": 5, "chunk": 0, "prompt": 42, "chunks": [(0, 19), (19, 42)]},
    # no attention callbacks: per chunk
    42: {"src_pages": [0, 15, 10, 11, 13], "dst_pages": [7, 5, 12, 13, 15],
         "aux_index": 6, "dst_aux": 0, "chunk": 0, "prompt": 18, "chunks": [(0, 9), (9, 18)]},
}
#: operations each layer of room 41 streams per chunk: one of its K and one of its V buffer
#: (PER_OP planned pages each: chunk 1 pages 0-3, chunk 2 pages 4-7; pages 8-10 wait for the
#: last chunk's post-forward send, which closes the partial operation)
LAYER_OPS = [2 * 1, 2 * 1]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _layers_forward(st: Any, fb: Any, lo: int, hi: int, loc: Any, per_layer: int,
                    _sched: Any, _batch: Any) -> None:
    """The model forward around the attention calls: per layer, the real backend's forward
    (which writes that layer's K and V) and, when streaming, a wait until that layer's
    writes were posted; without streaming a captured graph's replay (the pool is written, no
    attention call runs Python)."""
    import torch

    base = st.ops_now()
    for i, layer in enumerate(st.layers):
        q = torch.randn(hi - lo, HEADS * HEAD_DIM, dtype=torch.bfloat16)
        k, v = st.kv_in[i][lo:hi], st.kv_in[LAYERS + i][lo:hi]
        st.order.append(("attn", i, st.ops_now() - base))
        if st.stream:
            st.backend.forward(q, k, v, layer, fb)  # the real base-class dispatch
            if st.late is None:
                st.wait_ops(base + per_layer * (i + 1))
                st.order.append(("posted", i, st.ops_now() - base))
        else:
            st.pool.set_kv_buffer(layer, loc, k, v)


def stream_prefill(cfg: dict[str, Any], rank: int, conn: Any) -> None:
    os.environ.update(cfg["env"])
    import torch
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.sampling.sampling_params import SamplingParams

    from transfer.sglang import layer_stream, plugin
    from transfer.sglang.conn import PdtoolKVBootstrapServer, PdtoolKVManager, PdtoolKVSender

    lines = _Lines()
    logging.getLogger("transfer.sglang.layer_stream").addHandler(lines)
    logging.getLogger("transfer.sglang.layer_stream").setLevel(logging.INFO)
    plugin.register()  # what SGLang's load_plugins runs, then applies the hooks
    HookRegistry.apply_hooks()
    hooked = getattr(AttentionBackend.forward, "__wrapped__", None) is not None

    server = PdtoolKVBootstrapServer("127.0.0.1", cfg["bootstrap_port"])
    sa, args, (pool, meta, bufs), aux = setup_rank("prefill", cfg, 0)
    mgr = PdtoolKVManager(args, DisaggregationMode.PREFILL, sa, False)
    conn.send("ready")
    addr = f"127.0.0.1:{cfg['bootstrap_port']}"
    senders = {room: PdtoolKVSender(mgr, addr, room) for room in cfg["rooms"]}
    poll_until(senders, lambda st: st != KVPoll.Bootstrapping, 60)

    # SGLang's pieces as ModelRunner wires them (CPU): the request->token map, the paged
    # allocator over the pool, the attention backend reading both, one RadixAttention a layer
    r2t = ReqToTokenPool(size=4, max_context_len=SLOTS, device="cpu", enable_memory_saver=False)
    alloc = PagedTokenToKVPoolAllocator(SLOTS - PAGE, PAGE, torch.bfloat16, "cpu", pool, False)
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=r2t, token_to_kv_pool=pool)
    backend = TorchNativeAttnBackend(runner)
    layers = [RadixAttention(HEADS, HEAD_DIM, HEAD_DIM ** -0.5, HEADS, i) for i in range(LAYERS)]
    sched = types.SimpleNamespace(  # what run_batch's plan and _send_kv_chunk read
        token_to_kv_pool_allocator=alloc, req_to_token_pool=r2t, enable_staging=False,
        server_args=sa, disagg_prefill_bootstrap_queue=types.SimpleNamespace(kv_manager=mgr),
        disagg_metadata_buffers=meta, disagg_prefill_pending_chunk_rids=set())
    ops_now = lambda: sum(mgr.plane.rail_ops)  # noqa: E731  operations this rank posted

    def wait_ops(n: int) -> bool:
        deadline = time.time() + 20
        while ops_now() < n and time.time() < deadline:
            time.sleep(0.001)
        return ops_now() == n

    report: dict[int, Any] = {}
    for slot, (room, req_cfg) in enumerate(cfg["rooms"].items(), start=1):
        stream = req_cfg["stream"]
        # a late room: its layer parts wait (as behind a slow layer thread or CUDA event)
        # until the writer planned the chunk SGLang sends after the forward
        late: list[threading.Event] | None = [] if req_cfg.get("late") else None
        if late is not None:
            layer_stream._marker = lambda _on_cuda, late=late: types.SimpleNamespace(
                synchronize=late[-1].wait)
        src = np.asarray(req_cfg["src_pages"])
        prompt, pages = req_cfg["prompt"], len(src)
        slots = (src[:, None] * PAGE + np.arange(PAGE)).reshape(-1)[:prompt]
        r2t.req_to_token[slot, :prompt] = torch.from_numpy(slots)
        # the forward must write the prompt's KV: what the pool holds there now is its input
        kv_in = [b[torch.from_numpy(slots)].clone() for b in bufs]
        for b in bufs:
            b[torch.from_numpy(slots)] = 0
        req = Req(f"r{room}", "", array("q", range(prompt)), SamplingParams(max_new_tokens=1))
        req.kv.req_pool_idx = slot
        req.metadata_buffer_index = req_cfg["aux_index"]
        sender = senders[room]
        req.disagg_kv_sender = sender
        sender.init(pages, req_cfg["aux_index"])  # as finalize_bootstrap (no decode prefix)
        order: list[tuple[str, int, int]] = []
        after_forward, after_send = [], []
        for c, (lo, hi) in enumerate(req_cfg["chunks"]):
            req.prefix_len, req.extend_end = lo, hi
            n = hi - lo
            loc = torch.from_numpy(slots[lo:hi])
            fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=1,
                              input_ids=torch.zeros(n, dtype=torch.int64),
                              req_pool_indices=torch.tensor([slot]),
                              seq_lens=torch.tensor([hi]), out_cache_loc=loc, seq_lens_sum=hi,
                              extend_prefix_lens=torch.tensor([lo]),
                              extend_seq_lens=torch.tensor([n]))
            backend.init_forward_metadata(fb)
            batch = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=[req])
            per_layer = LAYER_OPS[c]

            forward = functools.partial(_layers_forward, types.SimpleNamespace(
                stream=stream, kv_in=kv_in, order=order, backend=backend, layers=layers,
                pool=pool, ops_now=ops_now, wait_ops=wait_ops, late=late), fb, lo, hi, loc,
                per_layer)
            start_ops = ops_now()
            if late is not None:
                late.append(threading.Event())
            plugin.run_batch_hook(forward, sched, batch)
            time.sleep(0.2)  # anything a layer part would still post
            after_forward.append(ops_now() - start_ops)
            last = hi == prompt
            if last:
                req.output_ids.append(7)  # the sampled token set_buf copies
            SchedulerDisaggregationPrefillMixin._send_kv_chunk(sched, req, last_chunk=last)
            if late is not None:  # the chunk's writes posted, then its layer parts come
                wait_ops(start_ops + 1)
                late[-1].set()
            poll_until({room: sender}, lambda st, last=last: not last or st in (
                KVPoll.Success, KVPoll.Failed), 60)
            time.sleep(0.2)
            after_send.append(ops_now() - start_ops - after_forward[-1])
        report[room] = {"order": order, "after_forward": after_forward,
                        "after_send": after_send, "state": int(sender.poll())}
    conn.send(("done", report, {"hooked": hooked, "log": lines.lines, **mgr.stats()},
               [(ctypes.string_at(p, n), ilen) for p, n, ilen in aux]))
    conn.recv()
    mgr.teardown()
    del server
    os._exit(0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_layers_stream_during_the_forward_and_fall_back_without_callbacks() -> None:
    rooms = {41: {**ROOMS[41], "stream": True}, 42: {**ROOMS[42], "stream": False}}
    cfg = {"mla": False, "heads": HEADS, "prefill_tp": 1, "decode_tp": 1, "rooms": rooms}
    res = run_pair(cfg, targets=(stream_prefill, decode_rank))
    (_, report, stats, prefill_aux), = res["prefill"]
    (_, out, _bufs, dec_aux, remote_writes, stale, _), = res["decode"]
    assert stats["hooked"], "the plugin's hook is not on AttentionBackend.forward"
    assert {r: x["state"] for r, x in report.items()} == {41: 4, 42: 4}, report
    # the metadata row is the one SGLang's set_buf wrote on the prefill; KV as the forward wrote
    for req in rooms.values():
        row = req["dst_aux"]
        src_row = req["aux_index"]
        for (data, ilen), (pdata, _) in zip(dec_aux, prefill_aux, strict=True):
            assert data[row * ilen:(row + 1) * ilen] == pdata[src_row * ilen:(src_row + 1)
                                                                * ilen]
    check_bytes_kv(cfg, res)
    want = {room: sglang_decode_writes(
        is_mla=False, total_heads=HEADS, prefill_tp=1, decode_tp=1, decode_rank=0,
        page_size=PAGE, num_pages=len(req["src_pages"]), num_buffers=2 * LAYERS, num_aux=N_AUX,
        writes_per_op=PER_OP) for room, req in rooms.items()}
    assert {r: o["count"] for r, o in out.items()} == want
    assert remote_writes == sum(want.values()) and stale == 0

    # room 41: each layer's share was posted before the next layer's attention ran
    first, second = LAYER_OPS
    order = report[41]["order"]
    want_order = []
    for per_layer in (first, second):
        for i in range(LAYERS):
            want_order += [("attn", i, per_layer * i), ("posted", i, per_layer * (i + 1))]
    assert order == want_order, order
    # after the forward: nothing more; the post-forward sends post only the rest: nothing for
    # the first chunk, the last chunk's partial operation per buffer and the metadata rows
    assert report[41]["after_forward"] == [LAYERS * first, LAYERS * second]
    assert report[41]["after_send"] == [0, 2 * LAYERS + N_AUX]
    # room 42: no attention callback in its planned forwards: per chunk, logged once
    assert report[42]["after_forward"] == [0, 0]
    assert sum(report[42]["after_send"]) == want[42]
    assert stats["layer_fallbacks"] == 2 and stats["forwards_streamed"] == 2, stats
    assert stats["layer_parts"] == 2 * LAYERS, stats
    said = [x for x in stats["log"] if "no attention callback" in x]
    assert len(said) == 1, stats["log"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_layer_parts_after_their_chunk_write_nothing_twice() -> None:
    """The layer thread may fall behind the scheduler: a chunk's post-forward send reaches the
    writer before that forward's layer parts. Those pages must not be written again (the
    decoder counts operations: a second write of them failed the request on real servers)."""
    rooms = {43: {**ROOMS[41], "stream": True, "late": True}}
    cfg = {"mla": False, "heads": HEADS, "prefill_tp": 1, "decode_tp": 1, "rooms": rooms}
    res = run_pair(cfg, targets=(stream_prefill, decode_rank))
    (_, report, stats, _aux), = res["prefill"]
    (_, out, _bufs, _dec_aux, remote_writes, stale, _), = res["decode"]
    assert report[43]["state"] == 4, report
    check_bytes_kv(cfg, res)
    want = sglang_decode_writes(
        is_mla=False, total_heads=HEADS, prefill_tp=1, decode_tp=1, decode_rank=0,
        page_size=PAGE, num_pages=len(rooms[43]["src_pages"]), num_buffers=2 * LAYERS,
        num_aux=N_AUX, writes_per_op=PER_OP)
    assert out[43]["count"] == want and remote_writes == want and stale == 0
    # the forwards did stream: their layer parts reached the writer, and found nothing left
    assert stats["forwards_streamed"] == 2 and stats["layer_parts"] == 2 * LAYERS, stats
    assert report[43]["after_forward"] == [0, 0]


def check_bytes_kv(cfg: dict[str, Any], res: dict[str, Any]) -> None:
    """Every decode page byte-exact (the harness's expectation: the prefill pool's pages)."""
    for rank, (tag, out, bufs, *_rest) in enumerate(res["decode"]):
        assert tag == "done"
        for room, req in cfg["rooms"].items():
            assert out[room]["states"][-1] == 4, out[room]
            for buf, want in zip(bufs, expected_decode(cfg, rank, room), strict=True):
                got = buf.reshape(SLOTS // PAGE, PAGE, *buf.shape[1:])[req["dst_pages"]]
                bad = [i for i in range(len(got)) if not np.array_equal(got[i], want[i])]
                assert not bad, f"room {room}: pages at positions {bad} differ"


def test_switch_is_auto_on_off_and_a_bad_value_is_named() -> None:
    from transfer.sglang.layer_stream import enabled_for
    from transfer.workerenv import WorkerEnvError

    for value, host, cuda in ((None, True, False), ("auto", True, False), ("on", True, True),
                              ("off", False, False)):
        env = {} if value is None else {"PDTOOL_LAYER_STREAM": value}
        assert (enabled_for(False, env), enabled_for(True, env)) == (host, cuda), value
    with pytest.raises(WorkerEnvError, match="PDTOOL_LAYER_STREAM='yes'"):
        enabled_for(False, {"PDTOOL_LAYER_STREAM": "yes"})
