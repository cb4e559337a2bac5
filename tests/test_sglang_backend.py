"""The `pdtool` SGLang transfer backend driven through SGLang 0.5.23's own classes.

Real pieces only: the pinned SGLang (bootstrap HTTP server, rank mapping, KVPoll bookkeeping,
heartbeats), libfabric (shm / tcp;ofi_rxm) and separate OS processes per rank. KV and aux buffers
are SGLang's own classes on the CPU: `MHATokenToKVPool` (`[slots, heads, head_dim]` per layer,
separate K and V buffers), `MLATokenToKVPool` (`[slots, 1, kv_lora_rank + rope]`) and
`MetadataBuffers`; the KVArgs are filled from them the way SGLang's scheduler does.

The ranks, their buffers and the byte checks are tests/helpers/sglang_pair.py.
"""

from __future__ import annotations

import pytest
import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)
from helpers.sglang_pair import (
    AUX_ROWS,
    LAYERS,
    N_AUX,
    ROOMS,
    check_bytes,
    collected_metrics,
    ops,
    run_pair,
)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_mha_equal_tp_pages_arrive_byte_exact_and_counted() -> None:
    cfg = {"mla": False, "heads": 2, "prefill_tp": 1, "decode_tp": 1, "rooms": ROOMS}
    res = run_pair(cfg)
    check_bytes(cfg, res)
    (_, _out, _, _, remote_writes, stale, _), = res["decode"]
    # one write per (page, layer buffer), grouped PER_OP to an operation, + one per aux
    # buffer, counted per slot
    per_room = {r: ops(len(q["dst_pages"])) * 2 * LAYERS + N_AUX for r, q in ROOMS.items()}
    assert {r: o["count"] for r, o in _out.items()} == per_room
    assert remote_writes == sum(per_room.values()) and stale == 0
    # the prefill sender reached Success on its own local completions
    assert res["prefill"][0][1] == {11: 4, 12: 4}
    # the scheduler's view went Bootstrapping/WaitingForInput -> ... -> Success
    assert all(o["states"][0] in (1, 2, 3) for o in _out.values())


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
def test_waiting_for_the_engine_costs_neither_side_a_core(provider: str) -> None:
    """A room whose last chunk is still being computed: nothing is in flight, and neither the
    prefill's writer nor the decode's progress thread may spin. SGLang's scheduler computes
    on the same cores (and under the same GIL, on the prefill): when both spun, a 64-token
    prefill on the CPU engine took 80 ms instead of 20 (docs/benchmark.md). Their CPU is
    read from /proc over a 1.5 s hold (a bound on work done, not on time: a loaded box can
    only lower it)."""
    cfg = {"mla": False, "heads": 2, "prefill_tp": 1, "decode_tp": 1,
           "rooms": {11: ROOMS[11]}, "hold_last_s": 1.5, "provider": provider}
    res = run_pair(cfg)
    check_bytes(cfg, res)  # and the room still completes, byte-exact
    (_, results, _, stats), = res["prefill"]
    assert results == {11: 4}
    # a writer that polled in Python, sleeping 0.2 ms per round, took 0.18-0.19 s here
    assert stats["held_writer_cpu_s"] < 0.05 * cfg["hold_last_s"], stats
    (_, out, *_), = res["decode"]
    assert out[11]["counting_cpu_share"] < 0.3, out[11]  # spinning: 0.99


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_mla_prefill_tp2_to_decode_tp1_over_tcp_rxm() -> None:
    """MLA latent replicated on both prefill ranks: SGLang marks one real, one dummy; only the
    real one writes, one write per (page, layer buffer)."""
    cfg = {"mla": True, "heads": 1, "prefill_tp": 2, "decode_tp": 1, "rooms": ROOMS,
           "provider": "tcp;ofi_rxm"}
    res = run_pair(cfg)
    check_bytes(cfg, res)
    (_, out, _, _, remote_writes, stale, _), = res["decode"]
    want = {r: ops(len(q["dst_pages"])) * LAYERS + N_AUX for r, q in ROOMS.items()}
    assert {r: o["count"] for r, o in out.items()} == want
    assert remote_writes == sum(want.values()) and stale == 0
    assert [p[1] for p in res["prefill"]] == [{11: 4, 12: 4}] * 2  # the dummy rank too


@pytest.mark.timeout(400)
def test_mha_prefill_tp1_to_decode_tp2_slices_heads() -> None:
    """Each decode rank takes its two of four heads from the one prefill rank: the prefill packs
    them per page into a bounce buffer, one write per (page, layer buffer), landing in place."""
    cfg = {"mla": False, "heads": 4, "prefill_tp": 1, "decode_tp": 2, "rooms": {12: ROOMS[12]}}
    res = run_pair(cfg)
    check_bytes(cfg, res)
    for _, out, _, _, remote_writes, _, _ in res["decode"]:
        assert out[12]["count"] == remote_writes == ops(2) * 2 * LAYERS + N_AUX


