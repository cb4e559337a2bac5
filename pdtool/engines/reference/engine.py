"""Prefill and decode schedulers of the reference engine, one step at a time, I/O-free.

Every TP rank of an instance runs the same scheduler (as SGLang does): the lead rank's inputs
(new requests) are broadcast, the links' poll results are intersected across ranks, and every
decision after that (page allocation, batching) is a deterministic function of those, so all
ranks allocate the same page ids without sending them around.

The links (`PrefillLink`, `DecodeLink`) are the engine side of the KV messenger; the schedulers
call them at the protocol points of docs/messenger.md.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pdtool.reference_limits import AUX_ROWS, DEFAULT_MAX_RUNNING
from transfer.routes import pages_for

from .cache import PagedKV
from .model import EOS, Batch, TinyModel

log = logging.getLogger("pdtool.reference.engine")


class Coord:
    """Agreement among the TP ranks of one instance (the default process group)."""

    def __init__(self, size: int = 1, rank: int = 0) -> None:
        self.size, self.rank = size, rank

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def command(self, new: list | None, stop: bool) -> tuple[list, bool]:
        """The lead's (new requests, stop) for this iteration, on every rank. One small
        tensor broadcast per step; the requests themselves travel only when there are some."""
        if self.size == 1:
            return new or [], stop
        flag = torch.zeros(1, dtype=torch.int64)
        if self.leader:
            flag[0] = 2 if stop else (1 if new else 0)
        dist.broadcast(flag, src=0)
        code = int(flag[0])
        if code == 1:
            return self.broadcast(new if self.leader else None), False
        return [], code == 2

    def gather(self, *polls: set[str]) -> list[list[set[str]]]:
        """Per poll, every rank's set (one collective for all polls).

        Callers pass only ids of requests every rank tracks (the same on every rank), so when
        there are none they skip the call and no rank waits for the others."""
        if self.size == 1:
            return [[set(p)] for p in polls]
        seen: list[Any] = [None] * self.size
        dist.all_gather_object(seen, [sorted(p) for p in polls])
        return [[set(s[i]) for s in seen] for i in range(len(polls))]

    def agree(self, *polls: set[str]) -> list[set[str]]:
        """Per poll, the ids every rank reports (level-triggered polls make this converge)."""
        return [set.intersection(*sets) for sets in self.gather(*polls)]


# -- the engine side of the messenger ---------------------------------------------------------


class PrefillLink(Protocol):
    """What the prefill scheduler needs from the messenger (one object per TP rank)."""

    def recv(self) -> list[dict]:
        """Lead rank: new requests {"rid", "tokens", ...}; other ranks are never asked."""

    def accept(self, req: dict, pages: list[int]) -> None:
        """Every rank: `req` got source pages `pages` (prompt tokens[:-1])."""

    def refuse(self, req: dict, reason: str) -> None:
        """Every rank: `req` will never be accepted (its decoders fail it now, not after
        their timeout)."""

    def begin(self, chunks: list[tuple[str, int, int]]) -> None:
        """Every rank, before a forward pass: (rid, first token, end token) scheduled."""

    def layer_done(self, layer: int) -> None:
        """Every rank: layer `layer` of the current pass is in the cache (progress counter)."""

    def finish(self, rid: str, hidden: torch.Tensor) -> None:
        """Every rank, after the last chunk: ship `hidden` (last processed position)."""

    def done(self) -> set[str]:
        """Requests whose writes from this rank all completed (level-triggered)."""

    def release(self, rid: str) -> None:
        """Every rank: the scheduler freed the request's pages."""


