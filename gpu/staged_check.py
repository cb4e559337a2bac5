"""KV pages in CUDA memory between two processes on one GPU over shm, on the staged path.

Run by gpu/check.sh (which builds the libfabric binding first); `--cpu` runs the same code on
CPU tensors (the "device" copies are host copies), which is how it is checked without a GPU.

What it does, each step printed as one line and collected in a JSON summary:
  1. direct refused: an Endpoint with FI_HMEM registering CUDA memory fails with the message
     naming transfer.gpu_memory and the cause (this libfabric has no CUDA); the CUDA pointer
     check accepts a cudaMalloc tensor and refuses host memory.
  2. baselines: device->device (cudaMemcpy through torch) and device->host->device through
     pinned memory, for the same bytes.
  3. staged: a decode process arms a slot and reserves landing memory; a prefill process on
     the same GPU sends its KV pages layer by layer through bounce buffers (StagedSender);
     the decoder counts the operations, copies host->device and checks every byte against
     the prefill's pages (regenerated from the same seed). GB/s from the send's start to the
     pages being in the decoder's GPU memory.
Exit status 0 only when every check held.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

WAIT_S = 120.0


def kv_tensor(device: str, nbytes: int, seed: int) -> Any:
    """The prefill's KV buffer: deterministic bytes, so the decoder can regenerate them."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Which pages go where: a random subset of the prefill's pages to random decoder pages,
    grouped by layer (layers x pages_per_layer pages of page_bytes)."""
    rng = np.random.default_rng(args.seed)
    total = args.layers * args.pages
    n = total * 3 // 4
    return {"src": rng.choice(total, n, replace=False).tolist(),
            "dst": rng.choice(total, n, replace=False).tolist()}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def decode_proc(args: argparse.Namespace, conn: Any) -> None:
    import torch

    from transfer.fabric import Endpoint
    from transfer.staging import LandingPool

    dev = args.device
    p = plan(args)
    nbytes = args.layers * args.pages * args.page_bytes
    kv = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    ep = Endpoint("shm", max_slots=64)
    n = len(p["dst"])
    lengths = np.full(n, args.page_bytes, np.uint64)
    pages_per_block = max(1, args.block_bytes // args.page_bytes)
    landing = LandingPool(ep, capacity_bytes=-(-n // pages_per_block) * args.block_bytes,
                          block_bytes=args.block_bytes, device=dev)
    expect_src = kv_tensor(dev, nbytes, args.seed).view(-1, args.page_bytes)
    expect = expect_src[torch.as_tensor(p["src"], device=dev)]
    conn.send(ep.name)
    results = []
    for it in range(args.iterations):
        grant = landing.reserve(lengths)
        ep.arm(1, it + 1)
        kv.zero_()
        _sync(dev)
        conn.send((grant.region.to_dict(), grant.dst_offsets.tolist()))
        want, t0 = conn.recv()
        reached = ep.wait_recv(1, want, WAIT_S)
        t_counted = time.monotonic()
        landing.deliver(grant, kv, np.array(p["dst"], np.uint64) * np.uint64(args.page_bytes))
        t1 = time.monotonic()
        landing.release(grant)
        got = kv.view(-1, args.page_bytes)[torch.as_tensor(p["dst"], device=dev)]
        results.append({"reached": bool(reached), "count": int(ep.recv_counts[1]),
                        "want": want, "exact": bool(torch.equal(got, expect)),
                        "seconds": t1 - t0, "counted_s": t_counted - t0,
                        "deliver_s": t1 - t_counted, "stale": ep.stale_writes})
    conn.send(results)
    conn.recv()
    landing.close()
    ep.close()


def prefill_proc(args: argparse.Namespace, conn: Any) -> None:
    from transfer.fabric import Endpoint, RemoteRegion, encode_imm
    from transfer.staging import BouncePool, Chunk, StagedSender

    dev = args.device
    p = plan(args)
    nbytes = args.layers * args.pages * args.page_bytes
    kv = kv_tensor(dev, nbytes, args.seed)
    _sync(dev)
    ep = Endpoint("shm", max_slots=64)
    pool = BouncePool(ep, buffers=args.buffers, buffer_bytes=args.buffer_bytes, device=dev)
    sender = StagedSender(ep, pool, timeout=WAIT_S)
    peer = ep.insert_peer(conn.recv())
    src = np.array(p["src"], np.int64)
    layer_of = src // args.pages
    for _ in range(args.iterations):
        region, offsets = conn.recv()
        offsets = np.array(offsets, np.uint64)
        chunks = []
        for layer in range(args.layers):  # one chunk per layer, as a forward pass finishes them
            sel = np.flatnonzero(layer_of == layer)
            chunks.append(Chunk(kv, src[sel].astype(np.uint64) * np.uint64(args.page_bytes),
                                np.full(len(sel), args.page_bytes, np.uint64), offsets[sel]))
        want = sum(-(-len(c.lengths) // args.per_op) for c in chunks)
        t0 = time.monotonic()
        conn.send((want, t0))
        ops = sender.send(peer, RemoteRegion.from_dict(region), chunks, imm=encode_imm(1, _ + 1),
                          per_op=args.per_op)
        sender.flush()
        assert ops == want, (ops, want)
    conn.send({"peak_buffers": pool.in_use_peak, "pool_bytes": pool.allocated_bytes,
               "errors": ep.errors})
    conn.recv()
    sender.close()
    pool.close()
    ep.close()


def baselines(args: argparse.Namespace, nbytes: int) -> dict[str, float]:
    """GB/s of a device->device copy and a device->host->device copy of `nbytes`."""
    import torch

    dev = args.device
    a = kv_tensor(dev, nbytes, 1)
    b = torch.empty_like(a)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.startswith("cuda"))

    def best(fn: Any) -> float:
        times = []
        for _ in range(max(args.iterations, 3)):
            _sync(dev)
            t = time.perf_counter()
            fn()
            _sync(dev)
            times.append(time.perf_counter() - t)
        return nbytes / min(times) / 1e9

    d2d = best(lambda: b.copy_(a))
    d2h2d = best(lambda: (host.copy_(a), b.copy_(host)))
    assert torch.equal(a, b)
    return {"d2d_gbs": round(d2d, 2), "d2h2d_gbs": round(d2h2d, 2)}


def check_direct_refused(args: argparse.Namespace) -> dict[str, Any]:
    """transfer.gpu_memory=direct on this libfabric: refused, with the key and the cause."""
    import torch

    from transfer.fabric import (
        Endpoint,
        GpuMemoryError,
        build_features,
        check_cuda_pointer,
        gpu_direct_support,
    )

    out: dict[str, Any] = {"build_features": build_features()}
    buf = torch.zeros(1 << 20, dtype=torch.uint8, device=args.device)
    with Endpoint("shm", hmem=True) as ep:
        out["offers_hmem"] = ep.offers_hmem
        try:
            ep.register(buf.data_ptr(), buf.numel(), iface="cuda",
                        device=buf.device.index or 0)
            out["direct_refused"] = False
        except GpuMemoryError as exc:
            out["direct_refused"] = "transfer.gpu_memory" in str(exc)
            out["direct_message"] = str(exc)
    out["gpu_direct_support"] = list(gpu_direct_support("shm"))
    if args.device.startswith("cuda"):
        try:  # a cudaMalloc tensor of the right GPU passes the pointer check
            check_cuda_pointer(buf.data_ptr(), buf.numel(), buf.device.index or 0)
            out["device_pointer_accepted"] = True
        except GpuMemoryError as exc:
            out["device_pointer_accepted"] = False
            out["device_pointer_message"] = str(exc)
        host = torch.zeros(1 << 20, dtype=torch.uint8)
        try:
            check_cuda_pointer(host.data_ptr(), host.numel(), 0)
            out["host_pointer_refused"] = False
        except GpuMemoryError as exc:
            out["host_pointer_refused"] = "not CUDA device memory" in str(exc)
        out["expandable_segments"] = expandable_segments_refused()
    else:
        try:
            check_cuda_pointer(buf.data_ptr(), buf.numel(), 0)
            out["host_pointer_refused"] = False
        except GpuMemoryError as exc:  # no CUDA driver here, or not device memory
            out["host_pointer_refused"] = "transfer.gpu_memory" in str(exc)
            out["pointer_message"] = str(exc)
    return out


def expandable_segments_refused() -> str:
    """The pointer check on a tensor from PyTorch's expandable segments (CUDA VMM), in a
    process of its own (the allocator setting is read once per process): the message."""
    import subprocess

    code = ("import torch\nfrom transfer.fabric import check_cuda_pointer, GpuMemoryError\n"
            "t = torch.zeros(64 << 20, dtype=torch.uint8, device='cuda:0')\n"
            "try:\n    check_cuda_pointer(t.data_ptr(), t.numel(), 0)\n    print('ACCEPTED')\n"
            "except GpuMemoryError as e:\n    print(e)\n")
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    return (r.stdout + r.stderr).strip()[-600:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="CPU tensors (no GPU needed)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pages", type=int, default=256, help="pages per layer in each KV")
    ap.add_argument("--page-bytes", type=int, default=128 << 10)
    ap.add_argument("--per-op", type=int, default=4)
    ap.add_argument("--buffers", type=int, default=4)
    ap.add_argument("--buffer-bytes", type=int, default=16 << 20)
    ap.add_argument("--block-bytes", type=int, default=16 << 20)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", type=Path, help="write the summary here too")
    args = ap.parse_args()
    args.device = "cpu" if args.cpu else "cuda:0"
    import torch

    summary: dict[str, Any] = {"device": args.device, "torch": torch.__version__}
    if not args.cpu:
        summary["gpu"] = torch.cuda.get_device_name(0)
    summary["direct"] = check_direct_refused(args)
    print(f"direct: refused={summary['direct']['direct_refused']}: "
          f"{summary['direct'].get('direct_message', '')}", flush=True)
    moved = len(plan(args)["src"]) * args.page_bytes
    summary["baseline"] = baselines(args, moved)
    print(f"baseline ({moved / 2**20:.0f} MiB): {summary['baseline']}", flush=True)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=decode_proc, args=(args, pipes[0][1])),
             ctx.Process(target=prefill_proc, args=(args, pipes[1][1]))]
    for p in procs:
        p.start()
    dec, pre = pipes[0][0], pipes[1][0]

    def recv(conn: Any) -> Any:
        """The next message, or SystemExit as soon as either process died."""
        deadline = time.monotonic() + WAIT_S
        while not conn.poll(0.2):
            dead = [p.exitcode for p in procs if p.exitcode is not None]
            if dead:
                raise SystemExit(f"CHECK FAILED: a transfer process exited with {dead[0]}")
            if time.monotonic() > deadline:
                raise SystemExit("CHECK FAILED: no answer from the transfer processes")
        return conn.recv()

    try:
        pre.send(recv(dec))                  # the decoder's fabric name
        for _ in range(args.iterations):
            pre.send(recv(dec))              # landing region + offsets
            dec.send(recv(pre))              # expected operations + start time
        runs = recv(dec)
        sender = recv(pre)
        for c in (dec, pre):
            c.send("done")
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    gbs = [moved / r["seconds"] / 1e9 for r in runs]
    summary["staged"] = {
        "bytes": moved, "runs": runs, "gbs_best": round(max(gbs), 2),
        "gbs_median": round(statistics.median(gbs), 2), **sender,
        "buffers": args.buffers, "buffer_bytes": args.buffer_bytes,
    }
    direct = summary["direct"]
    ok = (direct["direct_refused"] and direct["host_pointer_refused"]
          and direct.get("device_pointer_accepted", True)
          and "virtual-memory-managed" in direct.get("expandable_segments",
                                                      "virtual-memory-managed")
          and all(r["reached"] and r["exact"] and r["count"] == r["want"] and r["stale"] == 0
                  for r in runs)
          and sender["peak_buffers"] <= args.buffers and not sender["errors"])
    summary["ok"] = bool(ok)
    print(f"staged over shm: {summary['staged']['gbs_best']} GB/s best, "
          f"{summary['staged']['gbs_median']} median; d2d {summary['baseline']['d2d_gbs']}, "
          f"d2h2d {summary['baseline']['d2h2d_gbs']} GB/s; byte-exact and counted: "
          f"{all(r['exact'] and r['count'] == r['want'] for r in runs)}", flush=True)
    text = json.dumps(summary, indent=2, default=str)
    if args.json:
        args.json.write_text(text)
    print(text)
    print("CHECK " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
