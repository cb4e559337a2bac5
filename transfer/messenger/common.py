"""Shared pieces of both messengers: configuration, states, and the single-thread worker.

Threading model (both sides). The engine calls the public methods from its own thread; they only
validate arguments, append a command to a deque and return (or read a snapshot). ONE messenger
thread owns everything else — the libfabric endpoint, the ZeroMQ sockets, the slot/tag tables —
and loops: drain the CQ, run commands, read control messages, watch the progress counter, check
counts, and every few milliseconds run timers (timeouts, heartbeats, quarantine). Keeping every
poll in one place matters on small machines: two busy-polling threads per process halve the
throughput (docs/libfabric.md). While nothing is in flight the thread sleeps on its sockets and the
engine's command doorbell (so a message or a command wakes it at once; `idle_sleep_s` only
paces the timers); while writes are due it polls the completion queue in short C slices (the
GIL released, the core yielded when a poll finds nothing), or, with `busy_sleep_s` > 0, polls
once per loop and sleeps that long. A prefill thread waiting for the engine's next layer waits
in C on the progress word and the doorbell, sleeping between polls (no core, no GIL taken).
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
import secrets as _secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import zmq

from .. import timers
from ..fabric import FabricError
from ..layout import KVLayout, LayoutError
from ..plane import idle
from ..plane.metrics import TRANSFER_S_BOUNDS
from ..progress import LAYER_MASK, PASS_SHIFT  # noqa: F401  the progress word's one home
from ..routes import RouteError, ShardSpec
from ..wakeups import CommandQueue, Doorbell
from ..wire.channel import check_bind_host
from ..wire.secret import check_secret

log = logging.getLogger("transfer.messenger")
#: token ids and page ids in REQUEST bodies: uint32, little-endian
WIRE_U32 = np.dtype("<u4")


class MessengerError(RuntimeError):
    """The messenger thread could not start or died; the text says why."""


def _positive(name: str, v: Any, *, allow_zero: bool = False) -> None:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and (v >= 0 if allow_zero
                                                                      else v > 0)
    if not ok:
        raise ValueError(f"{name}: expected a {'non-negative' if allow_zero else 'positive'} "
                         f"number, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class CommonConfig:
    """Settings both sides share. `spec` is this side's sharding, `peer_spec` the other's.

    `rank` is this process's attention-TP rank inside its instance (0 = lead). `domain`: the
    libfabric domain (NIC) to open, the one the plan chose for this rank's GPU (the worker
    exports it, `transfer.workerenv.domain_for`); None takes the provider's first domain, and a
    domain the provider does not have fails the start with an error naming `domain`. Timeouts:
    `timeout_s` bounds one transfer from when the prefill takes it (binds it; time in the
    prefill's queue does not count: the lead's PONGs list queued transfers); a peer silent
    for `peer_timeout_s` is dead; heartbeats go every `heartbeat_s`. `busy_sleep_s`: 0 (the
    default, and the fast path) polls in C slices while writes are due, yielding the core when
    idle; a positive value polls once
    per loop and sleeps that long instead (gentler on heavily oversubscribed cores, but on
    `tcp;ofi_rxm`/`verbs` the receiver's polling is what moves the bytes, so it is slower).
    `poll_backoff_s`: while writes are due but polls keep finding nothing (a decoder counting
    writes that come only after each prefill forward pass, a sender whose peer has not copied
    yet), the C waits sleep between polls, from `POLL_SLEEP_S` doubling to this; any poll that
    finds work starts over. Measured on a 2-core box, the decoder's yield-only wait took more
    CPU than the prefill compute it waited for (docs/benchmark-rounds.md). 0: yield only (no
    sleep).
    """

    secret: bytes
    spec: ShardSpec
    peer_spec: ShardSpec
    rank: int = 0
    provider: str = "shm"
    domain: str | None = None
    buffers_per_layer: int = 1
    timeout_s: float = timers.TIMEOUT_S
    heartbeat_s: float = timers.HEARTBEAT_S
    peer_timeout_s: float = timers.PEER_TIMEOUT_S
    busy_sleep_s: float = 0.0
    idle_sleep_s: float = 0.005  # = MessengerThread.TIMER_S: messages and commands wake it anyway
    poll_backoff_s: float = idle.POLL_BACKOFF_S
    name: str = ""

    def __post_init__(self) -> None:
        check_secret(self.secret)
        for name in ("spec", "peer_spec"):
            spec = getattr(self, name)
            if not isinstance(spec, ShardSpec):
                raise ValueError(f"{name}: expected a transfer.routes.ShardSpec")
            try:
                spec.check()
            except RouteError as exc:
                raise ValueError(f"{name}: {exc}") from None
        if self.spec.num_kv_heads != self.peer_spec.num_kv_heads:
            raise ValueError(f"spec.num_kv_heads={self.spec.num_kv_heads} differs from "
                             f"peer_spec.num_kv_heads={self.peer_spec.num_kv_heads}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.spec.attn_tp:
            raise ValueError(f"rank: expected 0..{self.spec.attn_tp - 1}, got {self.rank!r}")
        if self.domain is not None and (not isinstance(self.domain, str) or not self.domain):
            raise ValueError(f"domain: expected a libfabric domain name or None, got "
                             f"{self.domain!r}")
        if self.buffers_per_layer not in (1, 2):
            raise ValueError(f"buffers_per_layer: 1 (fused K/V) or 2 (separate), got "
                             f"{self.buffers_per_layer!r}")
        for name in ("timeout_s", "heartbeat_s", "peer_timeout_s"):
            _positive(name, getattr(self, name))
        for name in ("busy_sleep_s", "idle_sleep_s", "poll_backoff_s"):
            _positive(name, getattr(self, name), allow_zero=True)
        if self.poll_backoff_s >= 0.05:
            raise ValueError(f"poll_backoff_s: expected less than 0.05 s, got "
                             f"{self.poll_backoff_s!r}")
        if self.peer_timeout_s <= self.heartbeat_s:
            raise ValueError(f"peer_timeout_s ({self.peer_timeout_s}) must exceed heartbeat_s "
                             f"({self.heartbeat_s})")

    def identity(self, role: str) -> str:
        """A routing id unique per process (a restarted peer is a new peer)."""
        base = self.name or f"{role}-r{self.rank}"
        return f"{base}-{os.getpid()}-{_secrets.token_hex(3)}"


@dataclass(frozen=True, kw_only=True)
class PrefillConfig(CommonConfig):
    """Prefill side: where its control socket listens (a configured interface, never every
    interface unless `allow_any_interface`), and how many requests may be bound at once
    (`max_requests`: each needs one fabric tag per destination rank). `inflight_bytes`: bytes
    of writes in flight at once (split evenly over a decoder's receive lanes); on shm it bounds
    how long one poll of the receiver copies before it looks at its control work again."""

    bind_host: str = "127.0.0.1"
    port: int = 0
    allow_any_interface: bool = False
    max_requests: int = 4096
    inflight_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bind_host(self.bind_host, self.allow_any_interface)
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port: expected 0..65535, got {self.port!r}")
        _positive("max_requests", self.max_requests)
        if not isinstance(self.inflight_bytes, int) or self.inflight_bytes < 1:
            raise ValueError(f"inflight_bytes: expected a positive int, got "
                             f"{self.inflight_bytes!r}")


@dataclass(frozen=True, kw_only=True)
class DecodeConfig(CommonConfig):
    """Decode side: the prefill groups it may use, each a list of its attention ranks'
    control addresses (`tcp://host:port`, rank 0 first; a prefill instance with DP attention
    gives one group per DP rank, and the engine's `peer` or a hash of the request id picks
    one); `max_inflight` transfer slots (aux rows must be at least this many);
    `quarantine_grace_s`: see transfer.plane.slots; `writes_per_op`: page writes the prefill groups
    into one RMA operation (one completion counted here): 0 = as many as the provider takes
    (its iov limit, 4 on shm and tcp), 1 = one operation per write; `lanes`: receive
    endpoints, each drained by a thread of its own, that the prefill spreads KV writes over:
    0 = 2 on shm (where the receiver performs every copy, so one thread caps the decoder at one
    core's copy speed) and 1 elsewhere (the NIC or the sender moves the bytes)."""

    prefill_endpoints: tuple[tuple[str, ...], ...]
    max_inflight: int = 256
    quarantine_grace_s: float = 5.0
    seed: int | None = None
    writes_per_op: int = 0
    lanes: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.prefill_endpoints:
            raise ValueError("prefill_endpoints: at least one prefill instance is needed")
        for i, group in enumerate(self.prefill_endpoints):
            if len(group) != self.peer_spec.attn_tp:
                raise ValueError(f"prefill_endpoints[{i}]: {len(group)} addresses for "
                                 f"{self.peer_spec.attn_tp} prefill attention ranks")
            for j, addr in enumerate(group):
                if not isinstance(addr, str) or not addr.startswith("tcp://"):
                    raise ValueError(f"prefill_endpoints[{i}][{j}]: expected tcp://host:port, "
                                     f"got {addr!r}")
        if not isinstance(self.max_inflight, int) or not 0 < self.max_inflight <= 1 << 16:
            raise ValueError(f"max_inflight: expected 1..65536, got {self.max_inflight!r}")
        _positive("quarantine_grace_s", self.quarantine_grace_s)
        if not isinstance(self.writes_per_op, int) or not 0 <= self.writes_per_op <= 64:
            raise ValueError(f"writes_per_op: expected 0 (the provider's limit) .. 64, got "
                             f"{self.writes_per_op!r}")
        if not isinstance(self.lanes, int) or not 0 <= self.lanes <= 8:
            raise ValueError(f"lanes: expected 0 (2 on shm, else 1) .. 8, got {self.lanes!r}")

    @property
    def receive_lanes(self) -> int:
        """The number of receive endpoints `lanes` resolves to for this provider."""
        return self.lanes or (2 if self.provider == "shm" else 1)


class TransferStatus(StrEnum):
    """Decode-side life of one request's transfer.

    PENDING: sent (or waiting for a slot); TRANSFERRING: writes are being counted;
    SUCCESS: every expected write landed, the engine may schedule it;
    ABORTING: it failed (reason set) but its pages are quarantined — do NOT free them yet;
    FAILED: failed and the pages are safe to free.
    """

    PENDING = "pending"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    ABORTING = "aborting"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferState:
    rid: str
    status: TransferStatus
    reason: str = ""
    received: int = 0
    expected: int = 0
    slot: int = -1




@dataclass
class TransferTally:
    """A decode messenger's settled transfers: how many succeeded, failed and (of those)
    timed out on this side, and how long each success took from submit until the messenger
    thread saw its count complete, or the engine released it having read the full count
    (per bucket of TRANSFER_S_BOUNDS, the last bucket unbounded). Written by the
    messenger thread, read by any (plain ints: a snapshot, as `stats()` gives)."""

    ok: int = 0
    failed: int = 0
    timed_out: int = 0
    seconds_sum: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_S_BOUNDS) + 1))

    def snapshot(self) -> dict[str, Any]:
        """The tally as `stats()` gives it (the decode messenger's keys)."""
        return {"transfers_ok": self.ok, "transfers_failed": self.failed,
                "transfers_timed_out": self.timed_out, "transfer_s_sum": self.seconds_sum,
                "transfer_s_buckets": list(self.buckets)}

    def settled(self, ok: bool, timed_out: bool, seconds: float) -> None:
        if not ok:
            self.failed += 1
            self.timed_out += timed_out
            return
        self.ok += 1
        self.seconds_sum += seconds
        self.buckets[bisect.bisect_left(TRANSFER_S_BOUNDS, seconds)] += 1


