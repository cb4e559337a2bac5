"""Messenger latency and operation rate, each next to its baseline measured in the same run.

Per provider (`shm`, `tcp;ofi_rxm` over loopback), interleaved round by round:

* latency of a one-page request: a decode process submits one request of one page per layer
  and waits for its count to be reached (`submit` -> `ready()`: the REQUEST over the signed
  control plane, the prefill engine's bind and pass, the imm-counted write, the count), one
  request at a time, p50/p99; next to a raw `fi_writedata` ping-pong of the same bytes through
  the binding (transfer.fabric: write with immediate data, the other side counts it in C and
  writes back), whose round trip is the least a request/answer over this provider costs;
* operations per second at 4 KiB writes: one request of `--rate-pages` 4 KiB pages through the
  messenger with one write per operation (`writes_per_op=1`) and with its default grouping
  (the provider's iov limit, writes/s), the raw binding's `write_batch` of the same writes,
  and fabtests' `fi_rma_bw -o writedata -S 4096` message rate on the same provider.

fabtests is not in Debian bookworm's archive (Debian packages it as `fabtests` from trixie
on: `apt-get install fabtests`); on bookworm build `fi_rma_bw` from the `fabtests/` folder of
the libfabric release matching the system library (1.17: `./autogen.sh && ./configure &&
make`), and pass its folder with `--fabtests DIR` or put it on PATH. Without it the row says so.

Usage (from the repository root):
    python bench/messenger_latency.py                  # table
    python bench/messenger_latency.py --json           # one JSON object
    python bench/messenger_latency.py --quick          # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the `transfer` package, not bench/transfer.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.append(str(Path(__file__).resolve().parent))

from messenger_engines import (
    Child,
    RawPair,
    Setup,
    decode_client,
    event,
    percentile,
    prefill_engine,
    remove_shm_leftovers,
    serial_latency,
)

PROVIDERS = ("shm", "tcp;ofi_rxm")
RATE_BYTES = 4096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ fabtests
def find_rma_bw(folder: str | None) -> str | None:
    if folder:
        path = Path(folder) / "fi_rma_bw"
        return str(path) if path.is_file() and os.access(path, os.X_OK) else None
    return shutil.which("fi_rma_bw")


def rma_bw_rate(exe: str, provider: str, iters: int, size: int = RATE_BYTES) -> float:
    """fabtests' fi_rma_bw writedata message rate (operations/s) between two processes here.
    Each side gets its own source port (`-B`): with out-of-band address exchange (`-E`) both
    otherwise take the default one, and on shm that names both endpoints alike."""
    oob, sport, cport = free_port(), free_port(), free_port()
    common = [exe, "-p", provider, "-o", "writedata", "-S", str(size), "-I", str(iters),
              f"-E{oob}"]
    if provider.startswith("tcp"):
        common += ["-d", "lo"]
    server = subprocess.Popen([*common, "-B", str(sport)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(0.5)  # the server listens on the out-of-band port
        client = subprocess.run([*common, "-B", str(cport), "127.0.0.1"], capture_output=True,
                                text=True, timeout=300)
    finally:
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    out = client.stdout + client.stderr
    # columns: bytes iters total time MB/sec usec/xfer Mxfers/sec
    rows = [ln.split() for ln in out.splitlines() if re.match(r"^\s*\d+k?\s+\d+k?\s", ln)]
    if client.returncode != 0 or not rows:
        raise RuntimeError(f"fi_rma_bw -p {provider} failed (status {client.returncode}): "
                           f"{out.strip()[-300:]}")
    return 1e6 / float(rows[-1][5])  # from usec/xfer: Mxfers/sec has two decimals only


# ------------------------------------------------------------------ the messenger pair
class MessengerPair:
    """One prefill engine and the decode clients the benchmark drives against it."""

    def __init__(self, s: Setup) -> None:
        self.s = s
        self.stop = event()
        self.prefill = Child(prefill_engine, s, self.stop)
        self.address = self.prefill.get("prefill address")
        self.pids = [self.prefill.proc.pid]

    def latency(self, count: int) -> list[float]:
        c = Child(serial_latency, self.s, [self.address], count)
        self.pids.append(c.proc.pid)
        try:
            return c.get("latency", 300)
        finally:
            c.reap()

    def rate(self, pages: int, writes_per_op: int, rounds: int) -> float:
        """Best writes/s of `rounds` requests of `pages` pages (one per layer)."""
        from dataclasses import replace

        s = replace(self.s, writes_per_op=writes_per_op)
        c = Child(decode_client, s, [self.address], [(1, pages)] * rounds)
        self.pids.append(c.proc.pid)
        try:
            waves = c.get("rate", 300)
        finally:
            c.reap()
        return max(w["pages"] * s.layers / w["seconds"] for w in waves)

    def close(self) -> None:
        self.stop.set()
        try:
            self.prefill.get("prefill report", 20)
        finally:
            self.prefill.reap()
            remove_shm_leftovers(self.pids)


# ------------------------------------------------------------------ driver
def measure(args: argparse.Namespace) -> dict[str, Any]:
    from transfer.wire.secret import generate_secret

    secret = generate_secret()
    exe = find_rma_bw(args.fabtests)
    res: dict[str, Any] = {"page_bytes": args.page_kib * 1024, "rate_bytes": RATE_BYTES,
                           "not_measured": {}}
    cells: dict[str, dict[str, list[Any]]] = {p: {} for p in args.providers}

    def keep(prov: str, name: str, value: Any) -> None:
        cells[prov].setdefault(name, []).append(value)

    for _r in range(args.rounds):
        for prov in args.providers:
            page = args.page_kib * 1024
            try:
                pair = RawPair(prov, max(page, RATE_BYTES) * max(args.rate_pages, 1))
                try:
                    keep(prov, "pingpong_rtt_s", pair.ping_pong(args.pings, page))
                    secs, ops = pair.rate(args.rate_pages, RATE_BYTES)
                    keep(prov, "raw_ops_per_s", ops / secs)
                finally:
                    pair.close()
            except Exception as exc:
                res["not_measured"][f"raw/{prov}"] = f"{type(exc).__name__}: {exc}"
            lat = Setup(provider=prov, page_bytes=page, layers=args.layers, secret=secret,
                        src_pages=max(64, args.rate_pages), dst_pages=max(64, args.rate_pages))
            try:
                mp_ = MessengerPair(lat)
                try:
                    keep(prov, "messenger_latency_s", mp_.latency(args.requests))
                finally:
                    mp_.close()
                rate = Setup(provider=prov, page_bytes=RATE_BYTES, layers=1, secret=secret,
                             src_pages=args.rate_pages, dst_pages=args.rate_pages)
                mp_ = MessengerPair(rate)
                try:
                    keep(prov, "messenger_ops_per_s", mp_.rate(args.rate_pages, 1, 2))
                    keep(prov, "messenger_writes_per_s", mp_.rate(args.rate_pages, 0, 2))
                finally:
                    mp_.close()
            except Exception as exc:
                res["not_measured"][f"messenger/{prov}"] = f"{type(exc).__name__}: {exc}"
            if exe is None:
                res["not_measured"]["fi_rma_bw"] = (
                    "fi_rma_bw not found (PATH or --fabtests DIR): `apt-get install fabtests` "
                    "where Debian has it (trixie on), else build libfabric's fabtests/")
            else:
                try:
                    keep(prov, "rma_bw_ops_per_s", rma_bw_rate(exe, prov, args.rma_iters))
                except Exception as exc:
                    res["not_measured"][f"fi_rma_bw/{prov}"] = f"{type(exc).__name__}: {exc}"
    res["providers"] = {p: summarize(c) for p, c in cells.items()}
    return res


def summarize(c: dict[str, list[Any]]) -> dict[str, float]:
    """Latencies: p50/p99 over every round's samples; rates: the best round."""
    out: dict[str, float] = {}
    for name in ("pingpong_rtt_s", "messenger_latency_s"):
        xs = [x for run in c.get(name, []) for x in run]
        if xs:
            out[f"{name[:-2]}_p50_us"] = 1e6 * percentile(xs, 50)
            out[f"{name[:-2]}_p99_us"] = 1e6 * percentile(xs, 99)
    for name in ("raw_ops_per_s", "messenger_ops_per_s", "messenger_writes_per_s",
                 "rma_bw_ops_per_s"):
        if c.get(name):
            out[name] = max(c[name])
    return out


