"""The OpenAI request bodies the front accepts, checked field by field, and its response bodies.

`/v1/completions` and `/v1/chat/completions` as the official clients send them. Every refusal
is a `BadRequest` whose text starts with the field's name (`prompt: ...`, `messages[1].role:
...`), so a user sees what to change. Fields the engine cannot honour are refused, never
silently ignored: several choices (`n`, `best_of`), log-probabilities, `echo`, `suffix`,
`logit_bias`, penalties, tools, structured output. Fields with no effect on the result
(`user`, `metadata`) are accepted.

Torch-free: the front imports it.
"""

from __future__ import annotations

import json
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .tokenizer import ByteTokenizer, HFTokenizer, TemplateError, render_chat
from .wire import MAX_PROMPT

MAX_NEW_TOKENS = 1 << 16  # the wire's bound; the context usually binds first
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP = 4
ROLES = ("system", "developer", "user", "assistant", "tool")

# (field, value it may have): anything else is refused with "not supported"
_UNSUPPORTED_COMMON = {
    "n": (None, 1),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
}
_UNSUPPORTED = {
    "completions": {**_UNSUPPORTED_COMMON, "best_of": (None, 1), "logprobs": (None, 0),
                    "echo": (None, False), "suffix": (None, "")},
    "chat": {**_UNSUPPORTED_COMMON, "logprobs": (None, False), "top_logprobs": (None, 0),
             "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
             "function_call": (None, "none"), "parallel_tool_calls": (None, False, True),
             "response_format": (None, {"type": "text"}), "audio": (None,),
             "modalities": (None, ["text"]), "prediction": (None,)},
}


class BadRequest(ValueError):
    """A request the front refuses with HTTP 400; the text names the field."""


@dataclass
class GenRequest:
    """One checked request, ready for the dispatcher."""

    tokens: list[int]
    max_tokens: int | None  # None: what the context leaves after the prompt
    stream: bool = False
    model: str = ""
    chat: bool = False
    stop: list[str] = field(default_factory=list)
    sampling: dict[str, Any] | None = None  # None: greedy
    include_usage: bool = False

    def fit(self, context: int) -> int:
        """`max_tokens` checked against the context (prompt + new tokens); returns it."""
        n = len(self.tokens)
        if n >= context:
            raise BadRequest(f"prompt: {n} tokens leave no room in the context of {context} "
                             f"tokens (prompt + max_tokens)")
        left = context - n
        if self.max_tokens is None:
            self.max_tokens = min(left, MAX_NEW_TOKENS)
        elif self.max_tokens > left:
            raise BadRequest(f"max_tokens: {self.max_tokens} is more than the {left} tokens "
                             f"the context of {context} leaves after the {n}-token prompt")
        return self.max_tokens


def _reject_constant(name: str) -> None:
    raise BadRequest(f"body: {name} is not a JSON number")


def load_body(body: bytes) -> dict[str, Any]:
    try:
        req = json.loads(body or b"{}", parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"body: not valid JSON ({exc.msg})") from None
    except UnicodeDecodeError:
        raise BadRequest("body: not valid JSON (not UTF-8/16/32 text)") from None
    except RecursionError:
        raise BadRequest("body: JSON nested too deeply") from None
    if not isinstance(req, dict):
        raise BadRequest("body: expected a JSON object")
    return req


def parse_request(body: bytes, tok: ByteTokenizer | HFTokenizer | None = None,
                  chat: bool = False) -> GenRequest:
    """Check a /v1/completions (or, with `chat`, /v1/chat/completions) body."""
    tok = tok or ByteTokenizer()
    req = load_body(body)
    kind = "chat" if chat else "completions"
    for name, allowed in _UNSUPPORTED[kind].items():
        if name in req and not _is_one_of(req[name], allowed):
            raise BadRequest(f"{name}: {_show(req[name])} is not supported by the reference "
                             f"engine (allowed: {', '.join(_show(a) for a in allowed)})")
    if chat:
        tokens = _chat_tokens(req.get("messages"), tok)
        max_tokens = req.get("max_completion_tokens", req.get("max_tokens"))
        name = "max_completion_tokens" if "max_completion_tokens" in req else "max_tokens"
    else:
        tokens = _prompt_tokens(req.get("prompt"), tok)
        max_tokens = req.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
        name = "max_tokens"
    if max_tokens is not None and not _int_in(max_tokens, 1, MAX_NEW_TOKENS):
        raise BadRequest(f"{name}: expected an integer in [1, {MAX_NEW_TOKENS}]")
    stream = req.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("stream: expected true or false")
    model = req.get("model", "")
    if not isinstance(model, str):
        raise BadRequest("model: expected a string")
    return GenRequest(tokens=tokens, max_tokens=max_tokens, stream=stream, model=model,
                      chat=chat, stop=_stop(req.get("stop")), sampling=_sampling(req),
                      include_usage=_include_usage(req.get("stream_options"), stream))


