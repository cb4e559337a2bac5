"""`pdtool logs NAME`: the log of one process of a running local deployment (or the
supervisor's log folder listing with no NAME), optionally following it."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pdtool.commands._common import EXIT_ERRORS, EXIT_OK, error_line
from pdtool.commands.status import add_job_arguments
from pdtool.launch.record import pick

NAME = "logs"
HELP = "print (or follow) the log of one process of a running local deployment"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", default=None,
                   help="the process, as `pdtool status` names it (e.g. decode-1, router); "
                        "without it, the names and their logs")
    add_job_arguments(p)
    p.add_argument("-n", "--lines", type=int, default=50,
                   help="how many of the last lines to print (default 50; 0: all)")
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep printing what is appended until Ctrl-C or the deployment stops")


def _tail(path: Path, lines: int) -> tuple[str, int]:
    """The last `lines` lines of `path` (all with 0), and the offset they end at."""
    data = path.read_bytes()
    text = data.decode(errors="replace")
    kept = text.splitlines(keepends=True)
    return "".join(kept[-lines:] if lines > 0 else kept), len(data)


def run(args: argparse.Namespace) -> int:
    try:
        rec = pick(args.root, args.job)
        if args.name is None:
            for p in rec.procs:
                print(f"{p.name}  {p.log}")
            return EXIT_OK
        proc = rec.proc(args.name)
    except (LookupError, ValueError) as e:
        error_line(str(e))
        return EXIT_ERRORS
    path = Path(proc.log)
    try:
        text, offset = _tail(path, args.lines)
    except OSError as e:
        error_line(f"cannot read {path}: {e.strerror}")
        return EXIT_ERRORS
    sys.stdout.write(text)
    sys.stdout.flush()
    while args.follow and rec.alive:
        time.sleep(0.5)
        try:
            with path.open("rb") as fh:
                fh.seek(offset)
                more = fh.read()
        except OSError:
            continue
        if more:
            offset += len(more)
            sys.stdout.write(more.decode(errors="replace"))
            sys.stdout.flush()
    return EXIT_OK