class DecodeLink(Protocol):
    """What the decode scheduler needs from the messenger (one object per TP rank)."""

    def submit(self, rid: str, tokens: list[int], pages: list[int], peer: int) -> None:
        """Every rank: ask prefill instance `peer` to fill `pages` for prompt `tokens`."""

    def ready(self) -> set[str]:
        """Requests whose expected writes all landed on this rank (level-triggered)."""

    def failed(self) -> set[str]:
        """Requests whose transfer failed/timed out on this rank (level-triggered)."""

    def hidden(self, rid: str) -> torch.Tensor:
        """The hidden state the prefill shipped for `rid`."""

    def release(self, rid: str) -> None:
        """Every rank: the request left the transfer stage (done or failed)."""

    def cancel(self, rid: str, reason: str) -> None:
        """Every rank: give up a transfer in flight; it ends up in `failed()`."""

    def reason(self, rid: str) -> str:
        """Why a failed transfer failed on this rank ("" if it did not fail here)."""


# -- prefill ------------------------------------------------------------------------------------


@dataclass
class _PReq:
    rid: str
    tokens: list[int]
    meta: dict
    pages: list[int] = field(default_factory=list)
    done: int = 0  # tokens of tokens[:-1] already in the cache

    @property
    def todo(self) -> int:
        return len(self.tokens) - 1


class PrefillEngine:
    """Chunked prefill of tokens[:-1]; pages freed once the link says every write completed."""

    def __init__(
        self,
        model: TinyModel,
        kv: PagedKV,
        link: PrefillLink,
        coord: Coord,
        chunk_size: int,
        max_batch_tokens: int | None = None,
        max_requests: int = AUX_ROWS,
    ) -> None:
        if chunk_size % kv.page_size:
            raise ValueError(
                f"chunked_prefill_size={chunk_size} must be a multiple of "
                f"page_size={kv.page_size}"
            )
        self.model, self.kv, self.link, self.coord = model, kv, link, coord
        self.chunk = chunk_size
        self.budget = max_batch_tokens or chunk_size
        self.max_requests = max_requests  # bound at once (the messenger has that many aux rows)
        self.waiting: list[_PReq] = []
        self.running: list[_PReq] = []
        self.sending: dict[str, _PReq] = {}

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.sending)

    def step(self, new: list[dict] | None = None) -> bool:
        """One scheduler iteration on every rank; `new` (already broadcast by the serving loop)
        must be the same on every rank. Returns True when a forward pass ran."""
        new = new or []
        for m in new:
            toks = list(m["tokens"])
            if len(toks) < 2:  # the decoder never sends these
                log.warning("request %s: prefill needs 2+ prompt tokens, dropped", m["rid"])
                self.link.refuse(m, "refused: the prefill needs 2 or more prompt tokens")
                continue
            self.waiting.append(_PReq(m["rid"], toks, m))
        while self.waiting and len(self.running) + len(self.sending) < self.max_requests:
            r = self.waiting[0]
            n = pages_for(len(r.tokens), self.kv.page_size)
            if n > self.kv.pages.num_pages:
                self.waiting.pop(0)
                log.warning("request %s: %d pages exceed the cache (%d), dropped", r.rid, n,
                            self.kv.pages.num_pages)
                self.link.refuse(r.meta, f"refused: the prompt needs {n} pages, the prefill's "
                                         f"cache holds {self.kv.pages.num_pages}")
                continue
            if n > self.kv.pages.num_free:
                break
            self.waiting.pop(0)
            r.pages = self.kv.pages.alloc(n)
            try:
                self.link.accept(r.meta, r.pages)
            except ValueError as exc:  # refused by the messenger: only this request fails
                log.warning("request %s refused by the messenger: %s", r.rid, exc)
                self.kv.pages.free(r.pages)
                continue
            self.running.append(r)
        ran = self._forward()
        if not self.sending and not self.running:
            return ran
        # a request still computing can be done too: the messenger aborted it (its decoder
        # died, timed out or cancelled) once its issued writes completed; stop computing it
        computing = {r.rid for r in self.running}
        (done,) = self.coord.agree(self.link.done() & (set(self.sending) | computing))
        for rid in sorted(done):
            r = self.sending.pop(rid, None)
            if r is None:
                r = next(x for x in self.running if x.rid == rid)
                self.running.remove(r)
                log.warning("request %s: aborted by the messenger, stopped after %d of %d "
                            "prompt tokens", rid, r.done, r.todo)
            self.kv.pages.free(r.pages)
            self.link.release(rid)
        return ran

    def _forward(self) -> bool:
        runs, chunks, picked, left = [], [], [], self.budget
        P = self.kv.page_size
        for r in self.running:
            take = min(self.chunk, left, r.todo - r.done)
            if r.done + take < r.todo:
                take -= take % P  # chunk boundaries stay page-aligned (whole pages per write)
            if take <= 0:
                break
            hi = r.done + take
            runs.append((r.tokens[r.done : hi], r.done, r.pages))
            chunks.append((r.rid, r.done, hi))
            picked.append(r)
            left -= hi - r.done
        if not runs:
            return False
        self.link.begin(chunks)
        batch = Batch.build(runs, self.kv.page_size)
        hidden = self.model.forward(batch, self.kv.layers, self.kv.page_size, self.link.layer_done)
        ends = torch.cumsum(torch.tensor([len(t) for t, _, _ in runs]), 0) - 1
        for r, (_, _, hi), end in zip(picked, chunks, ends.tolist(), strict=True):
            r.done = hi
            if hi == r.todo:
                self.running.remove(r)
                self.sending[r.rid] = r
                self.link.finish(r.rid, hidden[end].clone())
        return True