@dataclass(frozen=True)
class PrefillResult:
    """Prefill-side outcome of one request on this rank: its pages may be freed."""

    rid: str
    ok: bool
    reason: str = ""
    writes: int = 0  # RMA operations issued for it (what the decode ranks count)


@dataclass
class PeerClock:
    """Last time each peer was heard from; who has been silent too long."""

    timeout_s: float
    last: dict[Any, float] = field(default_factory=dict)
    dead: set[Any] = field(default_factory=set)

    def heard(self, peer: Any, now: float) -> bool:
        """Record a sign of life; True when the peer had been declared dead."""
        self.last[peer] = now
        if peer in self.dead:
            self.dead.discard(peer)
            return True
        return False

    def excuse(self, seconds: float) -> None:
        """The owner was not running for `seconds` (descheduled, or its thread starved of the
        GIL): a live peer's answers could not be read meanwhile, so that time does not count
        as the peer's silence. Moves every live peer's last sign of life later, which only
        delays a verdict (and the lease end computed from it), never hastens one."""
        for p in self.last:
            if p not in self.dead:
                self.last[p] += seconds

    def newly_dead(self, now: float) -> list[Any]:
        out = [p for p, t in self.last.items()
               if p not in self.dead and now - t > self.timeout_s]
        self.dead.update(out)
        return out


