"""`pdtool recipes`: the recipes in recipes/ with their one-line descriptions."""

from __future__ import annotations

import argparse

from pdtool.commands._common import console, dump_json

NAME = "recipes"
HELP = "list the deployment recipes (+recipe=NAME) with a one-line description"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from pdtool.compose import recipe_description, recipe_files

    rows = [(name, recipe_description(path), str(path)) for name, path in recipe_files().items()]
    if args.json:
        dump_json([{"name": n, "description": d, "path": p} for n, d, p in rows])
        return 0
    t = Table(title="recipes (use: pdtool validate +recipe=NAME)", title_justify="left")
    t.add_column("name", style="bold cyan", no_wrap=True)
    t.add_column("description", overflow="fold")
    for n, d, _ in rows:
        t.add_row(n, d)
    console().print(t)
    return 0
