"""The reference engine's side of the KV messenger (transfer.messenger), one object per TP rank.

The engine's schedulers speak the small `PrefillLink` / `DecodeLink` protocols of engine.py; this
module maps them onto `PrefillMessenger` / `DecodeMessenger`:

* decode: `submit` / `ready` / `failed` / `release` are the messenger's own; the hidden state
  arrives in aux buffer 0, whose row is the transfer slot, and is copied out before `release`.
* prefill: the lead rank's messenger hands out requests once every decode rank's part arrived;
  the serving loop broadcasts them (parts included) so every rank `bind`s the same request to
  the same source pages; each forward pass is announced (`begin`: which chunks), and after each
  layer the rank's progress counter is bumped so the messenger thread writes that layer's pages
  while the next layer computes. After the last chunk the hidden state goes into an aux row the
  engine allocated at bind time, and the messenger copies it to the decoder's slot row.

Control addresses: every prefill rank's messenger listens on a random port of its host; the
prefill lead gathers them over gloo and publishes them in its `/health`, where decode ranks read
them (`prefill_endpoints`), so no port has to be planned per rank. A restarted prefill instance
(launcher.restart) listens on new ports: while the messenger finds an instance silent, each
decode rank re-reads its /health every `REDISCOVER_S` and moves its channels to the new
addresses (`DecodeMessenger.reconnect`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from pdtool.reference_limits import AUX_ROWS

from .cache import PagedKV
from .health import read_health
from .model import TinyModel
from .spec import LinkSpec, RankSpec

log = logging.getLogger("pdtool.reference.link")
# How long an idle messenger thread sleeps on its sockets and command doorbell (either wakes it
# at once): only its timers (heartbeats every 0.5 s, timeouts) wait for it. At the messenger's
# default 5 ms, each idle decoder's thread took the GIL 200 times a second, ~4 % of a loaded core
# (docs/benchmark-rounds.md).
IDLE_WAIT_S = 0.02
REDISCOVER_S = 1.0  # a silent prefill instance's /health is read this often (new addresses?)


def _endpoints(health_url: str, timeout_s: float) -> tuple[tuple[str, ...], int]:
    """A prefill instance's per-rank control addresses and the longest prompt it holds (tokens,
    0 = not published), read from its lead's /health."""
    try:
        health = read_health(health_url, ("control",), timeout_s)
    except TimeoutError:
        raise TimeoutError(f"prefill instance at {health_url} did not publish its control "
                           f"addresses within {timeout_s:.0f} s") from None
    return tuple(health["control"]), int(health.get("context", 0))


def _common(spec: RankSpec, model: TinyModel) -> dict[str, Any]:
    link = _link(spec)
    cfg = model.cfg
    peer_tp = link.prefill_tp if spec.role == "decode" else link.decode_tp
    return {
        "secret": spec.secret,
        "spec": cfg.shard_spec(spec.tp),
        "peer_spec": cfg.shard_spec(peer_tp),
        "rank": spec.rank,
        "provider": link.provider,
        "domain": link.domain,
        "timeout_s": link.timeout_s,
        "peer_timeout_s": link.peer_timeout_s,
        "heartbeat_s": link.heartbeat_s,
        "idle_sleep_s": IDLE_WAIT_S,
        "name": f"{spec.role}{spec.instance}-r{spec.rank}",
    }


def _link(spec: RankSpec) -> LinkSpec:
    if spec.link is None:
        raise ValueError(f"the {spec.role} rank's RankSpec has no link (the messenger's settings)")
    return spec.link


class _Side:
    """What both links do with their messenger `m`."""

    m: Any

    def problem(self) -> str:
        """Why the messenger cannot take work now ('' when it can): read by /health."""
        return self.m.problem()

    @property
    def news_fd(self) -> int:
        """Readable when the messenger has news for the engine (a request, a transfer or
        a send settled): serving loops poll it beside their sockets instead of sleeping."""
        return self.m.news.fd

    def wait(self, seconds: float) -> None:
        """Sleep until the messenger has news or `seconds` passed."""
        self.m.news.wait(seconds)

    def clear_news(self) -> None:
        self.m.news.clear()

    def close(self) -> None:
        self.m.close()


