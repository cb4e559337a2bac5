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
Left out (not written yet): head-slice gather into pinned memory and scatter back, per-layer
markers on a side stream consumed by a thread.
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
    Step("mapped_aliasing", 60, True, _mapped_aliasing),
    Step("pointer_checks", 90, False, _pointer_checks),
    Step("paged_decode", 120, False, _paged_decode),
    Step("graph_progress", 150, False, _graph_progress),
    Step("staged_transfer", 150, False, _staged_transfer),
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