def _prompt_tokens(prompt: Any, tok: ByteTokenizer | HFTokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens = tok.encode(_text(prompt, "prompt"))
    elif isinstance(prompt, list) and all(_int_in(t, 0, tok.vocab_size - 1) for t in prompt):
        tokens = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise BadRequest("prompt: several prompts in one request are not supported (send one "
                         "request per prompt)")
    else:
        raise BadRequest(f"prompt: expected a string or a list of token ids "
                         f"(0..{tok.vocab_size - 1})")
    if not tokens:
        raise BadRequest("prompt: must not be empty")
    if len(tokens) > MAX_PROMPT:
        raise BadRequest(f"prompt: {len(tokens)} tokens, the engine takes at most {MAX_PROMPT}")
    return tokens


def _chat_tokens(messages: Any, tok: ByteTokenizer | HFTokenizer) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: expected a non-empty list of {role, content} objects")
    plain = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where}: expected an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role: expected one of {', '.join(ROLES)}")
        plain.append({"role": role, "content": _content(m.get("content"), f"{where}.content")})
    try:
        text = render_chat(tok, plain)
    except TemplateError as exc:
        raise BadRequest(f"messages: {exc}") from None
    encode = getattr(tok, "encode_plain", tok.encode)
    tokens = encode(text)
    if not tokens:
        raise BadRequest("messages: the chat template rendered an empty prompt")
    if len(tokens) > MAX_PROMPT:
        raise BadRequest(f"messages: {len(tokens)} tokens, the engine takes at most "
                         f"{MAX_PROMPT}")
    return tokens


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return _text(content, where)
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str
            ):
                raise BadRequest(f"{where}[{j}]: only text parts ({{type: text, text: ...}}) "
                                 f"are supported")
            out.append(_text(part["text"], f"{where}[{j}].text"))
        return "".join(out)
    raise BadRequest(f"{where}: expected a string or a list of text parts")


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(
        isinstance(s, str) and s for s in stop
    ):
        raise BadRequest(f"stop: expected a non-empty string or a list of up to {MAX_STOP}")
    return [_text(s, "stop") for s in stop]


def _sampling(req: dict[str, Any]) -> dict[str, Any] | None:
    temp = req.get("temperature")
    temp = 0.0 if temp is None else temp  # greedy unless asked: the same prompt, the same text
    if not _num_in(temp, 0.0, 2.0):
        raise BadRequest("temperature: expected a number in [0, 2]")
    top_p = req.get("top_p")
    top_p = 1.0 if top_p is None else top_p
    if not _num_in(top_p, 0.0, 1.0) or top_p == 0:
        raise BadRequest("top_p: expected a number in (0, 1]")
    seed = req.get("seed")
    if seed is not None and not _int_in(seed, -(1 << 63), (1 << 63) - 1):
        raise BadRequest("seed: expected a 64-bit integer")
    if temp == 0:
        return None
    seed = secrets.randbits(63) if seed is None else seed % (1 << 63)
    return {"temperature": float(temp), "top_p": float(top_p), "seed": seed}


def _include_usage(opts: Any, stream: bool) -> bool:
    if opts is None:
        return False
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise BadRequest("stream_options: expected {include_usage: true|false}")
    if not stream:
        raise BadRequest("stream_options: only allowed with stream: true")
    return opts.get("include_usage", False)


def _text(s: str, where: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{where}: not valid Unicode (a lone surrogate)") from None
    return s


def _int_in(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _num_in(v: Any, lo: float, hi: float) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and \
        lo <= v <= hi


def _is_one_of(v: Any, allowed: tuple) -> bool:
    return any(v is None if a is None else v == a and isinstance(v, bool) == isinstance(a, bool)
               for a in allowed)


def _show(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


# -- responses ------------------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(req: GenRequest, n: int) -> dict[str, int]:
    p = len(req.tokens)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def whole(req: GenRequest, rid: str, model: str, text: str, finish: str, n: int,
          extra: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed response body."""
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(req, n), "pdtool": extra}


def chunk(req: GenRequest, rid: str, model: str, text: str | None, finish: str | None,
          extra: dict[str, Any] | None = None, first: bool = False) -> dict[str, Any]:
    """One streamed chunk (`text` None: the usage-only chunk has no choices)."""
    body: dict[str, Any] = {"id": rid, "created": int(time.time()), "model": model,
                            "object": "chat.completion.chunk" if req.chat else "text_completion"}
    if text is None:
        body["choices"] = []
    elif req.chat:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        body["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish,
                            "logprobs": None}]
    else:
        body["choices"] = [{"index": 0, "text": text, "finish_reason": finish,
                            "logprobs": None}]
    if extra is not None:
        body["pdtool"] = extra
    return body
