"""Where the time to first token goes in the reference deployment, hop by hop.

    python3 bench/ttft_hops.py [--requests 30] [--isl 64 2000] [overrides...]

Starts `pdtool launch +recipe=tiny-local` on free ports with bench/hops/sitecustomize.py
loaded into every process (it timestamps the protocol points on the machine-wide monotonic
clock), sends `--requests` sequential streamed completions of `max_tokens=1` per prompt length,
stops the deployment and prints the median of every hop. Beside it, the same model computing
the same prompts in this one process (chunked like the prefill instance, then the decoder's
first step): the work any deployment must do, so `TTFT - in-process` is what serving adds.
The first decode step is also timed alone, right after that prefill (as an aggregated instance
runs it) and after idling as long as the prefill took (as a decode instance, waiting for the
KV, runs it): on the dev VM the second took 1.7 times the first (docs/benchmark-rounds.md,
"Fifth round"), a cost of the machine that a disaggregated first token pays and an aggregated
one does not.

Per worker process it also reads /proc (CPU time, run-queue wait, context switches of each
thread) around the served requests only: what the engine threads and everything else
(messenger threads, receive lanes, sockets) cost per request, and how long the engine thread
waited for a core. On a shared 2-core box the waits explain most of what the hops do not.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HOPS = (  # (name, from event, to event)
    ("client -> front (HTTP, parse)", "client.send", "front.submit"),
    ("front -> decode loop (zmq, poll)", "front.submit", "decode.gen"),
    ("decode admit -> messenger submit", "decode.gen", "decode.submit"),
    ("REQUEST -> prefill engine has it", "decode.submit", "prefill.recv"),
    ("  submit -> decode messenger", "decode.submit", "decode.msg_submit"),
    ("  REQUEST built and sent", "decode.msg_submit", "decode.request_sent"),
    ("  -> prefill messenger", "decode.request_sent", "prefill.request_in"),
    ("  -> prefill engine", "prefill.request_in", "prefill.recv"),
    ("prefill scheduling", "prefill.recv", "prefill.first_chunk"),
    ("prefill compute (all chunks)", "prefill.first_chunk", "prefill.computed"),
    ("last writes + count reached", "prefill.computed", "decode.ready"),
    ("  finish -> prefill messenger", "prefill.computed", "prefill.last_writes"),
    ("    thread woken, has the finish", "prefill.computed", "prefill.cmd_finish"),
    ("    writes planned (Python)", "prefill.cmd_finish", "prefill.last_writes"),
    ("  writes posted (C)", "prefill.last_writes", "prefill.flushed"),
    ("  copied, counted -> decode engine", "prefill.flushed", "decode.ready"),
    ("decode first step", "decode.ready", "decode.first_out"),
    ("decode -> front (OUT)", "decode.first_out", "front.first_out"),
    ("front -> client (SSE)", "front.first_out", "client.first"),
)


PASS_ROWS = ("prefill passes, wall", "prefill passes, engine thread CPU",
             "  stalled (off core, waiting for GIL)", "prefill messenger rounds (count)")


def ports() -> list[str]:
    from pdtool.engines.reference.local import free_port_overrides

    return free_port_overrides()


class InProcess:
    """The deployment's model, page and chunk sizes in this process: `run(prompt)` prefills it
    chunked like the prefill instance (or whole) and takes the first decode step, the work
    any deployment must do for the first token. Measured right after each served request,
    so both see the same load on a shared machine."""

    def __init__(self, overrides: list[str]) -> None:
        import torch

        from pdtool.engines.reference.cache import PagedKV
        from pdtool.engines.reference.fromplan import model_fields
        from pdtool.engines.reference.heap import keep_freed_memory
        from pdtool.engines.reference.models import build_model, model_config
        from pdtool.render import prepare

        torch.set_num_threads(1)  # as the serving ranks (serve._init), and with their heap
        keep_freed_memory()
        _cfg, plan, findings = prepare(["+recipe=tiny-local", *overrides])
        if plan is None:
            raise SystemExit(f"the config does not plan: {findings}")
        inst = plan.role_instances("prefill")[0]
        # built as a serving rank builds it (serve._start_rank): a checkpoint too
        self.cfg = model_config(model_fields(plan.model, inst.kv_dtype, "prefill"))
        self.model = build_model(self.cfg)
        self.P, self.chunk = inst.page_size, inst.chunked_prefill_size
        self.kv = PagedKV(self.cfg, len(self.model.kv_heads), 4096 // self.P + 1, self.P)
        self.pages = self.kv.pages.alloc(self.kv.pages.num_pages)

    def run(self, toks: list[int], chunked: bool = True) -> float:
        t0 = time.perf_counter()
        self.prefill(toks, self.chunk if chunked else len(toks))
        self.step(toks)
        return time.perf_counter() - t0

    def first_steps(self, toks: list[int]) -> tuple[float, float]:
        """The first decode step alone, right after the chunked prefill (as an aggregated
        instance runs it) and after idling as long as that prefill took (as a decode
        instance runs it, while the prefill instance computes): what this machine charges a
        process whose code and data sat unused for that long."""
        t0 = time.perf_counter()
        self.prefill(toks, self.chunk)
        t1 = time.perf_counter()
        self.step(toks)
        hot = time.perf_counter() - t1
        time.sleep(t1 - t0)
        t2 = time.perf_counter()
        self.step(toks)
        return hot, time.perf_counter() - t2

    def prefill(self, toks: list[int], step: int) -> None:
        """Every prompt token but the last into the cache, `step` tokens per pass."""
        import torch

        from pdtool.engines.reference.model import Batch

        P, n = self.P, len(toks)
        with torch.no_grad():
            for lo in range(0, n - 1, step):
                hi = min(lo + step, n - 1)
                self.model.forward(Batch.build([(toks[lo:hi], lo, self.pages)], P),
                                   self.kv.layers, P)

    def step(self, toks: list[int]) -> None:
        """The first decode step: the prompt's last token, then its logits."""
        import torch

        from pdtool.engines.reference.model import Batch

        n = len(toks)
        with torch.no_grad():
            h = self.model.forward(Batch.build([(toks[-1:], n - 1, self.pages)], self.P),
                                   self.kv.layers, self.P)
            self.model.logits(h).argmax(-1)


