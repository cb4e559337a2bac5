"""`pdtool discover`: write a cluster preset from the node this runs on (pdtool.discover).

Run it on one node of the site (inside `srun` to see what a job step gets), then
`pdtool validate +recipe=... hydra.searchpath=[file://DIR] cluster=NAME`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "discover"
HELP = "write a cluster preset (cluster=NAME) from this node's GPUs, NICs and CPUs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="discovered",
                   help="the preset's name, as cluster=NAME selects it (default: discovered)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="write DIR/cluster/NAME.yaml (default: print it)")
    p.add_argument("--root", type=Path, default=Path("/"), help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    import re

    from pdtool.commands._common import EXIT_USAGE, console
    from pdtool.discover import discover

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.name):
        console(stderr=True).print(f"[bold red]pdtool discover:[/] --name {args.name!r}: use "
                                   "letters, digits, '.', '_' and '-' (it is a file name)")
        return EXIT_USAGE
    text = discover(args.name, args.root)
    if args.out is None:
        print(text, end="")
        return 0
    path = args.out / "cluster" / f"{args.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    folder = args.out.resolve()
    print(f"wrote {path}\nuse it with: pdtool validate +recipe=... "
          f"'hydra.searchpath=[file://{folder}]' cluster={args.name}")
    return 0
