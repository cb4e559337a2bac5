"""One endpoint per NIC beside the GPU ("rails") for a rank of the SGLang backend.

Why: a p5 node has four EFA NICs beside each GPU (p5en two), and one endpoint drives one of
them. The plan's GPU->NIC map lists every NIC on the GPU's PCIe switch and the worker passes it
as `PDTOOL_NICS` (`transfer.workerenv.nics_for`); a rank opens an endpoint on each and
registers its KV and aux memory on each (a registration belongs to one domain, so each NIC
has its own keys).

Counting stays one mechanism. On the decode side the first endpoint owns the slot table
(`transfer.plane.slots.SlotTable` over its `recv_counts`); every further endpoint is made a receive
lane of it (`Endpoint.share_counts`): its CQ data counts, atomically and in C, into the same
per-slot counts, and a slot reaching its count wakes the owner's `wait_complete` whichever NIC
carried the last operation. Each lane is drained by a C progress thread of its own. So an
operation is counted once, wherever it landed, and the expected count does not change.

The prefill side stripes: each submission of a decode peer's writes goes to the (local rail,
remote endpoint) path whose local endpoint has the fewest bytes in flight (C's own figure),
ties taken in turn. Paths pair local rail k % M with remote endpoint k % N for
k < max(M, N), so every NIC on both sides carries traffic. Staged writes (staging_plane.py)
take the same chooser: the prefill's bounce buffers and the decode's landing area are
registered on every rail like the KV pools, a bounce buffer's tag completing on whichever rail
carried each write (its completions are summed over the rails before it is reused).

Addresses (`rail_specs`): a NIC name is a libfabric domain (EFA `rdmap...`, with its `-rdm`
RDM domain tried too; verbs devices; tcp interface names such as `eth1`). With `tcp;ofi_rxm` an
entry may instead be an IPv4/IPv6 address: that endpoint binds the address (fi_getinfo node
hint, no domain), which is how one machine tests several rails on 127.0.0.2, 127.0.0.3, ...
A tcp domain with the host's address as node hint only opens on the interface holding it, so
with several tcp NICs each endpoint takes its interface's own address (no node hint).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from transfer import fabric
from transfer.plane.idle import idle_options

logger = logging.getLogger(__name__)

SOCKET_PROVIDERS = ("tcp", "sockets")


class RailError(RuntimeError):
    """No endpoint could be opened for the rank's first NIC (the text names the setting), or
    memory could not be registered on one of the rank's NICs."""


@dataclass(frozen=True)
class RailSpec:
    """Where one endpoint opens: libfabric domain and node hint (None: the provider picks)."""

    label: str
    domain: str | None
    node: str | None


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def rail_specs(provider: str, nics: tuple[str, ...], local_ip: str | None) -> list[RailSpec]:
    """One spec per NIC the rank opens (at least one). `shm` has one domain per host: one
    rail. `local_ip` is SGLang's address of this host (the node hint of a single tcp rail)."""
    sockets = provider.startswith(SOCKET_PROVIDERS)
    if provider == "shm" or not nics:
        return [RailSpec(nics[0] if nics else "default", None,
                         local_ip if sockets and provider != "shm" else None)]
    out: list[RailSpec] = []
    for nic in dict.fromkeys(nics):  # order kept, duplicates dropped
        if sockets and _is_address(nic):
            out.append(RailSpec(nic, None, nic))
        elif sockets:
            out.append(RailSpec(nic, nic, local_ip if len(nics) == 1 else None))
        else:
            out.append(RailSpec(nic, nic, None))
    return out


def _open_one(provider: str, spec: RailSpec, max_slots: int, fallback: bool,
              **kw: Any) -> fabric.Endpoint | None:
    """The endpoint for `spec`: its domain, EFA's `-rdm` twin, then (first rail only) the
    provider's default NIC with a warning (it works, only slower when it is the wrong one)."""
    tried: list[str | None] = [spec.domain]
    if spec.domain and provider != "shm":
        tried.append(f"{spec.domain}-rdm")
    if fallback and spec.domain is not None:
        tried.append(None)
    last: Exception | None = None
    for domain in tried:
        try:
            ep = fabric.Endpoint(provider, domain=domain, node=spec.node, max_slots=max_slots,
                                 **kw)
        except fabric.FabricError as exc:
            last = exc
            continue
        if spec.domain and domain is None:
            logger.warning("pdtool: no libfabric domain %r (or %r) for provider %s; using %s",
                           spec.domain, f"{spec.domain}-rdm", provider, ep.domain)
        return ep
    if fallback:
        raise RailError(f"cannot open a libfabric {provider!r} endpoint (PDTOOL_FI_PROVIDER) on "
                        f"{spec.label!r}: {last}") from last
    logger.warning("pdtool: NIC %r (PDTOOL_NICS) cannot be opened with %s, left out: %s",
                   spec.label, provider, last)
    return None


