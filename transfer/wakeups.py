"""Waking a thread that waits: the engine → messenger command queue and the messenger → engine
doorbell. Neither control plane owns them: the reference messenger and the SGLang backend's
decode plane both hand commands to a thread that sleeps in C or in a poller, and the SGLang
prefill plane takes its chunks through a command queue."""

from __future__ import annotations

import contextlib
import os
import select
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np


def _drain(fd: int) -> None:
    """Empty a non-blocking wake-up pipe. A short read means it is empty: reading again only
    to get BlockingIOError cost an exception per wake-up on the engine's hot path."""
    with contextlib.suppress(OSError):  # BlockingIOError: it was empty
        while len(os.read(fd, 4096)) == 4096:
            pass


class CommandQueue(deque):
    """Commands from the engine thread to the messenger thread, each `(handler, *args)` with the
    messenger's bound handler (no dispatch by name). Appending also rings two
    doorbells, so a command wakes the thread at once wherever it waits: `bell[0]` (an int64
    its C waits watch, `Endpoint.wait_change`) and a byte on a pipe (`wake_fd`, which its idle
    wait polls along with its sockets; before, a new request waited out `idle_sleep_s`)."""

    def __init__(self) -> None:
        super().__init__()
        self.bell = np.zeros(1, dtype=np.int64)
        # set by a messenger whose C waits sleep on a kick word (transfer.kick): also kick it
        self.kick: Callable[[], None] | None = None
        self.wake_fd, self._wfd = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wfd, False)

    def append(self, item: Any) -> None:
        super().append(item)
        self.bell[0] += 1  # only the engine thread appends; the reader just sees "changed"
        self.ring()

    def ring(self) -> None:
        """Wake the messenger thread wherever it waits, without a command: the kick word
        and the pipe (a prefill's wait for its engine sleeps on either, `Endpoint.set_ctl_fd`)."""
        if self.kick is not None:
            self.kick()
        with contextlib.suppress(OSError):  # pipe full: a wake-up is pending anyway
            os.write(self._wfd, b"\0")

    def post(self, item: Any) -> None:
        """Append without waking the messenger thread: for a command it needs only once the
        engine's next signal (a progress-word change, which its waits watch, or a ringing
        command) comes, and that signal always follows. Each wake-up in the middle of a forward
        pass took the GIL from the engine thread (docs/benchmark-rounds.md, "Third round")."""
        super().append(item)

    def drain_wakeups(self) -> None:
        """Messenger thread, after its idle wait returned: forget the pending wake-ups."""
        _drain(self.wake_fd)

    def __del__(self) -> None:  # not at close: a late append must never hit a reused fd
        for fd in (self.wake_fd, self._wfd):
            with contextlib.suppress(OSError):
                os.close(fd)


class Doorbell:
    """News from the messenger thread for the engine thread: a byte on a pipe, so an engine
    loop can wait on it beside its own sockets (`fd` in a zmq/select poller) or alone
    (`wait`) and wake the moment there is news, instead of sleeping a fixed slice and
    looking (a prefill engine's idle sleep of up to 20 ms was most of the time between a
    decoder's REQUEST and the start of its prefill)."""

    def __init__(self) -> None:
        self.fd, self.write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self.write_fd, False)  # C rings it too (`Endpoint.set_news_fd`)

    def ring(self) -> None:
        with contextlib.suppress(OSError):  # pipe full: a wake-up is pending anyway
            os.write(self.write_fd, b"\0")

    def clear(self) -> None:
        _drain(self.fd)

    def wait(self, timeout: float) -> bool:
        """Block until rung or `timeout` seconds passed; True when rung. Clears it."""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        self.clear()
        return bool(ready)

    def __del__(self) -> None:  # not at close: a late ring must never hit a reused fd
        for fd in (self.fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
