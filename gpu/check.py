"""The GPU check's steps, each in a process of its own under its own timeout.

`gpu/check.sh` builds the libfabric binding and runs this; `--cpu` runs every step that can run
without a GPU (CI does, `tests/test_gpu_check.py`) and records the others as not run. After
every step `OUT/summary.json` is rewritten, so a step that hangs, or a machine taken back
mid-run, still leaves the results of the steps before it. Exit status 0 only when every step
that ran held.

Steps (what each proves, and what would make it fail):
  mapped_aliasing   GPU only. Pinned host pages mapped into the GPU (transfer.cudahost, the
                    reference engine's KV) alias both ways: bytes the host writes are read by
                    a kernel, bytes a kernel writes are read by the host after a sync.
  pointer_checks    transfer.gpu_memory=direct on this libfabric: refused naming the key; the
                    CUDA pointer check accepts a cudaMalloc tensor and each fused K/V half of
                    one, refuses pinned host, managed and past-the-end memory; whether the
                    driver hands out dma-bufs for device memory (where it does, EFA at API <
                    1.20 would have refused FI_MR_DMABUF).
  paged_decode      HND pages written over the fabric by two TP shards into one decode rank,
                    counted and byte-exact; torch's paged decode over the very bytes (on a GPU
                    through their host mapping) against an fp64 CPU reference.
  graph_progress    the progress word under CUDA-graph replays (--replays, fresh tokens each
                    replay): the watcher sees the layers in order while the replay runs, and
                    a layer's pages read the moment the word reports it already hold this
                    replay's bytes (a word visible before its KV fails here).
  staged_transfer   KV pages in GPU memory between two processes over shm on the staged
                    path, byte-exact and counted, with GB/s beside device->device and
                    device->host->device copies of the same bytes.
  head_slice        the staged path's head-slice copies for a TP mismatch: heads of token
                    rows of an NHD buffer gathered into pinned memory and scattered back into
                    another buffer, byte-exact, every other head and row untouched.
  side_stream_markers
                    per-layer markers (the layer hook's) recorded on a side stream and waited
                    for by a thread: each layer read after its marker holds this pass's value,
                    in order, and on a GPU layer 0 is read while later layers still run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


@dataclass(frozen=True)
class Step:
    name: str
    timeout_s: int
    gpu_only: bool
    run: Callable[[argparse.Namespace], dict[str, Any]]


def _mapped_aliasing(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from transfer.cudahost import device_alias
    from transfer.hostmem import host_buffer

    host = host_buffer((1 << 20,), torch.uint8)
    host.copy_(torch.arange(1 << 20, dtype=torch.int64).remainder(251).to(torch.uint8))
    dev = device_alias(host)
    seen_on_gpu = bool(torch.equal(dev.cpu(), host))       # host wrote, the GPU reads
    dev[::2].fill_(7)                                      # a kernel writes
    torch.cuda.synchronize()
    seen_on_host = bool((host[::2] == 7).all()) and bool(torch.equal(
        host[1::2], torch.arange(1, 1 << 20, 2).remainder(251).to(torch.uint8)))
    return {"ok": seen_on_gpu and seen_on_host, "host_to_gpu": seen_on_gpu,
            "gpu_to_host": seen_on_host}


def _pointer_checks(args: argparse.Namespace) -> dict[str, Any]:
    from staged_check import check_direct_refused

    out = check_direct_refused("cpu" if args.cpu else "cuda:0")
    if args.cpu:
        out["ok"] = bool(out["direct_refused"] and out["host_pointer_refused"])
    else:  # this libfabric has no CUDA: direct is refused whatever the pointer
        out["ok"] = bool(out["direct_refused"] and all(out["accepted"].values())
                         and all(out["refused"].values()))
    return out


def _head_slice(args: argparse.Namespace) -> dict[str, Any]:
    """The staged path's head-slice copies (`transfer.staging._Copier`, as the SGLang backend
    uses them for a TP mismatch): heads [2, 6) of 100 token rows of an NHD buffer gathered into
    pinned memory, then scattered into another buffer, byte-exact, every other head and row
    untouched."""
    import numpy as np
    import torch

    from transfer.staging import _Copier

    dev = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    slots, heads, head_bytes, lo, n = 512, 8, 256, 2, 4
    g = torch.Generator().manual_seed(args.seed)
    src = torch.randint(0, 256, (slots, heads, head_bytes), dtype=torch.uint8, generator=g)
    dst0 = torch.randint(0, 256, (slots, heads, head_bytes), dtype=torch.uint8, generator=g)
    rows = torch.as_tensor(np.random.default_rng(args.seed).choice(slots, 100, replace=False),
                           dtype=torch.int64)
    out = torch.zeros(len(rows) * n * head_bytes, dtype=torch.uint8, pin_memory=not args.cpu)
    copier = _Copier(dev)
    copier.wait(copier.gather_slice(src.to(dev), rows, lo, n, out))
    packed = bool(torch.equal(out.view(len(rows), n, head_bytes), src[rows, lo:lo + n]))
    dst = dst0.to(dev)
    copier.scatter_slice(out.view(len(rows), n, head_bytes), dst, rows, lo, n)
    want = dst0.clone()
    want[rows, lo:lo + n] = src[rows, lo:lo + n]
    back = dst.cpu()
    others = torch.ones(slots, heads, dtype=torch.bool)
    others[rows, lo:lo + n] = False
    untouched = bool(torch.equal(back[others], dst0[others]))
    return {"ok": packed and bool(torch.equal(back, want)) and untouched,
            "packed_exact": packed, "scattered_exact": bool(torch.equal(back, want)),
            "other_heads_untouched": untouched}


def _side_stream_markers(args: argparse.Namespace) -> dict[str, Any]:
    """Per-layer markers (`sglang.layer_stream._marker`, what the layer hook records after a
    layer's attention) on a side stream, consumed by a thread the way the layer thread does:
    each marker waited for, then the layer's buffer read. Each read must be that layer's final
    value of this pass, and layer 0 must be read while later layers still run (a marker that
    completed only with the whole stream fails this)."""
    import queue
    import threading

    import torch

    from transfer.sglang.layer_stream import _marker

    layers, n, passes = 8, 1 << 20, 5
    dev = "cpu" if args.cpu else "cuda"
    bufs = [torch.zeros(n, device=dev) for _ in range(layers)]
    results = []
    for p in range(1, passes + 1):
        q: queue.Queue = queue.Queue()
        seen: list[tuple[int, bool, int]] = []

        def consume(q: queue.Queue = q, seen: list = seen, p: int = p) -> None:
            for _ in range(layers):
                i, marker = q.get()
                marker.synchronize()
                seen.append((i, bool((bufs[i].cpu() == p * 100 + i).all()),
                             time.perf_counter_ns()))

        th = threading.Thread(target=consume)
        th.start()

        def produce(q: queue.Queue = q, p: int = p) -> None:
            for i in range(layers):
                if not args.cpu:
                    torch.cuda._sleep(20_000_000)  # ~10 ms of a layer's compute
                bufs[i].fill_(p * 100 + i)
                q.put((i, _marker(not args.cpu)))

        if args.cpu:
            produce()
        else:
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                produce()
            side.synchronize()
        t_end = time.perf_counter_ns()
        th.join(60)
        results.append({"order": [i for i, _, _ in seen], "fresh": all(f for _, f, _ in seen),
                        "layer0_read_before_end": bool(seen) and seen[0][2] < t_end})
    ok = all(r["order"] == list(range(layers)) and r["fresh"] for r in results)
    if not args.cpu:  # on a CPU the producer ends before the thread reads: nothing overlaps
        ok = ok and all(r["layer0_read_before_end"] for r in results)
    return {"ok": bool(ok), "passes": results}


def _paged_decode(args: argparse.Namespace) -> dict[str, Any]:
    from check_reference import step_paged_decode

    return step_paged_decode(args)


def _graph_progress(args: argparse.Namespace) -> dict[str, Any]:
    from check_reference import step_graph_progress

    return step_graph_progress(args)


def _staged_transfer(args: argparse.Namespace) -> dict[str, Any]:
    from staged_check import run

    return run(cpu=args.cpu)


STEPS = (
    Step("mapped_aliasing", 45, True, _mapped_aliasing),
    Step("pointer_checks", 60, False, _pointer_checks),
    Step("paged_decode", 75, False, _paged_decode),
    Step("graph_progress", 110, False, _graph_progress),
    Step("staged_transfer", 100, False, _staged_transfer),
    Step("head_slice", 30, False, _head_slice),
    Step("side_stream_markers", 30, False, _side_stream_markers),
)
BY_NAME = {s.name: s for s in STEPS}


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def run_step(args: argparse.Namespace) -> int:
    """Child process: one step; its result goes to OUT/<step>.json."""
    step = BY_NAME[args.step]
    try:
        res = step.run(args)
    except Exception as exc:  # reported in the summary; the parent goes on with the next
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    _write(args.out / f"{step.name}.json", res)
    return 0 if res.get("ok") else 1


def run_all(args: argparse.Namespace) -> int:
    """Parent: every step in a child under its timeout; the summary after each."""
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"cpu": args.cpu, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "steps": {}}
    if not args.cpu:
        import torch

        summary["gpu"] = torch.cuda.get_device_name(0)
        summary["torch"] = torch.__version__
    summary_path = args.out / "summary.json"
    for step in STEPS:
        if args.only and step.name not in args.only:
            continue
        if step.gpu_only and args.cpu:
            summary["steps"][step.name] = {"ok": None, "run": "not run (no GPU)"}
            _write(summary_path, summary)
            continue
        result = args.out / f"{step.name}.json"
        result.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__)), "--step", step.name, "--out", str(args.out),
               "--replays", str(args.replays)] + (["--cpu"] if args.cpu else []) + \
            (["--report-ahead"] if args.report_ahead else [])
        t = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=step.timeout_s)
            res = json.loads(result.read_text()) if result.is_file() else {
                "ok": False, "error": f"exit {proc.returncode} without a result"}
            tail = (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired as exc:
            res = {"ok": False, "error": f"timed out after {step.timeout_s} s"}
            tail = ((exc.stdout or b"") + (exc.stderr or b"")).decode(errors="replace")[-2000:]
        res["seconds"] = round(time.monotonic() - t, 1)
        if not res.get("ok"):
            res["output_tail"] = tail
        summary["steps"][step.name] = res
        _write(summary_path, summary)
        print(f"{step.name}: {'ok' if res.get('ok') else 'FAILED'} ({res['seconds']} s)"
              + ("" if res.get("ok") else f": {res.get('error', 'see summary.json')}"),
              flush=True)
    ran = [r for r in summary["steps"].values() if r.get("ok") is not None]
    summary["ok"] = bool(ran) and all(r["ok"] for r in ran)
    _write(summary_path, summary)
    print(f"summary: {summary_path}")
    print("CHECK " + ("PASSED" if summary["ok"] else "FAILED"))
    return 0 if summary["ok"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="only the steps that run without a GPU")
    ap.add_argument("--out", type=Path, required=True, help="summary.json and each step's JSON")
    ap.add_argument("--only", action="append", choices=sorted(BY_NAME), default=[],
                    help="run only this step (repeatable)")
    ap.add_argument("--replays", type=int, default=30, help="graph_progress's replays")
    ap.add_argument("--provider", default="shm", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=11, help=argparse.SUPPRESS)
    ap.add_argument("--step", choices=sorted(BY_NAME), help=argparse.SUPPRESS)
    ap.add_argument("--report-ahead", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out = args.out.resolve()
    return run_step(args) if args.step else run_all(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
