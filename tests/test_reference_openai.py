"""The OpenAI surface of the front, through the official `openai` client, on a live deployment
serving a checkpoint folder (a tiny random Qwen3 with a BPE tokenizer and a chat template).

Completions and chat completions, streamed and not, equal transformers' greedy output on the
same folder (the chat prompt rendered by transformers' own `apply_chat_template`); token-id
prompts, stop strings, seeded sampling, usage and /v1/models; unsupported options refused with
a 400 naming the field; hostile bodies (malformed JSON, wrong types, huge values, deep nesting,
lone surrogates, NaN) refused, and an ordinary request still served after each.
"""

from __future__ import annotations

import http.client
import json

import openai
import pytest
from helpers.hf_checkpoints import deployment, greedy, make_checkpoint

from pdtool.engines.reference.tokenizer import HFTokenizer

NAME = "tiny-qwen3"
PROMPT = "The quick brown fox streams KV pages"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Where do the KV pages go?"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai")
    folder = make_checkpoint(tmp / "qwen3", "qwen3")
    dep, url, _ = deployment(folder, tmp / "dep", 1, 1, "shm", name=NAME)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield {"client": client, "url": url, "folder": folder, "tok": HFTokenizer(folder)}
    dep.stop()


def _oracle(live, prompt: list[int], n: int) -> str:
    return live["tok"].decode(greedy(live["folder"], prompt, n))


def _chat_prompt(live) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(live["folder"]))
    out = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _ordinary(live) -> None:
    c = live["client"].completions.create(model=NAME, prompt=PROMPT, max_tokens=4,
                                          temperature=0)
    assert c.choices[0].text == _oracle(live, live["tok"].encode(PROMPT), 4)


@pytest.mark.slow
def test_completions_whole_and_streamed(live):
    client, tok = live["client"], live["tok"]
    want = _oracle(live, tok.encode(PROMPT), 10)
    c = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    assert c.choices[0].text == want and c.model == NAME
    assert c.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert c.usage.completion_tokens == len(c.model_extra["pdtool"]["token_ids"])
    parts = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == want
    assert parts[-1].usage.total_tokens == c.usage.total_tokens
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] in ("length", "stop")
    ids = tok.encode("fox")  # a prompt given as token ids
    c = client.completions.create(model=NAME, prompt=ids, max_tokens=5, temperature=0)
    assert c.choices[0].text == _oracle(live, ids, 5)


def test_chat_uses_the_checkpoints_template(live):
    client = live["client"]
    want = _oracle(live, _chat_prompt(live), 8)
    c = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8,
                                       temperature=0)
    assert c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == want
    assert c.usage.prompt_tokens == len(_chat_prompt(live))
    parts = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8,
                                                temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == want


def test_stop_strings_cut_the_text(live):
    client, tok = live["client"], live["tok"]
    full = _oracle(live, tok.encode(PROMPT), 16)
    stop = full[5:8]
    assert stop and full.find(stop) >= 0
    c = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                  stop=[stop, "never appears"])
    assert c.choices[0].text == full[: full.find(stop)]
    assert c.choices[0].finish_reason == "stop"
    parts = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16,
                                           temperature=0, stop=stop, stream=True))
    assert "".join(p.choices[0].text for p in parts) == full[: full.find(stop)]
    assert parts[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats_and_differs_from_greedy(live):
    client = live["client"]

    def sample(seed: int) -> str:
        return client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12,
                                         temperature=1.5, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    greedy_text = _oracle(live, live["tok"].encode(PROMPT), 12)
    assert {sample(s) for s in (1, 2, 3)} != {greedy_text}


def test_models_lists_the_served_name(live):
    models = live["client"].models.list()
    assert [m.id for m in models.data] == [NAME]
    assert live["client"].models.retrieve(NAME).id == NAME


@pytest.mark.parametrize(("extra", "field"), [
    ({"n": 2}, "n"),
    ({"logprobs": 2}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"best_of": 3}, "best_of"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"suffix": "x"}, "suffix"),
])
def test_unsupported_options_are_a_400_naming_the_field(live, extra, field):
    with pytest.raises(openai.BadRequestError) as err:
        live["client"].completions.create(model=NAME, prompt=PROMPT, max_tokens=2, **extra)
    assert err.value.body["message"].startswith(f"{field}:"), err.value.body


def test_unsupported_chat_options_are_refused(live):
    client = live["client"]
    for extra, field in (({"n": 3}, "n"), ({"logprobs": True}, "logprobs"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}]},
                          "tools")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2,
                                           **extra)
        assert err.value.body["message"].startswith(f"{field}:"), err.value.body


def _post(url: str, path: str, body: bytes) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


HOSTILE = [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 3', "body"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": NaN}', "body"),
    ("/v1/completions", b'{"prompt": {"a": 1}}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 1000000000000000000000}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e308}', "temperature"),
    ("/v1/completions", b'{"prompt": "x", "top_p": 0}', "top_p"),
    ("/v1/completions", b'{"prompt": "x", "seed": "7"}', "seed"),
    ("/v1/completions", b'{"prompt": "x", "stop": [1, 2]}', "stop"),
    ("/v1/completions", b'{"prompt": "\\ud800 lone surrogate"}', "prompt"),
    ("/v1/completions", b'{"prompt": [99999999]}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "stream_options": {"include_usage": true}}',
     "stream_options"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body"),
    ("/v1/chat/completions", b'{"messages": []}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}',
     "messages[0].role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}',
     "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": '
     b'"image_url", "image_url": {"url": "x"}}]}]}', "messages[0].content[0]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user",
                                                       "content": "x" * 900_000}]}).encode(),
     "messages"),
]


@pytest.mark.parametrize(("path", "body", "field"), HOSTILE)
def test_hostile_bodies_fail_alone(live, path, body, field):
    code, reply = _post(live["url"], path, body)
    assert code == 400, reply
    assert reply["error"]["message"].startswith(f"{field}:"), reply
    _ordinary(live)


def test_unicode_edge_cases_round_trip(live):
    """Combining marks, emoji with joiners, RTL text and NUL are ordinary prompts."""
    tok = live["tok"]
    for text in ("e\u0301\u0301", "👩‍👩‍👧 ✓", "שלום عربى", "a\x00b"):
        c = live["client"].completions.create(model=NAME, prompt=text, max_tokens=3,
                                              temperature=0)
        assert c.choices[0].text == _oracle(live, tok.encode(text), 3)