class MessengerThread:
    """Runs `_setup`, then `_step` in a loop on the messenger thread, then `_teardown`."""

    role = "worker"
    TIMER_S = 0.005
    POLL_SLEEP_S = idle.POLL_SLEEP_S  # first sleep of an empty stretch of polls
    # a wait whose events all come with a kick (transfer.kick) sleeps this long at once; a
    # kick ends the sleep, so this bounds only what a missed kick would cost
    KICK_SLEEP_S = 0.005

    def __init__(self, config: CommonConfig) -> None:
        self.config = config
        self._cmds = CommandQueue()
        self.news = Doorbell()  # rung when the engine has something to collect
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._fatal = ""
        self._beat = time.monotonic()  # the messenger loop's last round (see stalled_s)
        # the longest time between two rounds of the loop: how long the box (or the GIL) kept
        # this thread away, which a liveness verdict about a peer has to allow for
        self.longest_round_s = 0.0
        self._ctx: zmq.Context | None = None
        self._thread = threading.Thread(target=self._main, name=f"pdtool-{self.role}",
                                         daemon=True)

    def _check_kv_buffers(self, kv_buffers: Sequence[Any], layout: str) -> KVLayout:
        """The one layout every layer buffer shares, checked against this rank's shard spec."""
        per_layer = self.config.buffers_per_layer
        if not kv_buffers or len(kv_buffers) % per_layer:
            raise LayoutError(f"kv_buffers: need a positive multiple of buffers_per_layer="
                              f"{per_layer}, got {len(kv_buffers)}")
        first = KVLayout.from_tensor(kv_buffers[0], layout)
        for i, b in enumerate(kv_buffers):
            if KVLayout.from_tensor(b, layout) != first:
                raise LayoutError(f"kv_buffers[{i}]: shape differs from kv_buffers[0]")
        spec = self.config.spec
        if first.heads_local != spec.heads_per_rank:
            raise LayoutError(f"kv_buffers: {first.heads_local} local heads, but spec "
                              f"{spec} gives {spec.heads_per_rank} per rank")
        return first

    def _open_endpoint(self, **options: Any) -> Any:
        """An endpoint of the configured provider on the configured domain (messenger thread).
        EFA names its RDM domain after the device with a `-rdm` suffix, so a NIC name is tried
        as given, then with that suffix; neither existing is an error naming `domain`."""
        from ..fabric import Endpoint  # loads the binding: validate/plan never need it

        cfg = self.config
        options = {**self.idle_options(), **options}
        if cfg.domain is None:
            return Endpoint(cfg.provider, **options)
        first: FabricError | None = None
        for name in (cfg.domain, f"{cfg.domain}-rdm"):
            try:
                return Endpoint(cfg.provider, domain=name, **options)
            except FabricError as exc:
                first = first or exc
        raise MessengerError(f"domain: cannot open provider {cfg.provider!r} on domain "
                             f"{cfg.domain!r} (nor {cfg.domain + '-rdm'!r}): {first}") from None

    def _sleep_on(self, word: np.ndarray | None = None) -> None:
        """Make this messenger's C waits sleep on a kick word (transfer.kick; a private one
        unless `word` is given) that the engine thread kicks with every command, so a command
        ends the sleep at once instead of after up to `poll_backoff_s`. Nothing without a
        backoff (the waits do not sleep)."""
        from ..fabric import kick

        if not self.config.poll_backoff_s:
            return
        word = np.zeros(1, dtype=np.uint32) if word is None else word
        self._ep.set_kick(word)
        self._kick_word = word
        self._cmds.kick = functools.partial(kick, word)

    def idle_options(self) -> dict[str, Any]:
        """Endpoint options for how this messenger's C waits idle (`poll_backoff_s`)."""
        return idle.idle_options(self.config.provider, self.config.poll_backoff_s,
                                 receiver=self.role == "decode")

    @property
    def fabric_domain(self) -> str:
        """The libfabric domain (NIC) this messenger's endpoint opened (once started)."""
        return self._ep.domain

    def _start(self, timeout: float = 60.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            self._stop.set()
            raise MessengerError(f"{self.role} messenger did not start within {timeout:.0f} s")
        if self._error is not None:
            self._thread.join(5)
            raise MessengerError(f"{self.role} messenger failed to start: {self._error}") \
                from self._error

    def problem(self) -> str:
        """Any thread: why this messenger cannot take work now, '' when it can (for an
        engine's health check; `submit`/`bind` refuse with the same text)."""
        if self._fatal:
            return f"{self.role} messenger thread died: {self._fatal}"
        if self._stop.is_set():
            return f"{self.role} messenger is closed"
        stuck = self.stalled_s()
        if stuck > 2 * self.config.peer_timeout_s:
            return (f"{self.role} messenger thread stuck for {stuck:.1f} s in one call (more "
                    f"than 2 x peer_timeout_s): the fabric provider does not return (on shm: a "
                    f"peer killed while holding this endpoint's queue lock?)")
        return ""

    def _check_alive(self) -> None:
        reason = self.problem()
        if reason:
            raise MessengerError(reason)

    def stalled_s(self) -> float:
        """Any thread: seconds since the messenger thread last went round its loop. Every wait
        in the loop is bounded (well under peer_timeout_s), so a large value means it is stuck
        inside the provider; `submit`/`bind` then refuse with that reason instead of queueing
        work nobody will do."""
        if not self._thread.is_alive():
            return 0.0
        return max(0.0, time.monotonic() - self._beat)

    # -- thread ------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._ctx = zmq.Context()
            self._setup()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            self._safe_teardown()
            return
        self._beat = time.monotonic()
        self._ready.set()
        next_timer = 0.0
        cfg = self.config
        try:
            while not self._stop.is_set():
                busy = self._step()
                now = time.monotonic()
                self.longest_round_s = max(self.longest_round_s, now - self._beat)
                self._beat = now
                if now >= next_timer:
                    self._timers(now)
                    next_timer = now + self.TIMER_S
                if not busy:
                    self._idle_wait(cfg.idle_sleep_s)
                elif cfg.busy_sleep_s:
                    time.sleep(cfg.busy_sleep_s)
        except Exception as exc:  # a bug or a fatal provider error: fail loudly, clean up
            log.exception("%s messenger thread died", self.role)
            self._fatal = f"{type(exc).__name__}: {exc}"
            self._on_fatal(self._fatal)
        finally:
            self._safe_teardown()

    def _safe_teardown(self) -> None:
        try:
            self._teardown()
        except Exception:
            log.exception("%s messenger teardown", self.role)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread and free the endpoint and sockets (engine thread; idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> MessengerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- to implement ------------------------------------------------------------------------
    def _setup(self) -> None: ...
    def _step(self) -> bool: ...
    def _timers(self, now: float) -> None: ...
    def _idle_wait(self, seconds: float) -> None: ...
    def _teardown(self) -> None: ...
    def _on_fatal(self, reason: str) -> None: ...