# -- decode -------------------------------------------------------------------------------------


@dataclass
class Faults:
    """Test hooks that damage what arrived over the messenger, to prove the decoder uses it."""

    page: tuple[int, int] | list[int] | None = None  # (layer, index among received pages)
    hidden: bool = False


class Sampler:
    """Temperature / top-p sampling of one request from its own seeded generator. Every TP
    rank computes the same logits and draws from the same seed, so all ranks pick the same
    token without a collective."""

    def __init__(self, temperature: float, top_p: float = 1.0, seed: int = 0) -> None:
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.gen = torch.Generator().manual_seed(int(seed))

    def pick(self, logits: torch.Tensor) -> int:
        probs = torch.softmax(logits.to(torch.float64) / self.temperature, dim=-1)
        if self.top_p < 1.0:  # the smallest set of most likely tokens holding top_p
            p, idx = probs.sort(descending=True)
            keep = (p.cumsum(0) - p) < self.top_p
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], p[keep])
        return int(torch.multinomial(probs, 1, generator=self.gen))


@dataclass
class _DReq:
    rid: str
    prompt: list[int]
    max_tokens: int
    peer: int
    pages: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)
    pos: int = 0  # tokens already in the cache
    draft: int | None = None
    faults: Faults | None = None
    first_draft: int | None = None
    draft_accepted: bool = False
    error: str = ""
    sampler: Sampler | None = None  # None: greedy
    kv_writes: int = 0  # counted writes the KV transfer waited for on this rank


@dataclass
class Event:
    """What the decoder reports to the front: new tokens, and `done` with stats at the end."""

    rid: str
    tokens: list[int]
    done: bool = False
    info: dict = field(default_factory=dict)


