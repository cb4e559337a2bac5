"""What this machine charges a thread for having slept: the same work timed right after the
previous run of it and after idle gaps of growing length.

    python3 bench/idle_penalty.py [--gaps-ms 0 2 5 20] [--runs 100] [--json]

Two pieces of work from the first token's path, each in this one process with one torch thread:
the decode messenger's per-request input checks (`DecodeMessenger.submit`'s numpy calls on a
64-token prompt, a few microseconds of Python) and the reference model's first decode step (the
prompt's last token through the tiny-local model, as `bench/ttft_hops.py` times it in-process).
A disaggregated first token wakes threads of three processes that sat idle while the prefill
computed (docs/benchmark-rounds.md, "Fifth round"); an aggregated one runs in one process that
computed a moment before. On a machine with dedicated cores the ratios stay near 1; where they
grow with the gap, every such wake-up pays them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the checkout, and ttft_hops beside this file


def submit_checks() -> Callable[[], None]:
    """The decode messenger's checks of one request (`DecodeMessenger.submit`): its token ids
    and its pages."""
    import numpy as np

    from transfer.layout import KVLayout
    from transfer.messenger.decode import check_token_ids
    from transfer.routes import pages_for

    layout = KVLayout("HND", 512, 2, 2, 16, 16, 4)
    tokens, pages = list(range(1, 65)), [3, 4, 5, 6]

    def run() -> None:
        ids = check_token_ids("bench", tokens)
        n = pages_for(len(ids), layout.page_size)
        layout.check_pages(np.asarray(pages[:n], dtype=np.int64)).astype(np.uint32)
        ids.astype(np.uint32)

    return run


def decode_step() -> Callable[[], None]:
    """The tiny-local model's first decode step after a 64-token prompt's prefill, in the
    serving rank's setting (`bench/ttft_hops.py`'s InProcess)."""
    from ttft_hops import InProcess

    local, prompt = InProcess([]), list(range(1, 65))
    local.prefill(prompt, local.chunk)
    return lambda: local.step(prompt)


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
