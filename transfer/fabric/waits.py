"""The endpoint's waits and wake-ups: polling in C until a count, a word or a bell changes,
and what ends an idle sleep early (a kick word, the CQ's wait fd, a wake pipe, a control
socket's fd, a news pipe). A part of `Endpoint`, kept apart because it is the part that decides
how a waiting thread spends the core."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from .errors import FabricError
from .native import check, ffi, lib
from .values import DEFAULT_TIMEOUT_S


def kick(word: np.ndarray) -> None:
    """Wake whoever sleeps on `word` (Endpoint.set_kick), in this or another process."""
    lib.pd_kick(ffi.cast("uint32_t *", word.ctypes.data))



def _watched_words(call: str, a: np.ndarray, b: np.ndarray | None) -> tuple[Any, Any]:
    """C pointers to the words a wait watches (`b` may be None: NULL); ValueError naming
    `call` for anything but a contiguous int64 numpy array."""
    for name, arr in (("a", a), ("b", b)):
        if arr is not None and (type(arr) is not np.ndarray or arr.dtype != np.int64
                                or arr.size < 1 or not arr.flags.c_contiguous):
            raise ValueError(f"{call}: {name} must be a contiguous int64 numpy array")
    return (ffi.cast("int64_t *", a.ctypes.data),
            ffi.cast("int64_t *", b.ctypes.data) if b is not None else ffi.NULL)


class Waits:
    """Endpoint's waits (mixed into `Endpoint`, whose handle, lock and counters they use)."""

    _lock: threading.Lock
    provider: str
    max_slots: int
    send_done: np.ndarray
    _errors: list[tuple[int, int, str]]

    def _calls(self) -> Any: ...
    def _live(self) -> Any: ...
    @property
    def errors(self) -> list[tuple[int, int, str]]: ...

    def _wait(self, fn: Any, args: tuple, timeout: float, what: str) -> bool:
        with self._lock:
            ret = fn(self._calls(), *args, int(timeout * 1e9))
        if ret == -lib.PD_ETIMEDOUT:
            return False
        if ret:
            check(ret, what, self.provider)
        return True

    def wait_recv(self, slot: int, count: int, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
        """Poll (in C) until recv_counts[slot] >= count; False on timeout."""
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must be in [0, {self.max_slots}), got {slot}")
        return self._wait(lib.pd_wait_recv, (slot, count), timeout, "wait_recv")

    def wait_send(self, tag: int, count: int, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
        """Poll (in C) until send_done[tag] >= count: True; False on timeout. A completion
        error for this tag raises FabricError (errors of other tags stay in `errors`)."""
        if not 0 <= tag < self.max_slots:
            raise ValueError(f"tag must be in [0, {self.max_slots}), got {tag}")
        deadline = time.monotonic() + timeout
        while True:
            # the C loop also returns when any completion error is queued, so it surfaces fast
            ok = self._wait(lib.pd_wait_send, (tag, count),
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
        pa, pb = _watched_words("wait_change", a, b)
        with self._lock:
            ret = lib.pd_wait_change(self._calls(), pa, a_seen, pb, b_seen,
                                      int(sleep_s * 1e9), int(timeout * 1e9))
        if ret < 0:
            check(ret, "wait_change", self.provider)
        return ret == 1

    def wait_idle_or_change(self, a: np.ndarray, a_seen: int, b: np.ndarray | None = None,
                            b_seen: int = 0, *, timeout: float = 0.001) -> str:
        """Drain the CQ (in C, GIL released) until no local write is outstanding ("idle"),
        another thread stores a value other than `a_seen` in `a[0]` (or `b_seen` in `b[0]`)
        ("changed"), or `timeout` passes ("timeout"). A sender's wait while its writes are in
        flight and the engine computes: idles as the endpoint's `idle_*` settings say."""
        pa, pb = _watched_words("wait_idle_or_change", a, b)
        with self._lock:
            ret = lib.pd_wait_idle_or_change(self._calls(), pa, a_seen, pb, b_seen,
                                              int(timeout * 1e9))
        if ret == -lib.PD_ETIMEDOUT:
            return "timeout"
        if ret < 0:
            check(ret, "wait_idle_or_change", self.provider)
        return "changed" if ret == 1 else "idle"

    def watch_targets(self, targets: np.ndarray) -> None:
        """Let `wait_complete` return when a slot's count reaches `targets[slot]` (a uint32
        array of `max_slots` entries that the caller keeps alive and updates when it arms)."""
        if targets.dtype != np.uint32 or targets.shape != (self.max_slots,) or \
                not targets.flags.c_contiguous:
            raise ValueError(f"targets: expected a contiguous uint32 array of {self.max_slots}")
        self._targets = targets  # keep it alive as long as C may read it
        with self._lock:
            lib.pd_set_targets(self._live(), ffi.cast("uint32_t *", targets.ctypes.data))

    def set_kick(self, word: np.ndarray | None, max_sleep_s: float = 0.0,
                 change_only: bool = False) -> None:
        """Sleep on `word` (a 1-element uint32 array, shared memory for another process,
        transfer.kick) in this endpoint's idle waits and its progress thread, so a `kick(word)`
        ends the sleep. `max_sleep_s` > 0: what the waits wait for comes with a kick, so they
        sleep that long at once after a few empty polls (0: their usual backoff);
        `change_only`: that holds only for `wait_change` (a progress word and a doorbell that
        are kicked; the other waits keep their backoff). None: plain sleeps again (before the
        word's memory goes away)."""
        ptr = ffi.NULL
        if word is not None:
            if word.dtype != np.uint32 or word.size != 1:
                raise ValueError("set_kick: expected a 1-element uint32 array")
            ptr = ffi.cast("uint32_t *", word.ctypes.data)
        self._kick_word = word  # keep it alive as long as C may sleep on it
        with self._lock:
            lib.pd_set_kick(self._live(), ptr, int(max_sleep_s * 1e9), int(change_only))

    @property
    def has_wait_fd(self) -> bool:
        """Whether the provider gave this endpoint's CQ a wait fd (tcp): its idle sleeps
        without a kick word then end as soon as the provider has work for it."""
        return bool(lib.pd_has_wait_fd(self._live()))

    def set_wake_fd(self, fd: int) -> None:
        """Also end those sleeps when a byte arrives on `fd` (the read end of a non-blocking
        pipe, e.g. the engine's command pipe), taking the pending bytes; -1: no more. Used
        with `has_wait_fd`, and with `set_ctl_fd`; the fd must stay open as long as the
        endpoint does."""
        lib.pd_set_wake_fd(self._live(), int(fd))

    def set_ctl_fd(self, fd: int) -> None:
        """Watch a control socket's readiness fd (a ZeroMQ socket's `zmq.FD`; -1: no more)
        in `wait_change`'s kicked sleeps, beside the wake pipe (`set_wake_fd`), instead of
        sleeping on the kick word: the wait returns (False) when the socket may have a
        message, so it can sleep as long as its caller likes, where it had to come back every
        few milliseconds to look at the socket. Whoever kicks the word must also write a byte
        to the wake pipe. ZMQ_FD is edge-triggered: check the socket's `zmq.EVENTS` before
        each wait. The fd must stay open as long as the endpoint does."""
        lib.pd_set_ctl_fd(self._live(), int(fd))

    def set_news_fd(self, fd: int) -> None:
        """Decoder (the lanes' owner): when a slot watched by `watch_targets` reaches its
        target, whichever thread counted the last write (a `wait_complete` or a lane) writes a
        byte to `fd` (the write end of a non-blocking pipe the engine polls), and
        `wait_complete` no longer returns for it: the engine learns of a finished transfer
        without a hand-off through the messenger thread. -1: no more. The fd must stay open
        as long as the endpoint does."""
        lib.pd_set_news_fd(self._live(), int(fd))

    @property
    def fd_wakes(self) -> int:
        """Sleeps on the wait fd that work from the provider or a wake-fd byte ended."""
        return int(lib.pd_fd_wakes(self._live()))

    @property
    def kick_wakes(self) -> int:
        """Idle sleeps of this endpoint (its waits, its progress thread) a kick ended."""
        return int(lib.pd_kick_wakes(self._live()))

    def set_active(self, on: bool) -> None:
        """Owner: say whether transfers are being counted, so its lanes poll eagerly (on) or
        sleep between polls (off, an idle decoder costs no core)."""
        lib.pd_set_active(self._live(), int(on))

    def wait_complete(self, bell: np.ndarray, bell_seen: int, timeout: float) -> int:
        """Poll (in C) until a watched slot reaches its target (1; not with `set_news_fd`),
        `bell[0]` differs from `bell_seen` (2) or `timeout` seconds pass (0)."""
        with self._lock:
            ret = lib.pd_wait_complete(self._calls(), ffi.cast("int64_t *", bell.ctypes.data),
                                        bell_seen, int(timeout * 1e9))
        if ret < 0:
            check(ret, "wait_complete", self.provider)
        return ret

    def wait_idle(self, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
        """Poll until no local write is outstanding; False on timeout."""
        return self._wait(lib.pd_wait_idle, (), timeout, "wait_idle")
