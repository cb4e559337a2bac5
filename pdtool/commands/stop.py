"""`pdtool stop`: stop a running local deployment from another shell, as Ctrl-C in its own
would: its supervisor gets SIGTERM and stops the router, then decode, then prefill."""

from __future__ import annotations

import argparse
import os
import signal
import time

from pdtool.commands._common import EXIT_ERRORS, EXIT_OK, error_line
from pdtool.commands.status import add_job_arguments
from pdtool.launch.health import pid_alive
from pdtool.launch.record import pick

NAME = "stop"
HELP = "stop a running local deployment (its supervisor stops every process, in order)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_job_arguments(p)
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds to wait for every process to exit (default 120: the "
                        "supervisor's own grace periods, launcher.stop_grace_s, come first)")


def run(args: argparse.Namespace) -> int:
    try:
        rec = pick(args.root, args.job)
    except LookupError as e:
        error_line(str(e))
        return EXIT_ERRORS
    print(f"stopping {rec.run_dir} (supervisor pid {rec.supervisor_pid}, "
          f"{len(rec.procs)} processes)", flush=True)
    try:
        os.kill(rec.supervisor_pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    except PermissionError:
        error_line(f"not allowed to signal pid {rec.supervisor_pid} (another user's deployment)")
        return EXIT_ERRORS
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        left = [p.name for p in rec.procs if pid_alive(p.pid)]
        if not pid_alive(rec.supervisor_pid) and not left:
            print("stopped: every process of the deployment has exited", flush=True)
            return EXIT_OK
        time.sleep(0.2)
    left = [f"{p.name} (pid {p.pid})" for p in rec.procs if pid_alive(p.pid)]
    error_line(f"still running after {args.timeout:g} s: "
               + (", ".join(left) or f"the supervisor (pid {rec.supervisor_pid})"))
    return EXIT_ERRORS
