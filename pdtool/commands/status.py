"""`pdtool status`: the running local deployments, each process alive or not, and its health.

Reads the record the local supervisor keeps in the job folder (`pdtool.launch.record`), so it
works from any shell on the machine, while `pdtool launch` runs in another."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pdtool.commands._common import EXIT_ERRORS, EXIT_OK, dump_json, error_line
from pdtool.launch.health import check, pid_alive
from pdtool.launch.record import Record, find, pick

NAME = "status"
HELP = "the running local deployments: each process, alive or not, and its health"


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """--job / --root: which running deployment (shared by status, logs and stop)."""
    p.add_argument("--job", type=Path, default=None,
                   help="the deployment's job folder (default: the one running under --root)")
    p.add_argument("--root", type=Path, default=Path("outputs"),
                   help="where job folders are (launcher.output_dir; default: outputs)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_job_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def describe(rec: Record) -> dict:
    """What status shows of one deployment: each process alive or not and its health."""
    procs = []
    for p in rec.procs:
        alive = pid_alive(p.pid)
        if not alive:
            health = "exited"
        elif p.health:
            health = check(p.health, timeout=2.0) or "ok"  # '' when it answers ready
        else:
            health = ""
        procs.append({"name": p.name, "role": p.role, "pid": p.pid, "alive": alive,
                      "health": health, "log": p.log})
    return {"job": rec.run_dir, "supervisor_pid": rec.supervisor_pid, "state": rec.state,
            "router_url": rec.router_url, "up_s": round(time.time() - rec.started, 1),
            "processes": procs}


def run(args: argparse.Namespace) -> int:
    try:
        recs = [pick(args.root, args.job)] if args.job else find(args.root)
    except LookupError as e:
        error_line(str(e))
        return EXIT_ERRORS
    shown = [describe(r) for r in recs]
    if args.json:
        dump_json(shown)
        return EXIT_OK if shown else EXIT_ERRORS
    if not shown:
        error_line(f"no running deployment under {args.root}/ (start one with `pdtool launch`, "
                   "or name its job folder with --job DIR)")
        return EXIT_ERRORS
    for d in shown:
        print(f"{d['job']}: {d['state']}, up {d['up_s']:.0f} s, supervisor pid "
              f"{d['supervisor_pid']}" + (f", router {d['router_url']}" if d["router_url"] else ""))
        width = max(len(p["name"]) for p in d["processes"]) if d["processes"] else 0
        for p in d["processes"]:
            state = "running" if p["alive"] else "exited"
            print(f"  {p['name']:<{width}}  pid {p['pid']:<7}  {state:<7}  "
                  f"{p['health'] or '-':<12}  {p['log']}")
    return EXIT_OK
