"""KV messenger end to end: real processes, real libfabric (shm and tcp;ofi_rxm), real KV-shaped
torch tensors, chunked prefill, several layers and two aux (metadata) buffers.

Every decode rank checks its pages byte for byte against the prefill's deterministic cache, and
the write counts are checked against arithmetic done here, independently of routes.py: with HND
(FlashInfer's `[pages, 2, heads, page, dim]`) a decode rank receives one write per (page, layer,
source shard) when the slice is the whole page, two (the K run and the V run) when it is part of
the heads, one for an MLA latent or a K-only / V-only buffer, plus one per aux buffer, and the
prefill ranks together issue exactly that many. The prefill groups up to
`writes_per_op` consecutive page writes of a (slice, layer buffer) into one RMA operation (4 on
shm and tcp;ofi_rxm), and the decoder counts one completion per operation:
ceil(pages / writes_per_op) per (layer, source shard), whatever the chunking.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch  # noqa: F401  (imported before forking so the rank processes start fast)

from transfer.fabric import shm_leftovers
from transfer.routes import pages_for
from transfer.testing.loopback import Scenario, run
from transfer.wire import WireError, generate_secret

PROVIDERS = ["shm", "tcp;ofi_rxm"]
PROVIDER_IOV_LIMIT = 4  # fi_info: iov_limit and rma_iov_limit of both providers
PROMPTS = (17, 33, 5, 2)  # 4, 8, 1 and 1 pages of 4 tokens; 33 tokens = 4 chunked passes
AUX = (48, 20)


def _check(s: Scenario, sources_per_rank: int, secret: bytes | None = None,
           runs: int = 1) -> list[dict]:
    """`runs`: contiguous writes per page of one source slice (2: a partial head slice of a
    fused HND page, its K and its V run)."""
    before = set(shm_leftovers())
    out = run(s, secret)
    assert len(out.decode) == s.decode_tp and len(out.prefill) == s.prefill_tp
    want_writes = want_ops = 0
    for rep in out.decode:
        assert rep["stale_writes"] == 0
        assert len(rep["lane_writes"]) == (s.lanes or (2 if s.provider == "shm" else 1))
        assert sum(rep["lane_writes"]) == sum(r["received"] for r in rep["requests"].values())
        k = rep["writes_per_op"]
        assert k == (s.writes_per_op or PROVIDER_IOV_LIMIT)
        for rid, r in rep["requests"].items():
            n = pages_for(len_of(s, rid), s.page_size)
            aux = len(s.aux_row_bytes)
            ops = math.ceil(n * runs / k) * s.num_layers * sources_per_rank + aux
            assert r["status"] == "success", (rid, r)
            assert r["bad_layers"] == [] and r["aux_ok"], (rid, r)
            assert r["received"] == r["expected"] == ops, (rid, r)
            want_writes += n * runs * s.num_layers * sources_per_rank + aux
            want_ops += ops
    assert sum(p["writes_issued"] for p in out.prefill) == want_writes
    assert sum(p["ops_issued"] for p in out.prefill) == want_ops
    for p in out.prefill:
        assert all(r["ok"] for r in p["results"].values())
    assert set(shm_leftovers()) <= before
    return out.prefill


def len_of(s: Scenario, rid: str) -> int:
    return s.prompts[int(rid.split("-r")[1])]


def test_the_harness_runs_with_the_callers_secret():
    # the harness has no secret of its own: the caller's key (or a fresh one per run) signs
    _check(Scenario(provider="shm", prompts=(9,), aux_row_bytes=AUX), sources_per_rank=1,
           secret=generate_secret())
    with pytest.raises(WireError, match="secret: need at least"):
        run(Scenario(), secret=b"short")


@pytest.mark.parametrize("provider", PROVIDERS)
def test_equal_tp(provider):
    # the decoders poll without pausing here: the production path (C polling slices)
    _check(Scenario(provider=provider, num_kv_heads=4, prefill_tp=2, decode_tp=2,
                    prompts=PROMPTS, aux_row_bytes=AUX, busy_sleep_s=0.0,
                    prefill_busy_sleep_s=0.0002), sources_per_rank=1)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_writes_spread_over_receive_lanes(provider):
    # three receive lanes per decode rank, and so little in flight (one operation per lane)
    # that the prefill must alternate: every lane carries writes, counted as one transfer
    out = run(Scenario(provider=provider, num_kv_heads=4, prefill_tp=2, decode_tp=2,
                       prompts=PROMPTS, aux_row_bytes=AUX, lanes=3, prefill_inflight_bytes=1,
                       busy_sleep_s=0.0))
    for rep in out.decode:
        assert all(r["status"] == "success" and r["bad_layers"] == [] and r["aux_ok"]
                   for r in rep["requests"].values()), rep["requests"]
        assert len(rep["lane_writes"]) == 3 and min(rep["lane_writes"]) > 0, rep["lane_writes"]
        assert sum(rep["lane_writes"]) == sum(r["received"] for r in rep["requests"].values())


@pytest.mark.parametrize("provider", PROVIDERS)
def test_prefill_tp4_to_decode_tp2(provider):
    """Each decode rank rebuilds full pages from the head slices of two prefill ranks."""
    # the prefill ranks poll without pausing here: the production path (C polling slices)
    _check(Scenario(provider=provider, num_kv_heads=4, prefill_tp=4, decode_tp=2,
                    prompts=PROMPTS, aux_row_bytes=AUX, prefill_busy_sleep_s=0.0),
           sources_per_rank=2, runs=2)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_prefill_tp2_to_decode_tp4(provider):
    """Each decode rank takes its one-head slice out of a prefill rank's two-head pages; one
    operation per page write (writes_per_op=1)."""
    _check(Scenario(provider=provider, num_kv_heads=4, prefill_tp=2, decode_tp=4,
                    prompts=PROMPTS, aux_row_bytes=AUX, writes_per_op=1), sources_per_rank=1,
           runs=2)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_mla_replicas_8_prefill_to_2_decode(provider):
    """MLA: one latent head on every rank; one replica (drawn per request) sends each page."""
    s = Scenario(provider=provider, num_kv_heads=1, kv_parts=1, head_dim=16, prefill_tp=8,
                 decode_tp=2, prompts=(17, 33, 9, 13, 21, 25), aux_row_bytes=AUX)
    prefill = _check(s, sources_per_rank=1)
    senders = [p["rank"] for p in prefill if p["writes_issued"]]
    assert len(senders) >= 2, f"replicas are drawn at random per request; only {senders} sent"


def test_nhd_tp_mismatch_writes_per_token():
    """NHD with a partial head run costs one write per token (what the validator warns of);
    with writes_per_op=3 the per-token writes of a slice go three to an operation."""
    s = Scenario(layout="NHD", num_kv_heads=4, prefill_tp=4, decode_tp=2, prompts=(17, 9),
                 aux_row_bytes=(16,), writes_per_op=3)
    out = run(s)
    for rep in out.decode:
        for rid, r in rep["requests"].items():
            n = pages_for(s.prompts[int(rid.split("-r")[1])], s.page_size)
            assert r["status"] == "success" and r["bad_layers"] == [] and r["aux_ok"]
            per_token = n * s.page_size  # writes per (layer, source shard)
            assert r["received"] == math.ceil(per_token / 3) * s.num_layers * 2 + 1
    issued = sum(p["writes_issued"] for p in out.prefill)
    pages = sum(pages_for(t, s.page_size) for t in s.prompts)
    assert issued == s.decode_tp * (pages * s.page_size * s.num_layers * 2 + len(s.prompts))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_many_requests_queue_for_few_slots(provider):
    """30 prompts of random length through 4 transfer slots: the rest wait for a free slot,
    slots are reused with new generations, and every page still arrives exactly."""
    rng = np.random.default_rng(7)
    prompts = tuple(int(n) for n in rng.integers(2, 60, 30))
    s = Scenario(provider=provider, num_kv_heads=4, prefill_tp=4, decode_tp=2, prompts=prompts,
                 max_inflight=4, chunk_pages=3, src_pages=512, dst_pages=512, aux_row_bytes=AUX)
    _check(s, sources_per_rank=2, runs=2)


def test_separate_k_and_v_buffers():
    """buffers_per_layer=2 (FlashInfer's separate `(k_cache, v_cache)`, each `[pages, heads,
    page, dim]`): one write per (page, layer, K|V buffer, source shard)."""
    s = Scenario(num_kv_heads=4, prefill_tp=4, decode_tp=2, prompts=(17, 9), split_kv=True,
                 aux_row_bytes=AUX)
    _check(s, sources_per_rank=2 * 2)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_shm_decoders_sleep_until_the_prefill_kicks_them(provider):
    # on shm the decoder's waits sleep on its kick word and every prefill rank bumps it after
    # posting writes (transfer.kick): the decoder takes the long kick sleep only once every
    # prefill rank said it kicks, and its sleeps are ended by those kicks; on tcp they keep
    # the short polling backoff, but sleep on the CQ's wait fd and the command pipe
    out = run(Scenario(provider=provider, prefill_tp=2, decode_tp=1, prompts=PROMPTS,
                       aux_row_bytes=AUX, busy_sleep_s=0.0, track=True))
    (dec,) = out.decode
    assert all(r["status"] == "success" and r["bad_layers"] == [] and r["aux_ok"]
               for r in dec["requests"].values()), dec["requests"]
    kicks = [p["stats"]["kicks"] for p in out.prefill]
    if provider == "shm":
        assert dec["stats"]["kick_sleep_s"] > 0
        assert dec["stats"]["kick_wakes"] > 0
        assert min(kicks) > 0, kicks  # both ranks send (TP2 -> TP1: each its heads)
        assert dec["stats"]["fd_wakes"] == 0  # shm's CQ has no wait fd
    else:
        # tcp: no kicks; the decoder's sleeps wait on its CQ's wait fd (arriving bytes) and its
        # command pipe instead. Whether one of them was ended early depends on how busy the
        # machine is (a loaded box may never let the thread sleep): the fd wake-ups themselves
        # are shown deterministically in tests/test_fabric.py
        # (test_tcp_idle_sleeps_wait_on_the_cq_fd_and_a_wake_pipe)
        assert dec["stats"]["kick_sleep_s"] == 0 and kicks == [0, 0]


def test_a_paused_owner_does_not_count_its_pause_as_a_peers_silence():
    """PeerClock.excuse: the decoder's loop away for longer than a heartbeat (descheduled, the
    GIL held) read no PONG meanwhile; that time moves every live peer's last sign of life
    later, so the verdict (and the lease end taken from it) only comes later, never sooner."""
    from transfer.messenger.common import PeerClock

    clock = PeerClock(0.6)
    clock.heard("a", 10.0)
    clock.heard("b", 10.0)
    assert clock.newly_dead(10.7) == ["a", "b"]  # silent 0.7 s: both dead
    clock.heard("a", 11.0)                       # a answers again, b stays dead
    clock.excuse(0.5)                            # the owner was away 10.9 .. 11.4 s
    assert clock.last == {"a": 11.5, "b": 10.0}  # a dead peer's lease is not moved
    assert clock.newly_dead(12.0) == []          # a: 0.5 s watched, not 1.0
    assert clock.newly_dead(12.2) == ["a"]
