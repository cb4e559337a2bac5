"""The prefill's per-layer progress word, and its two writers.

One int64, `(pass_id << PASS_SHIFT) | layers_done`, so a reader never
sees a torn pass/layer pair. `PrefillMessenger.begin_pass` sets it to (new pass, 0 layers) from
the host; then one of two writers sets the layer field after each layer's attention output
projection, and the messenger thread, which polls the word in C, writes that layer's pages:

* on a CPU, the engine thread (`PrefillMessenger.layer_done`), a plain store;
* on a GPU, the GPU stream itself (`GpuProgressWriter.layer_done`): a fenced 32-bit store of
  `layer + 1` into the word's low half (the layer field; the pass id is the high half, which
  the host wrote) through its device mapping (host memory the GPU addresses,
  `transfer.cudahost`), enqueued with cuStreamWriteValue32 on the current stream. The store is
  ordered after the layer's kernels and behind a system-scope fence, so a host thread that
  sees the layer also sees its KV in host-mapped pages; two ordinary kernels writing the word
  gave no such order (the GPU check's graph step reads each reported layer's pages at once and
  fails on a stale one). A prefill forward captured in a CUDA graph replays the store at the
  same points, and a replay reports the pass the host began.

The word lives in a page of its own, anonymous or in a file (`path`, e.g. under /dev/shm) so
the other TP ranks of the lead's node can `attach` to the lead's word and poll it instead of
their own: the word is written after the output projection's all-reduce, when every rank's
KV of that layer is in its cache.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Any

import numpy as np

PASS_SHIFT = 32  # the word's one home (the GPU writes the low half); transfer.messenger.common
#                 imports it
LAYER_MASK = (1 << PASS_SHIFT) - 1
_PAGE = mmap.PAGESIZE


class ProgressWord:
    """The int64 progress word in a page of its own (`array` is a 1-element int64 view)."""

    def __init__(self, path: str | None = None, *, create: bool = True) -> None:
        self.path = path
        self._owner = bool(path) and create
        if path is None:
            self._map = mmap.mmap(-1, _PAGE, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        else:
            flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
            fd = os.open(path, flags, 0o600)
            try:
                if create:
                    os.ftruncate(fd, _PAGE)
                self._map = mmap.mmap(fd, _PAGE, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.int64, count=1)

    @classmethod
    def attach(cls, path: str) -> ProgressWord:
        """Another process's word (a TP lead's), by its file."""
        return cls(path, create=False)

    @property
    def value(self) -> int:
        return int(self.array[0])

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data)

    def close(self) -> None:
        """Unlink the file if this process created it (the mapping stays valid while views of
        it live)."""
        if self._owner and self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self._owner = False


class GpuProgressWriter:
    """The GPU stream's writer of a `ProgressWord` (CUDA only; imports torch and the driver
    when built)."""

    def __init__(self, word: ProgressWord) -> None:
        import torch

        from .cudahost import device_alias

        self.word = word
        self.device_word = device_alias(torch.from_numpy(word.array))
        self.layer_field = self.device_word.data_ptr()  # the low half (little-endian)

    def layer_done(self, layer: int) -> None:
        """Enqueue, on the current stream, the fenced store of `layer + 1` into the layer
        field."""
        import torch

        from .fabric import cuda_stream_write_u32

        cuda_stream_write_u32(torch.cuda.current_stream().cuda_stream, self.layer_field,
                              layer + 1)


class HostLayerStore:
    """`GpuProgressWriter`'s store made from the host: `layer + 1` into the word's low 32 bits
    (the layer field, little-endian) and nothing else, so the pass id the host began stays.
    The CPU emulation of the GPU writer (tests, `gpu/check.sh --cpu`)."""

    def __init__(self, word: ProgressWord) -> None:
        self.word = word

    def layer_done(self, layer: int) -> None:
        self.word.array.view(np.uint32)[0] = layer + 1


def check_word(progress: Any) -> np.ndarray:
    """The int64 array a messenger polls, from a ProgressWord or an int64 array."""
    arr = progress.array if isinstance(progress, ProgressWord) else progress
    if not isinstance(arr, np.ndarray) or arr.dtype != np.int64 or arr.size < 1:
        raise ValueError("progress: expected a ProgressWord or an int64 array of at least one "
                         "element")
    return arr
