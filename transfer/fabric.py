"""Typed Python surface of the libfabric binding (the native `transfer._fabric` stays private).

One `Endpoint` = one RDM endpoint + address vector + one completion queue (FI_CQ_FORMAT_DATA)
in a fabric + domain (transfer/csrc/domain.c). Use it from ONE thread (a lock makes accidental
sharing safe, not fast), or hand it to its own C progress thread as a decoder's receive lane:
`open_lane` opens another endpoint in the SAME domain (FI_THREAD_COMPLETION: each endpoint's CQ
is drained by one thread) counting into the owner's slots, and memory registered once in that
domain serves every lane (`lane_region`), so the KV is registered once, not once per lane.
Progress is manual on shm and rxm: the target must keep calling `poll()` (or
a `wait_*`) or nothing lands; the sender's `write_batch` drains the CQ itself when the queue is
full.

Completion counting (docs/libfabric.md): every write carries 32 bits of immediate data,
`encode_imm(slot, gen)`. The target's `poll()` adds one to `recv_counts[slot]` when `gen` equals
`recv_gen[slot]` (set by the decoder when it arms the slot), else to `stale_writes`: a late write
from a timed-out transfer never advances the slot's new owner. The sender passes a `tag` with each
batch; local completions add one to `send_done[tag]`, so it knows when its pages are free again.

Flow control (measured on shm, libfabric 1.17): the target performs the copy (CMA,
process_vm_readv, one copy; FI_SHM_DISABLE_CMA's two-copy SAR path measured ~20% slower) inside
its CQ reads, and one read copies everything queued for it. So `write_batch` caps the bytes in
flight per endpoint (`max_inflight_bytes`, not just the provider's queue depth): with 1 MiB pages
the queue alone let one poll of the target copy 1 GiB, blind to its control work for ~200 ms.

GPU memory (`transfer.gpu_memory=direct`): `Endpoint(..., hmem=True)` asks fi_getinfo for
FI_HMEM; `register(iface="cuda", device=gpu)` checks the pointer through the CUDA driver (loaded
only then) and registers it with FI_HMEM_CUDA / FI_HMEM_DEVICE_ONLY, as a dma-buf where the
headers and driver have it. Where this libfabric cannot (`cuda_registration`,
`gpu_direct_support`) it raises GpuMemoryError naming the key and the cause; the staged path
(transfer/staging.py) needs none of it.

Errors: caller mistakes raise `ValueError`; provider faults raise `FabricError` carrying the
failing call, the provider's message and context. Completion errors are data: `poll()` records
them and `errors` hands them out as `(tag, errno, message)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_INSTALL_HINT = (
    "the libfabric binding transfer._fabric is not available: {why}. It is compiled when pdtool "
    "is installed and needs the system libfabric with its headers: on Debian/Ubuntu "
    "`apt-get install libfabric-dev gcc` (on clusters the EFA installer or MOFED libfabric; "
    "set CPATH/LIBRARY_PATH or pkg-config if it lives elsewhere), then reinstall pdtool "
    "(`pip install -e .`). `pdtool validate/plan/render` work without it."
)


class FabricUnavailableError(ImportError):
    """The compiled binding or the system libfabric (Debian package libfabric-dev) is missing."""


try:
    from transfer import _fabric  # type: ignore[attr-defined]
except ImportError as exc:  # the .so is absent, or libfabric.so.1 cannot be loaded
    raise FabricUnavailableError(_INSTALL_HINT.format(why=exc)) from exc

_ffi = _fabric.ffi
_lib = _fabric.lib
log = logging.getLogger("transfer.fabric")

__all__ = [
    "Endpoint",
    "FabricError",
    "FabricUnavailableError",
    "GpuMemoryError",
    "MemoryRegion",
    "RemoteRegion",
    "available_providers",
    "buffer_address",
    "build_features",
    "check_cuda_pointer",
    "decode_imm",
    "encode_imm",
    "gpu_direct_support",
    "shm_leftovers",
]

# fi_mr_mode bits (rdma/fabric.h, stable ABI values)
_FI_MR_LOCAL = 1 << 2
_FI_MR_VIRT_ADDR = 1 << 4
_FI_MR_ALLOCATED = 1 << 5
_FI_MR_PROV_KEY = 1 << 6
_FI_MR_ENDPOINT = 1 << 8

_IFACES = {"system": _lib.PD_HMEM_SYSTEM, "cuda": _lib.PD_HMEM_CUDA}
# enum fi_addr_format (rdma/fabric.h): FI_SOCKADDR, FI_SOCKADDR_IN, FI_SOCKADDR_IN6
_FI_SOCKADDR = 1
_SOCKADDR_LEN = {2: 16, 3: 28}
_FAMILY_LEN = {2: 16, 10: 28}  # AF_INET, AF_INET6 -> sizeof(sockaddr_in[6])
_ADDR_STR_MAX = 256            # shm's SMR_NAME_MAX
_ERRBUF = 512
DEFAULT_TIMEOUT_S = 30.0
# Completion-queue entries; 0 = the provider's default (small CQs made shm slower at 64 KiB).
# Local writes in flight are capped in BYTES instead (see write_batch): that is what bounds how
# long one poll of the target can run on shm, where the target copies every queued write.
DEFAULT_MAX_INFLIGHT_BYTES = 64 << 20
SHM_DRAIN_SLEEP_S = 50e-6
DEFAULT_CQ_SIZE = 0
MAX_SLOTS = 1 << 16  # 16 bits of slot in the 32-bit immediate


class FabricError(RuntimeError):
    """A libfabric call failed: `call` names it, `errno` is the positive fi errno."""

    def __init__(self, call: str, errno: int, message: str, context: str = "") -> None:
        self.call = call
        self.errno = abs(errno)
        self.provider_message = message
        self.context = context
        text = f"{call} failed: {message}"
        if context:
            text += f" [{context}]"
        super().__init__(text)


def _check(ret: int, call: str, context: str = "", errbuf: Any = None) -> None:
    if ret == 0:
        return
    msg = _ffi.string(errbuf).decode(errors="replace") if errbuf is not None else ""
    if not msg:
        msg = f"{_ffi.string(_lib.pd_strerror(ret)).decode()} ({ret})"
    raise FabricError(call, ret, msg, context)


def encode_imm(slot: int, gen: int) -> int:
    """32-bit immediate data: slot in the high 16 bits, generation in the low 16.

    32 bits because EFA and verbs carry only 32 bits of CQ data (shm/tcp carry 64).
    """
    if not 0 <= slot < MAX_SLOTS:
        raise ValueError(f"slot must be in [0, {MAX_SLOTS}), got {slot}")
    if not 0 <= gen < 1 << 16:
        raise ValueError(f"gen must be in [0, 65536), got {gen}")
    return (slot << 16) | gen


def decode_imm(imm: int) -> tuple[int, int]:
    """Inverse of `encode_imm`: (slot, gen)."""
    return (imm >> 16) & 0xFFFF, imm & 0xFFFF


def kick(word: np.ndarray) -> None:
    """Wake whoever sleeps on `word` (Endpoint.set_kick), in this or another process."""
    _lib.pd_kick(_ffi.cast("uint32_t *", word.ctypes.data))


def available_providers() -> list[str]:
    """Names of providers that offer RDM endpoints with RMA writes here (e.g. shm, tcp;ofi_rxm)."""
    found: list[str] = []
    for prov in ("shm", "tcp;ofi_rxm", "efa", "verbs;ofi_rxm", "sockets", "udp;ofi_rxd"):
        info = _ffi.new("struct pd_info *")
        out = _ffi.new("pd_dom **")
        err = _ffi.new("char[]", _ERRBUF)
        if _lib.pd_domain_open(out, prov.encode(), _ffi.NULL, _ffi.NULL, _ffi.NULL, 0, 0, info,
                               err, _ERRBUF) == 0:
            _lib.pd_domain_release(out[0])
            found.append(prov)
    return found


class GpuMemoryError(FabricError, NotImplementedError):
    """CUDA memory cannot be registered here (transfer.gpu_memory=direct is impossible): the
    provider or this libfabric build lacks it, or the pointer is not registrable device memory.
    Also a NotImplementedError, what callers caught before CUDA registration existed."""


@dataclass(frozen=True)
class RemoteRegion:
    """What a peer needs to write into a registered region: sent over the control plane.

    `base` is the address to add offsets to: the virtual address on FI_MR_VIRT_ADDR providers,
    0 on offset-based ones. `length` bounds the offsets.
    """

    base: int
    key: int
    length: int

    def to_dict(self) -> dict[str, int]:
        return {"base": self.base, "key": self.key, "length": self.length}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RemoteRegion:
        try:
            vals = {k: d[k] for k in ("base", "key", "length")}
        except KeyError as exc:
            raise ValueError(f"RemoteRegion: missing field {exc.args[0]!r}") from None
        for k, v in vals.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v >= 1 << 64:
                raise ValueError(f"RemoteRegion.{k}: expected an unsigned 64-bit int, got {v!r}")
        return cls(**vals)


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
        return _lib.pd_mr_desc(self._h) if self._h is not None else None

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
                _lib.pd_mr_close(self._h)
                self._h = None
            self._ep._mrs.discard(self)

    def __repr__(self) -> str:
        return f"MemoryRegion(addr=0x{self.addr:x}, length={self.length}, key=0x{self.key:x})"


class WriteGroup:
    """One batch of `Endpoint.write_groups`: the arguments of one `write_batch` call."""

    __slots__ = ("dst_offsets", "imm", "kick", "lengths", "local", "peers", "per_op", "remotes",
                 "src_offsets", "tag")

    def __init__(self, peer: int | Sequence[int], local: MemoryRegion,
                 remote: RemoteRegion | Sequence[RemoteRegion], src_offsets: np.ndarray,
                 dst_offsets: np.ndarray, lengths: np.ndarray, imm: int, tag: int,
                 per_op: int = 1, kick: np.ndarray | None = None) -> None:
        self.peers = [peer] if isinstance(peer, int) else list(peer)
        self.remotes = [remote] if isinstance(remote, RemoteRegion) else list(remote)
        self.local, self.imm, self.tag, self.per_op, self.kick = local, imm, tag, per_op, kick
        self.src_offsets, self.dst_offsets, self.lengths = src_offsets, dst_offsets, lengths


def _u64(name: str, a: Any) -> np.ndarray:
    if type(a) is np.ndarray and a.dtype == np.uint64 and a.flags.c_contiguous and a.ndim == 1:
        return a  # the common case, no copy
    arr = np.ascontiguousarray(a, dtype=np.uint64)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {arr.shape}")
    return arr


def buffer_address(buf: Any) -> tuple[int, int]:
    """(address, nbytes) of a contiguous numpy array or torch tensor (CPU)."""
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):  # torch.Tensor
        if not buf.is_contiguous():
            raise ValueError("tensor must be contiguous to register")
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    arr = np.asarray(buf)
    if not arr.flags.c_contiguous:
        raise ValueError("array must be C-contiguous to register")
    return int(arr.ctypes.data), int(arr.nbytes)


class _Domain:
    """One libfabric fabric + domain as Python sees it: the fi_info the domain was opened with,
    and the counter of requested MR keys, which must be unique per DOMAIN (shared by lanes).

    The C domain is reference counted: every endpoint and registration on it holds one, so it
    closes after the last of them; `handle` is only used to open the first endpoint."""

    def __init__(self, provider: str, domain: str | None, node: str | None,
                 service: str | None, remote_counter: bool, hmem: bool) -> None:
        self.provider_arg = provider
        self.args = (domain, node, service)
        self.context = (f"provider={provider!r} domain={domain!r} node={node!r} "
                        f"service={service!r}; see `fi_info -p '{provider}'`")
        self.info = _ffi.new("struct pd_info *")
        self.next_key = 1
        self._offers_hmem: bool | None = True if hmem else None
        self._cuda_mr: tuple[bool, str] | None = None
        out = _ffi.new("pd_dom **")
        err = _ffi.new("char[]", _ERRBUF)
        ret = _lib.pd_domain_open(out, provider.encode(), _c(domain), _c(node), _c(service),
                                  int(remote_counter), int(hmem), self.info, err, _ERRBUF)
        if ret and hmem:
            why = _ffi.string(err).decode(errors="replace")
            raise GpuMemoryError("open endpoint", ret, f"transfer.gpu_memory=direct: provider "
                                 f"{provider!r} does not offer FI_HMEM (registration of GPU "
                                 f"memory) here ({why}); use transfer.gpu_memory=staged",
                                 self.context)
        _check(ret, "open endpoint", self.context, err)
        self.handle = out[0]

    def offers_hmem(self) -> bool:
        """Asked for the domain this one IS (its name), not the one requested (maybe None)."""
        if self._offers_hmem is None:
            _, node, service = self.args
            ret = _lib.pd_offers_hmem(self.provider_arg.encode(), self.info.domain, _c(node),
                                      _c(service))
            self._offers_hmem = ret == 1
        return self._offers_hmem


def _c(s: str | None) -> Any:
    return s.encode() if s else _ffi.NULL


_NO_CUDA = ("transfer.gpu_memory=direct is not possible with provider {prov}: {why}. This "
            "libfabric cannot register CUDA memory (-FI_ENOSYS: built without CUDA, as "
            "Debian's libfabric 1.17 is, or its CUDA support did not initialize). Use "
            "transfer.gpu_memory=staged (KV through registered host memory, copied to and from "
            "the GPU) or a libfabric built with CUDA (EFA installer, MOFED/HPC-X)")


class Endpoint:
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
        if same_domain_as is not None:
            if same_domain_as.closed:
                raise ValueError("same_domain_as: that endpoint is closed")
            self._domain = same_domain_as._domain
            if provider != self._domain.provider_arg:
                raise ValueError(f"same_domain_as: provider {provider!r} differs from the "
                                 f"domain's {self._domain.provider_arg!r}")
            dom_h = _lib.pd_ep_domain(same_domain_as._h)
            opened = False
        else:
            self._domain = _Domain(provider, domain, node, service, remote_counter, hmem)
            dom_h, opened = self._domain.handle, True
        if provider.split(";")[0] == "shm":
            _clear_stale_shm()
        out = _ffi.new("pd_ep **")
        err = _ffi.new("char[]", _ERRBUF)
        ret = _lib.pd_ep_open(out, dom_h, max_outstanding, cq_size, err, _ERRBUF)
        if opened:
            _lib.pd_domain_release(dom_h)  # the endpoint (and later its MRs) hold it now
        _check(ret, "open endpoint", self._domain.context, err)
        self._h = out[0]
        info = self._domain.info
        # Both peers busy-poll (manual progress). When a wait/retry loop finds nothing to do it
        # calls sched_yield(), so a peer sharing the core (2-core boxes, oversubscribed nodes)
        # gets to run; costs one syscall per idle spin when cores are plentiful.
        # `idle_sleep_s` > 0: after `idle_spins` empty polls in a row, sleep that long per poll
        # instead (a long wait then costs almost no CPU). Off by default: on tcp;ofi_rxm the
        # polling itself moves the bytes, and sleeping halved throughput in bench/transfer.py.
        _lib.pd_set_idle(self._h, int(yield_when_idle), idle_spins, int(idle_sleep_s * 1e9))
        # `idle_max_sleep_s` > `idle_sleep_s`: that sleep doubles every 8 empty polls up to
        # it (a progress thread's active sleep too), for waits that last a whole forward pass
        _lib.pd_set_idle_backoff(self._h, int(idle_max_sleep_s * 1e9))
        _lib.pd_set_max_inflight_bytes(self._h, max_inflight_bytes)
        self.addr_format: int = int(info.addr_format)
        self.provider: str = _ffi.string(info.provider).decode()
        # Burst refill when the send queue is full: wait (sleeping `drain_sleep_s` per poll)
        # until half of it drained. Default on for shm only, where the target does the copy
        # and a sender posting one write per completion spins on the target's queue lock; on
        # tcp/verbs/efa the sender's own progress moves bytes, so it keeps polling.
        if drain_sleep_s is None:
            drain_sleep_s = SHM_DRAIN_SLEEP_S if self.provider == "shm" else 0.0
        _lib.pd_set_drain(self._h, int(drain_sleep_s * 1e9))
        self.fabric: str = _ffi.string(info.fabric).decode()
        self.domain: str = _ffi.string(info.domain).decode()
        self.mr_mode: int = int(info.mr_mode)
        self.cq_data_size: int = int(info.cq_data_size)
        self.max_msg_size: int = int(info.max_msg_size)
        # writes one operation may carry (write_batch `ops`): the provider's iov and rma_iov limit
        self.iov_limit: int = int(_lib.pd_iov_limit(out[0]))
        self.mr_virt_addr = bool(info.mr_mode & _FI_MR_VIRT_ADDR)
        self.mr_prov_key = bool(info.mr_mode & _FI_MR_PROV_KEY)
        self.mr_local = bool(info.mr_mode & _FI_MR_LOCAL)
        self.mr_endpoint = bool(info.mr_mode & _FI_MR_ENDPOINT)
        self.rma_event = bool(info.has_rma_event)
        self.has_remote_counter = bool(_lib.pd_has_remote_cntr(self._h))
        # FI_HMEM: asked for (hmem=True) and granted; `offers_hmem` says whether it could be
        self.hmem = bool(info.hmem)
        self.threading: int = int(info.threading)
        if self.cq_data_size < 4:
            self.close()
            raise FabricError("open endpoint", 95, f"provider {self.provider} carries only "
                              f"{self.cq_data_size} bytes of CQ data; 4 are needed for the imm")
        self.max_slots = max_slots
        self.recv_counts = np.zeros(max_slots, dtype=np.uint32)
        self.recv_gen = np.zeros(max_slots, dtype=np.uint16)
        self.send_done = np.zeros(max_slots, dtype=np.uint32)
        _lib.pd_set_counters(
            self._h,
            _ffi.cast("uint32_t *", self.recv_counts.ctypes.data),
            _ffi.cast("uint16_t *", self.recv_gen.ctypes.data),
            _ffi.cast("uint32_t *", self.send_done.ctypes.data),
            max_slots,
        )
        self.name: bytes = self._getname()
        # read in place, without a call (each call releases the GIL): see pd_inflight_word
        self._inflight_word = np.frombuffer(
            _ffi.buffer(_lib.pd_inflight_word(self._h), 8), dtype=np.uint64)
        self._completions_word = np.frombuffer(
            _ffi.buffer(_lib.pd_completions_word(self._h), 8), dtype=np.uint64)
        self._nerr_word = np.frombuffer(
            _ffi.buffer(_lib.pd_nerr_word(self._h), _ffi.sizeof("size_t")), dtype=np.uintp)
        self._errors: list[tuple[int, int, str]] = []
        self._done = _ffi.new("size_t *")  # per-call scratch, used under self._lock
        self._group_at = _ffi.new("size_t *")  # the same, for write_groups
        self._errbuf = _ffi.new("char[]", _ERRBUF)

    # ----------------------------------------------------------------- lifecycle
    def _getname(self) -> bytes:
        namelen = _ffi.new("size_t *", 256)
        namebuf = _ffi.new("char[]", 256)
        ret = _lib.pd_getname(self._h, namebuf, namelen)
        _check(ret, "fi_getname", self.provider)
        # passed through unchanged: shm names end with a NUL that is part of the address
        return bytes(_ffi.buffer(namebuf, namelen[0]))

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
                _lib.pd_close(self._h)
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
        access = int(_lib.PD_ACCESS_LOCAL_WRITE)
        if remote_write:
            access |= int(_lib.PD_ACCESS_REMOTE_WRITE)
        out = _ffi.new("pd_mr **")
        key = _ffi.new("uint64_t *")
        err = _ffi.new("char[]", _ERRBUF)
        with self._lock:
            h = self._calls()
            requested = self._domain.next_key
            self._domain.next_key += 1
            ret = _lib.pd_mr_reg(h, _ffi.cast("void *", addr), length, access,
                                 _IFACES[iface], device, requested, out, key, err, _ERRBUF)
        context = f"addr={addr:#x} length={length} iface={iface}"
        if ret and iface == "cuda":
            why = _ffi.string(err).decode(errors="replace")
            raise GpuMemoryError("register memory", ret, f"transfer.gpu_memory=direct: cannot "
                                 f"register GPU {device}'s memory with {self.provider}: {why}",
                                 context)
        _check(ret, "register memory", context, err)
        mr = MemoryRegion(self, out[0], int(key[0]), addr, length, iface)
        mr.dmabuf = bool(_lib.pd_mr_uses_dmabuf(out[0]))
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
            raise GpuMemoryError("register memory", int(_lib.PD_ENOSYS),
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
                err = _ffi.new("char[]", _ERRBUF)
                with self._lock:
                    ret = _lib.pd_probe_cuda_mr(self._calls(), err, _ERRBUF)
                dom._cuda_mr = (ret == 0, _ffi.string(err).decode(errors="replace"))
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
        if fmt == _lib.PD_ADDR_STR:
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
        out = _ffi.new("uint64_t *")
        buf = _ffi.new("char[]", bytes(name))
        with self._lock:
            ret = _lib.pd_av_insert(self._calls(), buf, out)
        _check(ret, "fi_av_insert", f"name={bytes(name)!r}")
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
            ret = _lib.pd_av_remove(self._calls(), fi_addr)
        _check(ret, "fi_av_remove", f"fi_addr={fi_addr}")

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
        out = _ffi.new("uint64_t *")
        with self._lock:  # no write may meet the endpoint before its peers are back
            ret = _lib.pd_ep_reset(self._live(), why.encode(errors="replace"), self._errbuf,
                                   _ERRBUF)
            broken = ret not in (0, -_lib.PD_EBUSY)  # closed, not reopened: unusable
            if not broken:
                _check(ret, "reset endpoint", self.provider, self._errbuf)
                self.name = self._getname()
                for addr, name in enumerate(self._names):
                    ret = _lib.pd_av_insert(self._h, name if addr in self._peers else self.name,
                                            out)
                    _check(ret, "fi_av_insert", f"reset, fi_addr={addr}")
                    if int(out[0]) != addr:
                        raise FabricError("reset endpoint", 22,
                                          f"peer {addr} came back as {out[0]}")
                self._lane_arrays.clear()
                self.resets += 1
        if broken:  # closed here, so a later call raises "endpoint is closed", never crashes
            msg = _ffi.string(self._errbuf).decode(errors="replace")
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
        per call (docs/benchmark.md, "Third round").

        Each group is checked and submitted as one `write_batch`; `timeout` bounds the whole
        call, and a peer's kick word is kicked once after the last operation of the call, and
        after its first one too when the call carries 1 MiB or more (the receiver copies
        while the rest is posted; before a few KiB an early kick only woke it twice). An
        error raises as `write_batch`'s do, with `.group` (its index: the groups before it
        were submitted whole) and `.submitted` (that group's writes submitted)."""
        if not groups:
            return []
        arr = _ffi.new("struct pd_write_group[]", len(groups))
        keep: list[Any] = []  # the arrays the C structs point into, alive for the call
        nops = [self._fill_group(arr[i], g, keep) for i, g in enumerate(groups)]
        with self._lock:
            ret = _lib.pd_write_groups(self._calls(), arr, len(groups), int(timeout * 1e9),
                                       self._group_at, self._done, self._errbuf, _ERRBUF)
            submitted, at = int(self._done[0]), int(self._group_at[0])
            msg = _ffi.string(self._errbuf).decode(errors="replace") if ret else ""
        if not ret:
            return nops
        g = groups[at]
        if ret == -_lib.PD_EINVAL and submitted == 0 and msg.startswith("write"):
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
        fb = _ffi.from_buffer
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
        out.kick = _ffi.NULL if g.kick is None else _ffi.cast("uint32_t *", g.kick.ctypes.data)
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
            ret = _lib.pd_poll(self._calls(), max_entries)
        if ret < 0:
            _check(ret, "fi_cq_read", self.provider)
        return ret

    def _wait(self, fn: Any, args: tuple, timeout: float, what: str) -> bool:
        with self._lock:
            ret = fn(self._calls(), *args, int(timeout * 1e9))
        if ret == -_lib.PD_ETIMEDOUT:
            return False
        if ret:
            _check(ret, what, self.provider)
        return True

    def wait_recv(self, slot: int, count: int, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
        """Poll (in C) until recv_counts[slot] >= count; False on timeout."""
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must be in [0, {self.max_slots}), got {slot}")
        return self._wait(_lib.pd_wait_recv, (slot, count), timeout, "wait_recv")

    def wait_send(self, tag: int, count: int, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
        """Poll (in C) until send_done[tag] >= count: True; False on timeout. A completion
        error for this tag raises FabricError (errors of other tags stay in `errors`)."""
        if not 0 <= tag < self.max_slots:
            raise ValueError(f"tag must be in [0, {self.max_slots}), got {tag}")
        deadline = time.monotonic() + timeout
        while True:
            # the C loop also returns when any completion error is queued, so it surfaces fast
            ok = self._wait(_lib.pd_wait_send, (tag, count),
                            max(0.0, deadline - time.monotonic()), "wait_send")
            self.raise_errors(tag)  # moves other tags' errors out of the C ring
            if int(self.send_done[tag]) >= count:
                return True
            if not ok or time.monotonic() >= deadline:
                return False

    def raise_errors(self, tag: int | None = None) -> None:
        """Raise FabricError for the first completion error recorded for `tag` (any tag when
        None); errors of other tags stay queued in `errors`."""
        pending = self.errors
        mine = [e for e in pending if tag is None or e[0] == tag]
        self._errors = [e for e in pending if not (tag is None or e[0] == tag)]
        if mine:
            t, errno, msg = mine[0]
            err = FabricError("write completion", errno, msg,
                              f"tag={t} provider={self.provider}; {len(mine)} error(s)")
            err.errors = mine  # type: ignore[attr-defined]
            raise err

    def wait_change(self, a: np.ndarray, a_seen: int, b: np.ndarray | None = None,
                    b_seen: int = 0, *, timeout: float = 0.001,
                    sleep_s: float = 50e-6) -> bool:
        """Drain the CQ (in C, GIL released) until another thread stores a value other than
        `a_seen` in `a[0]` (or `b_seen` in `b[0]`): True; False on timeout, or when the
        control socket (`set_ctl_fd`) may have a message. For waiting on compute, e.g. a
        prefill engine's progress word: after a few empty polls it sleeps `sleep_s` per poll,
        so the wait costs neither a core nor the GIL."""
        for name, arr in (("a", a), ("b", b)):
            if arr is not None and (type(arr) is not np.ndarray or arr.dtype != np.int64
                                    or arr.size < 1 or not arr.flags.c_contiguous):
                raise ValueError(f"wait_change: {name} must be a contiguous int64 numpy array")
        pa = _ffi.cast("int64_t *", a.ctypes.data)
        pb = _ffi.cast("int64_t *", b.ctypes.data) if b is not None else _ffi.NULL
        with self._lock:
            ret = _lib.pd_wait_change(self._calls(), pa, a_seen, pb, b_seen,
                                      int(sleep_s * 1e9), int(timeout * 1e9))
        if ret < 0:
            _check(ret, "wait_change", self.provider)
        return ret == 1

    def wait_idle_or_change(self, a: np.ndarray, a_seen: int, b: np.ndarray | None = None,
                            b_seen: int = 0, *, timeout: float = 0.001) -> str:
        """Drain the CQ (in C, GIL released) until no local write is outstanding ("idle"),
        another thread stores a value other than `a_seen` in `a[0]` (or `b_seen` in `b[0]`)
        ("changed"), or `timeout` passes ("timeout"). A sender's wait while its writes are in
        flight and the engine computes: idles as the endpoint's `idle_*` settings say."""
        for name, arr in (("a", a), ("b", b)):
            if arr is not None and (type(arr) is not np.ndarray or arr.dtype != np.int64
                                    or arr.size < 1 or not arr.flags.c_contiguous):
                raise ValueError(f"wait_idle_or_change: {name} must be a contiguous int64 "
                                 "numpy array")
        pa = _ffi.cast("int64_t *", a.ctypes.data)
        pb = _ffi.cast("int64_t *", b.ctypes.data) if b is not None else _ffi.NULL
        with self._lock:
            ret = _lib.pd_wait_idle_or_change(self._calls(), pa, a_seen, pb, b_seen,
                                              int(timeout * 1e9))
        if ret == -_lib.PD_ETIMEDOUT:
            return "timeout"
        if ret < 0:
            _check(ret, "wait_idle_or_change", self.provider)
        return "changed" if ret == 1 else "idle"

    def watch_targets(self, targets: np.ndarray) -> None:
        """Let `wait_complete` return when a slot's count reaches `targets[slot]` (a uint32
        array of `max_slots` entries that the caller keeps alive and updates when it arms)."""
        if targets.dtype != np.uint32 or targets.shape != (self.max_slots,) or \
                not targets.flags.c_contiguous:
            raise ValueError(f"targets: expected a contiguous uint32 array of {self.max_slots}")
        self._targets = targets  # keep it alive as long as C may read it
        with self._lock:
            _lib.pd_set_targets(self._live(), _ffi.cast("uint32_t *", targets.ctypes.data))

    # ----------------------------------------------------------------- receive lanes
    def share_counts(self, owner: Endpoint) -> None:
        """Make this endpoint a receive lane of `owner`: CQ data arriving here is counted in
        `owner`'s slots (`recv_counts`, its watched targets, `wait_complete`), atomically,
        so several lanes and the owner can count the same transfer from different threads.
        Why lanes: on shm the RECEIVER performs every copy (process_vm_readv inside its CQ
        poll), so one receiving thread caps a decoder at one core's copy speed; a sender that
        spreads operations over lanes (`write_batch` with several peers) gets one copying
        thread per lane."""
        if owner is self or owner._owner is not None:
            raise ValueError("share_counts: the owner must be another, non-lane endpoint")
        if owner.max_slots != self.max_slots:
            raise ValueError(f"share_counts: owner has {owner.max_slots} slots, this endpoint "
                             f"{self.max_slots}")
        with self._lock:
            _lib.pd_share_counts(self._calls(), owner._live())
        self._owner = owner  # keeps the owner's arrays alive while C may count into them

    def open_lane(self, **kw: Any) -> Endpoint:
        """A receive lane of this endpoint: a new endpoint (own CQ and address, drained by its
        own thread once `start_progress` is called) in this endpoint's fabric and DOMAIN,
        counting into this endpoint's slots (`share_counts`). Memory registered here serves
        the lane too (`lane_region`): one domain and one registration for all lanes.
        `kw`: Endpoint options for the lane (idle/cq settings); slots follow the owner."""
        lane = Endpoint(self._domain.provider_arg, same_domain_as=self,
                        max_slots=self.max_slots, **kw)
        try:
            lane.share_counts(self)
        except Exception:
            lane.close()
            raise
        return lane

    def lane_region(self, mr: MemoryRegion) -> MemoryRegion:
        """The registration a sender must use to write `mr`'s memory through THIS endpoint:
        `mr` itself when it belongs to this endpoint's domain (the registration is the
        domain's). Only providers with FI_MR_ENDPOINT tie a registration to one endpoint:
        there the memory is registered again for this endpoint, once. Call before
        `start_progress`."""
        if mr.closed:
            raise ValueError("lane_region: the MemoryRegion is closed")
        if mr._ep._domain is not self._domain:
            raise ValueError("lane_region: the MemoryRegion belongs to another domain")
        if not self.mr_endpoint or mr._ep is self:
            return mr
        own = self._lane_mrs.get(id(mr))
        if own is None or own.closed:
            own = self.register(mr.addr, mr.length, iface=mr.iface)
            self._lane_mrs[id(mr)] = own
        return own

    @property
    def domain_handle(self) -> int:
        """Identity of the C domain this endpoint lives in (equal for an endpoint and its
        lanes): for checks and logs, not a libfabric object to pass anywhere."""
        return int(_ffi.cast("uintptr_t", _lib.pd_ep_domain(self._live())))

    def start_progress(self, sleep_s: float = 20e-6) -> None:
        """Drain this endpoint's CQ (and so, on shm, perform its copies) from a C thread of its
        own until `stop_progress`/`close`. Register memory and insert peers BEFORE: while the
        thread runs, calls into the provider are refused (the endpoint is single-threaded).
        When a poll finds nothing the thread yields, then sleeps `sleep_s` per poll while
        the owner's transfers are active (`set_active`) and 50x that while not."""
        if not 0 < sleep_s < 0.05:
            raise ValueError(f"sleep_s must be in (0, 0.05) seconds, got {sleep_s!r}")
        with self._lock:
            ret = _lib.pd_progress_start(self._calls(), int(sleep_s * 1e9))
        _check(ret, "start progress thread", self.provider)
        self._progress = True

    def stop_progress(self, timeout: float = 2.0) -> bool:
        """Stop the progress thread (idempotent); the endpoint is callable again. False when
        the thread did not come back within `timeout` s (stuck inside the provider): it keeps
        running and the endpoint stays its own."""
        if self._progress and self._h is not None:
            with self._lock:
                if _lib.pd_progress_stop(self._h, int(timeout * 1e9)):
                    return False
        self._progress = False
        return True

    @property
    def progress_stalled_s(self) -> float:
        """Seconds the progress thread has been inside its current poll (0 when it is not in
        one). Polls are short; a large value means the provider does not return."""
        if not self._progress or self._h is None:
            return 0.0
        return int(_lib.pd_progress_stalled_ns(self._h)) / 1e9

    def set_kick(self, word: np.ndarray | None, max_sleep_s: float = 0.0,
                 change_only: bool = False) -> None:
        """Sleep on `word` (a 1-element uint32 array, shared memory for another process,
        transfer.kick) in this endpoint's idle waits and its progress thread, so a `kick(word)`
        ends the sleep. `max_sleep_s` > 0: what the waits wait for comes with a kick, so they
        sleep that long at once after a few empty polls (0: their usual backoff);
        `change_only`: that holds only for `wait_change` (a progress word and a doorbell that
        are kicked; the other waits keep their backoff). None: plain sleeps again (before the
        word's memory goes away)."""
        ptr = _ffi.NULL
        if word is not None:
            if word.dtype != np.uint32 or word.size != 1:
                raise ValueError("set_kick: expected a 1-element uint32 array")
            ptr = _ffi.cast("uint32_t *", word.ctypes.data)
        self._kick_word = word  # keep it alive as long as C may sleep on it
        with self._lock:
            _lib.pd_set_kick(self._live(), ptr, int(max_sleep_s * 1e9), int(change_only))

    @property
    def has_wait_fd(self) -> bool:
        """Whether the provider gave this endpoint's CQ a wait fd (tcp): its idle sleeps
        without a kick word then end as soon as the provider has work for it."""
        return bool(_lib.pd_has_wait_fd(self._live()))

    def set_wake_fd(self, fd: int) -> None:
        """Also end those sleeps when a byte arrives on `fd` (the read end of a non-blocking
        pipe, e.g. the engine's command pipe), taking the pending bytes; -1: no more. Used
        with `has_wait_fd`, and with `set_ctl_fd`; the fd must stay open as long as the
        endpoint does."""
        _lib.pd_set_wake_fd(self._live(), int(fd))

    def set_ctl_fd(self, fd: int) -> None:
        """Watch a control socket's readiness fd (a ZeroMQ socket's `zmq.FD`; -1: no more)
        in `wait_change`'s kicked sleeps, beside the wake pipe (`set_wake_fd`), instead of
        sleeping on the kick word: the wait returns (False) when the socket may have a
        message, so it can sleep as long as its caller likes, where it had to come back every
        few milliseconds to look at the socket. Whoever kicks the word must also write a byte
        to the wake pipe. ZMQ_FD is edge-triggered: check the socket's `zmq.EVENTS` before
        each wait. The fd must stay open as long as the endpoint does."""
        _lib.pd_set_ctl_fd(self._live(), int(fd))

    def set_news_fd(self, fd: int) -> None:
        """Decoder (the lanes' owner): when a slot watched by `watch_targets` reaches its
        target, whichever thread counted the last write (a `wait_complete` or a lane) writes a
        byte to `fd` (the write end of a non-blocking pipe the engine polls), and
        `wait_complete` no longer returns for it: the engine learns of a finished transfer
        without a hand-off through the messenger thread. -1: no more. The fd must stay open
        as long as the endpoint does."""
        _lib.pd_set_news_fd(self._live(), int(fd))

    @property
    def fd_wakes(self) -> int:
        """Sleeps on the wait fd that work from the provider or a wake-fd byte ended."""
        return int(_lib.pd_fd_wakes(self._live()))

    @property
    def kick_wakes(self) -> int:
        """Idle sleeps of this endpoint (its waits, its progress thread) a kick ended."""
        return int(_lib.pd_kick_wakes(self._live()))

    def set_active(self, on: bool) -> None:
        """Owner: say whether transfers are being counted, so its lanes poll eagerly (on) or
        sleep between polls (off, an idle decoder costs no core)."""
        _lib.pd_set_active(self._live(), int(on))

    def wait_complete(self, bell: np.ndarray, bell_seen: int, timeout: float) -> int:
        """Poll (in C) until a watched slot reaches its target (1; not with `set_news_fd`),
        `bell[0]` differs from `bell_seen` (2) or `timeout` seconds pass (0)."""
        with self._lock:
            ret = _lib.pd_wait_complete(self._calls(), _ffi.cast("int64_t *", bell.ctypes.data),
                                        bell_seen, int(timeout * 1e9))
        if ret < 0:
            _check(ret, "wait_complete", self.provider)
        return ret

    def wait_idle(self, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
        """Poll until no local write is outstanding; False on timeout."""
        return self._wait(_lib.pd_wait_idle, (), timeout, "wait_idle")

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
        return int(_lib.pd_stale(self._live()))

    @property
    def remote_writes(self) -> int:
        """All remote CQ-data completions seen (counted + stale)."""
        return int(_lib.pd_remote_writes(self._live()))

    @property
    def inflight_bytes(self) -> int:
        """Bytes of local writes submitted and not yet completed (capped by the
        `max_inflight_bytes` the endpoint was opened with, except for a single larger write)."""
        return int(_lib.pd_inflight_bytes(self._live()))

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
        return int(_lib.pd_remote_cntr(self._live()))

    @property
    def errors(self) -> list[tuple[int, int, str]]:
        """Completion errors seen so far as (tag, errno, message), one per failed operation;
        taking them clears the native list (which folds a tag's errors into one entry with a
        count and never drops one). tag is 2**64-1 when unknown."""
        self._live()
        if self._nerr_word[0] == 0:
            out, self._errors = self._errors, []
            return out
        buf = _ffi.new("struct pd_err[64]")
        n = 64
        while n == 64:
            with self._lock:
                n = _lib.pd_take_errors(self._live(), buf, 64)
            for i in range(n):
                e = buf[i]
                msg = _ffi.string(e.msg).decode(errors="replace")
                self._errors.extend([(int(e.tag), int(e.err), msg)] * max(1, int(e.count)))
        out, self._errors = self._errors, []
        return out


def build_features() -> dict[str, bool]:
    """What the binding was compiled against: `dmabuf` (headers with FI_MR_DMABUF, libfabric
    >= 1.20: CUDA memory is registered as a dma-buf where the driver offers one) and
    `cuda_api_permitted` (FI_OPT_CUDA_API_PERMITTED, >= 1.18: set to false on EFA)."""
    return {"dmabuf": bool(_lib.pd_have_dmabuf()),
            "cuda_api_permitted": bool(_lib.pd_have_cuda_api_permitted())}


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


def check_cuda_pointer(addr: int, length: int, device: int) -> None:
    """GpuMemoryError unless [addr, addr+length) is registrable memory of CUDA device `device`
    (device memory, that GPU's, one cudaMalloc allocation, not VMM/expandable segments). Loads
    the CUDA driver (libcuda.so.1) on first use; `register(iface="cuda")` runs the same check."""
    err = _ffi.new("char[]", _ERRBUF)
    ret = _lib.pd_cuda_check_pointer(_ffi.cast("void *", addr), length, device, err, _ERRBUF)
    if ret:
        raise GpuMemoryError("check CUDA pointer", ret, "transfer.gpu_memory=direct: " +
                             _ffi.string(err).decode(errors="replace"),
                             f"addr={addr:#x} length={length} device={device}")


_shm_cleared = {"pid": 0}
_shm_clear_lock = threading.Lock()


def _clear_stale_shm() -> None:
    """Before this process's first shm endpoint: remove /dev/shm files named after its pid.
    shm names an endpoint's region `<pid>:<ep>:<n>` and a SIGKILLed process leaves its region
    behind; once pids wrap (pid_max is 32,768 on many hosts) a new process with that pid
    failed to enable its endpoint (`fi_enable: Device or resource busy`). Any such file that
    exists before this process opened one belongs to a dead process."""
    with _shm_clear_lock:
        pid = os.getpid()  # per process: a forked child has not opened any yet
        if _shm_cleared["pid"] == pid:
            return
        _shm_cleared["pid"] = pid
        for path in shm_leftovers([pid]):
            with contextlib.suppress(OSError):
                os.unlink(path)


def shm_leftovers(pids: list[int] | None = None) -> list[str]:
    """Files in /dev/shm that libfabric's shm provider left behind.

    shm names its region `<pid>:<ep>:<n>` (the address `fi_shm://<pid>:...`). A clean close
    removes it; a SIGKILLed process leaves ~16 MiB. With `pids`, those processes' files; without,
    the files of processes that no longer exist.
    """
    root = "/dev/shm"
    try:
        names = os.listdir(root)
    except OSError:
        return []
    out = []
    for n in names:
        head = n.split(":", 1)[0]
        if ":" not in n or not head.isdigit():
            continue
        pid = int(head)
        if pids is not None:
            if pid in pids:
                out.append(os.path.join(root, n))
        elif not os.path.exists(f"/proc/{pid}"):
            out.append(os.path.join(root, n))
    return out
