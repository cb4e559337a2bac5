"""How the messenger's and the planner's costs grow: three tables, measured in one run.

1. Requests in flight on one prefill (`--inflight 1,100,1000`): one decode client submits that
   many one-page requests at once; the prefill engine binds them all and runs one request per
   pass (as an engine computing one chunk while the rest wait, bound), so its messenger thread
   walks every bound request on every step (`PrefillMessenger._check_requests`). Printed: the
   wave's time per request, per-request latency p50/p99, and the mean time of one
   `_check_requests` call with at least half that many bound, with the number of such calls
   (timed by wrapping it at the class: the messenger's code runs unchanged). A walk growing
   linearly with N, taken once per step while N requests drain, is a cost quadratic in N.
2. Decode instances per prefill (`--decoders 1,2,4,8`): that many decode processes submit
   `--requests` requests of `--pages` pages each at once to one prefill; aggregate requests/s,
   GB/s and latency p50/p99.
3. `validate` / `plan` time against nodes (`--nodes 1,...,128`): composing, validating and
   planning DeepSeek-R1 (TP8 instances, one node each, 1 prefill : 3 decode) scaled to that
   many nodes; one node (too small for DeepSeek-R1's two) is tiny-local, the one-machine shape.

    python bench/messenger_scale.py              # all three tables
    python bench/messenger_scale.py --quick      # a smoke run
    python bench/messenger_scale.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the `transfer` package, not bench/transfer.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.append(str(Path(__file__).resolve().parent))

from messenger_engines import (
    Child,
    Setup,
    decode_client,
    event,
    percentile,
    prefill_engine,
    remove_shm_leftovers,
)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


class Deployment:
    """One prefill engine and `decoders` decode clients, each running `waves`."""

    def __init__(self, s: Setup, decoders: int, waves: list[tuple[int, int]]) -> None:
        self.stop, self.go = event(), event()
        self.prefill = Child(prefill_engine, s, self.stop)
        address = self.prefill.get("prefill address")
        self.clients = [Child(decode_client, s, [address], waves, self.go, f"d{i}-")
                        for i in range(decoders)]
        self.pids = [c.proc.pid for c in [self.prefill, *self.clients]]

    def run(self) -> tuple[list[list[dict[str, Any]]], dict[str, Any]]:
        """(each client's waves, the prefill's report)."""
        try:
            time.sleep(0.5)  # every client has connected and sent its warm-up request
            self.go.set()
            waves = [c.get("decode client", 600) for c in self.clients]
            self.stop.set()
            report = self.prefill.get("prefill report", 30)
            return waves, report
        finally:
            self.stop.set()
            for c in [*self.clients, self.prefill]:
                c.reap()
            remove_shm_leftovers(self.pids)


def inflight_table(base: Setup, counts: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in counts:
        s = replace(base, requests_per_pass=1, step_profile=True, max_inflight=max(1024, n),
                    src_pages=max(base.src_pages, n), dst_pages=max(base.dst_pages, n))
        (waves,), prefill = Deployment(s, 1, [(n, 1)]).run()
        w = waves[0]
        steps = prefill["steps"]
        # the bins of at least half of n bound: the steps taken with (about) n in flight
        top = [v for k, v in steps.items() if k and k * 2 >= n and v["checks"]] or \
            list(steps.values())
        nsteps = sum(v["steps"] for v in top)
        nchecks = sum(v["checks"] for v in top)
        rows.append({
            "inflight": n, "wave_s": w["seconds"], "per_request_us": 1e6 * w["seconds"] / n,
            "latency_p50_ms": 1e3 * percentile(w["latency_s"], 50),
            "latency_p99_ms": 1e3 * percentile(w["latency_s"], 99),
            "step_us": sum(v["step_us"] * v["steps"] for v in top) / max(1, nsteps),
            "check_us": sum(v["check_us"] * v["checks"] for v in top) / max(1, nchecks),
            "steps": nsteps, "checks": nchecks,
        })
    return rows


def decoders_table(base: Setup, counts: list[int], requests: int, pages: int
                   ) -> list[dict[str, Any]]:
    rows = []
    for k in counts:
        s = replace(base, max_inflight=max(256, requests),
                    src_pages=max(base.src_pages, requests * pages),
                    dst_pages=max(base.dst_pages, requests * pages))
        waves, _prefill = Deployment(s, k, [(requests, pages)]).run()
        ws = [cw[0] for cw in waves]
        secs = max(w["seconds"] for w in ws)
        lat = [x for w in ws for x in w["latency_s"]]
        n = k * requests
        rows.append({"decoders": k, "requests": n, "seconds": secs,
                     "requests_per_s": n / secs,
                     "gbps": n * pages * s.layers * s.page_bytes / secs / 1e9,
                     "latency_p50_ms": 1e3 * percentile(lat, 50),
                     "latency_p99_ms": 1e3 * percentile(lat, 99)})
    return rows


def nodes_overrides(n: int) -> list[str]:
    if n < 2:  # no GPU recipe is disaggregated on one node: the one-machine shape
        return ["+recipe=tiny-local"]
    p = max(1, n // 4)
    return ["+recipe=deepseek-r1", f"cluster.nodes={n}", f"prefill.instances={p}",
            f"decode.instances={n - p}"]


def plan_table(counts: list[int], repeat: int) -> list[dict[str, Any]]:
    from pdtool.compose import load_config
    from pdtool.plan import build_plan
    from pdtool.rules import validate
    from pdtool.rules.finding import has_errors

    rows = []
    for n in counts:
        best = {"compose": 1e9, "validate": 1e9, "plan": 1e9}
        for _ in range(repeat):
            t0 = time.perf_counter()
            cfg, problems = load_config(nodes_overrides(n))
            t1 = time.perf_counter()
            if cfg is None:
                raise RuntimeError(f"{n} nodes: the config does not compose: {problems}")
            found = validate(cfg)
            t2 = time.perf_counter()
            if has_errors(found):
                raise RuntimeError(f"{n} nodes: validate refused it: {found[0]}")
            plan = build_plan(cfg)
            t3 = time.perf_counter()
            for k, v in (("compose", t1 - t0), ("validate", t2 - t1), ("plan", t3 - t2)):
                best[k] = min(best[k], v)
        rows.append({"nodes": plan.nodes, "recipe": nodes_overrides(n)[0].split("=")[1],
                     "instances": len(plan.instances),
                     **{f"{k}_ms": 1e3 * v for k, v in best.items()}})
    return rows


def report(res: dict[str, Any]) -> str:
    lines = [f"{res['date']}, load average {res['load_average']:.2f}, provider "
             f"{res['provider']}, {res['page_bytes'] // 1024} KiB pages"]
    if res.get("inflight"):
        lines += ["", "requests in flight on one prefill (one-page requests, one per pass):",
                  f"{'in flight':>10} {'us/request':>11} {'p50 ms':>8} {'p99 ms':>8} "
                  f"{'check us':>9} {'checks':>7}   (check: one _check_requests walk with "
                  f"about that many bound)"]
        lines += [f"{r['inflight']:>10} {r['per_request_us']:>11.1f} {r['latency_p50_ms']:>8.2f} "
                  f"{r['latency_p99_ms']:>8.2f} {r['check_us']:>9.1f} {r['checks']:>7}"
                  for r in res["inflight"]]
    if res.get("decoders"):
        lines += ["", "decode instances per prefill:",
                  f"{'1:K':>5} {'requests':>9} {'req/s':>8} {'GB/s':>6} {'p50 ms':>8} "
                  f"{'p99 ms':>8}"]
        lines += [f"{'1:' + str(r['decoders']):>5} {r['requests']:>9} {r['requests_per_s']:>8.0f} "
                  f"{r['gbps']:>6.2f} {r['latency_p50_ms']:>8.2f} {r['latency_p99_ms']:>8.2f}"
                  for r in res["decoders"]]
    if res.get("plan"):
        lines += ["", "validate / plan time against nodes (best of the repeats):",
                  f"{'nodes':>6} {'recipe':>14} {'instances':>9} {'compose ms':>11} "
                  f"{'validate ms':>12} {'plan ms':>8}"]
        lines += [f"{r['nodes']:>6} {r['recipe']:>14} {r['instances']:>9} "
                  f"{r['compose_ms']:>11.1f} {r['validate_ms']:>12.2f} {r['plan_ms']:>8.2f}"
                  for r in res["plan"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--inflight", default="1,100,1000")
    ap.add_argument("--decoders", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=32, help="requests per decode instance")
    ap.add_argument("--pages", type=int, default=16, help="pages per request (1:K table)")
    ap.add_argument("--nodes", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--repeat", type=int, default=3, help="validate/plan repeats (best kept)")
    ap.add_argument("--quick", action="store_true", help="small counts (smoke run)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.quick:
        args.inflight, args.decoders, args.requests, args.pages = "1,10", "1,2", 4, 2
        args.nodes, args.repeat, args.page_kib = "1,4", 1, 4
    from transfer.wire.secret import generate_secret

    base = Setup(provider=args.provider, page_bytes=args.page_kib * 1024,
                 secret=generate_secret(), src_pages=256, dst_pages=256)
    res: dict[str, Any] = {"provider": args.provider, "page_bytes": base.page_bytes}
    res["inflight"] = inflight_table(base, _ints(args.inflight))
    res["decoders"] = decoders_table(base, _ints(args.decoders), args.requests, args.pages)
    res["plan"] = plan_table(_ints(args.nodes), args.repeat)
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    res["load_average"] = os.getloadavg()[0]
    print(json.dumps(res, sort_keys=True) if args.json else report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