class DecodeEngine:
    """Continuous batching; each request's first step runs its last prompt token (plus the
    draft proposed from the shipped hidden state), never the rest of the prompt."""

    def __init__(
        self,
        model: TinyModel,
        kv: PagedKV,
        link: DecodeLink,
        coord: Coord,
        max_running: int = DEFAULT_MAX_RUNNING,
    ) -> None:
        self.model, self.kv, self.link, self.coord = model, kv, link, coord
        self.max_running = max_running
        self.waiting: list[_DReq] = []
        self.transfer: dict[str, _DReq] = {}
        self.running: list[_DReq] = []
        self.prompt_tokens_seen = 0  # prompt tokens the decoder's forward passes processed
        self.requests_started = 0
        self.steps = 0  # decode forward passes
        self.max_batch = 0  # most requests stepping together in one pass
        self.ran = False
        self.eos = frozenset(getattr(model, "eos_ids", (EOS,)))
        self.vocab = int(model.embed.shape[0])

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.transfer or self.running)

    def step(self, new: list[dict] | None = None) -> list[Event]:
        """One iteration on every rank; `new` ({"rid", "tokens", "max_tokens", "peer"}, already
        broadcast by the serving loop) must be the same on every rank. Returns the events
        (identical on every rank); `self.ran` says whether a forward pass ran."""
        self.ran = False
        events: list[Event] = []
        self._take_new(new or [], events)
        self._admit()
        self._collect_transfers(events)
        if self.running:
            self._decode(events)
            self.ran = True
        return events

    def _take_new(self, new: list[dict], events: list[Event]) -> None:
        """Queue the serving loop's new requests and apply its cancels; a request the model
        cannot run is answered at once (an event with its error) and goes no further."""
        for m in new:
            if m.get("cancel"):
                self._cancel(m["rid"], events)
                continue
            toks = list(m["tokens"])
            if not toks or m["max_tokens"] < 1:
                events.append(Event(m["rid"], [], True, {"error": "empty prompt or max_tokens"}))
                continue
            if max(toks) >= self.vocab:  # the front checks its tokenizer's; the model decides
                events.append(Event(m["rid"], [], True, {"error": f"prompt: token id "
                                    f"{max(toks)} is outside the model's {self.vocab} rows"}))
                continue
            faults = Faults(**m["faults"]) if m.get("faults") else None
            sampling = m.get("sampling")
            sampler = Sampler(**sampling) if sampling and sampling.get("temperature") else None
            self.waiting.append(_DReq(m["rid"], toks, int(m["max_tokens"]),
                                      int(m["peer"]), faults=faults, sampler=sampler))

    def _take_waiting(self) -> _DReq | None:
        """The first waiting request with its pages allocated, or None while none fits now.
        A request the cache can never hold fails (reported and dropped by _decode)."""
        P = self.kv.page_size
        while self.waiting:
            r = self.waiting[0]
            # prompt + every new token + the draft slot of the first step
            n = math.ceil((len(r.prompt) + r.max_tokens + 1) / P)
            if n > self.kv.pages.num_pages:
                self.waiting.pop(0)
                r.error = f"needs {n} pages, the cache has {self.kv.pages.num_pages}"
                self.running.append(r)
                continue
            if n > self.kv.pages.num_free:
                return None
            self.waiting.pop(0)
            r.pages = self.kv.pages.alloc(n)
            r.pos = len(r.prompt) - 1
            self.requests_started += 1
            return r
        return None

    def _admit(self) -> None:
        P = self.kv.page_size
        while self.waiting and len(self.running) + len(self.transfer) < self.max_running:
            r = self._take_waiting()
            if r is None:
                break
            if len(r.prompt) == 1:
                self.running.append(r)  # nothing to prefill, no hidden state to draft from
            else:
                try:
                    self.link.submit(r.rid, r.prompt, r.pages[: pages_for(len(r.prompt), P)],
                                     r.peer)
                except ValueError as exc:  # refused by the messenger: only this request fails
                    self.kv.pages.free(r.pages)
                    r.error = f"KV transfer refused: {exc}"
                    self.running.append(r)  # reported (and dropped) by _decode
                    continue
                self.transfer[r.rid] = r

    def _collect_transfers(self, events: list[Event]) -> None:
        ids = set(self.transfer)  # the same on every rank: skip the collective when empty
        if not ids:
            return
        fails, oks = self.coord.gather(self.link.failed() & ids, self.link.ready() & ids)
        # settled on every rank (success or safely failed); failed if it failed anywhere
        settled = set.intersection(*(f | o for f, o in zip(fails, oks, strict=True)))
        failed = settled & set.union(*fails)
        ready = settled - failed
        for rid in sorted(failed):
            r = self.transfer.pop(rid)
            why = r.error or getattr(self.link, "reason", lambda _rid: "")(rid)
            self.link.release(rid)
            self.kv.pages.free(r.pages)
            events.append(Event(rid, [], True, {"error": f"KV transfer failed: {why}" if why
                                                else "KV transfer failed"}))
        for rid in sorted(ready):
            r = self.transfer.pop(rid)
            hidden = self.link.hidden(rid).to(self.model.cfg.torch_dtype)
            self._inject_faults(r, hidden)
            draft = self.model.draft(hidden[None], torch.tensor([r.prompt[-1]]))
            r.draft = None if draft is None else int(draft[0])  # checkpoints have no draft
            r.first_draft = r.draft
            r.kv_writes = int(getattr(self.link, "writes", lambda _rid: 0)(rid))
            self.link.release(rid)
            self.running.append(r)

    def _cancel(self, rid: str, events: list[Event]) -> None:
        """The client went away: drop the request wherever it is. A transfer in flight is
        cancelled in the messenger and its pages freed only once they are safe (`failed()`)."""
        reason = "cancelled: the client went away"
        for r in list(self.waiting):
            if r.rid == rid:
                self.waiting.remove(r)
                events.append(Event(rid, [], True, {"error": reason}))
        r = self.transfer.get(rid)
        if r is not None and not r.error:
            r.error = reason
            self.link.cancel(rid, reason)
        for r in list(self.running):
            if r.rid == rid:
                self.running.remove(r)
                if r.pages:
                    self.kv.pages.free(r.pages)
                events.append(Event(rid, [], True, {"error": reason}))

    def _inject_faults(self, r: _DReq, hidden: torch.Tensor) -> None:
        f = r.faults
        if f is None:
            return
        if f.page is not None:
            layer, idx = f.page
            g = torch.Generator().manual_seed(1)
            buf = self.kv.layers[layer]
            page = r.pages[idx]
            noise = torch.randn(buf[page].shape, generator=g, dtype=torch.float64)
            buf[page] += (3.0 * noise).to(buf.dtype)
        if f.hidden:  # replace it with noise of the same scale
            g = torch.Generator().manual_seed(2)
            scale = hidden.pow(2).mean().sqrt()
            hidden.copy_(scale * torch.randn(hidden.shape, generator=g, dtype=hidden.dtype))

    def _decode(self, events: list[Event], extra: list | None = None) -> torch.Tensor | None:
        """One forward pass over every running request's next token(s), plus `extra` runs
        (the aggregated engine's prefill chunks) batched behind them; returns the hidden
        states (decode rows first), or None when nothing ran."""
        for r in [r for r in self.running if r.error]:
            self.running.remove(r)
            events.append(Event(r.rid, [], True, {"error": r.error}))
        if not self.running and not extra:
            return None
        runs = []
        for r in self.running:
            last = r.out[-1] if r.out else r.prompt[-1]
            if not r.out:
                self.prompt_tokens_seen += 1
            toks = [last] if r.draft is None else [last, r.draft]
            runs.append((toks, r.pos, r.pages))
        self.steps += 1
        self.max_batch = max(self.max_batch, len(runs))
        rows = sum(len(t) for t, _, _ in runs)
        batch = Batch.build(runs + (extra or []), self.kv.page_size)
        hidden = self.model.forward(batch, self.kv.layers, self.kv.page_size)
        logits = self.model.logits(hidden[:rows])
        best = logits.argmax(-1).tolist()
        i = 0
        for r, (toks, _, _) in zip(list(self.running), runs, strict=True):
            pick = (lambda j: best[j]) if r.sampler is None else (
                lambda j, s=r.sampler: s.pick(logits[j]))
            got = [pick(i)]
            if r.draft is not None and got[0] == r.draft:
                # the draft was right: its successor comes for free (sampled or greedy, the
                # token after the draft is drawn from the distribution given the draft)
                got.append(pick(i + 1))
                r.draft_accepted = True
            i += len(toks)
            r.draft = None
            emitted, finished = [], False
            for t in got:
                if t in self.eos:
                    finished = True
                    break
                emitted.append(t)
                if len(r.out) + len(emitted) >= r.max_tokens:
                    finished = True
                    break
            r.out += emitted
            r.pos += len(got)  # an accepted draft's cache entry is kept, a rejected one rewritten
            if finished:
                self.running.remove(r)
                self.kv.pages.free(r.pages)
                info = {"draft": r.first_draft, "draft_accepted": r.draft_accepted,
                        "kv_writes": r.kv_writes}
                events.append(Event(r.rid, emitted, True, info))
            else:
                events.append(Event(r.rid, emitted))
        return hidden