@pytest.mark.timeout(400)
def test_mha_prefill_tp2_to_decode_tp1_reassembles_heads() -> None:
    """TP mismatch on NHD pools: each prefill rank writes its head slice of a page as one packed
    write into the decoder's landing area, scattered into its pool before Success."""
    cfg = {"mla": False, "heads": 4, "prefill_tp": 2, "decode_tp": 1, "rooms": {11: ROOMS[11]}}
    res = run_pair(cfg)
    check_bytes(cfg, res)
    (_, out, _, _, remote_writes, _, _), = res["decode"]
    pages = len(ROOMS[11]["dst_pages"])
    want = ops(pages) * 2 * LAYERS * 2 + N_AUX  # per page, from both prefill ranks
    assert out[11]["count"] == want == remote_writes
    # only the rank holding the first head slice wrote the metadata rows
    writes = [p[2] for p in res["prefill"]]
    assert writes == [0, 0]  # prefill endpoints receive nothing


@pytest.mark.timeout(400)
def test_decode_abort_and_page_count_mismatch_fail_with_reasons() -> None:
    """Room 11: decode aborts (deferred release: prefill ACKs, nothing was written).
    Room 13: decode allocated more pages than prefill sends: both sides fail at the last chunk
    with the reason instead of the decoder waiting for writes that never come."""
    mismatch = {**ROOMS[12], "dst_pages": [3, 4, 9]}
    cfg = {"mla": False, "heads": 2, "prefill_tp": 1, "decode_tp": 1,
           "rooms": {11: {**ROOMS[11], "abort": True}, 13: mismatch},
           "extra_env": {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1"}}
    res = run_pair(cfg)
    (_, out, bufs, _, remote_writes, _, _), = res["decode"]
    assert out[11] == {"released": True, "states": [0]}  # ACK arrived, receiver Failed
    prefill = res["prefill"][0][1]
    assert prefill[11] == (
        "KVTransferError: KVTransferError(bootstrap_room=11): "
        "Aborted by decode-side abort notification."
    )
    reason = "prefill sends 2 pages but decode"
    assert out[13]["states"][-1] == 0 and reason in out[13]["error"], out[13]
    assert reason in prefill[13] and "allocated 3" in prefill[13]
    assert remote_writes == 0 and not any(b.any() for b in bufs)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_killed_prefill_fails_the_request_with_a_reason() -> None:
    cfg = {"mla": False, "heads": 2, "prefill_tp": 1, "decode_tp": 1, "hold": True,
           "rooms": {11: ROOMS[11]}, "wait": 40}
    res = run_pair(cfg, kill_prefill=True)
    (_, out, bufs, _, remote_writes, _, _), = res["decode"]
    assert out[11]["states"][-1] == 0  # KVPoll.Failed
    assert "Lost connection with prefill instance" in out[11]["error"]
    assert "KVTransferError" in out[11]["error"]
    assert remote_writes == 0 and not any(b.any() for b in bufs)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_transfer_sglang_gives_up_on_counts_as_timed_out(tmp_path) -> None:
    """A prefill that is alive but never sends: SGLang's own waiting timeout fails the decode's
    room, and the backend's transfer metrics (prometheus-client's multiprocess files, as
    SGLang's --enable-metrics collects them) count it as failed and timed out, from the
    prefill rank the slot was armed for; nothing succeeded."""
    cfg = {"mla": False, "heads": 2, "prefill_tp": 1, "decode_tp": 1, "hold": True,
           "rooms": {11: ROOMS[11]}, "wait": 40, "metrics_dir": str(tmp_path),
           "extra_env": {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "3"}}
    res = run_pair(cfg)
    (_, out, *_), = res["decode"]
    assert out[11]["states"][-1] == 0 and "timed out after" in out[11]["error"], out[11]
    got = collected_metrics(str(tmp_path))
    ((labels, failed),) = got["pdtool_kv_transfers_failed_total"]
    assert failed == 1 and ":" in labels["peer"], labels
    assert [v for _, v in got["pdtool_kv_transfers_timed_out_total"]] == [1]
    assert "pdtool_kv_transfers_succeeded_total" not in got


@pytest.mark.timeout(400)
def test_send_metadata_never_waits_for_the_endpoint_lock() -> None:
    """SGLang's scheduler thread calls send_metadata while the progress thread sits in a poll
    holding the endpoint lock (on shm a poll performs the copies). Before, arming the slot took
    that lock, so the scheduler stalled behind every long poll."""
    cfg = {"mla": True, "heads": 1, "prefill_tp": 1, "decode_tp": 1, "rooms": ROOMS,
           "hold_ep_lock": True}
    res = run_pair(cfg)
    check_bytes(cfg, res)
    (*_, blocked), = res["decode"]
    assert blocked == [False, False]


@pytest.mark.timeout(400)
def test_failed_writes_release_their_rooms_and_tags() -> None:
    """70 rooms whose decode rank died after sending its metadata: every write fails on
    tcp;ofi_rxm. Each room fails with the reason and gives its fabric tag back. Before, a
    failed operation was never counted as done, so its room, its tag and any deferred ACK
    waited forever, and the native error ring kept only the newest 64 errors. Rooms written
    after the provider saw the connection close fail by refusal (the test below)."""
    rooms = {100 + i: {"src_pages": [i % 16, (i + 5) % 16], "dst_pages": [i % 16, (i + 7) % 16],
                       "aux_index": i % AUX_ROWS, "dst_aux": i % AUX_ROWS, "chunk": 1,
                       "after_go": True} for i in range(70)}
    rooms[10] = ROOMS[12]  # lands first: the fabric connection exists when the decode dies
    cfg = {"mla": True, "heads": 1, "prefill_tp": 1, "decode_tp": 1, "rooms": rooms,
           "provider": "tcp;ofi_rxm", "go_after": True, "wait": 120}
    res = run_pair(cfg, kill_decode=True)
    (_, results, _, stats), = res["prefill"]
    assert set(results) == set(rooms) and results.pop(10) == 4
    for room, r in results.items():
        assert isinstance(r, str) and "pdtool write to decode" in r, (room, r)
    assert stats["rooms"] == 0 and stats["leaked_tags"] == 0, stats
    from transfer.sglang.conn import MAX_SLOTS
    from transfer.sglang.staging_plane import BOUNCE_BUFFERS

    assert stats["tags_free"] == MAX_SLOTS - BOUNCE_BUFFERS, stats  # the last count bounces


REFUSED = "refused every write to it for 2 s with none in flight"


def test_writes_refused_after_the_connection_closed_fail_their_rooms() -> None:
    """rxm over tcp, once it knows the dead decode's connection closed, refuses every
    later write to it with none in flight and reports no error (the queue "stays full"). The
    rooms sent after that fail with the reason within SGLang's heartbeat window (2 s here)
    instead of waiting for its waiting timeout (60 s here, 300 s by default)."""
    rooms = {100 + i: {"src_pages": [i, i + 5], "dst_pages": [i, i + 7], "aux_index": i,
                       "dst_aux": i, "chunk": 1, "after_go": True} for i in range(4)}
    rooms[10] = ROOMS[12]  # lands first: the fabric connection exists when the decode dies
    cfg = {"mla": True, "heads": 1, "prefill_tp": 1, "decode_tp": 1, "rooms": rooms,
           "provider": "tcp;ofi_rxm", "go_after": True, "wait": 120, "first_alone": True}
    res = run_pair(cfg, kill_decode=True)
    (_, results, _, stats), = res["prefill"]
    assert results.pop(10) == 4
    # the first write either finds the connection closed (EPIPE) or, when rxm noticed the
    # closed socket before it, is refused like the rest: which one is up to the kernel's timing
    first = results.pop(100)
    assert "Broken pipe" in first or REFUSED in first, first
    for room, r in results.items():
        assert REFUSED in r, (room, r)
    assert stats["rooms"] == 0 and stats["leaked_tags"] == 0, stats


@pytest.mark.timeout(400)
def test_dead_progress_thread_fails_rooms_at_once_with_the_reason() -> None:
    """The decode's progress thread dies (its endpoint closed under it) while two rooms wait
    for their writes: both fail at once with the reason (before: they waited for SGLang's
    timeout), and a request made afterwards is refused with the same reason."""
    rooms = {r: {**q, "after_go": True} for r, q in ROOMS.items()}  # written after the death
    # the decode reports before the prefill is let go: the prefill's writes to the closed
    # endpoint change nothing the test reads, so the prefill waits for them only briefly
    # (waiting `wait` seconds for them to end was most of this test's time)
    cfg = {"mla": True, "heads": 1, "prefill_tp": 1, "decode_tp": 1, "rooms": rooms,
           "provider": "tcp;ofi_rxm", "go_after": True, "close_endpoint": True, "wait": 30,
           "prefill_wait": 1}
    res = run_pair(cfg)
    (_, out, *_), = res["decode"]
    for room in (11, 12, 99):
        assert out[room]["states"][-1] == 0, (room, out[room])  # KVPoll.Failed
        assert "decode progress thread died" in out[room]["error"], (room, out[room])
        assert "endpoint is closed" in out[room]["error"], (room, out[room])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_restarted_decode_rank_replaces_its_peer_and_av_entry() -> None:
    """The decode instance restarts between two requests (new process, new port, new fabric
    address, same GPU and TP rank): the prefill forgets the old peer and removes its address
    vector entry instead of keeping one of each per restart."""
    cfg = {"mla": True, "heads": 1, "prefill_tp": 1, "decode_tp": 1,
           "rooms": {11: ROOMS[11], 21: ROOMS[12]}, "waves": [[11], [21]], "settle_s": 1}
    res = run_pair(cfg)
    assert [o[1][r]["states"][-1] for o, r in zip(res["decode"], (11, 21), strict=True)] \
        == [4, 4]
    (_, results, _, stats), = res["prefill"]
    assert results == {11: 4, 21: 4}
    assert stats["peers"] == 1 and stats["av_entries"] == 1, stats
