"""Serving processes of the reference engine: prefill ranks, decode ranks and the front.

Entry point for the worker entry (`pdtool.worker`): `run_worker(ctx)` turns the plan into a
`RankSpec` (spec.py: plain data, also accepted as JSON by `python -m
pdtool.engines.reference.serve`, which the engine's own tests use) and serves until
SIGTERM/SIGINT.

Per instance, TP ranks form one gloo process group (rendezvous on rank 0's host at the
instance's `dist_init_port`). Rank 0 leads: it takes new requests (the front's, or the
messenger's on prefill), broadcasts them with a stop flag each iteration, and serves `/health`
and `/stats` on the instance's `http_port`. A decode leader also listens for the front on a
ZeroMQ socket whose address it publishes in `/health`, so no extra port has to be planned.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import zmq

from pdtool.reference_limits import AUX_ROWS, DEFAULT_MAX_RUNNING

from .health import HealthServer
from .spec import RankSpec
from .wire import Wire, router

if TYPE_CHECKING:  # torch is imported by the prefill/decode roles only: the front starts fast
    from collections.abc import Callable

    from .cache import PagedKV
    from .engine import Coord, Event
    from .model import TP, TinyModel

log = logging.getLogger("pdtool.reference.serve")

IDLE_WAIT_S = 0.05  # decode leader's longest wait for the front when nothing is running
PREFILL_IDLE_S = (0.001, 0.02)  # prefill leader's messenger poll: backs off from 1 to 20 ms
BUSY_WAIT_S = 0.0005  # while transfers are in flight but nothing can be computed


# -- plumbing -------------------------------------------------------------------------------------


def _init(spec: RankSpec) -> tuple[Coord, TP]:
    import torch
    import torch.distributed as dist

    from .engine import Coord
    from .heap import keep_freed_memory
    from .model import TP

    torch.set_num_threads(1)
    if spec.device.startswith("cuda"):  # kernels that take the current device use the rank's
        torch.cuda.set_device(torch.device(spec.device))
    keep_freed_memory()  # each pass's temporaries stay mapped (heap.py)
    if spec.tp > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{spec.leader_host}:{spec.dist_port}",
            world_size=spec.tp,
            rank=spec.rank,
            timeout=timedelta(minutes=10),
        )
    return Coord(spec.tp, spec.rank), TP(spec.tp, spec.rank, None)


class StartError(RuntimeError):
    """This rank could not start (a port taken, a peer that never came up); the text says
    which and why. `run` prints it as one line and exits 1."""


def _exit_on_signals() -> None:
    """Until a rank serves, SIGTERM/SIGINT end its process at once: it holds nothing that
    needs a clean shutdown yet, and its start-up waits (a peer's /health, the process
    group's rendezvous) watch no stop flag, so a launcher stopping a deployment whose
    prefill died at start would otherwise wait its whole grace period for the decoders."""

    def handler(signum: int, frame: Any) -> None:
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def _stop_on_signals(stop: threading.Event) -> None:
    """From the moment a rank serves, SIGTERM/SIGINT set `stop`; the loops then shut down
    cleanly and print their STATS.

    Installed once the messenger is up: libfabric's shm provider installs its own handlers
    (unlink its files, then die by the signal), which would skip the clean shutdown that
    closes the endpoint anyway."""

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():  # second signal: a follower stuck waiting for a dead leader
            os._exit(128 + signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def _health(spec: RankSpec, info: Callable[[], dict[str, Any]],
            stats: Callable[[], dict[str, Any]], link: Any) -> HealthServer:
    """The leader's /health (and /stats, and /metrics from its messenger's counters) on its
    planned HTTP port, or a StartError naming the port."""
    from .metrics import messenger_metrics

    m = getattr(link, "m", None)  # the messenger (none on an aggregated instance)
    metrics = messenger_metrics(m.stats if m is not None else dict, spec.role)
    try:
        return HealthServer(spec.host, spec.http_port, info, stats,
                            getattr(link, "problem", lambda: ""), metrics)
    except OSError as exc:
        raise StartError(f"{spec.role} {spec.instance}: cannot serve /health on "
                         f"{spec.host}:{spec.http_port} (its HTTP port): "
                         f"{exc.strerror or exc}") from None


def make_link(spec: RankSpec, kv: PagedKV, model: TinyModel) -> Any:
    """The messenger adapter for this rank (imported late: it needs the libfabric binding);
    its start-up failures (a control port taken, a prefill instance that never published its
    addresses) as a StartError."""
    from transfer.messenger.common import MessengerError

    from .link import messenger_link

    try:
        return messenger_link(spec, kv, model)
    except (MessengerError, TimeoutError) as exc:
        raise StartError(f"{spec.role} {spec.instance} rank {spec.rank}: {exc}") from None


def _start_rank(spec: RankSpec, stop: threading.Event, link: Any) -> tuple[Any, ...]:
    """Process group, model, warmed-up KV cache and messenger link of one serving rank."""
    from .cache import PagedKV
    from .models import build_model

    coord, tp = _init(spec)
    model = build_model(spec.cfg, tp)
    kv = PagedKV(spec.cfg, len(model.kv_heads), spec.num_pages, spec.page_size, spec.layout,
                 spec.device)
    if spec.device != "cpu":  # the prefill's GPU stream writes its progress word
        model.to_device(spec.device, spec.page_size,
                        kv.progress if spec.role == "prefill" else None)
    _warm_up(model, kv)
    log.info("%s %d rank %d: model and cache ready", spec.role, spec.instance, spec.rank)
    if spec.role == "aggregated":  # whole requests here: no KV messenger
        from .engine import _NoTransfer

        link = _NoTransfer()
    else:
        link = link if link is not None else make_link(spec, kv, model)
        log.info("%s %d rank %d: messenger ready", spec.role, spec.instance, spec.rank)
    _stop_on_signals(stop)
    return coord, model, kv, link


# -- decode ---------------------------------------------------------------------------------------


def serve_decode(spec: RankSpec, stop: threading.Event, link: Any = None) -> dict[str, Any]:
    """A decode instance's rank, or (role "aggregated") an ordinary instance's: the same
    request socket, health and loop; the aggregated engine prefills its requests itself."""
    from .engine import AggregatedEngine, DecodeEngine

    coord, model, kv, link = _start_rank(spec, stop, link)
    max_running = spec.max_running or DEFAULT_MAX_RUNNING
    if spec.role == "aggregated":
        engine = AggregatedEngine(model, kv, coord, spec.chunk, max_running)
    else:
        engine = DecodeEngine(model, kv, link, coord, max_running)

    def stats() -> dict[str, Any]:
        return {"role": spec.role, "instance": spec.instance, "rank": spec.rank,
                "pages_total": kv.pages.num_pages, "pages_free": kv.pages.num_free,
                "kv_layout": kv.layout, "kv_shape": list(kv.shape),
                "kv_writes_per_op": int(getattr(getattr(link, "m", None), "writes_per_op", 0)),
                "tokens_seen": model.tokens_seen, "prompt_tokens_seen": engine.prompt_tokens_seen,
                "requests_started": engine.requests_started, "steps": engine.steps,
                "max_batch": engine.max_batch, "running": len(engine.running),
                "in_transfer": len(engine.transfer), "waiting": len(engine.waiting),
                "prefilling": len(getattr(engine, "prefilling", ()))}

    sock = health = None
    wire = Wire(spec.secret, role="decode")
    owner: dict[str, bytes] = {}
    if coord.leader:
        ctx = zmq.Context.instance()
        sock = router(ctx, spec.host, 0)
        address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        context = decode_context(spec, getattr(link, "peer_context", 0),
                                 getattr(model.cfg, "max_context", 0))
        health = _health(spec, lambda: {"role": spec.role, "engine": address,
                                        "context": context}, stats, link)
        health.ready = True
    news = getattr(link, "news_fd", None)  # the messenger's doorbell: a transfer settled
    if sock is not None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if news is not None:
            poller.register(news, zmq.POLLIN)
    try:
        while True:
            new: list[dict] = []
            if coord.leader:
                if not engine.ran:  # sleeps in the kernel until the front sends, a transfer
                    # settles (the doorbell) or time is up; without a doorbell, 1 ms slices
                    busy = engine.busy and news is None
                    poller.poll(1 if busy else int(IDLE_WAIT_S * 1000))
                    if news is not None:
                        link.clear_news()  # before the step reads ready()/failed()
                new = _take_requests(sock, wire, owner, spec.peer, spec.allow_faults,
                                     spec.corrupt_page)
                cmd = (new, stop.is_set())
            else:
                cmd = None
            new, stopping = coord.command(*(cmd or (None, False)))
            if stopping:
                log.info("decode %d rank %d: stopping", spec.instance, spec.rank)
                break
            events = engine.step(new)
            if coord.leader:
                _send_events(sock, wire, owner, events)
    finally:
        if health:
            health.close()
        if sock is not None:
            sock.close(0)
        _close_link(link)
    return stats()


def decode_context(spec: RankSpec, peer_context: int = 0, model_context: int = 0) -> int:
    """Tokens one request may span (prompt + max_tokens) on this decode instance: its cache
    holds them plus the first step's draft slot, the prefill's cache holds the prompt, the
    wire carries at most MAX_PROMPT, and the model's context_length bounds both. The front
    refuses longer requests with a 400 (published in /health)."""
    from .wire import MAX_PROMPT

    limits = [spec.num_pages * spec.page_size - 1, MAX_PROMPT]
    limits += [c for c in (spec.context, peer_context, model_context) if c > 0]
    return min(limits)


def _take_requests(sock: zmq.Socket, wire: Wire, owner: dict[str, bytes],
                   peer: int, allow_faults: bool,
                   corrupt_page: list[int] | None = None) -> list[dict]:
    new = []
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return new
        if len(frames) < 2:
            continue
        got = wire.unpack(frames[1:], ("HELLO", "GEN", "PING", "CANCEL"), peer=frames[0])
        if got is None:
            continue
        kind, body = got
        if kind == "HELLO":  # a front (re)connected: answer bound to its session
            sock.send_multipart([frames[0], *wire.pack("HELLO", wire.hello(),
                                                       session=wire.last_session)])
        elif kind == "PING":
            sock.send_multipart([frames[0], *wire.pack("PONG", {"rid": body["rid"],
                                                                  "tokens": []},
                                                       peer=frames[0])])
        elif kind == "CANCEL":  # only whoever sent the request may cancel it
            if owner.get(body["rid"]) == frames[0]:
                log.info("request %s cancelled by the front (client gone)", body["rid"])
                new.append({"rid": body["rid"], "cancel": True})
        elif body["rid"] in owner:
            log.warning("duplicate request id %s refused", body["rid"])
        else:
            owner[body["rid"]] = frames[0]
            new.append({"rid": body["rid"], "tokens": body["tokens"],
                        "max_tokens": body["max_tokens"], "peer": peer,
                        "sampling": body.get("sampling"),
                        "faults": (body.get("faults") or ({"page": corrupt_page}
                                                          if corrupt_page else None))
                        if allow_faults else None})


def _send_events(sock: zmq.Socket, wire: Wire, owner: dict[str, bytes],
                 events: list[Event]) -> None:
    for ev in events:
        ident = owner.pop(ev.rid) if ev.done else owner.get(ev.rid)
        if ident is None:
            continue
        body = {"rid": ev.rid, "tokens": ev.tokens, "done": ev.done, "info": ev.info}
        sock.send_multipart([ident, *wire.pack("OUT", body, peer=ident)])


# -- prefill --------------------------------------------------------------------------------------


def serve_prefill(spec: RankSpec, stop: threading.Event, link: Any = None) -> dict[str, Any]:
    from .engine import PrefillEngine

    coord, model, kv, link = _start_rank(spec, stop, link)
    engine = PrefillEngine(model, kv, link, coord, spec.chunk,
                           max_requests=spec.max_running or AUX_ROWS)

    def stats() -> dict[str, Any]:
        return {"role": "prefill", "instance": spec.instance, "rank": spec.rank,
                "pages_total": kv.pages.num_pages, "pages_free": kv.pages.num_free,
                "tokens_seen": model.tokens_seen, "running": len(engine.running),
                "sending": len(engine.sending), "waiting": len(engine.waiting)}

    health = None
    if coord.leader:
        control = list(getattr(link, "control", []))
        context = spec.num_pages * spec.page_size  # pages_for(prompt) must fit the cache
        health = _health(spec, lambda: {"role": "prefill", "control": control,
                                        "context": context}, stats, link)
        health.ready = True
    ran = False
    idle = PREFILL_IDLE_S[0]
    try:
        while True:
            cmd = None
            if coord.leader:
                if ran or engine.busy:
                    idle = PREFILL_IDLE_S[0]
                if not ran and hasattr(link, "wait"):  # woken by news: requests, sends done
                    _idle(link, PREFILL_IDLE_S[1])
                elif not ran:  # each idle wake costs every TP rank a collective: back off
                    _idle(link, BUSY_WAIT_S if engine.busy else idle)
                    idle = min(PREFILL_IDLE_S[1], idle * 2)
                cmd = (link.recv(), stop.is_set())
            new, stopping = coord.command(*(cmd or (None, False)))
            if stopping:
                log.info("prefill %d rank %d: stopping", spec.instance, spec.rank)
                break
            ran = engine.step(new)
    finally:
        if health:
            health.close()
        _close_link(link)
    return stats()


def _warm_up(model: TinyModel, kv: PagedKV) -> None:
    """One throw-away pass (every rank: it all-reduces) so the first request does not pay for
    torch's lazy initialisation. It writes page 0, which no request has yet: every page is
    written (by the messenger or a forward pass) before anything reads it."""
    from .model import Batch

    model.forward(Batch.build([([0], 0, [0])], kv.page_size), kv.layers, kv.page_size)
    model.tokens_seen = 0


def _idle(link: Any, seconds: float) -> None:
    """Sleep until the link has news or `seconds` passed (links may offer a blocking wait)."""
    wait = getattr(link, "wait", None)
    if wait is not None:
        wait(seconds)
    else:
        time.sleep(seconds)


def _close_link(link: Any) -> None:
    close = getattr(link, "close", None)
    if close is not None:
        close()


# -- front ----------------------------------------------------------------------------------------


def discover(health_urls: list[str], timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Wait for every decode leader's /health: its request socket address ("engine") and the
    context it takes ("context")."""
    from .health import read_health

    deadline = time.monotonic() + timeout_s
    out: list[dict[str, Any]] = []
    for url in health_urls:
        try:
            health = read_health(url, ("engine",), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise TimeoutError(f"decode instance at {url} not healthy after "
                               f"{timeout_s:.0f} s") from None
        out.append({"engine": str(health["engine"]), "context": int(health.get("context", 0))})
    return out


def serve_front(spec: RankSpec, stop: threading.Event) -> int:
    """Serve until `stop`; returns 1 if the front broke (its dispatcher died) so the process
    exits with an error and the launcher stops the deployment."""
    from .front import Front
    from .tokenizer import load_tokenizer
    from .wire import MAX_PROMPT

    try:
        found = discover(spec.decoders)
    except TimeoutError as exc:
        raise StartError(f"front: {exc}") from None
    context = min((d["context"] for d in found if d["context"] > 0), default=MAX_PROMPT)
    try:
        front = Front([d["engine"] for d in found], spec.secret, spec.host, spec.http_port,
                      model_name=spec.model_name, context=context,
                      tokenizer=load_tokenizer(spec.tokenizer), health_urls=list(spec.decoders),
                      request_timeout_s=spec.request_timeout_s)
    except OSError as exc:
        raise StartError(f"front: cannot listen on {spec.host}:{spec.http_port} (router.port): "
                         f"{exc.strerror or exc}") from None
    front.start()
    _stop_on_signals(stop)
    log.info("front on http://%s:%d over %d decode instances, context %d tokens", spec.host,
             front.port, len(found), context)
    try:
        while not stop.wait(0.2):
            if front.dead.is_set():
                log.error("front: stopping: %s", front.problem)
                return 1
    finally:
        front.stop()
    return 0


# -- the worker entry's hooks --------------------------------------------------------------------


def run_worker(ctx: Any) -> int:
    """`pdtool.worker`'s reference-engine hook: serve this process's role until SIGTERM."""
    from .fromplan import SpecError, spec_from_context

    try:
        spec = spec_from_context(ctx)
    except SpecError as exc:
        print(f"pdtool-reference: ERROR: {exc}", file=sys.stderr, flush=True)
        return 2
    return run(spec)


# -- entry points ---------------------------------------------------------------------------------


def run(spec: RankSpec) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    log.info("%s %d rank %d: starting", spec.role, spec.instance, spec.rank)
    stop = threading.Event()
    _exit_on_signals()  # until the rank serves: then _stop_on_signals
    try:
        if spec.role in ("decode", "aggregated"):
            stats = serve_decode(spec, stop)
        elif spec.role == "prefill":
            stats = serve_prefill(spec, stop)
        elif spec.role == "front":
            code = serve_front(spec, stop)
            log.info("front: stopped")
            return code
        else:
            raise ValueError(f"role: expected prefill, decode, aggregated or front, got "
                             f"{spec.role!r}")
    except StartError as exc:
        print(f"pdtool-reference: ERROR: {exc}", file=sys.stderr, flush=True)
        return 1
    print("STATS " + json.dumps(stats), flush=True)
    log.info("%s %d rank %d: stopped", spec.role, spec.instance, spec.rank)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="run one reference-engine process from a spec")
    ap.add_argument("--spec", required=True, help="RankSpec as JSON")
    args = ap.parse_args(argv)
    raw = json.loads(args.spec)
    names = {f.name for f in dataclasses.fields(RankSpec)}
    unknown = sorted(set(raw) - names)
    if unknown:
        print(f"--spec: unknown keys {unknown}", file=sys.stderr)
        return 2
    if not raw.get("secret_hex") and os.environ.get("PDTOOL_SECRET_FILE"):
        from transfer.wire import WireError, read_secret

        try:  # the secret stays off the command line: read it from the 0600 file
            raw["secret_hex"] = read_secret(os.environ["PDTOOL_SECRET_FILE"]).hex()
        except WireError as exc:
            print(f"PDTOOL_SECRET_FILE: {exc}", file=sys.stderr)
            return 2
    return run(RankSpec(**raw))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # everything is closed; skip slow interpreter teardown (torch, gloo)