class _NoTransfer:
    """An aggregated instance has no KV messenger: nothing is ever in transfer."""

    def problem(self) -> str:
        return ""


class AggregatedEngine(DecodeEngine):
    """An ordinary (non-disaggregated) instance: it prefills its own requests' prompts in
    chunks and batches those chunks with the running requests' decode steps in one forward
    pass, as a plain SGLang server does (`mode=aggregated`). The prompt but its last token is
    prefilled here, then the request decodes exactly as on a decode instance (its first step
    runs the last prompt token, plus the draft proposed from the hidden state at N-2), so the
    output is the same as disaggregated serving's."""

    def __init__(self, model: TinyModel, kv: PagedKV, coord: Coord, chunk_size: int,
                 max_running: int = DEFAULT_MAX_RUNNING) -> None:
        if chunk_size % kv.page_size:
            raise ValueError(f"chunked_prefill_size={chunk_size} must be a multiple of "
                             f"page_size={kv.page_size}")
        super().__init__(model, kv, _NoTransfer(), coord, max_running)  # type: ignore[arg-type]
        self.chunk = chunk_size
        self.prefilling: list[_DReq] = []
        self.prefill_done: dict[str, int] = {}  # rid -> prompt tokens already in the cache

    @property
    def busy(self) -> bool:
        return bool(self.prefilling) or super().busy

    def _admit(self) -> None:
        while self.waiting and (len(self.running) + len(self.prefilling)) < self.max_running:
            r = self._take_waiting()
            if r is None:
                break
            if len(r.prompt) == 1:
                self.running.append(r)
            else:
                self.prefill_done[r.rid] = 0
                self.prefilling.append(r)

    def _cancel(self, rid: str, events: list[Event]) -> None:
        for r in list(self.prefilling):
            if r.rid == rid:
                self.prefilling.remove(r)
                self.prefill_done.pop(rid, None)
                self.kv.pages.free(r.pages)
                events.append(Event(rid, [], True, {"error": "cancelled: the client went away"}))
        super()._cancel(rid, events)

    def step(self, new: list[dict] | None = None) -> list[Event]:
        self.ran = False
        events: list[Event] = []
        self._take_new(new or [], events)
        self._admit()
        P, left, chunks, picked = self.kv.page_size, self.chunk, [], []
        for r in self.prefilling:  # chunks of prompt[:-1], page-aligned but for the last
            done, todo = self.prefill_done[r.rid], len(r.prompt) - 1
            take = min(left, todo - done)
            if done + take < todo:
                take -= take % P
            if take <= 0:
                break
            chunks.append((r.prompt[done : done + take], done, r.pages))
            picked.append((r, done + take))
            left -= take
        decoding = sum(len(t) for t in ([1] if r.draft is None else [1, 1]
                                        for r in self.running if not r.error))
        hidden = self._decode(events, chunks)
        if hidden is None:
            return events
        self.ran = True
        self.prompt_tokens_seen += sum(len(t) for t, _, _ in chunks)
        ends = torch.cumsum(torch.tensor([len(t) for t, _, _ in chunks] or [0]), 0) - 1
        for (r, hi), end in zip(picked, ends.tolist(), strict=False):
            self.prefill_done[r.rid] = hi
            if hi == len(r.prompt) - 1:  # prompt[:-1] cached: decode it from the next step
                self.prefilling.remove(r)
                del self.prefill_done[r.rid]
                h = hidden[decoding + end].to(torch.float32).to(self.model.cfg.torch_dtype)
                draft = self.model.draft(h[None], torch.tensor([r.prompt[-1]]))
                r.draft = None if draft is None else int(draft[0])
                r.first_draft = r.draft
                self.running.append(r)
        return events
