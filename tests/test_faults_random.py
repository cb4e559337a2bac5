"""Randomized fault injection over real processes (transfer.testing.loopback, real libfabric).

Each trial draws a deployment (provider, prefill TP, decode TP, prompt sizes) and one fault from
a seeded generator, runs it, and checks the invariants of the failure model:

* kill a prefill instance (SIGKILL) before the request, mid-layer, after its last KV write or
  while its metadata (aux rows) is copied; stall it past the transfer timeout; kill the decoder
  right after submitting or mid-transfer; drop or delay control messages (REQUEST, ABORTED,
  PONG, the decoder's PINGs) with the control plane's fault hook (`PDTOOL_CONTROL_FAULTS`);
* the survivor fails exactly the affected requests (the faulty instance's, or those whose
  REQUEST was lost; of a stalled instance, which resumes once one of its transfers failed, at
  least one, the others finishing byte-exact) with a clear reason, detected within the
  configured timeout and settled (pages free) within the fencing bound; every other request
  succeeds byte for byte;
* timing is judged against what the trial measured: every process reports its messenger
  loop's longest round (how long the loaded box, or the GIL, kept it away); the bounds grow by
  it, and a request the fault did not touch may fail for liveness ("silent", "timed out") only
  when that round reached half of `peer_timeout_s`, so a busy box does not fail the test while
  a protocol that misjudges a live peer still does. Its bytes and pages are checked either way;
* follow-up requests reuse the very destination pages of the first wave (failed ones included)
  and read them byte-exact: no late write corrupts a reused page;
* afterwards every decoder slot is free, nothing is quarantined, and a surviving prefill holds
  no request, aux row or tag.

`PDTOOL_FAULT_TRIALS` (default 12) and `PDTOOL_FAULT_SEED` (default 7) pick how many trials and
which; run with `-s` to see the per-trial lines and the summary.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections import Counter
from dataclasses import dataclass

import pytest
import torch  # noqa: F401  (imported before forking so the rank processes start fast)

from transfer.fabric import shm_leftovers
from transfer.testing.loopback import Scenario, run

TRIALS = int(os.environ.get("PDTOOL_FAULT_TRIALS", "12"))
SEED = int(os.environ.get("PDTOOL_FAULT_SEED", "7"))
TIMEOUT_S, PEER_TIMEOUT_S, HEARTBEAT_S, GRACE_S = 1.5, 0.6, 0.15, 2.0
ALL = -2    # Trial.faulty: the fault may hit any request
SLACK_S = 2.5  # two shared cores: scheduling noise on top of the protocol's own bounds
# what a request fails with when a peer was (or seemed) silent: excused for a request the fault
# did not touch only when a messenger loop was kept away for half the liveness bound or more
LIVENESS = r"silent for more than|not answering|aborted|timed out"

KINDS = ["pkill@before", "pkill@layer", "pkill@last", "pkill@meta", "pstall@layer",
         "dkill@submit", "dkill@writes", "drop-request", "delay-request", "drop-aborted+stall",
         "delay-pong", "drop-ping"]


@dataclass
class Trial:
    n: int
    kind: str
    scenario: Scenario
    faulty: int        # prefill instance that misbehaves (-1: none)
    must_fail: bool    # every first-wave request of the faulty instance must fail
    reason: str        # regex a failure's reason must match
    # a stalled instance resumes once the decoder failed ONE of its transfers: the requests of
    # that pass whose own timeout had not run out may then finish, byte-exact; what must hold
    # is that at least one of its first-wave requests failed (the data decides, not the clock)
    one_fails: bool = False


def _draw(n: int, rng: random.Random) -> Trial:
    kind = KINDS[n % len(KINDS)] if n < len(KINDS) else rng.choice(KINDS)
    provider = rng.choice(["shm", "shm", "tcp;ofi_rxm"])
    layers = rng.randint(2, 4)
    dkill = kind.startswith("dkill")
    ptp = rng.choice([1, 2])
    dtp = 1 if dkill else rng.choice([1, 1, 2])
    k = rng.randint(1, 3)  # first-wave requests per prefill instance
    prompts = tuple(rng.randint(2, 37) for _ in range(2 * k))
    chunk = rng.randint(1, 4)
    base = dict(provider=provider, prefill_tp=ptp, decode_tp=dtp, num_layers=layers,
                num_kv_heads=4, prompts=prompts, chunk_pages=chunk,
                writes_per_op=rng.choice([0, 0, 1, 3]),  # 0: the provider's limit (4)
                lanes=rng.choice([0, 0, 1, 3]),  # 0: 2 on shm, 1 on tcp
                # 1 byte in flight: the prefill alternates lanes operation by operation
                prefill_inflight_bytes=rng.choice([64 << 20, 1]),
                timeout_s=TIMEOUT_S, heartbeat_s=HEARTBEAT_S, peer_timeout_s=PEER_TIMEOUT_S,
                track=True, run_timeout_s=30.0)
    two = dict(prefill_instances=2, peers=(0,) * k + (1,) * k,
               followups=prompts, followup_peers=(1,) * (2 * k))
    layer = rng.randrange(layers)
    if kind.startswith("pkill"):
        point = kind.split("@")[1]
        point = f"layer:{layer}" if point == "layer" else point
        # one more follow-up goes to the dead instance: it must fail at once, not time out
        dead = {**two, "followups": (*prompts, 5), "followup_peers": (1,) * (2 * k) + (0,)}
        s = Scenario(**base, **dead, faults=((0, f"kill@{point}"),))
        return Trial(n, kind, s, 0, point in ("before",) or point.startswith("layer"),
                     r"silent for more than|aborted")
    if kind == "pstall@layer":
        s = Scenario(**base, **two, faults=((0, f"stall@layer:{layer}"),))
        return Trial(n, kind, s, 0, False, r"timed out|aborted", one_fails=True)
    if dkill:
        if kind.endswith("writes"):  # "hold" needs layer 0 of the first chunk to complete an
            base["writes_per_op"] = chunk  # operation (a partial one waits for the next chunk)
        s = Scenario(**{**base, "prompts": prompts[:k]}, decode_kill_at=kind.split("@")[1],
                     faults=((0, "hold"),) if kind.endswith("writes") else (),
                     linger_s=2 * PEER_TIMEOUT_S + 1.5)
        return Trial(n, kind, s, 0, False, r"silent for more than|aborted")
    if kind == "drop-request":
        s = Scenario(**base, **two, control_faults=(("decode", f"drop=REQUEST:0.5,seed={n}"),))
        return Trial(n, kind, s, -1, False, r"timed out")
    if kind == "delay-request":  # arrives after the decoder gave up: refused by a tombstone
        s = Scenario(**base, **two, control_faults=(
            ("decode", f"delay=REQUEST:{TIMEOUT_S + 0.5},seed={n}"),))
        return Trial(n, kind, s, -1, False, r"timed out")
    if kind == "drop-aborted+stall":  # ABORTED lost half the time: the decoder asks again
        s = Scenario(**base, **two, faults=((0, f"stall@layer:{layer}"),),
                     control_faults=(("prefill0", f"drop=ABORTED:0.5,seed={n}"),))
        return Trial(n, kind, s, 0, False, r"timed out|aborted", one_fails=True)
    if kind == "drop-ping":  # the decoder's heartbeats are lost: every prefill sees it silent
        s = Scenario(**base, **two, faults=((0, f"stall@layer:{layer}"),),
                     control_faults=(("decode", f"drop=PING:1,seed={n}"),))
        # a prefill that binds a request once it counts the decode rank silent refuses it as
        # "not answering" (its `_dest`), depending on when the request reached it
        return Trial(n, kind, s, ALL, False, r"silent for more than|not answering|aborted")
    # PONGs of instance 0 arrive later than the liveness timeout while it stalls: the decoder
    # thinks it dead though it is alive (and gets the ABORT): an asymmetric partition
    s = Scenario(**base, **two, faults=((0, f"stall@layer:{layer}"),), control_faults=(
        ("prefill0", f"delay=PONG:{PEER_TIMEOUT_S + 0.4},seed={n}"),))
    return Trial(n, kind, s, 0, False, r"silent for more than|aborted|timed out",
                 one_fails=True)


def _check(t: Trial, out) -> tuple[Counter, list[float], list[str]]:
    """Outcome counts, failure settle times, and the list of violated invariants."""
    s, errs, counts, times = t.scenario, [], Counter(), []
    dkill = t.kind.startswith("dkill")
    # the longest round any surviving messenger loop took: time the box (or the GIL) kept a
    # process away. Its peers may then rightly count it silent, and every bound moves by it
    pause = max((x.get("stats", {}).get("longest_round_s", 0.0)
                 for x in (*out.decode, *out.prefill)), default=0.0)
    counts["longest-round-ms"] = round(pause * 1000)
    bound = s.timeout_s + 3 * s.peer_timeout_s + GRACE_S + SLACK_S + pause
    if dkill:
        if len(out.decode) != s.decode_tp - 1:
            errs.append(f"decode reports: {len(out.decode)}")
    elif len(out.decode) != s.decode_tp:
        errs.append(f"decode reports: {len(out.decode)} of {s.decode_tp}")
    # a REQUEST part lost by any decode rank fails the request on every rank
    dropped = {rid for dec in out.decode for _act, typ, rid in dec.get("control_log", ())
               if typ == "REQUEST"}
    for dec in out.decode:
        for rid, r in dec["requests"].items():
            first = rid.startswith("w0-")
            to_dead = not first and r.get("peer") == t.faulty and t.kind.startswith("pkill")
            affected = (first and r.get("peer") == t.faulty) or rid in dropped or \
                t.faulty == ALL or to_dead
            if to_dead and not re.search(r"not answering|silent for more than", r["reason"]):
                errs.append(f"{rid}: sent to a dead instance, reason {r['reason']!r}")
            counts[r["status"]] += 1
            if r["status"] == "success":
                if r.get("bad_layers") or not r.get("aux_ok"):
                    errs.append(f"{rid}: success but bytes differ {r}")
                if affected and (t.must_fail or rid in dropped):
                    errs.append(f"{rid}: must have failed, succeeded")
            elif r["status"] == "failed":
                times.append(r["settled_s"])
                if not affected and pause >= s.peer_timeout_s / 2 and \
                        re.search(LIVENESS, r["reason"]):
                    counts["failed-while-paused"] += 1  # its data checks below still hold
                elif not affected:
                    errs.append(f"{rid}: not affected by the fault but failed: {r['reason']}"
                                f" (longest loop round {pause:.2f} s)")
                elif not re.search(t.reason, r["reason"]):
                    errs.append(f"{rid}: unclear reason {r['reason']!r}")
                if r["detected_s"] > s.timeout_s + SLACK_S + pause:
                    errs.append(f"{rid}: failure detected after {r['detected_s']:.2f} s")
                if r["settled_s"] > bound:
                    errs.append(f"{rid}: pages free only after {r['settled_s']:.2f} s")
            else:
                errs.append(f"{rid}: never settled ({r['status']})")
        st = dec.get("stats", {})
        counts["stale-writes-fenced"] += st.get("stale_writes", 0)
        if (st.get("slots_free") != st.get("slots_total") or st.get("quarantined")
                or st.get("requests")):
            errs.append(f"decode rank {dec['rank']}: not idle {st}")
    faulty_failed = sum(1 for dec in out.decode for rid, r in dec["requests"].items()
                        if rid.startswith("w0-") and r.get("peer") == t.faulty
                        and r["status"] == "failed")
    if t.one_fails and not faulty_failed:
        errs.append(f"no first-wave request of stalled instance {t.faulty} failed")
    killed = t.faulty if t.kind.startswith("pkill") else -1
    want = {(i, r) for i in range(s.prefill_instances) for r in range(s.prefill_tp)
            if i != killed}
    got = {(p["inst"], p["rank"]) for p in out.prefill}
    if not want <= got:  # a prefill process that was not killed died (or never reported)
        errs.append(f"prefill processes lost: {sorted(want - got)}")
    survivors = [p for p in out.prefill if p["inst"] != killed]
    for p in survivors:
        st = p.get("stats", {})
        if st.get("bound") or st.get("sending") or st.get("assembling") or \
                st.get("aux_rows_free") != 64:
            errs.append(f"prefill {p['inst']} rank {p['rank']}: not idle {st}")
        for rid, r in p["results"].items():
            counts["prefill-" + ("ok" if r["ok"] else "failed")] += 1
            if not r["ok"] and not re.search(t.reason + r"|timed out", r["reason"]):
                errs.append(f"prefill {rid}: unclear reason {r['reason']!r}")
            if not r["ok"] and dkill and r["seconds"] > bound:
                errs.append(f"prefill {rid}: settled after {r['seconds']:.2f} s")
    if dkill and not any(p["inst"] == 0 for p in out.prefill):
        errs.append("the prefill did not survive the decoder's death")
    if leftovers := shm_leftovers([p["pid"] for p in out.prefill]):
        errs.append(f"/dev/shm leftovers {leftovers}")
    return counts, times, errs


@pytest.mark.slow
def test_randomized_faults_fail_only_affected_requests_and_leak_nothing():
    rng = random.Random(SEED)
    total, settle, failures, by_kind = Counter(), [], [], Counter()
    longest = 0  # the longest messenger loop round of any trial, ms
    t0 = time.monotonic()
    for n in range(TRIALS):
        t = _draw(n, rng)
        start = time.monotonic()
        out = run(t.scenario)
        counts, times, errs = _check(t, out)
        longest = max(longest, counts["longest-round-ms"])
        total.update({k: v for k, v in counts.items() if k != "longest-round-ms"})
        by_kind[t.kind] += 1
        settle += times
        line = (f"trial {n:3d} {t.kind:18s} {t.scenario.provider:11s} "
                f"P{t.scenario.prefill_tp}->D{t.scenario.decode_tp} lanes={t.scenario.lanes} "
                f"k={t.scenario.writes_per_op} "
                f"{dict(counts)} {time.monotonic() - start:.1f}s")
        print(line + ("" if not errs else f"  VIOLATIONS: {errs}"))
        if errs:
            failures.append((n, t.kind, t.scenario, errs))
    print(f"fault trials: {TRIALS} (seed {SEED}) in {time.monotonic() - t0:.0f} s; kinds "
          f"{dict(by_kind)}; outcomes {dict(total)}; failed transfers settled (pages free) "
          f"in max {max(settle, default=0):.2f} s; longest messenger loop round {longest} ms; "
          f"violations in {len(failures)} trials")
    assert not failures, failures


def test_control_fault_hook_drops_and_delays_only_what_it_is_told():
    """The hook the trials use, over real sockets: parse errors name the variable; a dropped
    type never arrives (and is logged with its rid); a delayed one arrives later; others pass."""
    import pytest
    import zmq
    from helpers.wire_bodies import hello_body

    from transfer.wire import Envelope, WireError
    from transfer.wire.channel import Channel, ControlFaults
    from transfer.wire.messenger import MESSENGER

    with pytest.raises(WireError, match="PDTOOL_CONTROL_FAULTS: cannot read 'oops'"):
        ControlFaults.parse("oops")
    with pytest.raises(WireError, match="drop=NOPE: unknown message type"):
        ControlFaults.parse("drop=NOPE:1")
    faults = ControlFaults.parse("drop=ABORT:1,delay=PING:0.3")
    secret = b"f" * 32
    ctx = zmq.Context()
    try:
        server = Channel.listen(ctx, Envelope(secret, "p0", MESSENGER), "127.0.0.1")
        client = Channel.connect(ctx, Envelope(secret, "d0", MESSENGER), server.address,
                                 faults=faults)
        client.send("HELLO", hello_body())  # not faulted: the binding the others need
        hello = _until(server, "HELLO")
        server.send("HELLO", hello_body(role="prefill"), peer=b"d0", session=hello.session)
        _until(client, "HELLO")
        client.send("ABORT", {"rid": "gone", "slot": 1, "gen": 2, "reason": "x"})
        client.send("PING", {})
        client.send("PONG", {})

        def drain(seconds: float) -> list[str]:
            got, end = [], time.monotonic() + seconds
            while time.monotonic() < end:
                client.recv()  # the owner's loop: releases held messages when due
                if server.sock.poll(20):
                    got += [m.type for _, m in server.recv()]
            return got

        assert drain(0.15) == ["PONG"]
        assert drain(1.0) == ["PING"]
        assert faults.log == [("drop", "ABORT", "gone"), ("delay", "PING", "")]
        server.close()
        client.close()
    finally:
        ctx.term()


def _until(ch, kind: str, timeout: float = 5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ch.sock.poll(20):
            for _, m in ch.recv():
                if m.type == kind:
                    return m
    raise AssertionError(f"no {kind} within {timeout} s")
