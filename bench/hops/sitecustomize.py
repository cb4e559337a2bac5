"""Hop timestamps for bench/ttft_hops.py, loaded into every deployment process through
PYTHONPATH when PDTOOL_HOPS names a file. Wraps the reference engine's protocol points (the
front, the decode and prefill serving loops, the messenger links) without changing them and
appends `event rid monotonic-seconds` lines to that file. time.perf_counter is CLOCK_MONOTONIC
on Linux, one clock for every process of the machine, so hops between processes subtract."""

import os

if os.environ.get("PDTOOL_HOPS"):
    import time

    _fd = os.open(os.environ["PDTOOL_HOPS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    _seen: set = set()

    def _log(event: str, rid: str, t: float | None = None, once: bool = False) -> None:
        if once:
            if (event, rid) in _seen:
                return
            _seen.add((event, rid))
        os.write(_fd, f"{event} {rid} {time.perf_counter() if t is None else t:.7f}\n".encode())

    def _install() -> None:
        from pdtool.engines.reference import front, serve

        take = serve._take_requests

        def take_requests(*a, **k):
            new = take(*a, **k)
            for m in new:
                if "tokens" in m:
                    _log("decode.gen", m["rid"])
            return new

        serve._take_requests = take_requests
        send = serve._send_events

        def send_events(sock, wire, owner, events):
            send(sock, wire, owner, events)
            for ev in events:
                if ev.tokens:
                    _log("decode.first_out", ev.rid, once=True)

        serve._send_events = send_events
        submit = front.Front.submit

        def front_submit(self, tokens, max_tokens, *a, **k):
            t = time.perf_counter()
            rid, p = submit(self, tokens, max_tokens, *a, **k)
            _log("front.submit", rid, t)
            return rid, p

        front.Front.submit = front_submit
        results = front.Front.results

        def front_results(self, rid, p):
            for t, body in results(self, rid, p):
                if body["tokens"]:
                    _log("front.first_out", rid, t, once=True)
                yield t, body

        front.Front.results = front_results

    def _wrap(cls, name, fn) -> None:
        """cls.name(self, *a) becomes fn(original, self, *a)."""
        orig = getattr(cls, name)
        setattr(cls, name, lambda self, *a: fn(orig, self, *a))

    def _install_links() -> None:
        from pdtool.engines.reference import link

        def submit(orig, self, rid, *a):
            _log("decode.submit", rid)
            return orig(self, rid, *a)

        def ready(orig, self):
            got = orig(self)
            for rid in got:
                _log("decode.ready", rid, once=True)
            return got

        def recv(orig, self):
            got = orig(self)
            for r in got:
                _log("prefill.recv", r["rid"])
            return got

        def begin(orig, self, chunks):
            for rid, lo, _hi in chunks:
                if lo == 0:
                    _log("prefill.first_chunk", rid)
            return orig(self, chunks)

        def finish(orig, self, rid, hidden):
            _log("prefill.computed", rid)
            return orig(self, rid, hidden)

        def done(orig, self):
            got = orig(self)
            for rid in got:
                _log("prefill.writes_done", rid, once=True)
            return got

        _wrap(link.DecodeSide, "submit", submit)
        _wrap(link.DecodeSide, "ready", ready)
        _wrap(link.PrefillSide, "recv", recv)
        _wrap(link.PrefillSide, "begin", begin)
        _wrap(link.PrefillSide, "finish", finish)
        _wrap(link.PrefillSide, "done", done)

    def _install_messengers() -> None:
        """The messenger threads' side of the two protocol hops (REQUEST out and in, the
        last writes out), so each hop splits into its thread hand-offs."""
        from transfer.messenger import decode, prefill

        def logged(event, rid_of, after=False):
            def fn(orig, self, *a):
                if not after:
                    _log(event, rid_of(*a))
                out = orig(self, *a)
                if after:
                    _log(event, rid_of(*a))
                return out
            return fn

        _wrap(decode.DecodeMessenger, "_cmd_submit", logged("decode.msg_submit", lambda x: x.rid))
        _wrap(decode.DecodeMessenger, "_begin",
              logged("decode.request_sent", lambda x: x.rid, after=True))
        _wrap(prefill.PrefillMessenger, "_on_request",
              logged("prefill.request_in", lambda peer, b, now: b.get("rid", "")))
        _wrap(prefill.PrefillMessenger, "_queue_aux",
              logged("prefill.last_writes", lambda x: x.rid))
        _wrap(prefill.PrefillMessenger, "_cmd_finish",
              logged("prefill.cmd_finish", lambda rid, rows: rid))

        def flushed(orig, self):
            last = {q[0].rid for q in self._queued if q[0].aux_sent}  # a prompt's last writes
            out = orig(self)
            for rid in last:
                _log("prefill.flushed", rid)
            return out

        _wrap(prefill.PrefillMessenger, "_flush_writes", flushed)
        # the count reaching its target is seen in C (the receive lane rings the decode
        # engine's doorbell itself): no Python point to stamp between the writes and `ready`

    def _install_passes() -> None:
        """Every forward pass as `pass <process> <start> <end> <thread CPU ns>`, and every
        round of the prefill messenger thread as `step prefill <start> <end> 0`: a pass's
        wall time minus its CPU time is how long the engine thread was off its core or
        waiting for the GIL (in an aggregated instance, about nothing), and the rounds are
        what takes the GIL from it."""
        import sys

        from pdtool.engines.reference import model
        from transfer.messenger import prefill

        args = sys.argv
        who = (args[args.index("--role") + 1] + args[args.index("--instance") + 1]
               if "--role" in args and "--instance" in args else "main")
        forward = model.TinyModel.forward

        def timed_forward(self, *a, **k):
            c0, t0 = time.thread_time_ns(), time.perf_counter()
            out = forward(self, *a, **k)
            t1, c1 = time.perf_counter(), time.thread_time_ns()
            os.write(_fd, f"pass {who} {t0:.7f} {t1:.7f} {c1 - c0}\n".encode())
            return out

        model.TinyModel.forward = timed_forward

        def step(orig, self):
            t0 = time.perf_counter()
            out = orig(self)
            os.write(_fd, f"step {who} {t0:.7f} {time.perf_counter():.7f} 0\n".encode())
            return out

        _wrap(prefill.PrefillMessenger, "_step", step)

    import contextlib

    _install()
    with contextlib.suppress(ImportError):  # needs torch and libfabric: not in every process
        _install_links()
        _install_messengers()
        _install_passes()