def report(res: dict[str, Any]) -> str:
    lines = [f"one-page request: {res['page_bytes'] // 1024} KiB per layer; rates at "
             f"{res['rate_bytes'] // 1024} KiB writes"]
    for prov, c in res["providers"].items():
        lines.append(f"{prov}:")
        if "messenger_latency_p50_us" in c and "pingpong_rtt_p50_us" in c:
            for q in ("p50", "p99"):
                m, r = c[f"messenger_latency_{q}_us"], c[f"pingpong_rtt_{q}_us"]
                lines.append(f"  latency {q}: messenger {m:9.1f} us   raw fi_writedata "
                             f"round trip {r:7.1f} us   {m / r:6.1f}x")
        base = c.get("rma_bw_ops_per_s")
        for name, label in (("messenger_ops_per_s", "messenger, 1 write/op"),
                            ("messenger_writes_per_s", "messenger, grouped (writes/s)"),
                            ("raw_ops_per_s", "raw binding write_batch"),
                            ("rma_bw_ops_per_s", "fabtests fi_rma_bw writedata")):
            if name in c:
                ratio = f"   {c[name] / base:5.2f}x fi_rma_bw" if base else ""
                lines.append(f"  {label:<32} {c[name] / 1e3:9.1f} k ops/s{ratio}")
    for name, why in res["not_measured"].items():
        lines.append(f"not measured: {name}: {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--page-kib", type=int, default=4, help="page size of the one-page request")
    ap.add_argument("--layers", type=int, default=1, help="layers (one page each) per request")
    ap.add_argument("--requests", type=int, default=500, help="one-page requests per round")
    ap.add_argument("--pings", type=int, default=2000, help="ping-pong round trips per round")
    ap.add_argument("--rate-pages", type=int, default=16384, help="4 KiB writes per rate cell")
    ap.add_argument("--rma-iters", type=int, default=20000, help="fi_rma_bw iterations")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fabtests", help="folder holding fi_rma_bw (default: PATH)")
    ap.add_argument("--quick", action="store_true", help="small counts (smoke run)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    args.providers = [p for p in args.providers.split(",") if p]
    if args.quick:
        args.requests, args.pings, args.rate_pages, args.rma_iters, args.rounds = \
            20, 100, 256, 1000, 1
    res = measure(args)
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    res["load_average"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        print(f"{res['date']}, load average {res['load_average']:.2f}")
        print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
