"""Soak the reference deployment: thousands of random-size requests, every output exact.

Starts 1 prefill (TP1) + 2 decode (TP1) instances and the HTTP front as local processes (KV over
the libfabric messenger, shm), sends `--requests` requests of random prompt lengths and output
lengths through the front with `--workers` concurrent clients (stopping after `--max-seconds`),
compares every output with the single-process oracle, and prints the figures: requests, tokens,
throughput, RSS of every process after a warm-up share and at the end, KV pages left allocated.
Exit status 1 when an output differs, a request failed, a page leaked or RSS grew by more than
`--rss-growth-mib` in one process.

    python bench/soak.py --requests 3000 --workers 16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

# run as a script, bench/ comes first on sys.path, and bench/transfer.py would shadow the
# `transfer` package the engine imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

from pdtool.engines.reference.soak import deployment, run_soak  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--max-seconds", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-growth-mib", type=float, default=64.0)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdtool-soak-") as tmp:
        dep, url, leaders, model = deployment(Path(tmp))
        try:
            dep.start()
            res = run_soak(url, leaders, [p.pid for p in dep.procs], model,
                           requests=args.requests, workers=args.workers, seed=args.seed,
                           max_seconds=args.max_seconds)
        finally:
            dep.stop()
    if args.json:
        print(json.dumps({"requests": res.requests, "tokens": res.tokens,
                          "seconds": round(res.seconds, 2),
                          "mismatches": len(res.mismatches), "errors": len(res.errors),
                          "rss_warm_mib": round(sum(res.rss_warm_mib.values()), 1),
                          "rss_end_mib": round(sum(res.rss_end_mib.values()), 1),
                          "rss_max_growth_mib": round(res.rss_growth_mib, 1),
                          "pages_leaked": res.pages_leaked}))
    else:
        print(res.summary())
        for e in res.errors[:5]:
            print("  error:", e)
    bad = (res.mismatches or res.errors or any(res.pages_leaked.values())
           or res.rss_growth_mib > args.rss_growth_mib)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