class DecodeSide(_Side):
    """DecodeLink over a DecodeMessenger."""

    def __init__(self, spec: RankSpec, kv: PagedKV, model: TinyModel) -> None:
        from transfer.messenger.common import DecodeConfig
        from transfer.messenger.decode import DecodeMessenger

        link = _link(spec)
        found = [_endpoints(url, link.connect_timeout_s) for url in link.prefill]
        groups = tuple(control for control, _ in found)
        #: longest prompt every prefill instance this rank may send to can hold (0: no limit)
        self.peer_context = min((c for _, c in found if c), default=0)
        self.aux = torch.zeros(AUX_ROWS, model.cfg.hidden, dtype=torch.float32)
        config = DecodeConfig(**_common(spec, model), prefill_endpoints=groups,
                              max_inflight=AUX_ROWS, lanes=link.lanes)
        self.m = DecodeMessenger(config, kv.buffers, kv.layout, [self.aux])
        self._control = list(groups)
        self._health_urls = list(link.prefill)
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._rediscover, daemon=True,
                                         name="prefill-rediscovery")
        self._watcher.start()

    def _rediscover(self) -> None:
        """A silent prefill instance publishing new control addresses was restarted: move
        the messenger's channels there (its old process is gone: the launcher stopped it).
        Its lead listens on its bootstrap port again, an address that does not change: the
        messenger greets a silent rank there anew by itself (only the other ranks move)."""
        while not self._stop.wait(REDISCOVER_S):
            for g in self.m.silent_groups():
                try:
                    control, _ = _endpoints(self._health_urls[g], 0)
                except TimeoutError:
                    continue  # not up yet
                if control != self._control[g] and len(control) == len(self._control[g]):
                    try:
                        self.m.reconnect(g, control)
                    except Exception as exc:  # the messenger died: /health says why
                        log.warning("prefill %d: cannot reconnect: %s", g, exc)
                        return
                    self._control[g] = control

    def close(self) -> None:
        self._stop.set()
        self._watcher.join(timeout=5)
        self.m.close()

    def submit(self, rid: str, tokens: list[int], pages: list[int], peer: int) -> None:
        self.m.submit(rid, tokens, pages, peer)

    def ready(self) -> set[str]:
        return self.m.ready()

    def failed(self) -> set[str]:
        return self.m.failed()

    def hidden(self, rid: str) -> torch.Tensor:
        row = np.array(self.m.aux(rid, 0))  # copy: the row goes back with the slot
        return torch.from_numpy(row.view(np.float32).copy())

    def release(self, rid: str) -> None:
        self.m.release(rid)

    def reason(self, rid: str) -> str:
        """Why a failed transfer failed (empty if it failed on another decode rank)."""
        return self.m.status(rid).reason

    def writes(self, rid: str) -> int:
        """Counted writes this rank's transfer of `rid` waited for (the route math's count)."""
        return self.m.status(rid).expected

    def cancel(self, rid: str, reason: str) -> None:
        """Give up a transfer; it shows up in `failed()` once its pages are safe to free."""
        self.m.cancel(rid, reason)



def messenger_link(spec: RankSpec, kv: PagedKV, model: TinyModel) -> Any:
    if spec.role == "decode":
        return DecodeSide(spec, kv, model)
    return PrefillSide(spec, kv, model)