def stream_once(url: str, prompt: list[int], log) -> None:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1, "stream": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            if first is None and raw.startswith(b"data:") and b"token_ids\": [" in raw \
                    and b"token_ids\": []" not in raw:
                first = time.perf_counter()
    log.append((t0, first))


def workers(launcher: int) -> dict[int, str]:
    """pid -> name (role and instance) of the deployment's worker processes."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            args = [a.decode() for a in Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")]
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher and "--role" in args:
            name = args[args.index("--role") + 1]
            if "--instance" in args:
                name += args[args.index("--instance") + 1]
            out[int(d)] = name
    return out


def thread_times(procs: dict[int, str]) -> dict[tuple[str, str], list[int]]:
    """(process, thread kind) -> [CPU ns, run-queue wait ns, context switches], summed over
    threads: "engine" is the main thread (the serving loop), "lanes" the receive lanes' C
    threads, "other" the rest (messenger thread, ZeroMQ I/O, health server)."""
    out: dict[tuple[str, str], list[int]] = {}
    for pid, name in procs.items():
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            try:
                run, wait, _ = (int(x) for x in Path(f"{base}/schedstat").read_text().split())
                comm = Path(f"{base}/comm").read_text().strip()
                status = Path(f"{base}/status").read_text()
            except (OSError, ValueError):
                continue
            switches = sum(int(line.split()[1]) for line in status.splitlines()
                           if "ctxt_switches:" in line)  # voluntary + involuntary
            kind = "engine" if int(tid) == pid else ("lanes" if comm == "pdtool-lane" else
                                                      "other")
            acc = out.setdefault((name, kind), [0, 0, 0])
            acc[0] += run
            acc[1] += wait
            acc[2] += switches
    return out


def add_delta(total: dict, before: dict, after: dict) -> None:
    for key, b in after.items():
        a = before.get(key, [0, 0, 0])
        acc = total.setdefault(key, [0, 0, 0])
        for i in range(3):
            acc[i] += b[i] - a[i]


def measure(isls: list[int], n: int, overrides: list[str]) -> dict:
    import numpy as np

    from pdtool.bench.lengths import prompts

    fd, hops = tempfile.mkstemp(prefix="pdtool-hops-")
    os.close(fd)
    out_dir = tempfile.mkdtemp(prefix="pdtool-hops-job-")
    p = ports()
    url = "http://127.0.0.1:" + next(x for x in p if x.startswith("router.port")).split("=")[1]
    env = {**os.environ, "PDTOOL_HOPS": hops,
           "PYTHONPATH": f"{ROOT}:{ROOT / 'bench' / 'hops'}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdtool.cli", "launch", "+recipe=tiny-local", *p, *overrides,
         f"launcher.output_dir={out_dir}"], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if "deployment ready" in line:
                break
        else:
            raise SystemExit("the deployment did not start")
        rng = np.random.default_rng(0)
        local = InProcess(overrides)
        procs = workers(proc.pid)
        client: dict[int, list] = {}
        alone: dict[int, list] = {}
        cpu: dict[int, dict] = {}
        for isl in isls:
            client[isl], alone[isl], cpu[isl] = [], [], {}
            stream_once(url, prompts(rng, [isl], 256)[0], [])  # warm the path once
            local.run(prompts(rng, [isl], 256)[0])
            for prompt in prompts(rng, [isl] * n, 256):
                before = thread_times(procs)
                stream_once(url, prompt, client[isl])
                add_delta(cpu[isl], before, thread_times(procs))
                alone[isl].append((local.run(prompt), local.run(prompt, chunked=False),
                                   *local.first_steps(prompt)))
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    events: list[tuple[str, str, float]] = []
    spans: list[tuple[str, str, float, float, int]] = []  # forward passes, messenger rounds
    for line in Path(hops).read_text().splitlines():
        f = line.split()
        if len(f) == 5:
            spans.append((f[0], f[1], float(f[2]), float(f[3]), int(f[4])))
        else:
            events.append((f[0], f[1], float(f[2])))
    os.unlink(hops)
    return {"client": client, "events": events, "spans": spans, "alone": alone, "cpu": cpu}


def breakdown(client: list[tuple[float, float]], events: list,
              spans: list) -> dict[str, float]:
    """Median milliseconds per hop; each request is the window [send, first token]. Also,
    per request, the prefill engine's forward passes (wall, thread CPU, and the difference:
    the engine thread off its core or waiting for the GIL) and the prefill messenger
    thread's rounds in the window."""
    per: dict[str, list[float]] = {name: [] for name, _, _ in HOPS}
    passes: dict[str, list[float]] = {k: [] for k in PASS_ROWS}
    ttft = []
    for t0, t1 in client:
        seen = {"client.send": t0, "client.first": t1}
        for ev, _rid, t in events:
            if t0 <= t <= t1 and ev not in seen:
                seen[ev] = t
        ttft.append(t1 - t0)
        for name, a, b in HOPS:
            if a in seen and b in seen:
                per[name].append(seen[b] - seen[a])
        mine = [s for s in spans if s[0] == "pass" and s[1].startswith("prefill")
                and t0 <= s[2] and s[3] <= t1]
        if mine:
            wall, cpu = sum(s[3] - s[2] for s in mine), sum(s[4] for s in mine) / 1e9
            rounds = sum(1 for s in spans if s[0] == "step" and t0 <= s[3] <= t1)
            ms = (1000 * wall, 1000 * cpu, 1000 * (wall - cpu), rounds)  # the last a count
            for key, v in zip(PASS_ROWS, ms, strict=True):
                passes[key].append(v)
    out = {name: 1000 * statistics.median(v) for name, v in per.items() if v}
    out.update({name: statistics.median(v) for name, v in passes.items() if v})
    out["TTFT (client)"] = 1000 * statistics.median(ttft)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--isl", type=int, nargs="+", default=[64, 2000])
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    got = measure(args.isl, args.requests, args.overrides)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "load": os.getloadavg(), "requests": args.requests, "by_isl": {}}
    for isl in args.isl:
        table = breakdown(got["client"][isl], got["events"], got["spans"])
        alone = got["alone"][isl]
        chunked = 1000 * statistics.median(a[0] for a in alone)
        table["in-process, chunked prefill + step"] = chunked
        table["in-process, whole prompt + step"] = 1000 * statistics.median(a[1] for a in alone)
        table["TTFT - in-process chunked"] = table["TTFT (client)"] - chunked
        for name, i in (("right after", 2), ("after idling", 3)):
            table[f"in-process first step, {name}"] = 1000 * statistics.median(
                a[i] for a in alone)
        doc["by_isl"][isl] = table
        print(f"\nprompt {isl} tokens, {args.requests} sequential requests, max_tokens=1 "
              "(median ms)")
        for name, v in table.items():
            print(f"  {name:<38} {v:9.2f}")
        threads = {f"{p} {k}": {"cpu_ms": run / 1e6 / args.requests,
                                "runqueue_wait_ms": wait / 1e6 / args.requests,
                                "switches": sw / args.requests}
                   for (p, k), (run, wait, sw) in sorted(got["cpu"][isl].items())}
        doc.setdefault("threads_by_isl", {})[isl] = threads
        print("  per request, served requests only:       CPU ms  run-queue ms  switches")
        for name, t in threads.items():
            if t["cpu_ms"] >= 0.5 or t["runqueue_wait_ms"] >= 0.5:
                print(f"  {name:<38} {t['cpu_ms']:9.1f} {t['runqueue_wait_ms']:13.1f} "
                      f"{t['switches']:9.0f}")
    print(f"\n{doc['date']}, load average {doc['load'][0]:.2f} {doc['load'][1]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
