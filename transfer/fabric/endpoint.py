"""One RDM endpoint: its address vector, completion queue and per-slot counters, the memory
registered in its domain, its peers and its writes. Waits and wake-ups (`waits`) and lanes and
progress threads (`lanes`) are its other two parts."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .domain import Domain
from .errors import FabricError, GpuMemoryError
from .lanes import Lanes
from .native import ERRBUF, check, ffi, lib
from .shm import _clear_stale_shm
from .values import (
    DEFAULT_CQ_SIZE,
    DEFAULT_MAX_INFLIGHT_BYTES,
    DEFAULT_TIMEOUT_S,
    MAX_SLOTS,
    SHM_DRAIN_SLEEP_S,
    RemoteRegion,
    WriteGroup,
    buffer_address,
)
from .waits import Waits

log = logging.getLogger("transfer.fabric")

# fi_mr_mode bits (rdma/fabric.h, stable ABI values)
_FI_MR_LOCAL = 1 << 2
_FI_MR_VIRT_ADDR = 1 << 4
_FI_MR_ALLOCATED = 1 << 5
_FI_MR_PROV_KEY = 1 << 6
_FI_MR_ENDPOINT = 1 << 8

_IFACES = {"system": lib.PD_HMEM_SYSTEM, "cuda": lib.PD_HMEM_CUDA}
# enum fi_addr_format (rdma/fabric.h): FI_SOCKADDR, FI_SOCKADDR_IN, FI_SOCKADDR_IN6
_FI_SOCKADDR = 1
_SOCKADDR_LEN = {2: 16, 3: 28}
_FAMILY_LEN = {2: 16, 10: 28}  # AF_INET, AF_INET6 -> sizeof(sockaddr_in[6])
_ADDR_STR_MAX = 256            # shm's SMR_NAME_MAX


class MemoryRegion:
    """A registered buffer: local handle (`desc` for FI_MR_LOCAL) plus `descriptor()` for peers."""

    def __init__(self, ep: Endpoint, handle: Any, key: int, addr: int, length: int,
                 iface: str) -> None:
        self._ep = ep
        self._h = handle
        self.key = key
        self.addr = addr
        self.length = length
        self.iface = iface
        self.dmabuf = False  # registered through a dma-buf (CUDA memory, libfabric >= 1.20)

    @property
    def desc(self) -> Any:
        """The provider's local descriptor (cffi `void *`, may be NULL); write_batch passes it
        on every write, which FI_MR_LOCAL providers require and others ignore."""
        return lib.pd_mr_desc(self._h) if self._h is not None else None

    def descriptor(self) -> RemoteRegion:
        base = self.addr if self._ep.mr_virt_addr else 0
        return RemoteRegion(base=base, key=self.key, length=self.length)

    @property
    def closed(self) -> bool:
        return self._h is None

    def close(self) -> None:
        """Deregister. Only once no write using it is outstanding (see Endpoint.wait_idle)."""
        if self._h is not None:
            with self._ep._lock:
                lib.pd_mr_close(self._h)
                self._h = None
            self._ep._mrs.discard(self)

    def __repr__(self) -> str:
        return f"MemoryRegion(addr=0x{self.addr:x}, length={self.length}, key=0x{self.key:x})"


def _u64(name: str, a: Any) -> np.ndarray:
    if type(a) is np.ndarray and a.dtype == np.uint64 and a.flags.c_contiguous and a.ndim == 1:
        return a  # the common case, no copy
    arr = np.ascontiguousarray(a, dtype=np.uint64)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {arr.shape}")
    return arr


_NO_CUDA = ("transfer.gpu_memory=direct is not possible with provider {prov}: {why}. This "
            "libfabric cannot register CUDA memory (-FI_ENOSYS: built without CUDA, as "
            "Debian's libfabric 1.17 is, or its CUDA support did not initialize). Use "
            "transfer.gpu_memory=staged (KV through registered host memory, copied to and from "
            "the GPU) or a libfabric built with CUDA (EFA installer, MOFED/HPC-X)")


def _check_options(max_slots: int, max_outstanding: int, drain_sleep_s: float | None,
                   max_inflight_bytes: int, cq_size: int, idle_spins: int,
                   idle_sleep_s: float, idle_max_sleep_s: float) -> None:
    """ValueError naming the first Endpoint option out of range, before anything is opened."""
    if not 0 < max_slots <= MAX_SLOTS:
        raise ValueError(f"max_slots must be in [1, {MAX_SLOTS}], got {max_slots}")
    if max_outstanding < 1:
        raise ValueError(f"max_outstanding must be >= 1, got {max_outstanding}")
    if drain_sleep_s is not None and not 0 <= drain_sleep_s < 1:
        raise ValueError(f"drain_sleep_s must be in [0, 1) seconds, got {drain_sleep_s!r}")
    if not isinstance(max_inflight_bytes, int) or max_inflight_bytes < 0:
        raise ValueError(f"max_inflight_bytes must be an int >= 0 (0: no cap), got "
                         f"{max_inflight_bytes!r}")
    if not isinstance(cq_size, int) or cq_size < 0:
        raise ValueError(f"cq_size must be an int >= 0, got {cq_size!r}")
    if not isinstance(idle_spins, int) or idle_spins < 0:
        raise ValueError(f"idle_spins must be an int >= 0, got {idle_spins!r}")
    if not 0 <= idle_sleep_s < 1:
        raise ValueError(f"idle_sleep_s must be in [0, 1) seconds, got {idle_sleep_s!r}")
    if not 0 <= idle_max_sleep_s < 1:
        raise ValueError(f"idle_max_sleep_s must be in [0, 1) seconds, got "
                         f"{idle_max_sleep_s!r}")


class Endpoint(Waits, Lanes):
    """One RDM endpoint with its AV, CQ and per-slot counters. See the module docstring."""

    def __init__(
        self,
        provider: str = "shm",
        *,
        domain: str | None = None,
        node: str | None = None,
        service: str | None = None,
        max_slots: int = MAX_SLOTS,
        remote_counter: bool = False,
        max_outstanding: int = 1 << 16,
        yield_when_idle: bool = True,
        idle_spins: int = 64,
        idle_sleep_s: float = 0.0,
        idle_max_sleep_s: float = 0.0,
        cq_size: int = DEFAULT_CQ_SIZE,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        drain_sleep_s: float | None = None,
        hmem: bool = False,
        same_domain_as: Endpoint | None = None,
    ) -> None:
        """The ladder: check the options, open (or share) the domain, open the endpoint in
        it, set how its waits idle, read what the provider granted, hand C the counters."""
        _check_options(max_slots, max_outstanding, drain_sleep_s, max_inflight_bytes, cq_size,
                       idle_spins, idle_sleep_s, idle_max_sleep_s)
        self._lock = threading.Lock()
        self._mrs: set[MemoryRegion] = set()
        self._h: Any = None
        self._lane_mrs: dict[int, MemoryRegion] = {}
        self._peers: set[int] = set()
        self._names: list[bytes] = []  # every name inserted, at its fi_addr (reset)
        self.kept_peers = 0  # shm: removed peers left in the AV (remove_peer)
        self.resets = 0  # reset() calls
        self._lane_arrays: dict[tuple, np.ndarray] = {}  # see _lanes
        self._progress = False
        self._owner: Endpoint | None = None
        self._open(provider, domain, node, service, remote_counter, hmem, same_domain_as,
                   max_outstanding, cq_size)
        self._read_info()
        self._set_idling(yield_when_idle, idle_spins, idle_sleep_s, idle_max_sleep_s,
                         max_inflight_bytes, drain_sleep_s)
        if self.cq_data_size < 4:
            self.close()
            raise FabricError("open endpoint", 95, f"provider {self.provider} carries only "
                              f"{self.cq_data_size} bytes of CQ data; 4 are needed for the imm")
        self._attach_counters(max_slots)
        self.name: bytes = self._getname()
        self._errors: list[tuple[int, int, str]] = []
        self._done = ffi.new("size_t *")  # per-call scratch, used under self._lock
        self._group_at = ffi.new("size_t *")  # the same, for write_groups
        self._errbuf = ffi.new("char[]", ERRBUF)

    def _open(self, provider: str, domain: str | None, node: str | None, service: str | None,
              remote_counter: bool, hmem: bool, same_domain_as: Endpoint | None,
              max_outstanding: int, cq_size: int) -> None:
        """fi_getinfo, fabric and domain (or the domain of `same_domain_as`, for a lane), then
        the endpoint with its AV and CQ."""
        if same_domain_as is not None:
            if same_domain_as.closed:
                raise ValueError("same_domain_as: that endpoint is closed")
            self._domain = same_domain_as._domain
            if provider != self._domain.provider_arg:
                raise ValueError(f"same_domain_as: provider {provider!r} differs from the "
                                 f"domain's {self._domain.provider_arg!r}")
            dom_h = lib.pd_ep_domain(same_domain_as._h)
            opened = False
        else:
            self._domain = Domain(provider, domain, node, service, remote_counter, hmem)
            dom_h, opened = self._domain.handle, True
        if provider.split(";")[0] == "shm":
            _clear_stale_shm()
        out = ffi.new("pd_ep **")
        err = ffi.new("char[]", ERRBUF)
        ret = lib.pd_ep_open(out, dom_h, max_outstanding, cq_size, err, ERRBUF)
        if opened:
            lib.pd_domain_release(dom_h)  # the endpoint (and later its MRs) hold it now
        check(ret, "open endpoint", self._domain.context, err)
        self._h = out[0]

    def _read_info(self) -> None:
        """What the provider granted: names, MR mode, CQ data size, limits, FI_HMEM."""
        info = self._domain.info
        self.addr_format: int = int(info.addr_format)
        self.provider: str = ffi.string(info.provider).decode()
        self.fabric: str = ffi.string(info.fabric).decode()
        self.domain: str = ffi.string(info.domain).decode()
        self.mr_mode: int = int(info.mr_mode)
        self.cq_data_size: int = int(info.cq_data_size)
        self.max_msg_size: int = int(info.max_msg_size)
        # writes one operation may carry (write_batch `ops`): the provider's iov and rma_iov limit
        self.iov_limit: int = int(lib.pd_iov_limit(self._h))
        self.mr_virt_addr = bool(info.mr_mode & _FI_MR_VIRT_ADDR)
        self.mr_prov_key = bool(info.mr_mode & _FI_MR_PROV_KEY)
        self.mr_local = bool(info.mr_mode & _FI_MR_LOCAL)
        self.mr_endpoint = bool(info.mr_mode & _FI_MR_ENDPOINT)
        self.rma_event = bool(info.has_rma_event)
        self.has_remote_counter = bool(lib.pd_has_remote_cntr(self._h))
        # FI_HMEM: asked for (hmem=True) and granted; `offers_hmem` says whether it could be
        self.hmem = bool(info.hmem)
        self.threading: int = int(info.threading)

    def _set_idling(self, yield_when_idle: bool, idle_spins: int, idle_sleep_s: float,
                    idle_max_sleep_s: float, max_inflight_bytes: int,
                    drain_sleep_s: float | None) -> None:
        """How the endpoint's waits spend the core, and how much it keeps in flight."""
        # Both peers busy-poll (manual progress). When a wait/retry loop finds nothing to do it
        # calls sched_yield(), so a peer sharing the core (2-core boxes, oversubscribed nodes)
        # gets to run; costs one syscall per idle spin when cores are plentiful.
        # `idle_sleep_s` > 0: after `idle_spins` empty polls in a row, sleep that long per poll
        # instead (a long wait then costs almost no CPU). Off by default: on tcp;ofi_rxm the
        # polling itself moves the bytes, and sleeping halved throughput in bench/transfer.py.
        lib.pd_set_idle(self._h, int(yield_when_idle), idle_spins, int(idle_sleep_s * 1e9))
        # `idle_max_sleep_s` > `idle_sleep_s`: that sleep doubles every 8 empty polls up to
        # it (a progress thread's active sleep too), for waits that last a whole forward pass
        lib.pd_set_idle_backoff(self._h, int(idle_max_sleep_s * 1e9))
        lib.pd_set_max_inflight_bytes(self._h, max_inflight_bytes)
        # Burst refill when the send queue is full: wait (sleeping `drain_sleep_s` per poll)
        # until half of it drained. Default on for shm only, where the target does the copy
        # and a sender posting one write per completion spins on the target's queue lock; on
        # tcp/verbs/efa the sender's own progress moves bytes, so it keeps polling.
        if drain_sleep_s is None:
            drain_sleep_s = SHM_DRAIN_SLEEP_S if self.provider == "shm" else 0.0
        lib.pd_set_drain(self._h, int(drain_sleep_s * 1e9))

    def _attach_counters(self, max_slots: int) -> None:
        """The per-slot arrays C counts into, and the words read in place without a call."""
        self.max_slots = max_slots
        self.recv_counts = np.zeros(max_slots, dtype=np.uint32)
        self.recv_gen = np.zeros(max_slots, dtype=np.uint16)
        self.send_done = np.zeros(max_slots, dtype=np.uint32)
        lib.pd_set_counters(
            self._h,
            ffi.cast("uint32_t *", self.recv_counts.ctypes.data),
            ffi.cast("uint16_t *", self.recv_gen.ctypes.data),
            ffi.cast("uint32_t *", self.send_done.ctypes.data),
            max_slots,
        )
        # read in place, without a call (each call releases the GIL): see pd_inflight_word
        self._inflight_word = np.frombuffer(
            ffi.buffer(lib.pd_inflight_word(self._h), 8), dtype=np.uint64)
        self._completions_word = np.frombuffer(
            ffi.buffer(lib.pd_completions_word(self._h), 8), dtype=np.uint64)
        self._nerr_word = np.frombuffer(
            ffi.buffer(lib.pd_nerr_word(self._h), ffi.sizeof("size_t")), dtype=np.uintp)

    # ----------------------------------------------------------------- lifecycle
    def _getname(self) -> bytes:
        namelen = ffi.new("size_t *", 256)
        namebuf = ffi.new("char[]", 256)
        ret = lib.pd_getname(self._h, namebuf, namelen)
        check(ret, "fi_getname", self.provider)
        # passed through unchanged: shm names end with a NUL that is part of the address
        return bytes(ffi.buffer(namebuf, namelen[0]))

    def _live(self) -> Any:
        if self._h is None:
            raise ValueError("endpoint is closed")
        return self._h

    def _calls(self) -> Any:
        """The handle, for calls into the provider: refused while a progress thread owns it."""
        if self._progress:
            raise ValueError("endpoint is driven by its progress thread (start_progress); "
                             "stop_progress first")
        return self._live()

    @property
    def closed(self) -> bool:
        return self._h is None

    def close(self) -> None:
        """Close MRs, endpoint, AV, CQ, domain, fabric (in that order). Idempotent. An
        endpoint whose progress thread is stuck inside the provider is leaked instead (the
        thread still uses it), with a warning."""
        if not self.stop_progress():
            log.warning("endpoint %s: its progress thread is stuck inside the provider (%.1f s "
                        "in one poll); leaking the endpoint instead of closing it under the "
                        "thread", self.name, self.progress_stalled_s)
            self._mrs.clear()
            self._h = None
            return
        for mr in list(self._mrs):
            mr.close()
        with self._lock:
            if self._h is not None:
                lib.pd_close(self._h)
                self._h = None
        self._kick_word = None  # C sleeps on it no more: its owner may unmap it now

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return f"Endpoint({self.provider!r}, domain={self.domain!r}, name={self.name!r})"

    # ----------------------------------------------------------------- memory
    def register(self, addr: int, length: int, *, remote_write: bool = True,
                 iface: str = "system", device: int = 0) -> MemoryRegion:
        """Register [addr, addr+length) in this endpoint's domain (so every lane opened with
        `open_lane` can use it, see `lane_region`).

        iface="cuda" registers GPU memory of `device` for transfer.gpu_memory=direct: the
        endpoint must be opened with `hmem=True`; this libfabric must have CUDA support (asked
        once, `cuda_registration`); the pointer is checked through the CUDA driver, loaded only
        now (device memory of `device`, one cudaMalloc allocation, not VMM/expandable
        segments); then fi_mr_regattr with FI_HMEM_CUDA and FI_HMEM_DEVICE_ONLY, as a dma-buf
        where both libfabric and the driver offer it. Any refusal raises GpuMemoryError."""
        if iface not in _IFACES:
            raise ValueError(f"iface must be one of {sorted(_IFACES)}, got {iface!r}")
        if addr <= 0 or length <= 0:
            raise ValueError(f"register: need addr > 0 and length > 0, got {addr:#x}, {length}")
        if iface == "cuda":
            self._check_cuda_capable()
        access = int(lib.PD_ACCESS_LOCAL_WRITE)
        if remote_write:
            access |= int(lib.PD_ACCESS_REMOTE_WRITE)
        out = ffi.new("pd_mr **")
        key = ffi.new("uint64_t *")
        err = ffi.new("char[]", ERRBUF)
        with self._lock:
            h = self._calls()
            requested = self._domain.next_key
            self._domain.next_key += 1
            ret = lib.pd_mr_reg(h, ffi.cast("void *", addr), length, access,
                                 _IFACES[iface], device, requested, out, key, err, ERRBUF)
        context = f"addr={addr:#x} length={length} iface={iface}"
        if ret and iface == "cuda":
            why = ffi.string(err).decode(errors="replace")
            raise GpuMemoryError("register memory", ret, f"transfer.gpu_memory=direct: cannot "
                                 f"register GPU {device}'s memory with {self.provider}: {why}",
                                 context)
        check(ret, "register memory", context, err)
        mr = MemoryRegion(self, out[0], int(key[0]), addr, length, iface)
        mr.dmabuf = bool(lib.pd_mr_uses_dmabuf(out[0]))
        self._mrs.add(mr)
        return mr

    def _check_cuda_capable(self) -> None:
        if not self.hmem:
            raise GpuMemoryError(
                "register memory", 95, f"transfer.gpu_memory=direct: this {self.provider} "
                f"endpoint was opened without FI_HMEM (Endpoint(..., hmem=True)); with "
                f"transfer.gpu_memory=staged KV moves through registered host memory instead")
        ok, why = self.cuda_registration()
        if not ok:
            raise GpuMemoryError("register memory", int(lib.PD_ENOSYS),
                                 _NO_CUDA.format(prov=self.provider, why=why))

    @property
    def offers_hmem(self) -> bool:
        """Whether the provider offers FI_HMEM on this domain (asked from fi_getinfo once).
        Necessary for direct GPU registration, not sufficient: see `cuda_registration`."""
        return self._domain.offers_hmem()

    def cuda_registration(self) -> tuple[bool, str]:
        """(True, "") when this libfabric can register CUDA memory at all, else (False, why).
        Asked without CUDA (a CUDA registration of a host page: -FI_ENOSYS means no CUDA
        support in the library), once per domain."""
        dom = self._domain
        if dom._cuda_mr is None:
            if not self.offers_hmem:
                dom._cuda_mr = (False, f"provider {self.provider} does not offer FI_HMEM")
            else:
                err = ffi.new("char[]", ERRBUF)
                with self._lock:
                    ret = lib.pd_probe_cuda_mr(self._calls(), err, ERRBUF)
                dom._cuda_mr = (ret == 0, ffi.string(err).decode(errors="replace"))
        return dom._cuda_mr

    def register_buffer(self, buf: Any, **kw: Any) -> MemoryRegion:
        """Register a contiguous numpy array or CPU torch tensor (keep it alive yourself)."""
        addr, n = buffer_address(buf)
        return self.register(addr, n, **kw)

    # ----------------------------------------------------------------- peers
    def check_peer_name(self, name: bytes) -> None:
        """ValueError unless `name` has this provider's address format and length.

        Why: fi_av_insert reads as many bytes as the provider's address format says (16 for a
        sockaddr_in, up to the NUL for shm's string names) whatever the buffer holds, so a short
        name is read past its end, and on tcp;ofi_rxm one failed insert leaves the AV refusing
        later, valid inserts. Names come from peers over the control plane: check them here.
        """
        if not isinstance(name, bytes | bytearray) or not name:
            raise ValueError("insert_peer: name must be the peer's non-empty bytes name")
        name = bytes(name)
        fmt = self.addr_format
        if fmt == lib.PD_ADDR_STR:
            # e.g. b"fi_shm://<pid>:0:0\0": one NUL, at the end, printable before it
            body = name[:-1]
            if (not name.endswith(b"\0") or b"\0" in body or len(name) > _ADDR_STR_MAX
                    or not all(32 < c < 127 for c in body)):
                raise ValueError(f"insert_peer: name {name[:64]!r} is not a {self.provider} "
                                 f"address (a NUL-terminated string of at most "
                                 f"{_ADDR_STR_MAX} bytes, like {self.name!r})")
            scheme = self.name.split(b"://", 1)[0]
            if b"://" in self.name and not name.startswith(scheme + b"://"):
                raise ValueError(f"insert_peer: name {name[:64]!r} lacks this provider's "
                                 f"{scheme.decode()}:// scheme")
            return
        want = _SOCKADDR_LEN.get(fmt)
        if fmt == _FI_SOCKADDR and len(name) >= 2:
            want = _FAMILY_LEN.get(int.from_bytes(name[:2], "little"))
        if want is None:
            want = len(self.name)  # other binary formats: the length fi_getname reports
        if len(name) != want:
            raise ValueError(f"insert_peer: name is {len(name)} bytes; {self.provider} "
                             f"addresses (fi addr_format {fmt}) are {want} bytes")
        if fmt in _SOCKADDR_LEN and name[:2] != self.name[:2]:
            raise ValueError(f"insert_peer: name has address family "
                             f"{int.from_bytes(name[:2], 'little')}, this endpoint "
                             f"{int.from_bytes(self.name[:2], 'little')}")

    def insert_peer(self, name: bytes) -> int:
        """Add a peer's `name` (from its `Endpoint.name`) to the AV; returns its fi_addr.
        A name of the wrong format or length raises ValueError (`check_peer_name`)."""
        self.check_peer_name(name)
        out = ffi.new("uint64_t *")
        buf = ffi.new("char[]", bytes(name))
        with self._lock:
            ret = lib.pd_av_insert(self._calls(), buf, out)
        check(ret, "fi_av_insert", f"name={bytes(name)!r}")
        self._peers.add(int(out[0]))
        self._names.extend([b""] * (int(out[0]) + 1 - len(self._names)))
        self._names[int(out[0])] = bytes(name)
        return int(out[0])

    def remove_peer(self, fi_addr: int) -> None:
        """Forget a peer (e.g. a dead one). Writes still in flight to it may complete with
        errors; drain them with poll()/wait_idle() first where possible.

        On shm the address stays in the provider's AV (`kept_peers` counts them): shm gives a
        removed peer's index to the next peer inserted, with the old peer's connection state,
        so writes to a restarted decode process queued behind a dead one's full queue (the
        first write timed out) or crashed it (SIGSEGV in its progress, on real SGLang servers).
        A new index is a new connection. Each restart costs one of shm's AV entries."""
        if fi_addr not in self._peers:
            raise ValueError(f"remove_peer: {fi_addr} is not a peer of this endpoint")
        self._peers.discard(fi_addr)
        self._lane_arrays.clear()  # they were checked against the peers
        if self.provider == "shm":
            self.kept_peers += 1
            return
        with self._lock:
            ret = lib.pd_av_remove(self._calls(), fi_addr)
        check(ret, "fi_av_remove", f"fi_addr={fi_addr}")

    def reset(self, why: str) -> None:
        """Cancel every write in flight and reopen this (sending) endpoint on its domain.

        Each cancelled write is reported once in `errors` on its tag (ECANCELED, `why`), so a
        caller settles it as any failed write. Registrations stay valid and every peer keeps
        its fi_addr (inserted again in order; a removed peer's index gets this endpoint's own
        name, never written to). The name changes: a sender's peers never address it.

        For shm, where nothing else can drop a write to a dead peer: shm retires a sender's
        writes from one response queue in order, so a write to a peer that died with writes in
        flight stays at its head and no write to any other peer completes after it
        (tests/test_fabric.py::test_shm_dead_peer_stalls_others_until_reset). Refused
        (FabricError) on a receiving endpoint (a progress thread, a lane, a remote counter)."""
        out = ffi.new("uint64_t *")
        with self._lock:  # no write may meet the endpoint before its peers are back
            ret = lib.pd_ep_reset(self._live(), why.encode(errors="replace"), self._errbuf,
                                   ERRBUF)
            broken = ret not in (0, -lib.PD_EBUSY)  # closed, not reopened: unusable
            if not broken:
                check(ret, "reset endpoint", self.provider, self._errbuf)
                self.name = self._getname()
                for addr, name in enumerate(self._names):
                    ret = lib.pd_av_insert(self._h, name if addr in self._peers else self.name,
                                            out)
                    check(ret, "fi_av_insert", f"reset, fi_addr={addr}")
                    if int(out[0]) != addr:
                        raise FabricError("reset endpoint", 22,
                                          f"peer {addr} came back as {out[0]}")
                self._lane_arrays.clear()
                self.resets += 1
        if broken:  # closed here, so a later call raises "endpoint is closed", never crashes
            msg = ffi.string(self._errbuf).decode(errors="replace")
            self.close()
            raise FabricError("reset endpoint", ret, msg, self.provider)

    # ----------------------------------------------------------------- data path
    def write_batch(
        self,
        peer: int | Sequence[int],
        local: MemoryRegion,
        remote: RemoteRegion | Sequence[RemoteRegion],
        src_offsets: np.ndarray,
        dst_offsets: np.ndarray,
        lengths: np.ndarray,
        imm: int,
        tag: int,
        *,
        per_op: int = 1,
        timeout: float = DEFAULT_TIMEOUT_S,
        kick: np.ndarray | None = None,
    ) -> int:
        """Submit len(lengths) writes in one C call: local[src:src+len] -> remote[dst:dst+len],
        `per_op` consecutive writes (1..`iov_limit`; the last operation may carry fewer) to one
        operation (one fi_writemsg), which carries `imm` as remote CQ data, so the target counts
        ONE completion for it, and is counted in `send_done[tag]` on completion. Returns the
        number of operations submitted.

        Receive lanes: `peer` and `remote` may be equally long sequences, the same remote
        memory registered on each of the peer's lane endpoints (see `start_progress`); each
        operation then goes to one lane, a lane refilled only once it drained.

        `kick`: the peer's kick word mapped here (transfer.kick), or None: kicked after the last
        operation is posted (after the first too from 1 MiB on), and on every retry while its
        queue is full (it may be asleep, and only it drains that queue).

        Every range is checked (in C, before anything is submitted) -> ValueError naming the
        write. On a full queue, or with `max_inflight_bytes` already in flight, the C loop
        drains the CQ and retries until `timeout` seconds pass -> FabricError. A FabricError
        mid-batch says how many writes were submitted (`.submitted`); those still complete or
        fail via the CQ.
        """
        group = WriteGroup(peer, local, remote, src_offsets, dst_offsets, lengths, imm, tag,
                           per_op, kick)
        return self.write_groups([group], timeout=timeout)[0]

    def write_groups(self, groups: Sequence[WriteGroup], *,
                     timeout: float = DEFAULT_TIMEOUT_S) -> list[int]:
        """`write_batch` for each group in turn, in ONE call into C; returns each group's
        operations. A step holding writes for many layer buffers (each its own registration)
        made one call per buffer before, and every call releases the GIL: an engine thread
        computing the next pass then waited for the messenger thread to hand it back, once
        per call (docs/benchmark-rounds.md, "Third round").

        Each group is checked and submitted as one `write_batch`; `timeout` bounds the whole
        call, and a peer's kick word is kicked once after the last operation of the call, and
        after its first one too when the call carries 1 MiB or more (the receiver copies
        while the rest is posted; before a few KiB an early kick only woke it twice). An
        error raises as `write_batch`'s do, with `.group` (its index: the groups before it
        were submitted whole) and `.submitted` (that group's writes submitted)."""
        if not groups:
            return []
        arr = ffi.new("struct pd_write_group[]", len(groups))
        keep: list[Any] = []  # the arrays the C structs point into, alive for the call
        nops = [self._fill_group(arr[i], g, keep) for i, g in enumerate(groups)]
        with self._lock:
            ret = lib.pd_write_groups(self._calls(), arr, len(groups), int(timeout * 1e9),
                                       self._group_at, self._done, self._errbuf, ERRBUF)
            submitted, at = int(self._done[0]), int(self._group_at[0])
            msg = ffi.string(self._errbuf).decode(errors="replace") if ret else ""
        if not ret:
            return nops
        g = groups[at]
        if ret == -lib.PD_EINVAL and submitted == 0 and msg.startswith("write"):
            err: Exception = ValueError(f"write_batch: {msg}")
        else:
            err = FabricError("write_batch", ret, msg, f"peer={list(g.peers)} tag={g.tag} "
                              f"imm={g.imm:#x} submitted {submitted}/{len(g.lengths)}")
        err.group = at  # type: ignore[attr-defined]
        err.submitted = submitted  # type: ignore[attr-defined]
        raise err

    def _fill_group(self, out: Any, g: WriteGroup, keep: list[Any]) -> int:
        """Check one group (ValueError naming what is wrong) and fill its C struct; returns
        its number of operations."""
        if g.local._ep is not self or g.local._h is None:
            raise ValueError("write_batch: local MemoryRegion is closed or from another endpoint")
        peers = g.peers
        remotes = g.remotes
        if not peers or len(peers) != len(remotes):
            raise ValueError(f"write_batch: {len(peers)} peer lanes and {len(remotes)} remote "
                             f"regions; give one region per lane")
        if not 0 <= g.imm < 1 << 32:
            raise ValueError(f"imm must fit 32 bits, got {g.imm}")
        if not 0 <= g.tag < self.max_slots:
            raise ValueError(f"tag must be in [0, {self.max_slots}), got {g.tag}")
        src = _u64("src_offsets", g.src_offsets)
        dst = _u64("dst_offsets", g.dst_offsets)
        ln = _u64("lengths", g.lengths)
        n = len(ln)
        if len(src) != n or len(dst) != n:
            raise ValueError(f"write_batch: src/dst/lengths differ in length: "
                             f"{len(src)}, {len(dst)}, {n}")
        per_op = g.per_op
        if not 1 <= per_op <= self.iov_limit:
            raise ValueError(f"per_op must be in [1, {self.iov_limit}] (the provider's iov "
                             f"limit), got {per_op}")
        fb = ffi.from_buffer
        lanes = self._lanes(peers, remotes)
        keep += [lanes, src, dst, ln]
        out.peers = fb("uint64_t[]", lanes[0])
        out.remote_bases = fb("uint64_t[]", lanes[1])
        out.remote_keys = fb("uint64_t[]", lanes[2])
        out.nlanes = len(peers)
        out.local = g.local._h
        out.remote_len = min(r.length for r in remotes)
        out.src, out.dst, out.len = fb("uint64_t[]", src), fb("uint64_t[]", dst), fb(
            "uint64_t[]", ln)
        out.n, out.per_op = n, per_op
        out.imm, out.tag = g.imm, g.tag
        out.kick = ffi.NULL if g.kick is None else ffi.cast("uint32_t *", g.kick.ctypes.data)
        return -(-n // per_op)

    def _lanes(self, peers: list[int], remotes: list[RemoteRegion]) -> np.ndarray:
        """[3, lanes] uint64: fi_addr, remote base and key per receive lane, built once per
        (peers, regions): a sender writes to the same few every pass."""
        key = (tuple(peers), tuple(remotes))
        lanes = self._lane_arrays.get(key)
        if lanes is None:
            for p in peers:  # libfabric would dereference a bad fi_addr and crash
                if p not in self._peers:
                    raise ValueError(f"write_batch: peer {p} was not returned by insert_peer")
            lanes = np.array([[p, r.base, r.key] for p, r in zip(peers, remotes, strict=True)],
                             dtype=np.uint64).T.copy()
            if len(self._lane_arrays) >= 4096:  # many peers come and go: start over
                self._lane_arrays.clear()
            self._lane_arrays[key] = lanes
        return lanes

    def poll(self, max_entries: int = 1 << 16) -> int:
        """Drain the CQ once (drives manual progress). Returns the entries handled."""
        with self._lock:
            ret = lib.pd_poll(self._calls(), max_entries)
        if ret < 0:
            check(ret, "fi_cq_read", self.provider)
        return ret

    # ----------------------------------------------------------------- counters
    def arm(self, slot: int, gen: int) -> None:
        """Decoder side: expect generation `gen` on `slot` and reset its count. Safe to call
        from a thread other than the one polling (takes the endpoint lock)."""
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must be in [0, {self.max_slots}), got {slot}")
        if not 0 <= gen < 1 << 16:
            raise ValueError(f"gen must be in [0, 65536), got {gen}")
        # under the endpoint lock: a poll()/wait_*() on another thread counts between two CQ
        # drains, never half-way through re-arming (no old-generation count slips in)
        with self._lock:
            self.recv_gen[slot] = gen
            self.recv_counts[slot] = 0

    @property
    def stale_writes(self) -> int:
        """Remote writes whose generation did not match the slot's (late / foreign writes)."""
        return int(lib.pd_stale(self._live()))

    @property
    def remote_writes(self) -> int:
        """All remote CQ-data completions seen (counted + stale)."""
        return int(lib.pd_remote_writes(self._live()))

    @property
    def inflight_bytes(self) -> int:
        """Bytes of local writes submitted and not yet completed (capped by the
        `max_inflight_bytes` the endpoint was opened with, except for a single larger write)."""
        return int(lib.pd_inflight_bytes(self._live()))

    @property
    def completions(self) -> int:
        """Local writes settled (completed, failed or cancelled by `reset`) since opening: a
        sender with writes in flight whose count stands still is waiting on a peer."""
        self._live()
        return int(self._completions_word[0])

    @property
    def inflight(self) -> int:
        """Local writes submitted and not yet completed (successfully or with an error)."""
        self._live()
        return int(self._inflight_word[0])

    @property
    def remote_counter(self) -> int:
        """Remote-write counter (FI_RMA_EVENT fast path; 0 when the provider lacks it)."""
        return int(lib.pd_remote_cntr(self._live()))

    @property
    def errors(self) -> list[tuple[int, int, str]]:
        """Completion errors seen so far as (tag, errno, message), one per failed operation;
        taking them clears the native list (which folds a tag's errors into one entry with a
        count and never drops one). tag is 2**64-1 when unknown."""
        self._live()
        if self._nerr_word[0] == 0:
            out, self._errors = self._errors, []
            return out
        buf = ffi.new("struct pd_err[64]")
        n = 64
        while n == 64:
            with self._lock:
                n = lib.pd_take_errors(self._live(), buf, 64)
            for i in range(n):
                e = buf[i]
                msg = ffi.string(e.msg).decode(errors="replace")
                self._errors.extend([(int(e.tag), int(e.err), msg)] * max(1, int(e.count)))
        out, self._errors = self._errors, []
        return out


def gpu_direct_support(provider: str, *, domain: str | None = None,
                       node: str | None = None) -> tuple[bool, str]:
    """Can `provider` (on `domain`) register CUDA memory here: (True, "") or (False, why).

    What `transfer.gpu_memory=auto` asks at run time to pick direct over staged: the provider
    must offer FI_HMEM and this libfabric must have CUDA support (Debian's 1.17 has neither
    for tcp;ofi_rxm, and no CUDA for shm). Opens one endpoint; needs no GPU and no CUDA."""
    try:
        with Endpoint(provider, domain=domain, node=node, max_slots=1) as ep:
            return ep.cuda_registration()
    except FabricError as exc:
        return False, str(exc)