class PrefillSide(_Side):
    """PrefillLink over a PrefillMessenger."""

    def __init__(self, spec: RankSpec, kv: PagedKV, model: TinyModel) -> None:
        import torch.distributed as dist

        from transfer.messenger.common import MessengerError, PrefillConfig
        from transfer.messenger.prefill import PrefillMessenger
        from transfer.wire import WireError

        self.aux = torch.zeros(AUX_ROWS, model.cfg.hidden, dtype=torch.float32)
        port = _link(spec).control_port  # the lead's: its bootstrap port
        config = PrefillConfig(**_common(spec, model), bind_host=spec.host, port=port,
                               max_requests=AUX_ROWS)
        try:
            self.m = PrefillMessenger(config, kv.buffers, kv.layout, [self.aux],
                                      progress=kv.progress.array)
        except MessengerError as exc:
            if port and isinstance(exc.__cause__, WireError):  # its control socket
                raise MessengerError(f"prefill.bootstrap_port (base + instance {spec.instance}"
                                     f"): {exc.__cause__}") from None
            raise
        self.num_layers = self.m.num_layers
        self._todo: dict[str, int] = {}  # rid -> prompt tokens prefilled (all but the last)
        self._finishing = 0  # requests the current pass ends that have not had `finish` yet
        # this rank's KV bytes per prompt token, and those computed since the last announcement
        self._token_bytes = kv.page_bytes() * len(kv.buffers) // kv.page_size
        self._pass_bytes = 0
        self._unannounced = 0
        self.announce_bytes = _link(spec).announce_bytes or self.ANNOUNCE_BYTES
        # on a GPU the stream writes the progress word itself (model.progress_writer) and the
        # host never announces: the messenger's waits then watch the word instead of sleeping
        # until an announcement's kick, which would hold mid-prompt pages back
        self._host_progress = getattr(model, "progress_writer", None) is None
        addrs = [self.m.address]
        if spec.tp > 1:  # the lead publishes every rank's control address in /health
            addrs = [""] * spec.tp
            dist.all_gather_object(addrs, self.m.address)
        self.control = addrs

    def recv(self) -> list[dict]:
        return [{"rid": r.rid, "tokens": [int(t) for t in r.token_ids], "req": r}
                for r in self.m.poll_requests()]

    def accept(self, req: dict, pages: list[int]) -> None:
        self.m.bind(req["req"], pages)
        self._todo[req["rid"]] = len(req["tokens"]) - 1

    def refuse(self, req: dict, reason: str) -> None:
        self.m.refuse(req["req"], reason)

    def begin(self, chunks: list[tuple[str, int, int]]) -> None:
        self.m.begin_pass(chunks)
        self._finishing = sum(1 for rid, _lo, hi in chunks if hi == self._todo.get(rid))
        self._pass_bytes = sum(hi - lo for _rid, lo, hi in chunks) * self._token_bytes

    # a pass that ends no prompt wakes the messenger thread only once this much KV was
    # computed since it last woke (LinkSpec.announce_bytes may set it:
    # tests do, to stream short prompts pass by pass). What is left for the prompt's end is
    # then at most this, about a millisecond of writes on shm, while every wake-up stalled
    # the engine thread (its GIL) about half a millisecond (docs/benchmark-rounds.md,
    # "Eighth round"): at 2,000 tokens, 40-55 wake-ups per prompt had cost it 11-23 ms.
    ANNOUNCE_BYTES = 4 << 20

    def layer_done(self, layer: int) -> None:
        """Announce the pass's layers to the messenger once, after the last. Per layer, its
        thread woke and took the GIL four times per pass; each handoff cost the engine thread a
        scheduler wake-up, which on a loaded 2-core box doubled a 2,000-token prefill (1.85 s
        against 0.97 s aggregated). On CPU the layers' pages are written right after the pass
        instead, one pass later at most (docs/benchmark-rounds.md). A pass that ends some prompt
        announces its last layer only after their `finish`: the thread then wakes once for
        that layer and the hidden states. A pass that ends none announces only once
        ANNOUNCE_BYTES of KV were computed since the last announcement; the next announced
        pass's word (or the next pass's start) tells the thread that the ones between are in
        the cache too, and their pages go in that wake-up."""
        if layer == self.num_layers - 1 and not self._finishing:
            self._unannounced += self._pass_bytes
            if self._unannounced >= self.announce_bytes:
                self._announce(layer)

    def _announce(self, layer: int) -> None:
        self._unannounced = 0
        self.m.layer_done(layer)

    def finish(self, rid: str, hidden: torch.Tensor) -> None:
        if not self._host_progress:  # the stream wrote the pass's layers: the rows wake it
            self.m.finish(rid, [hidden.to(torch.float32).contiguous()])
            return
        try:
            self.m.finish(rid, [hidden.to(torch.float32).contiguous()], wake=False)
        finally:
            self._finishing -= 1
            if self._finishing <= 0:  # the pass's last finish: its last layer goes now
                self._finishing = 0
                self._announce(self.num_layers - 1)

    def done(self) -> set[str]:
        return self.m.done()

    def release(self, rid: str) -> None:
        self._todo.pop(rid, None)
        self.m.release(rid)
