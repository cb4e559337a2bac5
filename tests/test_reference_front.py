"""The front and the decode serving loop as real processes (TP2 decode, gloo), no messenger.

One-token prompts need no prefill, so this checks the HTTP surface, the signed front↔decode
wire, streaming and TP decoding against the oracle on their own; everything that moves KV pages
is in test_reference_serve.py.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from pdtool.engines.reference.client import complete
from pdtool.engines.reference.front import BadRequest, parse_request
from pdtool.engines.reference.local import Deployment, free_port, get_json, new_secret
from pdtool.engines.reference.oracle import decode, generate
from pdtool.engines.reference.serve import RankSpec
from pdtool.engines.reference.wire import Wire


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{", "body"),
        (b"[]", "body"),
        (b'{"prompt": 3}', "prompt"),
        (b'{"prompt": ""}', "prompt"),
        (b'{"prompt": [1, 300]}', "prompt"),
        (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        (b'{"prompt": "x", "max_tokens": true}', "max_tokens"),
        (b'{"prompt": "x", "stream": "yes"}', "stream"),
    ],
)
def test_bad_requests_name_the_field(body, field):
    with pytest.raises(BadRequest, match=f"^{field}:"):
        parse_request(body)


def test_wire_refuses_forged_and_malformed_messages():
    w = Wire(b"k" * 32)
    frames = w.pack("GEN", {"rid": "a", "tokens": [1, 2], "max_tokens": 3})
    assert w.unpack(frames, ("GEN",)) == ("GEN", {"rid": "a", "tokens": [1, 2], "max_tokens": 3})
    assert Wire(b"x" * 32).unpack(frames, ("GEN",)) is None  # other secret
    assert w.unpack([frames[0] + b"!", frames[1]], ("GEN",)) is None
    assert w.unpack(frames, ("OUT",)) is None
    assert w.rejected == 2


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    secret, dport, hport, fport = new_secret(), free_port(), free_port(), free_port()
    specs = [RankSpec(role="decode", tp=2, rank=r, dist_port=dport, http_port=hport,
                      secret_hex=secret, messenger={"kind": "none"}) for r in range(2)]
    specs.append(RankSpec(role="front", http_port=fport, secret_hex=secret,
                          decoders=[f"http://127.0.0.1:{hport}/health"]))
    dep = Deployment(specs, tmp_path_factory.mktemp("front"))
    dep.start()
    yield f"http://127.0.0.1:{fport}", dep
    dep.stop()


def test_front_serves_tp2_decoder_exactly(front):
    url, dep = front
    cfg = RankSpec(role="decode").cfg
    for prompt in ("H", "~", "\n"):
        code, body = get_json(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 7})
        assert code == 200, body
        want = generate(cfg, list(prompt.encode()), 7)
        assert body["pdtool"]["token_ids"] == want
        assert body["choices"][0]["text"] == decode(want)
        assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 7, "total_tokens": 8}
    # streaming: SSE chunks add up to the same tokens
    c = complete(url, "H", max_tokens=7)
    assert c.tokens == 7 and c.text == decode(generate(cfg, [72], 7)) and c.ttft_s > 0
    # a prompt that needs KV from a prefill fails cleanly without a messenger
    code, body = get_json(f"{url}/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert code == 500 and "KV transfer failed" in body["error"]["message"]
    code, body = get_json(f"{url}/v1/completions", {"prompt": "", "max_tokens": 3})
    assert code == 400 and body["error"]["message"].startswith("prompt:")
    code, stats = get_json(dep_stats_url(dep))
    assert stats["pages_free"] == stats["pages_total"]
    assert stats["prompt_tokens_seen"] == 4  # 3 + the streamed one; "Hi" never ran


def dep_stats_url(dep: Deployment) -> str:
    s = dep.specs[0]
    return f"http://{s.host}:{s.http_port}/stats"


def test_front_health_and_models(front):
    url, _ = front
    with urllib.request.urlopen(f"{url}/health") as r:
        assert json.loads(r.read())["decode_up"] == 1
    code, models = get_json(f"{url}/v1/models")
    assert code == 200 and models["data"][0]["id"] == "reference"
