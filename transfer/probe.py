"""Fabric probe: the bandwidth one prefill rank gets into one decode rank, measured with the
messenger's own endpoints (one per NIC, `transfer.sglang.rails`) before a deployment loads
any weights.

A decode rank opens its rails, registers a landing buffer of `nbytes` on each and hands out a
`descriptor` (each rail's address and registration, JSON-ready). A prefill rank opens its own
rails and, for each NIC pair `rail_pairs` gives (every NIC on both sides carries a share, as
the messenger stripes requests), writes `nbytes` in `WRITE_BYTES` writes and times them from
the first submission to the last local completion (on tcp the last few MiB may still sit in
socket buffers then: a few per cent of a few hundred MiB). The target counts what arrives in
the slot the source was given, as a decoder counts a request's writes; it needs no message
back, and it knows when every source it expects is done (`ProbeTarget.wait`).

docs/fabric-check.md says how pdtool uses it to gate a deployment.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from transfer import fabric
from transfer.sglang.rails import Rails, rail_specs

#: one RMA write (4 MiB: large enough to run at link speed, small against the total)
WRITE_BYTES = 4 << 20


def rail_pairs(src_rails: int, dst_rails: int) -> list[tuple[int, int]]:
    """(source rail, target rail) for each pair probed: k % M with k % N, k < max(M, N)."""
    return [(k % src_rails, k % dst_rails) for k in range(max(src_rails, dst_rails))]


def writes_per_pair(nbytes: int) -> int:
    """The timed writes of `nbytes`, after one untimed write (the connection's set-up)."""
    return math.ceil(nbytes / WRITE_BYTES) + 1


def expected_writes(src_rails: list[int], dst_rails: int, nbytes: int) -> int:
    """What a target with `dst_rails` rails receives from sources with these rail counts."""
    return sum(len(rail_pairs(m, dst_rails)) for m in src_rails) * writes_per_pair(nbytes)


@dataclass(frozen=True)
class PairResult:
    src_nic: str
    dst_nic: str
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Gbit/s, as NIC link speeds are given."""
        return self.nbytes * 8 / self.seconds / 1e9


def _open(provider: str, nics: tuple[str, ...], local_ip: str | None, nbytes: int,
          receive: bool, slots: int) -> tuple[Rails, np.ndarray, fabric.MemoryRegion]:
    rails = Rails.open(provider, rail_specs(provider, nics, local_ip), max(1, slots),
                       receive=receive)
    try:
        buf = np.ones(nbytes, dtype=np.uint8)  # written: no page faults inside the timing
        addr, length = fabric.buffer_address(buf)
        mr = rails.register(addr, length, remote_write=receive)
    except Exception:
        rails.close()
        raise
    return rails, buf, mr


class ProbeTarget:
    """A decode rank's landing buffer on each of its NICs, for `sources` prefill ranks."""

    def __init__(self, provider: str, nics: tuple[str, ...], local_ip: str | None,
                 nbytes: int, sources: int) -> None:
        self.rails, self._buf, mr = _open(provider, nics, local_ip, nbytes, True, sources)
        self.regions = [self.rails.twin(mr, i) for i in range(len(self.rails))]
        self.rails.start_lanes()
        self.rails.primary.start_progress()

    def descriptor(self) -> dict[str, Any]:
        return {"rails": [{"nic": label, "name": ep.name.hex(),
                           "region": region.descriptor().to_dict()}
                          for label, ep, region in zip(self.rails.labels, self.rails.eps,
                                                       self.regions, strict=True)]}

    def received(self) -> int:
        return int(self.rails.primary.recv_counts.sum())

    def wait(self, expected: int, timeout: float) -> bool:
        """True once `expected` writes have landed (over all rails and sources)."""
        deadline = time.monotonic() + timeout
        while self.received() < expected:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def close(self) -> None:
        self.rails.primary.stop_progress()
        self.rails.close()


class ProbeSource:
    """A prefill rank's NICs and a source buffer of `nbytes` registered on each."""

    def __init__(self, provider: str, nics: tuple[str, ...], local_ip: str | None,
                 nbytes: int) -> None:
        self.nbytes = nbytes
        self.rails, self._buf, self._mr = _open(provider, nics, local_ip, nbytes, False, 1)

    def probe(self, target: dict[str, Any], slot: int, timeout: float) -> list[PairResult]:
        """Write `nbytes` over each NIC pair into `target` (a ProbeTarget.descriptor), counted
        in the target's `slot`; one result per pair, in `rail_pairs` order."""
        remote = target["rails"]
        n = writes_per_pair(self.nbytes) - 1
        offsets = np.arange(n, dtype=np.uint64) * WRITE_BYTES
        lengths = np.minimum(WRITE_BYTES, self.nbytes - offsets).astype(np.uint64)
        out = []
        for i, j in rail_pairs(len(self.rails), len(remote)):
            ep = self.rails.eps[i]
            peer = ep.insert_peer(bytes.fromhex(remote[j]["name"]))
            region = fabric.RemoteRegion.from_dict(remote[j]["region"])
            mr, imm = self.rails.twin(self._mr, i), fabric.encode_imm(slot, 0)
            self._write(ep, peer, mr, region, offsets[:1], lengths[:1], imm, timeout)
            start = time.monotonic()
            self._write(ep, peer, mr, region, offsets, lengths, imm, timeout)
            out.append(PairResult(self.rails.labels[i], remote[j]["nic"], self.nbytes,
                                  time.monotonic() - start))
            ep.remove_peer(peer)
        return out

    def _write(self, ep: fabric.Endpoint, peer: int, mr: Any, region: fabric.RemoteRegion,
               offsets: np.ndarray, lengths: np.ndarray, imm: int, timeout: float) -> None:
        tag = 0
        done = int(ep.send_done[tag])
        ops = ep.write_batch(peer, mr, region, offsets, offsets, lengths, imm, tag,
                             timeout=timeout)
        if not ep.wait_send(tag, done + ops, timeout):
            raise fabric.FabricError("probe", 110, f"{int(lengths.sum())} bytes not complete "
                                     f"in {timeout:.0f} s")

    def close(self) -> None:
        self.rails.close()
