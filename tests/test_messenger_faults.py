"""Layer streaming and failure handling of the KV messenger, with real processes and libfabric.

* streaming: the prefill engine holds its progress counter at "layer 0 done" until the decoder
  has counted writes; if writes were only issued at the end of the pass, the decoder would
  never see any and the hold would time out;
* a stalled prefill: the decoder times out, ABORTs, and releases the pages only after the
  prefill confirmed; the prefill issues no write after the abort; the same pages then serve a
  new request byte-exactly;
* a SIGKILLed prefill: only its request fails, and the decoder's pages go to a request on
  another prefill instance, byte-exactly;
* a SIGKILLed decoder: the prefill fails that request and frees its pages.
"""

from __future__ import annotations

import pytest
import torch  # noqa: F401  (imported before forking so the rank processes start fast)

from transfer.fabric import shm_leftovers
from transfer.testing.loopback import Scenario, run

PROVIDERS = ["shm", "tcp;ofi_rxm"]
LAYERS = 4


@pytest.mark.parametrize("provider", PROVIDERS)
def test_layer0_completions_arrive_before_the_last_layer_is_written(provider):
    s = Scenario(provider=provider, prefill_tp=1, decode_tp=1, num_layers=LAYERS,
                 prompts=(33,), chunk_pages=8, faults=((0, "hold"),))
    out = run(s)
    (pre,), (dec,) = out.prefill, out.decode
    pages = 8
    per_layer = -(-pages // dec["writes_per_op"])  # operations per layer (pages grouped)
    assert pre["held"], "the decoder never saw a write while the prefill held at layer 0"
    assert pre["writes_while_held"] == pages  # only layer 0 was submitted
    assert 0 < dec["seen"]["received"] <= per_layer < dec["seen"]["expected"]
    r = dec["requests"]["w0-r0"]
    assert r["status"] == "success" and r["bad_layers"] == [] and r["aux_ok"]
    assert r["received"] == per_layer * LAYERS + 1


@pytest.mark.slow
@pytest.mark.parametrize("provider", PROVIDERS)
def test_stalled_prefill_times_out_and_pages_are_fenced_then_reused(provider):
    s = Scenario(provider=provider, prefill_tp=1, decode_tp=1, num_layers=LAYERS,
                 prompts=(33,), followups=(33,), chunk_pages=8, faults=((0, "stall"),),
                 timeout_s=1.5)
    out = run(s)
    (pre,), (dec,) = out.prefill, out.decode
    failed, again = dec["requests"]["w0-r0"], dec["requests"]["f-r0"]
    assert failed["status"] == "failed" and "timed out" in failed["reason"]
    assert pre["released"] and pre["writes_at_abort"] == 8
    assert not pre["results"]["w0-r0"]["ok"]
    reason = pre["results"]["w0-r0"]["reason"]  # whichever side's clock fired first
    assert "aborted by decode" in reason or "timed out on the prefill side" in reason
    # nothing was written after the abort: the only later writes are the follow-up's (8 pages
    # x LAYERS + 1 aux row), in the operations its decoder counted
    assert pre["writes_issued"] == 8 + 8 * LAYERS + 1
    assert again["expected"] == -(-8 // dec["writes_per_op"]) * LAYERS + 1
    assert again["status"] == "success" and again["bad_layers"] == [] and again["aux_ok"]
    assert dec["stale_writes"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("provider", PROVIDERS)
def test_killed_prefill_fails_only_its_request(provider):
    s = Scenario(provider=provider, prefill_tp=1, decode_tp=1, prefill_instances=2,
                 num_layers=LAYERS, prompts=(33, 17), peers=(0, 1), followups=(33,),
                 followup_peers=(1,), chunk_pages=8, faults=((0, "kill"),), peer_timeout_s=1.0)
    out = run(s)
    (dec,) = out.decode
    dead, alive, again = (dec["requests"][k] for k in ("w0-r0", "w0-r1", "f-r0"))
    assert dead["status"] == "failed" and "silent" in dead["reason"], dead
    assert alive["status"] == "success" and alive["bad_layers"] == [] and alive["aux_ok"]
    assert again["status"] == "success" and again["bad_layers"] == [] and again["aux_ok"]
    assert [p["inst"] for p in out.prefill] == [1]
    assert not shm_leftovers([p["pid"] for p in out.prefill])


@pytest.mark.slow
@pytest.mark.parametrize("provider", PROVIDERS)
def test_killed_decoder_fails_its_request_on_the_prefill(provider):
    s = Scenario(provider=provider, prefill_tp=1, decode_tp=1, num_layers=LAYERS,
                 prompts=(33,), chunk_pages=8, faults=((0, "hold"),), decode_kill=True,
                 peer_timeout_s=1.0, linger_s=3.0)
    out = run(s)
    assert out.decode == []
    assert shm_leftovers(out.pids) == []  # the killed decoder's /dev/shm file was removed
    (pre,) = out.prefill
    res = pre["results"]["w0-r0"]
    assert not res["ok"] and "silent" in res["reason"], res
    assert pre["writes_issued"] == 8  # layer 0 only: nothing more went to the dead peer


@pytest.mark.slow
def test_the_timeout_counts_from_the_bind_not_the_prefill_queue():
    # the prefill engine queues the request three times the decoder's timeout before binding
    # it (a long prefill queue, the mixed-load case): the lead's PONGs list it as queued, so
    # the decoder's timeout starts at the bind and the transfer completes byte-exactly
    s = Scenario(provider="shm", prefill_tp=2, decode_tp=1, num_layers=LAYERS, prompts=(33,),
                 timeout_s=0.8, heartbeat_s=0.1, peer_timeout_s=1.0, bind_delay_s=2.4)
    out = run(s)
    r = out.decode[0]["requests"]["w0-r0"]
    assert r["status"] == "success" and r["bad_layers"] == [] and r["aux_ok"], r
    assert all(res["ok"] for p in out.prefill for res in p["results"].values())


@pytest.mark.slow
def test_a_stalled_transfer_still_times_out_after_a_queue_wait():
    # queued past the timeout, then bound and stalled at layer 0: the clock started at the
    # bind still fires
    s = Scenario(provider="shm", prefill_tp=1, decode_tp=1, num_layers=LAYERS, prompts=(33,),
                 chunk_pages=8, faults=((0, "stall"),), timeout_s=0.8, heartbeat_s=0.1,
                 peer_timeout_s=1.0, bind_delay_s=1.6)
    out = run(s)
    r = out.decode[0]["requests"]["w0-r0"]
    assert r["status"] == "failed" and "timed out" in r["reason"], r
    assert out.prefill[0]["released"]


def test_a_request_the_prefill_refuses_fails_with_its_reason():
    # the engine cannot hold the request: the decoder learns why at once (ABORTED from the
    # lead), with the engine's reason, instead of timing out; the other rank answers the ABORT
    s = Scenario(provider="shm", prefill_tp=2, decode_tp=1, num_layers=LAYERS, prompts=(33,),
                 refuse=True, timeout_s=30.0, verify=False)
    out = run(s)
    r = out.decode[0]["requests"]["w0-r0"]
    assert r["status"] == "failed", r
    assert "the engine cannot hold this request" in r["reason"], r
