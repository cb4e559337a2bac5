"""What this machine charges a thread for having slept: the same work timed right after the
previous run of it and after idle gaps of growing length.

    python3 bench/idle_penalty.py [--gaps-ms 0 2 5 20] [--runs 100] [--json]

Two pieces of work from the first token's path, each in this one process with one torch thread:
the decode messenger's per-request input checks (`DecodeMessenger.submit`'s numpy calls on a
64-token prompt, a few microseconds of Python) and the reference model's first decode step (two
tokens through the tiny-local model). A disaggregated first token wakes threads of three
processes that sat idle while the prefill computed (docs/benchmark.md, "Fifth round"); an
aggregated one runs in one process that computed a moment before. On a machine with dedicated
cores the ratios stay near 1; where they grow with the gap, every such wake-up pays them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def submit_checks() -> Callable[[], None]:
    """The messenger's checks of one request: the token and page arrays it builds."""
    import numpy as np

    from transfer.layout import KVLayout
    from transfer.routes import pages_for

    layout = KVLayout("HND", 512, 2, 2, 16, 16, 4)
    tokens, pages = list(range(1, 65)), [3, 4, 5, 6]

    def run() -> None:
        t = np.asarray(tokens)
        if t.ndim != 1 or not np.issubdtype(t.dtype, np.integer) or t.min() < 0 \
                or t.max() >= 1 << 32:
            raise ValueError("tokens")
        n = pages_for(len(t), layout.page_size)
        layout.check_pages(np.asarray(pages[:n], dtype=np.int64)).astype(np.uint32)
        t.astype(np.uint32)

    return run


def decode_step() -> Callable[[], None]:
    """The tiny-local model's first decode step (the last prompt token and a draft)."""
    import torch

    from pdtool.engines.reference.cache import PagedKV
    from pdtool.engines.reference.fromplan import model_fields
    from pdtool.engines.reference.heap import keep_freed_memory
    from pdtool.engines.reference.model import Batch, TinyConfig, TinyModel
    from pdtool.render import prepare

    torch.set_num_threads(1)  # as the serving ranks, and with their heap
    keep_freed_memory()
    _cfg, plan, findings = prepare(["+recipe=tiny-local"])
    if plan is None:
        raise SystemExit(f"the config does not plan: {findings}")
    inst = plan.role_instances("decode")[0]
    cfg = TinyConfig(**model_fields(plan.model, inst.kv_dtype, "decode"))
    model, P = TinyModel(cfg), inst.page_size
    n = -(-66 // P)  # the prompt, the step's token and its draft
    kv = PagedKV(cfg, cfg.cache_heads, n, P)
    pages = kv.pages.alloc(n)
    with torch.no_grad():
        model.forward(Batch.build([(list(range(1, 64)), 0, pages)], P), kv.layers, P)

    def run() -> None:
        with torch.no_grad():
            h = model.forward(Batch.build([([65, 66], 63, pages)], P), kv.layers, P)
            model.logits(h).argmax(-1)

    return run


def timed(work: Callable[[], None], gap_s: float, runs: int) -> float:
    """Median microseconds of `work`, each run `gap_s` after the previous one ended."""
    work()
    out = []
    for _ in range(runs):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        work()
        out.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 2, 5, 20])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    works = {"messenger's request checks": submit_checks(), "first decode step": decode_step()}
    table = {name: {g: timed(work, g / 1000, args.runs) for g in args.gaps_ms}
             for name, work in works.items()}
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.json:
        print(json.dumps({"date": date, "runs": args.runs, "gaps_ms": args.gaps_ms,
                          "median_us": {n: list(row.values()) for n, row in table.items()}}))
        return 0
    print(f"median us over {args.runs} runs after each idle gap (ratio to no gap)")
    print(f"{'work':<28}" + "".join(f"{g:>10g} ms" for g in args.gaps_ms))
    for name, row in table.items():
        cells = list(row.values())
        print(f"{name:<28}" + "".join(f"{c:>9.1f}" + f"{'':>4}" for c in cells))
        print(f"{'':<28}" + "".join(f"{c / cells[0]:>8.1f}x" + f"{'':>4}" for c in cells))
    print(date)
    return 0


if __name__ == "__main__":
    sys.exit(main())
