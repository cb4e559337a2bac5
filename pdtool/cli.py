"""The `pdtool` command: a thin dispatcher over `pdtool.commands.<name>` modules.

Adding a subcommand = writing `pdtool/commands/<name>.py` (see pdtool/commands/__init__.py)
and adding its name to COMMANDS below.

Exit codes: 0 success, 1 the config has errors (or the command failed), 2 a bad command line
or a config that does not compose. No Python traceback reaches the user for bad input; an
unexpected exception (a bug) is printed as one line unless PDTOOL_DEBUG=1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType

from pdtool import __version__

COMMANDS: tuple[str, ...] = (
    "validate",
    "plan",
    "recipes",
    "config",
    "discover",
    "render",
    "launch",  # launch issue: pdtool/commands/{render,launch}.py
    "bench",
    "size",
    "status",
    "logs",
    "stop",
)

EPILOG = """\
overrides use Hydra syntax: +recipe=NAME, key=value (prefill.tp=4), group=option
(cluster=p5en, launcher=slurm), +launcher.env.prefill.NAME=value; with -m, key=a,b,c
sweeps. Examples:
  pdtool validate +recipe=deepseek-r1
  pdtool plan +recipe=llama-3.1-70b decode.tp=8 cluster.nodes=3 --tokens 8192
  pdtool validate -m +recipe=deepseek-r1 decode.instances=1,2,3
  pdtool bench +recipe=tiny-local --launch --concurrency 1,4 --isl 64-2000 --osl 32
"""


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"pdtool.commands.{name}")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="pdtool",
        description="Declarative disaggregated prefill/decode serving: validate, plan, "
        "render and launch deployments described by Hydra configs.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pdtool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subs: dict[str, argparse.ArgumentParser] = {}
    for name in COMMANDS:
        mod = _module(name)
        p = sub.add_parser(
            name,
            help=mod.HELP,
            description=mod.HELP,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
        subs[name] = p
    return parser, subs


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subs = build_parser()
    if argv and argv[0] in subs:
        # intermixed: options may follow overrides (`pdtool plan +recipe=x --json`)
        args = subs[argv[0]].parse_intermixed_args(argv[1:])
    else:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
    try:
        return int(args._run(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a pdtool bug, not bad input: say so without a traceback
        if os.environ.get("PDTOOL_DEBUG"):
            raise
        print(
            f"pdtool {argv[0] if argv else ''}: internal error: {type(e).__name__}: {e}\n"
            "(set PDTOOL_DEBUG=1 to see the traceback, and please report it)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
