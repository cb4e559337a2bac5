"""The environment an SGLang worker's transfer backend reads (pdtool's, mooncake or nixl).

Every backend runs under SGLang's own request timers (0.5.23 `environ.py`), which pdtool sets
from the transfer keys: `transfer.timeout_s` -> `SGLANG_DISAGGREGATION_WAITING_TIMEOUT` (a
decode request that bootstrapped and whose KV stops arriving fails after it; SGLang's default
is 300 s), `transfer.connect_timeout_s` -> `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` (a
prefill request whose decode never sent its page list, e.g. a dead decode server, fails after
it). Both in whole seconds, rounded up.

What SGLang 0.5.23's own backends (transfer.backend=mooncake|nixl) need besides:

pdtool renders their NICs itself (one `--disaggregation-ib-device` entry per GPU, from the
plan's GPU -> NIC map: pdtool.launch.sglang); what each backend reads besides, checked in
0.5.23's source (`distributed/device_communicators/mooncake_transfer_engine.py`,
`disaggregation/nixl/conn.py`, `environ.py`):

* mooncake picks its transport from `MOONCAKE_PROTOCOL` (default `rdma`; `efa` on AWS EFA,
  whose devices are not verbs devices for it), and `MC_FORCE_TCP=1` replaces RDMA by TCP,
  ignoring the device map: rendered for tcp (and for shm, one machine without RDMA NICs).
* nixl creates the backend `SGLANG_DISAGGREGATION_NIXL_BACKEND` names (default `UCX`, which
  takes the per-GPU device map as its `device_list`). On EFA it is NIXL's `LIBFABRIC`
  backend, libfabric's efa provider (FI_PROVIDER/FI_EFA_IFACE from the plan restrict it to
  the node's chosen EFAs; NIXL picks each GPU's rails by topology).

launcher.env overrides any of these (the role's launcher.env is applied after them).
"""

from __future__ import annotations

import math

from pdtool.schema import Config

#: SGLang 0.5.23's `/health` runs a one-token generation and answers once the scheduler sends
#: anything back (`entrypoints/http_server.py` health_generate): a prefill working through a
#: long prompt sends nothing until it is done, so the watchdog's and the router's probes missed
#: and restarted a busy, healthy server (measured: tests/test_sglang_servers.py). With this
#: variable `/health` answers from the HTTP process once warm-up is over (503 before, and
#: while shutting down); a scheduler that hangs in a forward pass is SGLang's own
#: `--watchdog-timeout` to end (it exits, and the launchers see the exit).
LIVENESS = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}


def rdma_provider(cfg: Config) -> bool:
    """Whether transfer.provider drives RDMA NICs (efa, verbs), which SGLang's own backends
    are given by name; over tcp and shm they use none."""
    return cfg.transfer.provider == "efa" or cfg.transfer.provider.startswith("verbs")


def timer_env(cfg: Config) -> dict[str, str]:
    """SGLang's request timers from transfer.timeout_s and transfer.connect_timeout_s, and a
    `/health` that answers without queueing behind work (see LIVENESS)."""
    t = cfg.transfer
    return {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(math.ceil(t.timeout_s)),
            "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(math.ceil(t.connect_timeout_s)),
            **LIVENESS}


def backend_env(cfg: Config) -> dict[str, str]:
    """Variables a worker process of SGLang's own backend gets for transfer.provider."""
    backend, provider = cfg.transfer.backend, cfg.transfer.provider
    if backend == "mooncake":
        if rdma_provider(cfg):
            return {"MOONCAKE_PROTOCOL": "efa" if provider == "efa" else "rdma"}
        return {"MC_FORCE_TCP": "1"}  # tcp, or shm: no RDMA device to use
    if backend == "nixl":
        return {"SGLANG_DISAGGREGATION_NIXL_BACKEND": "LIBFABRIC" if provider == "efa"
                else "UCX"}
    return {}
