"""A scheduler with nothing to run while its rooms wait for their transfer sleeps until one of
them changes, instead of spinning a core.

SGLang 0.5.23's disaggregated loops are never idle while a request waits for its KV: with no
batch to run, `Scheduler.on_idle` (managers/scheduler.py:5254-5272) finds the scheduler "not
fully idle" (a room in the transfer or bootstrap queue), calls `time.sleep(0)` and returns,
and the loop polls every receiver again at once. A decode waiting for a long prefill thus
spins one core for the whole prefill, whatever the transfer backend. On a machine where the
prefill's compute shares the cores (SGLang's CPU engine; a GPU node's host threads feeding
kernels) that core is taken from it: measured on the 2-core box, the decode's scheduler
thread used 9.2 CPU s while 4 prompts of 3,400 tokens were prefilled (docs/benchmark.md).

With `--sleep-on-idle` (the user asked SGLang to sleep rather than spin when idle) pdtool's
backend extends that sleep to the wait for its own rooms: after SGLang's `on_idle`, while any
room of this manager is neither done nor failed, the scheduler waits on what can change its
next round, with the GIL released:

* the scheduler's own request sockets (the ones SGLang's `IdleSleeper` waits on), so a new
  request is taken at once;
* the manager's news pipe (`transfer.wakeups.Doorbell`), rung on every room status change
  (`PdtoolKVManager.update_status`: a decode's last write counted, a prefill's writes done, a
  peer's failure), so a finished transfer is seen at once;
* at most `IDLE_WAIT_S`, for what changes with neither (SGLang's waiting timeouts, its
  heartbeats, a DP-rank lookup in an executor).

Without `--sleep-on-idle` (or with SGLang's Rust ingress, which has no socket to poll) the
loop is SGLang's own. Each wait is counted by how it ended (`stats()`, and on `/metrics` as
`pdtool_scheduler_idle_waits_total{ended=...}` with `--enable-metrics`).
"""

from __future__ import annotations

from typing import Any

from transfer.wakeups import Doorbell

#: the longest one wait lasts; what wakes the loop earlier is listed above
IDLE_WAIT_S = 0.01
#: how a wait ended: the news pipe, a request socket, neither within IDLE_WAIT_S
ENDINGS = ("news", "request", "timeout")


class IdleWait:
    """One scheduler's wait on its request sockets and a manager's news pipe."""

    def __init__(self, sockets: list[Any], news: Doorbell, metrics: Any) -> None:
        import zmq

        self.news = news
        self.metrics = metrics
        self.poller = zmq.Poller()
        for sock in sockets:
            self.poller.register(sock, zmq.POLLIN)
        self.poller.register(news.fd, zmq.POLLIN)
        self.ended = dict.fromkeys(ENDINGS, 0)

    @classmethod
    def for_scheduler(cls, sched: Any, news: Doorbell, metrics: Any) -> IdleWait | None:
        """The wait of SGLang's scheduler `sched`, or None when it does not sleep on idle
        (no `--sleep-on-idle`, or an idle sleeper without a socket poller)."""
        poller = getattr(getattr(sched, "idle_sleeper", None), "poller", None)
        if poller is None:
            return None
        return cls([sock for sock, _ in poller.sockets], news, metrics)

    def wait(self) -> str:
        """Block until news, a request or `IDLE_WAIT_S`; how it ended. The news pipe is
        emptied after the wait: a status changed before it has rung it already, so the wait
        returns at once, and one changed after it is seen by the loop's next poll anyway."""
        ready = dict(self.poller.poll(IDLE_WAIT_S * 1000))
        if self.news.fd in ready:
            ended = "news"
            self.news.clear()
        else:
            ended = "request" if ready else "timeout"
        self.ended[ended] += 1
        self.metrics.idle_wait(ended)
        return ended
