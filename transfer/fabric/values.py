"""Plain value types of the binding: the immediate that carries (slot, generation), a peer's
view of a registered region, a batch of writes, buffer addresses, the defaults. No native
import: the control planes and the wire use these without libfabric loaded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .endpoint import MemoryRegion

DEFAULT_TIMEOUT_S = 30.0
# Completion-queue entries; 0 = the provider's default (small CQs made shm slower at 64 KiB).
# Local writes in flight are capped in BYTES instead (see write_batch): that is what bounds how
# long one poll of the target can run on shm, where the target copies every queued write.
DEFAULT_MAX_INFLIGHT_BYTES = 64 << 20
SHM_DRAIN_SLEEP_S = 50e-6
DEFAULT_CQ_SIZE = 0
MAX_SLOTS = 1 << 16  # 16 bits of slot in the 32-bit immediate


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
