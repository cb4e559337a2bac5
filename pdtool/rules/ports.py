"""Ports: every listening port in range and unique per machine; the router agrees with them.

Instance i of a role listens on the ports `pdtool.ports.instance_ports` models: its HTTP port
and what SGLang derives from it (with DP attention: +13 and +233..+239), its dist-init port
(and, across nodes with DP attention, +1..+6 and +13), and for prefill its bootstrap port,
all on its head node; packed instances' bases are spaced so their own ports never meet. The
router binds `router.port` on node 0 (sglang-router also `router.port + 1`, its metrics).
With the local launcher every process shares one machine, so all of them must differ. The
router's prefill entries (URL + bootstrap port) are derived from the same numbers in the plan,
so they agree with the workers by construction.
"""

from __future__ import annotations

from pdtool.plan import placements
from pdtool.ports import instance_ports, router_ports
from pdtool.rules.finding import Finding, error
from pdtool.schema import ROLES, Config, RoleConfig, role

LOW, HIGH = 1024, 65535


def _bindings(cfg: Config) -> list[tuple[int, int, str, str]]:
    """(host, port, config key, what) for every listening socket of the deployment."""
    local = cfg.launcher.kind == "local"
    places = placements(cfg)
    out = [(0, port, "router.port", what) for port, what in router_ports(cfg)]
    for r in ROLES:
        for i in range(role(cfg, r).instances):
            host = 0 if local else places[(r, i)][0][0]
            out += [(host, port, key, f"{r}-{i} {what} ({key} + {port - _base(cfg, key)})"
                     if port != _base(cfg, key) else f"{r}-{i} {what}")
                    for port, key, what in instance_ports(cfg, r, i)]
    return out


def _base(cfg: Config, key: str) -> int:
    rname, field = key.split(".")
    return getattr(role(cfg, rname), field)


def _value(cfg: Config, key: str) -> int:
    node: object = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return int(node)  # type: ignore[call-overload]


def check_ports(cfg: Config) -> list[Finding]:
    out: list[Finding] = []
    reported: set[str] = set()
    bindings = _bindings(cfg)
    for _, port, key, what in bindings:
        if not LOW <= port <= HIGH and key not in reported:
            reported.add(key)
            # the range the key itself may take: every port derived from it stays in range
            base = _value(cfg, key)
            offsets = [p - base for _, p, k, _ in bindings if k == key]
            out.append(
                error(
                    key,
                    f"{what} would listen on port {port}, outside {LOW}..{HIGH}",
                    f"set {key} to a free port in {LOW - min(offsets)}..{HIGH - max(offsets)}",
                )
            )
    if out:
        return out
    seen: dict[tuple[int, int], tuple[str, str]] = {}
    for host, port, key, what in _bindings(cfg):
        prev = seen.get((host, port))
        if prev is None:
            seen[(host, port)] = (key, what)
            continue
        pair = tuple(sorted((prev[0], key)))
        if pair in reported:
            continue
        reported.add(pair)  # type: ignore[arg-type]
        where = "this machine" if cfg.launcher.kind == "local" else f"node {host}"
        free = max(p for _, p, _, _ in _bindings(cfg)) + 1
        out.append(
            error(
                key,
                f"{what} and {prev[1]} both listen on port {port} on {where} "
                f"({key} vs {prev[0]}; instance i uses base + i x spacing)",
                f"set {key}={free} (or another base whose range is free)",
            )
        )
    return out


def check_decode_bootstrap_port(cfg: Config) -> list[Finding]:
    """`bootstrap_port` is a field of both roles' schema, but only a prefill instance listens
    on one (SGLang's bootstrap server, the reference lead's control socket): a decode value
    set away from the default would be read by nothing."""
    default = RoleConfig().bootstrap_port
    if cfg.decode.bootstrap_port == default:
        return []
    return [error("decode.bootstrap_port",
                  f"{cfg.decode.bootstrap_port}: decode instances listen on no bootstrap port "
                  f"(only prefill instances serve one), so nothing would read it",
                  f"leave decode.bootstrap_port at its default ({default}); the prefill "
                  f"instances' is prefill.bootstrap_port")]


ALL = (check_ports, check_decode_bootstrap_port)
