"""Two steps of gpu/check.py on the reference engine's GPU path (`--cpu`: the same code on CPU
tensors, which is what CI runs).

  paged_decode: a "prefill" process holds two TP shards (2 KV heads each) of HND pages
     `[pages, 2, heads, page, dim]` and writes decode rank 0's pages (4 heads, TP1) over shm
     with `transfer.layout.write_plan`: two writes per page and source shard (its K run and
     its V run), counted by the decoder. The decoder checks the bytes; on a GPU it maps the
     pages into the device (`transfer.cudahost`) and runs torch's paged decode
     (`attention.paged_decode_torch`, HND) over the very bytes the fabric wrote, against the
     same decode in float64 on the CPU.
  graph_progress: a prefill forward pass of the tiny model (8 layers, wide enough that a layer
     takes a while) captured in a CUDA graph and replayed `replays` times with fresh tokens
     each time; a watcher thread polls the progress word the GPU stream writes after each
     layer's output projection and, the moment it reports layer L, copies layer L's pages
     (host-mapped, as the messenger would send them). Checks: each replay's word goes through
     its layers in order, spread over the replay (first to last report at least 30 % of its
     time: a word seen only after the graph ended comes as one burst), and every copy equals
     that layer's final bytes of the same replay (a word visible before its KV shows up as a
     stale copy). On the first layer report it also sends layer 0's pages to a decode
     endpoint, counted and checked.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WAIT_S = 120.0
HEADS, SHARDS, PAGE, DIM, PAGES = 4, 2, 16, 64, 64


# --------------------------------------------------------------------------- 1. fabric
def _global_pages(seed: int) -> Any:
    """Every head's HND pages [PAGES, 2, HEADS, PAGE, DIM], fp16, from a seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn((PAGES, 2, HEADS, PAGE, DIM), generator=g).to(torch.float16)


