"""`pdtool config`: the resolved config of a deployment, or with `--keys` every key with its
type, resolved value and one line of meaning (from the schema: `pdtool.keys`)."""

from __future__ import annotations

import argparse
from typing import Any

from pdtool.commands._common import (
    EXIT_OK,
    EXIT_USAGE,
    add_overrides_argument,
    console,
    dump_json,
    print_findings,
)

NAME = "config"
HELP = "print the resolved config, or with --keys every key, its type, value and meaning"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_overrides_argument(p)
    p.add_argument("--keys", nargs="?", const="", default=None, metavar="PREFIX",
                   help="list every key (or those starting with PREFIX, e.g. transfer.)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def _value(conf: Any, key: str) -> Any:
    from omegaconf import OmegaConf

    if "[]" in key:
        return None  # one per list item (cluster.nics): the resolved config shows them
    return OmegaConf.select(conf, key, throw_on_missing=False)


def run(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from pdtool.compose import config_to_yaml, load_config
    from pdtool.keys import schema_keys
    from pdtool.launch.secrets import redacted

    cfg, problems = load_config(list(args.overrides))
    if cfg is None:
        con = console(stderr=True)
        con.print("[bold red]config does not compose:[/]")
        print_findings(con, problems)
        return EXIT_USAGE
    cfg = redacted(cfg)
    if args.keys is None:
        if args.json:
            dump_json(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
        else:
            print(config_to_yaml(cfg), end="")
        return EXIT_OK
    conf = OmegaConf.structured(cfg)
    rows = [(k, _value(conf, k.key)) for k in schema_keys() if k.key.startswith(args.keys)]
    if not rows:
        console(stderr=True).print(f"[bold red]pdtool config:[/] no key starts with "
                                   f"{args.keys!r}")
        return EXIT_USAGE
    if args.json:
        dump_json([{"key": k.key, "type": k.type, "value": _plain(v), "meaning": k.meaning}
                   for k, v in rows])
        return EXIT_OK
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"config keys ({cfg.recipe or 'default'}; values as resolved)",
              title_justify="left", pad_edge=False)
    t.add_column("key", style="bold cyan", no_wrap=True)
    t.add_column("type", no_wrap=True)
    t.add_column("value", overflow="fold")
    t.add_column("meaning", overflow="fold")
    for k, v in rows:
        t.add_row(k.key, k.type, escape("" if v is None else str(_plain(v))), escape(k.meaning))
    console().print(t)
    return EXIT_OK


def _plain(v: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(v, resolve=True) if isinstance(v, DictConfig | ListConfig) \
        else v
