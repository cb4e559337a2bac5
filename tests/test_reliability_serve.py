"""Reliability and security of a LIVE reference deployment (real processes, real sockets).

`pdtool launch +recipe=tiny-local` (started the user's way: `Served` of
tests/helpers/reference_served.py):
* every listening socket of every process is bound to the configured interface (127.0.0.1),
  read from the sockets the kernel actually has (psutil), never 0.0.0.0;
* the control plane of the running prefill messenger is fuzzed with hypothesis (random frames,
  truncated, oversized, wrongly signed, wrong types under a valid signature, replays): it keeps
  serving, logs why it refused each, an unauthenticated peer gets no reply at all (so it can
  neither register, nor request pages, nor learn a memory key), and a real request afterwards
  is still exact; the front<->decode wire refuses forged and replayed GENs the same way;
* the front's HTTP input is fuzzed (bad JSON, wrong types, huge or lying Content-Length): a 4xx
  naming the field, never a 500 or a hang;
* a short soak (random sizes, every output vs the oracle, RSS flat, no KV page leaked);
* the render-time secret is 0600 and appears in no rendered script, log, command line or
  process environment.
A RankSpec deployment with two decode instances (no supervisor) then loses one decode instance
to SIGKILL mid-request: the front fails its request within seconds, not after 300 s.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path

import msgpack
import psutil
import pytest
import zmq
from helpers.reference_served import Served
from helpers.wire_bodies import hello_body, request_body
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdtool.engines.reference.front import DECODE_DEAD_S
from pdtool.engines.reference.local import get_json
from pdtool.engines.reference.soak import deployment, run_soak
from pdtool.engines.reference.wire import Wire, dealer
from transfer.fabric import shm_leftovers
from transfer.wire import PROTOCOL_VERSION, Envelope
from transfer.wire.messenger import MESSENGER

FUZZ_ID = "fuzzer"


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reliability")
    s = Served("tiny-local", tmp)
    s.tmp = tmp
    yield s
    s.stop()


def _procs(s: Served) -> list[psutil.Process]:
    root = psutil.Process(s.proc.pid)
    return [root, *root.children(recursive=True)]


def _logs(s: Served) -> str:
    return "\n".join(p.read_text(errors="replace") for p in Path(s.tmp).rglob("*.log"))


def _wait_log(s: Served, text: str, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if text in _logs(s):
            return True
        time.sleep(0.2)
    return False


# ----------------------------------------------------------------------------- interfaces
@pytest.mark.slow
def test_listeners_bind_the_configured_interface(launched):
    listening = []
    for p in _procs(launched):
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                listening.append((p.pid, p.name(), c.laddr.ip, c.laddr.port))
    ports = {port for *_, port in listening}
    # the front, each leader's /health, the prefill control socket, the decoders' GEN sockets
    assert len(ports) >= 6, listening
    assert {ip for _, _, ip, _ in listening} == {"127.0.0.1"}, listening


# ----------------------------------------------------------------------------- control plane
def _control(s: Served) -> str:
    _, health = get_json(f"{s.leaders[0]}/health")
    (address,) = health["control"]
    return address


def _signed(secret: bytes, env: object) -> list[bytes]:
    data = msgpack.packb(env, use_bin_type=True)
    return [data, hmac.new(secret, data, hashlib.sha256).digest()]


_fuzz_seq = iter(range(1 << 20, 1 << 40))


def _env(type_: str, body: object, to: bytes, **over: object) -> dict:
    """A fuzzer's envelope bound to the prefill's session `to` (past the binding checks)."""
    return {"v": PROTOCOL_VERSION, "p": "messenger", "k": type_, "from": FUZZ_ID,
            "sid": b"f" * 16, "to": to, "seq": next(_fuzz_seq), "body": body, **over}


_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=16),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=16)


def _bad_frames(secret: bytes, env: Envelope, to: bytes):
    """Strategies for hostile input; each yields the frames to send."""
    kinds = list(MESSENGER.kinds)
    return st.one_of(
        st.lists(st.binary(max_size=300), min_size=1, max_size=4),             # random
        st.integers(0, 60).map(lambda k: [env.seal("PING", {}, to)[0][:k],     # truncated
                                          env.seal("PING", {}, to)[1]]),
        st.sampled_from(kinds).map(                                            # wrong key
            lambda t: Envelope(b"w" * 32, FUZZ_ID, MESSENGER).seal(t, _valid_body(t), to)),
        st.tuples(st.sampled_from(kinds), _value).map(                         # wrong types
            lambda tb: _signed(secret, _env(tb[0], tb[1], to))),
        _value.map(lambda e: _signed(secret, e)),                              # not an envelope
        st.sampled_from([{"v": 99}, {"seq": 0}, {"from": "someone-else"}, {"sid": b"x"},
                         {"to": b"y" * 16}, {"to": b""}]).map(
            lambda over: _signed(secret, {**_env("PING", {}, to), **over})),
    )


def _abort_body() -> dict:
    return {"rid": "x", "slot": 0, "gen": 1, "reason": "fuzz"}


def _valid_body(type_: str) -> dict:
    return {"HELLO": hello_body(), "REQUEST": request_body(), "ABORT": _abort_body(),
            "ABORTED": {**_abort_body(), "issued": 0, "errored": 0}}.get(type_, {})


def _replies(sock: zmq.Socket, wait_s: float) -> list[list[bytes]]:
    out, end = [], time.monotonic() + wait_s
    while time.monotonic() < end:
        if sock.poll(50):
            out.append(sock.recv_multipart())
    return out


def _handshake(sock: zmq.Socket, env: Envelope) -> tuple[dict, bytes]:
    """HELLO to the live prefill rank: its answer, and its session (which binds our frames)."""
    sock.send_multipart(env.seal("HELLO", hello_body()))
    (reply,) = _replies(sock, 3.0)
    hello = env.open(reply)
    assert hello.type == "HELLO" and hello.body["role"] == "prefill"
    return hello.body, hello.session


@pytest.mark.slow
def test_live_prefill_survives_control_plane_fuzzing(launched):
    secret = bytes.fromhex(launched.secret)
    address = _control(launched)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, FUZZ_ID.encode())
    sock.connect(address)
    env = Envelope(secret, FUZZ_ID, MESSENGER)
    try:
        _, to = _handshake(sock, env)

        @settings(max_examples=300, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(_bad_frames(secret, env, to))
        def fuzz(frames):
            sock.send_multipart(frames)

        fuzz()
        _replies(sock, 1.0)  # PONGs to the complete PINGs among the examples
    finally:
        sock.close(0)
    # replayed: the first copy is answered, the second refused (a fresh peer: the fuzzer's
    # hand-made frames under its name opened sessions of their own, retiring `env`'s)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"replayer")
    sock.connect(address)
    env = Envelope(secret, "replayer", MESSENGER)
    try:
        _, to = _handshake(sock, env)
        ping = env.seal("PING", {}, to)
        sock.send_multipart(ping)
        sock.send_multipart(ping)
        got = _replies(sock, 2.0)
        pongs = [env.open(f) for f in got]
        assert [m.type for m in pongs] == ["PONG"], pongs
    finally:
        sock.close(0)
    # oversized: ZeroMQ drops the peer (MAXMSGSIZE) before a byte is decoded
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(address)
    big.send_multipart([b"\0" * (9 << 20), b"m" * 32])
    time.sleep(0.5)
    big.close(0)
    # still serving, exactly; and the refusals were logged with their reason
    body = launched.complete("after the storm", 6)
    assert body["pdtool"]["token_ids"] == launched.oracle("after the storm", 6)
    for reason in ("refused a message: mac: signature does not match",
                   "refused a message: seq: already seen (replayed message)",
                   "refused a message: frames: expected [payload, mac]",
                   "refused a message: envelope.v: protocol version 99, expected "
                   f"{PROTOCOL_VERSION}",
                   "refused a message: to: frame bound to another session"):
        assert _wait_log(launched, reason), reason


@pytest.mark.slow
def test_unauthenticated_peer_gets_no_reply_and_no_key(launched):
    """A peer without the secret is never answered (no PONG, no ABORTED), so it cannot
    register, request pages or learn anything; an insider's malformed request gets an ABORTED
    that carries only ids, counts and a reason, never a memory key or address."""
    secret = bytes.fromhex(launched.secret)
    ctx = zmq.Context.instance()
    outsider = ctx.socket(zmq.DEALER)
    outsider.setsockopt(zmq.LINGER, 0)
    outsider.setsockopt(zmq.ROUTING_ID, b"outsider")
    outsider.connect(_control(launched))
    wrong = Envelope(os.urandom(32), "outsider", MESSENGER)
    for type_ in MESSENGER.kinds:
        outsider.send_multipart(wrong.seal(type_, _valid_body(type_), b"t" * 16))
    outsider.send_multipart([b"PING"])  # unsigned
    assert _replies(outsider, 2.0) == []
    outsider.close(0)
    insider = ctx.socket(zmq.DEALER)
    insider.setsockopt(zmq.LINGER, 0)
    insider.setsockopt(zmq.ROUTING_ID, FUZZ_ID.encode())
    insider.connect(_control(launched))
    env = Envelope(secret, FUZZ_ID, MESSENGER)
    hello, to = _handshake(insider, env)  # a prefill's HELLO names no memory key or address
    assert hello["fabric_name"] == b"" and hello["regions"] == hello["aux_regions"] == []
    assert hello["error"]  # this decoder's static data does not fit the deployment
    insider.send_multipart(env.seal("REQUEST", _valid_body("REQUEST"), to))
    (reply,) = _replies(insider, 3.0)
    insider.close(0)
    msg = env.open(reply)
    assert msg.type == "ABORTED" and msg.body["reason"].startswith("refused: ")
    assert set(msg.body) == {"rid", "slot", "gen", "reason", "issued", "errored"}


@pytest.mark.slow
def test_decode_wire_refuses_forged_and_replayed_requests(launched):
    _, health = get_json(f"{launched.leaders[1]}/health")
    wire = Wire(bytes.fromhex(launched.secret))
    sock = dealer(zmq.Context.instance(), health["engine"], wire)
    try:
        forger = Wire(os.urandom(32), name=wire.name)
        sock.send_multipart(forger.pack("HELLO", forger.hello()))  # forged
        assert _replies(sock, 1.5) == []
        decoder = wire.handshake(sock)
        body = {"rid": f"replay-{time.monotonic_ns()}", "tokens": [72, 105], "max_tokens": 2}
        frames = wire.pack("GEN", body, peer=decoder)
        sock.send_multipart(frames)
        first = _replies(sock, 5.0)
        assert first and wire.unpack(first[-1], ("OUT",))
        sock.send_multipart(frames)  # a captured GEN, replayed: no second run
        assert _replies(sock, 1.5) == []
    finally:
        sock.close(0)
    assert _wait_log(launched, "seq: already seen (replayed message)")


# ----------------------------------------------------------------------------- HTTP input
def _post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest("POST", "/v1/completions")
        hdrs = {"Content-Type": "application/json", "Content-Length": str(len(body)),
                **(headers or {})}
        for k, v in hdrs.items():
            conn.putheader(k, v)
        conn.endheaders()
        conn.send(body)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


_bodies = st.one_of(
    st.binary(max_size=200),
    _value.map(lambda v: json.dumps(v, default=repr).encode()),
    st.fixed_dictionaries({}, optional={"prompt": _value, "max_tokens": _value,
                                        "stream": _value, "model": _value})
    .map(lambda d: json.dumps(d, default=repr).encode()),
)


def test_front_refuses_hostile_http_input(launched):
    from pdtool.engines.reference.front import BadRequest, parse_request

    codes = []

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_bodies)
    def fuzz(body):
        try:
            parse_request(body)
        except BadRequest:
            pass
        else:
            return  # a valid request: served by the other tests, too slow to send 150 of
        code, reply = _post(launched.url, body)
        codes.append(code)
        named = reply["error"]["message"].split(":")[0]
        sent = json.loads(body) if code == 400 and named not in ("body", "prompt") else {}
        assert code == 400 and (named in ("body", "prompt", "max_tokens", "stream", "model")
                                or named in sent), (body, code, reply)

    fuzz()
    assert codes, "hypothesis produced no invalid body"
    # refused from the header, before the body is read
    code, reply = _post(launched.url, b"{}", {"Content-Length": str(2 << 20)})
    assert code == 400 and "larger than" in reply["error"]["message"]
    code, reply = _post(launched.url, b"[" * 500_000)
    assert code == 400 and "nested too deeply" in reply["error"]["message"]
    code, reply = _post(launched.url, b"{}", {"Content-Length": "-1"})
    assert code == 400 and reply["error"]["message"].startswith("Content-Length")
    code, reply = _post(launched.url, b"{}", {"Content-Length": "lots"})
    assert code == 400 and reply["error"]["message"].startswith("Content-Length")
    body = launched.complete("still fine", 3)
    assert body["pdtool"]["token_ids"] == launched.oracle("still fine", 3)
    assert launched.proc.poll() is None


def test_a_prompt_longer_than_the_context_fails_alone(launched):
    """A 100,000-character prompt once killed the front's dispatcher thread (every later
    request hung while /health said ok): now it is a 400 naming the field, and the front
    keeps serving."""
    _, health = get_json(f"{launched.url}/health")
    context = health["context"]
    assert 0 < context < 100_000
    code, reply = get_json(f"{launched.url}/v1/completions",
                           {"prompt": "x" * 100_000, "max_tokens": 4})
    assert code == 400 and reply["error"]["message"].startswith("prompt: 100000 tokens"), reply
    code, reply = get_json(f"{launched.url}/v1/completions",
                           {"prompt": "x" * 10, "max_tokens": context - 5})
    assert code == 400 and reply["error"]["message"].startswith("max_tokens:"), reply
    assert str(context - 10) in reply["error"]["message"]
    code, reply = get_json(f"{launched.url}/v1/completions",
                           {"prompt": [66] * 70_000, "max_tokens": 1})
    assert code == 400 and reply["error"]["message"].startswith("prompt:"), reply
    body = launched.complete("still fine", 3)
    assert body["pdtool"]["token_ids"] == launched.oracle("still fine", 3)
    assert get_json(f"{launched.url}/health")[0] == 200
    routers = [p for p in Path(launched.tmp).rglob("*.log") if "router" in p.name]
    assert routers and not any("Traceback" in p.read_text() for p in routers)


# ----------------------------------------------------------------------------- soak
@pytest.mark.slow
def test_short_soak_exact_flat_memory_no_leak(launched):
    n = int(os.environ.get("PDTOOL_SOAK_REQUESTS", "150"))
    pids = [p.pid for p in _procs(launched)]
    res = run_soak(launched.url, launched.leaders, pids, launched.model, requests=n,
                   workers=16, seed=3, max_seconds=240)
    print(res.summary())
    assert res.requests == n and not res.errors and not res.mismatches, res.summary()
    assert not any(res.pages_leaked.values()), res.pages_leaked
    assert res.rss_growth_mib < 64, res.summary()


# ----------------------------------------------------------------------------- the secret
def test_secret_is_0600_and_never_written_anywhere_else(launched):
    job = Path(launched.tmp) / "job"
    key = job / "secret.key"
    assert key.stat().st_mode & 0o777 == 0o600
    secret = launched.secret
    assert secret == key.read_text().strip()
    files = [p for p in Path(launched.tmp).rglob("*") if p.is_file() and p != key]
    assert any(p.suffix == ".sh" for p in files) and any(p.suffix == ".log" for p in files)
    for p in files:
        assert secret not in p.read_text(errors="replace"), p
    for proc in _procs(launched):
        env = proc.environ()
        assert "PDTOOL_SECRET" not in env, proc.cmdline()
        assert secret not in " ".join(proc.cmdline()) and secret not in json.dumps(env)


# ----------------------------------------------------------------------------- decode death
@pytest.mark.slow
def test_front_fails_requests_of_a_dead_decode_instance_promptly(tmp_path):
    # the messengers declare a silent peer dead after 2 s: the prefill must still be computing
    # the long prompt below when it gives up its writes (2 x that after the death)
    dep, url, leaders, _model = deployment(tmp_path / "dep", decoders=2, peer_timeout_s=2.0)
    dep.start()
    try:
        secret = dep.specs[0].secret_hex  # handed over in 0600 files, not on command lines
        assert all(secret not in " ".join(psutil.Process(p.pid).cmdline()) for p in dep.procs)
        results: list[tuple[int, dict, float]] = []

        def long_request() -> None:
            code, body = get_json(f"{url}/v1/completions",
                                  {"prompt": "a long story", "max_tokens": 4096}, timeout=120)
            results.append((code, body, time.monotonic()))

        threads = [threading.Thread(target=long_request) for _ in range(2)]
        for t in threads:  # one per decode instance: the front picks the least loaded
            t.start()
            time.sleep(0.3)
        time.sleep(0.5)
        # and a long prompt straight to decode instance 1: the prefill is still computing it
        # when that decoder dies, and must stop (free its pages) instead of finishing it. Its
        # writes to the dead decoder are given up 2 x peer_timeout_s (4 s) after the death, so
        # the prompt must take longer than that to compute (8000 tokens at 10 s sometimes did
        # not, nor 12000 once attention was fused):
        # 12000 tokens = 3000 of the decoder's 4096 pages, next to the other request's
        _, health = get_json(f"{leaders[2]}/health")
        wire = Wire(bytes.fromhex(secret))
        sock = dealer(zmq.Context.instance(), health["engine"], wire)
        sock.send_multipart(wire.pack("GEN", {
            "rid": "long-prompt", "tokens": [65 + i % 26 for i in range(12000)],
            "max_tokens": 1}, peer=wire.handshake(sock)))
        time.sleep(1.0)
        sock.close(0)
        victim = next(p for p, s in zip(dep.procs, dep.specs, strict=True)
                      if s.role == "decode" and s.instance == 1)
        killed_at = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        for t in threads:
            t.join(120)
        failed = [(c, b, t) for c, b, t in results if c != 200]
        assert len(failed) == 1, results
        code, body, when = failed[0]
        assert code == 503 and "decode instance 1 stopped answering" in \
            body["error"]["message"], body
        assert when - killed_at < DECODE_DEAD_S + 5.0  # not the 300 s backstop
        # the front routes new requests to the instance still up
        code, body = get_json(f"{url}/v1/completions", {"prompt": "next", "max_tokens": 3})
        assert code == 200 and body["pdtool"]["decode_instance"] == 0
        code, health = get_json(f"{url}/health")
        assert health["decode_up"] == 1
        for u in (leaders[0], leaders[1]):  # nothing leaked on the survivors
            for _ in range(300):
                st_ = get_json(f"{u}/stats")[1]
                if st_["pages_free"] == st_["pages_total"] and st_["running"] == 0:
                    break
                time.sleep(0.1)
            assert st_["pages_free"] == st_["pages_total"] and st_["running"] == 0, st_
        prefill_log = next(dep.log_dir.glob("*-prefill-0-0.log")).read_text()
        assert "request long-prompt: aborted by the messenger, stopped after" in prefill_log
    finally:
        dep.stop()
    assert not shm_leftovers([p.pid for p in dep.procs])  # the killed one's file is removed


# ----------------------------------------------------------------------------- cancellation
@pytest.mark.slow
def test_a_streaming_client_that_goes_away_is_cancelled(launched):
    """The decoder drops a request whose client disconnected (pages and batch slot freed at
    once) instead of generating thousands of tokens for nobody."""
    import socket

    host, port = launched.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "talk for a long time", "max_tokens": 4000,
                       "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        seen = b""
        while b"data: " not in seen:  # generating
            chunk = sock.recv(4096)
            assert chunk, seen
            seen += chunk
        assert seen.startswith(b"HTTP/1.0 200") or seen.startswith(b"HTTP/1.1 200"), seen
    assert _wait_log(launched, "cancelled by the front (client gone)", timeout=20)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        decoders = [get_json(f"{u}/stats")[1] for u in launched.leaders[1:]]
        if all(d["running"] == 0 and d["pages_free"] == d["pages_total"] for d in decoders):
            break
        time.sleep(0.1)
    assert all(d["running"] == 0 and d["pages_free"] == d["pages_total"] for d in decoders), \
        decoders
