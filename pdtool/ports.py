"""Every TCP port an instance listens on, and the spacing of packed instances' port bases.

Pure functions of the config, used by the planner (instance i's bases are `base + i * stride`)
and by validate (rules.ports: no two listeners share a port on one machine).

What SGLang 0.5.23 binds per instance, besides `--port` (HTTP) and, for prefill, the
`--disaggregation-bootstrap-port` (read from server_args.py `PortArgs.init_new` and
managers/data_parallel_controller.py):
* without DP attention: the NCCL/dist-init port pdtool passes (`--nccl-port` on one node, the
  `--dist-init-addr` port across nodes); the rest is IPC;
* with DP attention on one node: `port + 233` (its dist-init address, ZMQ_TCP_PORT_DELTA),
  `port + 234 .. port + 239` (tokenizer, detokenizer, RPC, metrics, scheduler input, load
  collector: port_base + 0..5) and `port + 13` (the DP-attention handshake,
  DP_ATTENTION_HANDSHAKE_PORT_DELTA), plus `--nccl-port`;
* with DP attention across nodes, on the head node: the dist-init port, its `+1 .. +6` and its
  `+13` (the handshake is derived from `--dist-init-addr` then).
sglang-router 0.3.2 binds `router.port` and its Prometheus exporter, which defaults to one fixed
port (29000) whatever `--port` says, so two deployments on one machine collided on it: pdtool
gives it `router.port + 1` (`router_ports`).
The reference engine binds its HTTP port, its dist-init port (TP > 1) and, on prefill, the
bootstrap port: the lead rank's messenger control socket, where decode ranks reach it.
"""

from __future__ import annotations

import functools

from pdtool.adapters import adapter
from pdtool.schema import Config, RoleConfig, gpus_per_instance, role

#: SGLang 0.5.23 server_args.ZMQ_TCP_PORT_DELTA, DP_ATTENTION_HANDSHAKE_PORT_DELTA, and the
#: fixed ports derived from the DP-attention port base (port_base + 0 .. 5)
ZMQ_TCP_PORT_DELTA = 233
DP_ATTENTION_HANDSHAKE_PORT_DELTA = 13
DERIVED_PORTS = 6


def router_metrics_port(cfg: Config) -> int | None:
    """The port of the front's Prometheus exporter (None: the reference front has none)."""
    return adapter(cfg).router_metrics_port(cfg)


def router_ports(cfg: Config) -> list[tuple[int, str]]:
    """(port, what) of every socket the router binds on its node."""
    metrics = router_metrics_port(cfg)
    out = [(cfg.router.port, "router")]
    if metrics is not None:
        out.append((metrics, f"router metrics (router.port + {metrics - cfg.router.port})"))
    return out


def _dp_attention(cfg: Config, rc: RoleConfig) -> bool:
    return adapter(cfg).dp_attention(rc)


def multi_node(cfg: Config, rc: RoleConfig) -> bool:
    """True when an instance spans nodes (SGLang then takes --dist-init-addr), as the
    planner's `instance_nodes` decides."""
    return rc.nodes > 1 or gpus_per_instance(rc) > cfg.cluster.gpus_per_node


def http_offsets(cfg: Config, rc: RoleConfig) -> tuple[tuple[int, str], ...]:
    """(offset from the HTTP port, what) of the ports derived from `--port`."""
    out: list[tuple[int, str]] = [(0, "HTTP")]
    if _dp_attention(cfg, rc) and not multi_node(cfg, rc):
        out.append((DP_ATTENTION_HANDSHAKE_PORT_DELTA, "DP-attention handshake"))
        out.append((ZMQ_TCP_PORT_DELTA, "DP-attention dist-init"))
        out += [(ZMQ_TCP_PORT_DELTA + 1 + k, "DP-attention ZMQ") for k in range(DERIVED_PORTS)]
    return tuple(out)


def dist_offsets(cfg: Config, rc: RoleConfig) -> tuple[tuple[int, str], ...]:
    """(offset from the dist-init port, what) of the ports derived from it (on the head node)."""
    out: list[tuple[int, str]] = [(0, "dist-init")]
    if _dp_attention(cfg, rc) and multi_node(cfg, rc):
        out += [(1 + k, "DP-attention ZMQ") for k in range(DERIVED_PORTS)]
        out.append((DP_ATTENTION_HANDSHAKE_PORT_DELTA, "DP-attention handshake"))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def stride(offsets: tuple[tuple[int, str], ...], instances: int) -> int:
    """Smallest spacing of `instances` port bases whose derived ports never meet.

    Instances i < j collide when two offsets differ by (j - i) * s, so a spacing is good when
    no offset difference is a multiple k * s with 0 < k < instances. Cached: the planner and
    the port rule ask it once per instance."""
    offs = sorted({o for o, _ in offsets})
    diffs = {b - a for a in offs for b in offs if b > a}
    s = 1
    while any(d % s == 0 and d // s < instances for d in diffs):
        s += 1
    return s


def http_stride(cfg: Config, rname: str) -> int:
    rc = role(cfg, rname)
    return stride(http_offsets(cfg, rc), rc.instances)


def dist_stride(cfg: Config, rname: str) -> int:
    rc = role(cfg, rname)
    return stride(dist_offsets(cfg, rc), rc.instances)


def has_bootstrap(cfg: Config, rname: str) -> bool:
    """A prefill instance of a disaggregated deployment listens on its bootstrap port; with
    mode=aggregated no KV moves and nothing does."""
    return rname == "prefill" and cfg.mode != "aggregated"


def instance_ports(cfg: Config, rname: str, i: int) -> list[tuple[int, str, str]]:
    """(port, config key, what) of every listener of instance `i` of a role, on its head node."""
    rc = role(cfg, rname)
    http = rc.http_port + i * http_stride(cfg, rname)
    dist = rc.dist_init_port + i * dist_stride(cfg, rname)
    out = [(http + o, f"{rname}.http_port", what) for o, what in http_offsets(cfg, rc)]
    out += [(dist + o, f"{rname}.dist_init_port", what) for o, what in dist_offsets(cfg, rc)]
    if has_bootstrap(cfg, rname):
        out.append((rc.bootstrap_port + i, f"{rname}.bootstrap_port", "bootstrap"))
    return out


def deployment_listeners(cfg: Config) -> list[tuple[int, str, str]]:
    """(port, config key, what) of every listener of the deployment, all roles and instances
    together: on one machine, what a second deployment beside it must not take."""
    out = [(p, "router.port", what) for p, what in router_ports(cfg)]
    for rname in ("prefill", "decode"):
        for i in range(role(cfg, rname).instances):
            out += [(p, key, f"{rname}-{i} {what}")
                    for p, key, what in instance_ports(cfg, rname, i)]
    return out


def deployment_ports(cfg: Config) -> set[int]:
    """Every port of `deployment_listeners`."""
    return {p for p, _, _ in deployment_listeners(cfg)}