@dataclass
class Rails:
    """A rank's endpoints, one per NIC; `primary` (the first) owns the decode slot table.

    Memory registered with `register` is registered on every rail; `twin(mr, i)` is that
    memory's registration on rail i (None for memory registered on the primary only)."""

    eps: list[fabric.Endpoint]
    labels: list[str]
    _twins: dict[int, list[fabric.MemoryRegion]] = field(default_factory=dict)
    lanes_started: bool = False

    @classmethod
    def open(cls, provider: str, specs: list[RailSpec], max_slots: int, *,
             receive: bool, hmem: bool = False) -> Rails:
        """Open every rail; `receive` (decode) makes the others lanes of the first. A NIC
        after the first that does not open is left out with a warning. `hmem`: FI_HMEM
        endpoints (CUDA pools registered directly, transfer.gpu_memory=direct). Waits on
        either side sleep between empty polls (`transfer.plane.idle`): SGLang's scheduler
        computes on the same cores."""
        eps: list[fabric.Endpoint] = []
        labels: list[str] = []
        idling = idle_options(provider, receiver=receive)
        try:
            for i, spec in enumerate(specs):
                ep = _open_one(provider, spec, max_slots, fallback=i == 0, hmem=hmem, **idling)
                if ep is None:
                    continue
                if eps and receive:
                    ep.share_counts(eps[0])
                eps.append(ep)
                labels.append(spec.label)
        except Exception:
            for ep in reversed(eps):
                ep.close()
            raise
        return cls(eps, labels)

    @property
    def primary(self) -> fabric.Endpoint:
        return self.eps[0]

    def __len__(self) -> int:
        return len(self.eps)

    @property
    def iov_limit(self) -> int:
        return min(ep.iov_limit for ep in self.eps)

    def register(self, addr: int, length: int, **kw: Any) -> fabric.MemoryRegion:
        """Register [addr, addr+length) on every rail; returns the primary's registration.
        Memory registered once the decode's lanes run (its landing area on the direct path,
        made for the first request that needs one) stops each lane's thread for the call
        (the provider is the thread's while it runs); RailError when one does not stop."""
        mrs: list[fabric.MemoryRegion] = []
        try:
            for i, ep in enumerate(self.eps):
                with self._paused(i):
                    mrs.append(ep.register(addr, length, **kw))
        except Exception:
            for i, mr in enumerate(mrs):
                with self._paused(i):
                    mr.close()
            raise
        self._twins[id(mrs[0])] = mrs
        return mrs[0]

    def release(self, mr: fabric.MemoryRegion) -> None:
        """Deregister memory `register` registered, on every rail."""
        for i, twin in enumerate(self._twins.pop(id(mr), [mr])):
            with self._paused(i):
                twin.close()

    @contextlib.contextmanager
    def _paused(self, rail: int) -> Iterator[None]:
        """Rail `rail`'s provider is the caller's for the block: a lane's thread is stopped
        and started again after (a no-op before `start_lanes` and for the primary)."""
        ep = self.eps[rail]
        if not (rail and self.lanes_started):
            yield
            return
        if not ep.stop_progress():
            raise RailError(f"NIC {self.labels[rail]!r}: its progress thread is stuck in the "
                            f"provider ({ep.progress_stalled_s:.1f} s in one poll); memory "
                            f"cannot be registered on it")
        try:
            yield
        finally:
            ep.start_progress()

    def twin(self, mr: fabric.MemoryRegion, rail: int) -> fabric.MemoryRegion | None:
        if rail == 0:
            return mr
        mrs = self._twins.get(id(mr))
        return mrs[rail] if mrs is not None else None

    def start_lanes(self) -> None:
        """Decode: each further rail's CQ is drained by its own C thread from now on (the
        provider is then the thread's alone: `register` pauses it for later registrations)."""
        if not self.lanes_started:
            for ep in self.eps[1:]:
                ep.start_progress()
            self.lanes_started = True

    def poll(self) -> int:
        """Drain every rail's CQ once (the prefill's writer thread drives their progress)."""
        return sum(ep.poll() for ep in self.eps)

    def errors(self) -> list[tuple[int, int, str]]:
        return [e for ep in self.eps for e in ep.errors]

    def send_done(self, tag: int) -> int:
        return sum(int(ep.send_done[tag]) for ep in self.eps)

    def remote_writes(self) -> list[int]:
        """CQ-data completions each rail received (the decoder's spread over its NICs)."""
        return [ep.remote_writes for ep in self.eps]

    def close(self) -> None:
        """Lanes first: they count into the primary's arrays."""
        for ep in reversed(self.eps):
            ep.close()
