"""The send ledger both prefill control planes keep (transfer.plane.ledger), against a real
endpoint's completion counters: an account settles when its writes complete or fail, a tag is
handed out again only when its account closed clean, a given-up tag never comes back."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import partial

import numpy as np
import pytest

from transfer import fabric
from transfer.plane.ledger import Account, LedgerFull, SendLedger


@dataclass
class Route(Account):
    peer: str


def test_counts_follow_the_tags_completion_counter():
    done = np.zeros(4, dtype=np.uint64)  # what an endpoint's send_done holds
    ledger = SendLedger(2, lambda tag: int(done[tag]))
    done[0] = 7  # completions of an earlier account on tag 0
    a = ledger.open(partial(Route, peer="d0"))
    assert (a.tag, a.base, a.peer) == (0, 7, "d0") and ledger.free == 1
    a.issued = 3
    assert ledger.in_flight(a) == 3 and not ledger.drained(a)
    done[0] += 2
    assert ledger.failed(0) is a and a.errored == 1  # the third completed with an error
    assert ledger.drained(a) and ledger.completed(a) == 3
    assert ledger.failed(1) is None  # no open account on tag 1: nothing counted
    ledger.close(a)
    assert ledger.free == 2 and ledger.owner(0) is None
    ledger.close(a)  # closing twice frees nothing twice
    assert ledger.free == 2


def test_a_credited_operation_settles_like_a_completed_one():
    ledger = SendLedger(1, lambda tag: 0)
    a = ledger.open(partial(Route, peer="d0"))
    a.issued, a.credited = 2, 2  # bounce buffers whose writes completed
    assert ledger.drained(a)


def test_a_given_up_tag_is_retired_for_good():
    done = np.zeros(2, dtype=np.uint64)
    ledger = SendLedger(2, lambda tag: int(done[tag]))
    a = ledger.open(partial(Route, peer="dead"))
    a.issued = 5
    done[a.tag] += 1
    ledger.give_up(a)
    assert a.errored == 4 and ledger.drained(a)
    ledger.close(a, leak=True)
    assert ledger.leaked == 1 and ledger.free == 1
    b = ledger.open(partial(Route, peer="d1"))
    assert b.tag != a.tag  # a late completion on a's tag cannot be credited to b
    with pytest.raises(LedgerFull, match="more than 2 transfers in flight"):
        ledger.open(partial(Route, peer="d2"))


def test_tags_are_reused_oldest_first():
    """A tag just freed is the last handed out again: the longest time for stray counts to
    show up in a test (they never should) before another account reads the counter."""
    ledger = SendLedger(3, lambda tag: 0)
    a, b = (ledger.open(partial(Route, peer=p)) for p in "ab")
    ledger.close(a)
    assert [ledger.open(partial(Route, peer=p)).tag for p in "cd"] == [2, a.tag]
    assert b.tag == 1


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
def test_over_a_real_endpoint_an_account_drains_when_its_writes_complete(provider):
    """Two endpoints in this process: an account opened on a tag that earlier writes already
    counted on reads only its own writes, and drains when they complete."""
    kw = {"domain": "lo"} if provider.startswith("tcp") else {}
    n, page = 8, 4096
    with fabric.Endpoint(provider, **kw) as send, fabric.Endpoint(provider, **kw) as recv:
        src = np.arange(n * page, dtype=np.uint64).astype(np.uint8)
        dst = np.zeros(n * page, dtype=np.uint8)
        mr, region = send.register_buffer(src), recv.register_buffer(dst).descriptor()
        peer = send.insert_peer(recv.name)
        recv.arm(1, 0)
        got: list[bool] = []  # manual progress: the target polls while the writes land
        target = threading.Thread(target=lambda: got.append(recv.wait_recv(1, 1 + n // 2,
                                                                            20.0)))
        target.start()
        ledger = SendLedger(2, lambda tag: int(send.send_done[tag]))
        offs = np.arange(n, dtype=np.uint64) * np.uint64(page)
        pages = np.full(n, page, np.uint64)

        def write(a: Route, count: int) -> None:
            a.issued += send.write_batch(peer, mr, region, offs[:count], offs[:count],
                                         pages[:count], fabric.encode_imm(1, 0), a.tag,
                                         per_op=2)
            assert send.wait_send(a.tag, a.base + a.issued, 20.0)

        first = ledger.open(partial(Route, peer="d"))
        write(first, 2)
        ledger.close(first)
        ledger.open(partial(Route, peer="other"))  # takes tag 1: the next gets tag 0 again
        again = ledger.open(partial(Route, peer="d"))
        assert again.tag == first.tag and again.base == 1 and ledger.in_flight(again) == 0
        write(again, n)
        assert again.issued == n // 2 and ledger.drained(again) and again.errored == 0
        target.join(25)
        assert got == [True]
        assert np.array_equal(dst, src)
