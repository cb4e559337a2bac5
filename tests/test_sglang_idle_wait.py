"""The scheduler's idle wait for rooms in flight (transfer/sglang/idle_wait.py), built as the
plugin's hook builds it: from SGLang 0.5.23's own `IdleSleeper` (what `--sleep-on-idle` makes)
and a manager's news doorbell. The real servers' waits are counted on their /metrics
(tests/test_sglang_servers.py)."""

from __future__ import annotations

import types

import zmq
from sglang.srt.managers.scheduler_components.idle_sleeper import IdleSleeper

from transfer.sglang.idle_wait import IdleWait
from transfer.sglang.metrics import NO_METRICS
from transfer.wakeups import Doorbell


def test_the_wait_ends_on_news_a_request_or_its_bound() -> None:
    ctx = zmq.Context.instance()
    recv, send = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = recv.bind_to_random_port("tcp://127.0.0.1")
    send.connect(f"tcp://127.0.0.1:{port}")
    try:
        sched = types.SimpleNamespace(idle_sleeper=IdleSleeper([recv]))
        news = Doorbell()
        wait = IdleWait.for_scheduler(sched, news, NO_METRICS)
        assert wait is not None
        assert wait.wait() == "timeout"
        news.ring()  # a status changed before the wait: it returns at once, and clears
        assert wait.wait() == "news"
        assert wait.wait() == "timeout"
        send.send(b"request")  # SGLang's own request socket
        # arrived before the wait (loopback delivery is not the wait's to time on a loaded box)
        assert recv.poll(60_000, zmq.POLLIN)
        assert wait.wait() == "request"
        recv.recv()
        assert wait.ended == {"news": 1, "request": 1, "timeout": 2}
    finally:
        recv.close(0)
        send.close(0)


def test_no_wait_without_sleep_on_idle() -> None:
    """Without --sleep-on-idle SGLang has no idle sleeper; its Rust ingress has one without a
    socket poller: both keep SGLang's own loop."""
    assert IdleWait.for_scheduler(types.SimpleNamespace(idle_sleeper=None), Doorbell(),
                                  NO_METRICS) is None
    rust_like = types.SimpleNamespace(idle_sleeper=types.SimpleNamespace(maybe_sleep=None))
    assert IdleWait.for_scheduler(rust_like, Doorbell(), NO_METRICS) is None