def _plan(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = PAGES * 3 // 4
    return rng.choice(PAGES, n, replace=False), rng.choice(PAGES, n, replace=False)


def _prefill_proc(args: argparse.Namespace, conn: Any) -> None:
    from transfer.fabric import Endpoint, RemoteRegion, encode_imm
    from transfer.hostmem import host_buffer
    from transfer.layout import KVLayout, write_plan
    from transfer.routes import ShardSpec, routes_for

    full = _global_pages(args.seed)
    src_pages, dst_pages = _plan(args.seed)
    src, dst = ShardSpec(HEADS, SHARDS), ShardSpec(HEADS, 1)
    shards = []
    for r in range(SHARDS):
        hs = src.heads_of(r)
        t = full[:, :, hs.start:hs.stop].contiguous()
        shards.append(host_buffer(tuple(t.shape), t.dtype).copy_(t))
    ep = Endpoint(args.provider, max_slots=8)
    mrs = [ep.register_buffer(t) for t in shards]
    name, region, dst_layout = conn.recv()
    peer = ep.insert_peer(name)
    remote = RemoteRegion.from_dict(region)
    d_lay = KVLayout.from_dict(dst_layout)
    ops = 0
    for sl in routes_for(src, dst, 0, rng=None):
        s_lay = KVLayout.from_tensor(shards[sl.src_rank], "HND")
        so, do, ln = write_plan(s_lay, d_lay, src_pages, dst_pages, sl)
        ops += ep.write_batch(peer, mrs[sl.src_rank], remote, so, do, ln, encode_imm(1, 1),
                              tag=1, per_op=1, timeout=WAIT_S)
    ep.wait_send(1, ops, WAIT_S)
    conn.send({"ops": ops, "writes_per_page": ops // (len(src_pages) * SHARDS),
               "errors": ep.errors})
    conn.recv()
    ep.close()


def step_paged_decode(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pdtool.engines.reference.attention import paged_decode_torch, paged_kv_csr
    from transfer.fabric import Endpoint
    from transfer.geometry import expected_writes
    from transfer.hostmem import host_buffer
    from transfer.layout import KVLayout
    from transfer.routes import ShardSpec, routes_for

    src_pages, dst_pages = _plan(args.seed)
    kv = host_buffer((PAGES, 2, HEADS, PAGE, DIM), torch.float16)
    lay = KVLayout.from_tensor(kv, "HND")
    src, dst = ShardSpec(HEADS, SHARDS), ShardSpec(HEADS, 1)
    want = expected_writes(routes_for(src, dst, 0, rng=None), src, dst, layout=lay.pool,
                           page_size=PAGE, num_pages=len(src_pages), num_layers=1)
    ep = Endpoint(args.provider, max_slots=8)
    mr = ep.register_buffer(kv)
    ep.arm(1, 1)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_prefill_proc, args=(args, child))
    proc.start()
    try:
        parent.send((ep.name, mr.descriptor().to_dict(), lay.to_dict()))
        reached = ep.wait_recv(1, want, WAIT_S)
        sender = parent.recv() if parent.poll(WAIT_S) else {"ops": -1}
        parent.send("done")
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
    full = _global_pages(args.seed)
    exact = bool(torch.equal(kv[torch.as_tensor(dst_pages)], full[torch.as_tensor(src_pages)]))
    out: dict[str, Any] = {"expected_writes": want, "received": int(ep.recv_counts[1]),
                           "reached": bool(reached), "sender": sender, "exact": exact}
    # a decode batch over the pages that arrived: request b reads a run of them
    g = torch.Generator().manual_seed(args.seed + 1)
    lens = [1, PAGE, PAGE + 3, 5 * PAGE - 1, 9 * PAGE + 7]
    table = torch.zeros(len(lens), max(math.ceil(n / PAGE) for n in lens), dtype=torch.long)
    at = 0
    for b, n in enumerate(lens):
        k = math.ceil(n / PAGE)
        table[b, :k] = torch.as_tensor(dst_pages[at:at + k])
        at += k
    kv_len = torch.tensor(lens)
    q_heads = 8  # GQA group 2
    q = torch.randn(len(lens), q_heads, DIM, generator=g).to(torch.float16)
    csr = paged_kv_csr(table, kv_len, PAGE)
    ref_cpu = paged_decode_torch(q.double(), kv, *csr)
    out["torch_reference_rows"] = len(lens)
    ok = reached and exact and sender.get("ops") == want and bool(torch.isfinite(ref_cpu).all())
    if not args.cpu:
        from transfer.cudahost import device_alias

        pages_gpu = device_alias(kv)  # the very bytes the fabric wrote, read by the GPU
        got = paged_decode_torch(q.cuda().float(), pages_gpu.float(),
                                 *(t.cuda() for t in csr)).double().cpu()
        err = float((got - ref_cpu).abs().max())
        out.update(gpu_vs_fp64_max_abs_err=err)
        ok = ok and err < 1e-3
    out["ok"] = bool(ok and sender.get("writes_per_page") == 2)
    mr.close()
    ep.close()
    return out


# --------------------------------------------------------------------------- 2. graph progress
class _ReportsAhead:
    """A progress writer that reports each layer one early: what a word visible before its
    layer's KV looks like to the watcher (`--report-ahead`, tests/test_gpu_check.py)."""

    def __init__(self, inner: Any, layers: int) -> None:
        self.inner, self.layers = inner, layers

    def layer_done(self, layer: int) -> None:
        self.inner.layer_done(min(layer + 1, self.layers - 1))


def step_graph_progress(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pdtool.engines.reference.cache import PagedKV
    from pdtool.engines.reference.model import Batch, TinyConfig, TinyModel
    from transfer.fabric import Endpoint, encode_imm
    from transfer.progress import LAYER_MASK, PASS_SHIFT, HostLayerStore

    # --cpu: the same watcher and writes around a plain CPU forward whose progress word gets
    # the GPU writer's store made from the host (no graph, no mapping)
    dev = "cpu" if args.cpu else "cuda"
    layers, tokens, per_op = 8, (256 if args.cpu else 4096), 4  # ~10 ms a layer on an H200
    width = 256 if args.cpu else 2048
    cfg = TinyConfig(num_layers=layers, hidden=width, num_q_heads=16, num_kv_heads=4,
                     head_dim=128, intermediate=4 * width, dtype="float32", kv_dtype="float16")
    kv = PagedKV(cfg, cfg.num_kv_heads, tokens // PAGE + 1, PAGE, "HND", device=dev)
    model = TinyModel(cfg)
    if args.cpu:
        model.progress_writer = HostLayerStore(kv.progress)
    else:
        model.to_device("cuda", PAGE, kv.progress, flashinfer=False)  # prefill: torch's
    if args.report_ahead:  # the check's own test: a word ahead of its layer's KV must fail
        model.progress_writer = _ReportsAhead(model.progress_writer, layers)
    pages = list(range(tokens // PAGE))
    batch = Batch.build([(list(np.arange(tokens) % 256), 0, pages)], PAGE).to(
        torch.device(dev))
    # a decode endpoint the watcher writes layer 0's pages to, as the messenger would
    dec, pre = Endpoint(args.provider, max_slots=8), Endpoint(args.provider, max_slots=8)
    landing = torch.zeros_like(kv.buffers[0])
    d_mr, s_mr = dec.register_buffer(landing), pre.register_buffer(kv.buffers[0])
    peer = pre.insert_peer(dec.name)
    n = len(pages) * kv.page_bytes()
    so = np.arange(len(pages), dtype=np.uint64) * np.uint64(kv.page_bytes())
    ln = np.full(len(pages), kv.page_bytes(), np.uint64)
    if args.cpu:
        def replay() -> None:
            model.forward(batch, kv.layers, PAGE)

        def sync() -> None:
            pass
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (allocator, cuBLAS)
            for _ in range(2):
                model.forward(batch, kv.layers, PAGE)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model.forward(batch, kv.layers, PAGE)
        replay, sync = graph.replay, torch.cuda.current_stream().synchronize
    results = []
    want_ops = -(-len(pages) // per_op)
    gen = torch.Generator().manual_seed(args.seed)
    for it in range(1, args.replays + 1):
        # fresh tokens: every layer's KV differs from the replay before (copied into the
        # graph's own input tensor)
        batch.tokens.copy_(torch.randint(0, 256, (tokens,), generator=gen).to(dev))
        landing.zero_()
        dec.arm(1, it)
        got: dict[str, bool] = {}
        # the decode endpoint polls (on shm the receiver does the copies) while the watcher
        # writes: both endpoints live in this process
        rx = threading.Thread(target=lambda got=got: got.update(
            ok=dec.wait_recv(1, want_ops, WAIT_S)))
        rx.start()
        kv.progress.array[0] = (100 + it) << PASS_SHIFT  # PrefillMessenger.begin_pass
        seen: list[tuple[int, int]] = []
        snaps: dict[int, Any] = {}
        issued: dict[str, int] = {}

        def watch(it: int = it, seen: list = seen, snaps: dict = snaps,
                  issued: dict = issued) -> None:
            last, deadline = 0, time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                w = int(kv.progress.array[0])
                if w == last or (w >> PASS_SHIFT) != 100 + it:
                    continue
                seen.append((time.perf_counter_ns(), w))
                done = w & LAYER_MASK
                for layer in range(last & LAYER_MASK, done):  # newly reported: read them now
                    snaps[layer] = kv.buffers[layer].clone()
                last = w
                if done >= 1 and "ops" not in issued:
                    issued["ops"] = pre.write_batch(peer, s_mr, d_mr.descriptor(), so, so, ln,
                                                    encode_imm(1, it), tag=1, per_op=per_op,
                                                    timeout=WAIT_S)
                if done == layers:
                    return

        th = threading.Thread(target=watch)
        th.start()
        t0 = time.perf_counter_ns()
        replay()
        sync()
        t_end = time.perf_counter_ns()
        th.join(WAIT_S)
        rx.join(WAIT_S + 5)
        order = [w & LAYER_MASK for _, w in seen]
        stale = [layer for layer, snap in snaps.items()
                 if not torch.equal(snap, kv.buffers[layer])]
        results.append({
            "layers_seen": order, "monotone": order == sorted(order) and order[-1:] == [layers],
            # the reports spread over the replay (a word seen only once the graph ended
            # comes as one burst): first to last report against the replay's whole time
            "report_span": 0.0 if len(seen) < 2 else round(
                (seen[-1][0] - seen[0][0]) / max(1, t_end - t0), 3),
            "layers_read": len(snaps), "stale_layers": stale,
            "layer0_pages_arrived": bool(got.get("ok")) and issued.get("ops") == want_ops,
            "layer0_bytes_exact": bool(torch.equal(landing, kv.buffers[0])), "bytes": n})
    ok = all(r["monotone"] and r["layers_read"] == layers and not r["stale_layers"]
             and r["report_span"] >= 0.3
             and r["layer0_pages_arrived"] and r["layer0_bytes_exact"] for r in results)
    pre.close()
    dec.close()
    return {"ok": bool(ok), "run": "cpu emulation (no graph)" if args.cpu
            else "cuda graph replay", "replays": len(results),
            "failed_replays": [r for r in results if not (
                r["monotone"] and not r["stale_layers"] and r["layer0_bytes_exact"])][:3],
            "first_replay": results[0] if results else None}


