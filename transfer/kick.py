"""The kick word: how a prefill wakes a decoder on the same host (`transfer/csrc/kick.c`).

libfabric's shm provider gives a target nothing to sleep on: a decoder waiting for writes that
come only after each prefill forward pass has to poll, and with a backoff it still woke
thousands of times a second per thread on a box whose cores the prefill needs. With a kick word
the decoder's C waits sleep on one shared 32-bit word (futex), and the prefill bumps it after it
posts writes to that decoder, so a waiting decoder wakes when there is something to copy.

The word lives in a memfd page of the decode rank; a prefill rank of the same host maps it by
its `/proc/<pid>/fd/<fd>` path (sent in the decode rank's HELLO), which needs the same access
as shm's cross-memory copies. The memfd goes away with its last mapping, so a killed process
leaves nothing behind in /dev/shm. A prefill that cannot map it says so in its HELLO answer,
and the decoder then keeps its short polling sleeps.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re

import numpy as np

PAGE = 4096
_PATH = re.compile(r"/proc/[0-9]+/fd/[0-9]+")


class KickWord:
    """Decode rank: the word its waits sleep on (`word`, for `Endpoint.set_kick`) and the path
    a prefill rank maps it by (`path`)."""

    def __init__(self) -> None:
        self._fd = os.memfd_create("pdtool-kick", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, PAGE)
        self._mm = mmap.mmap(self._fd, PAGE)
        self.word: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint32, count=1)
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"

    def close(self) -> None:
        """After every endpoint sleeping on the word was closed or told `set_kick(None)`."""
        if self.word is None:
            return
        self.word = None
        with contextlib.suppress(BufferError):  # a view is still alive (a leaked endpoint's):
            self._mm.close()                    # the page is unmapped once it goes
        os.close(self._fd)


class PeerKick:
    """Prefill rank: a decode rank's word mapped from its path, which `write_batch(kick=)`
    bumps after posting writes to it. Raises OSError (cannot open or map it: another host, no
    access) or ValueError (not a kick word's path or size)."""

    def __init__(self, path: str) -> None:
        if not _PATH.fullmatch(path):
            raise ValueError(f"kick: {path!r} is not a /proc/<pid>/fd/<fd> path")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != PAGE:
                raise ValueError(f"kick: {path} is not a {PAGE}-byte kick word")
            self._mm = mmap.mmap(fd, PAGE)
        finally:
            os.close(fd)
        #: the mapped word, for `Endpoint.write_batch(kick=)` (None once closed)
        self.word: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint32, count=1)

    def close(self) -> None:
        if self.word is not None:
            self.word = None
            with contextlib.suppress(BufferError):  # as KickWord.close
                self._mm.close()
