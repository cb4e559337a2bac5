"""The load generator: streamed OpenAI completions at a fixed concurrency or arrival rate.

Uses the official `openai` async client (one HTTP connection per request in flight, no
retries: a failed request is a measured failure, not a hidden second try). Each request's
chunk arrival times are stamped on one monotonic clock as the client yields them. Token counts
per chunk come from the server when it says (the reference front's `pdtool.token_ids`, or the
final `usage` SGLang sends with `stream_options.include_usage`), else one per text chunk.

`--concurrency N` keeps N requests in flight (closed loop); `--rate R` sends at Poisson arrival
times of mean rate R per second (open loop, seeded), however many are in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdtool.bench.args import Pace
from pdtool.bench.stats import Record


class LoadError(RuntimeError):
    """The target cannot be benchmarked (unreachable, no model); the text says which and why."""


@dataclass(frozen=True)
class Request:
    # token ids, or their text where the front takes no ids (sglang-router: `text_prompts`)
    prompt: list[int] | str
    max_tokens: int


def client(url: str, timeout_s: float) -> Any:
    try:
        import httpx
        import openai
    except ImportError as exc:  # the `load` extra
        raise LoadError(f"pdtool bench needs the openai client ({exc.name} is missing): "
                        "pip install 'pdtool[load]'") from None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return openai.AsyncOpenAI(
        base_url=f"{url.rstrip('/')}/v1", api_key="unused", max_retries=0,
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        http_client=openai.DefaultAsyncHttpxClient(limits=limits))


async def served_model(api: Any, url: str) -> str:
    """The first model the server lists (what requests must name)."""
    import openai

    try:
        page = await api.models.list()
    except openai.APIConnectionError:
        raise LoadError(f"no deployment answers at {url} (is it running? --launch starts "
                        "one; --url points elsewhere)") from None
    except openai.APIStatusError as exc:
        raise LoadError(f"{url}/v1/models answered HTTP {exc.status_code}") from None
    if not page.data:
        raise LoadError(f"{url}/v1/models lists no model")
    return page.data[0].id


#: sglang-router refuses token-id prompts (HTTP 422, "prompt: data did not match any variant
#: of untagged enum StringOrArray at line 1 column N", a column per request); the bench sends
#: ids when its config names the reference engine, e.g. `--url` without the overrides
TEXT_ONLY_FRONT = ("HTTP 422: the front takes text prompts, not token ids (sglang-router): "
                   "give the bench the deployment's overrides (engine=sglang, e.g. "
                   "+recipe=sglang-local) or --job DIR")


def _chunk_tokens(chunk: Any) -> int:
    extra = getattr(chunk, "model_extra", None) or {}
    ids = (extra.get("pdtool") or {}).get("token_ids")
    if ids is not None:
        return len(ids)
    return 1 if chunk.choices and chunk.choices[0].text else 0


async def one(api: Any, model: str, req: Request, clock: Callable[[], float]) -> Record:
    """Send one streamed completion; the record says what happened, errors included."""
    import openai

    rec = Record(start=clock(),
                 input_tokens=len(req.prompt) if isinstance(req.prompt, list) else 0)
    try:
        stream = await api.completions.create(
            model=model, prompt=req.prompt, max_tokens=req.max_tokens, stream=True,
            temperature=0.0, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        usage = None
        last_choice = None  # arrival of the last chunk with a choice, text or not
        async for chunk in stream:
            n = _chunk_tokens(chunk)
            if chunk.choices:
                last_choice = clock()
            if n:
                rec.stamps.append(last_choice or clock())
                rec.tokens.append(n)
            if getattr(chunk, "usage", None) is not None:
                usage = chunk.usage.completion_tokens
                rec.input_tokens = chunk.usage.prompt_tokens or rec.input_tokens
        rec.end = clock()
        if usage and not rec.tokens and last_choice is not None:
            # tokens whose text is empty (a partial UTF-8 sequence the server holds back):
            # they arrived with the last choice, the usage says how many
            rec.stamps, rec.tokens = [last_choice], [usage]
        elif usage is not None and rec.tokens and usage != sum(rec.tokens):
            rec.tokens[-1] += usage - sum(rec.tokens)  # the server's count is the truth
        if not rec.stamps:
            rec.error = "the response carried no tokens"
    except openai.APIStatusError as exc:
        rec.error = f"HTTP {exc.status_code}: {_message(exc)}"
        if exc.status_code == 422 and isinstance(req.prompt, list) and \
                "StringOrArray" in rec.error:
            rec.error = TEXT_ONLY_FRONT
    except openai.APIError as exc:  # an error event in the stream, connection loss, timeout
        rec.error = f"{type(exc).__name__}: {_message(exc)}"
    if rec.end is None:
        rec.end = clock()
    return rec


def _message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"][:200]
    return str(getattr(exc, "message", exc))[:200]


async def drive(api: Any, model: str, requests: Sequence[Request], pace: Pace, seed: int,
                on_done: Callable[[Record], None] | None = None) -> list[Record]:
    """Run `requests` at `pace`; records in request order."""
    clock = time.perf_counter
    out: list[Record | None] = [None] * len(requests)

    async def send(i: int) -> None:
        out[i] = rec = await one(api, model, requests[i], clock)
        if on_done is not None:
            on_done(rec)

    if pace.concurrency:
        queue = iter(range(len(requests)))

        async def worker() -> None:
            for i in queue:  # one shared iterator: each index is taken once
                await send(i)

        await asyncio.gather(*(worker() for _ in range(min(pace.concurrency, len(requests)))))
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.exponential(1.0 / float(pace.rate), len(requests))
        t0 = clock()
        due = t0 + np.cumsum(gaps) - gaps[0]  # the first request goes at once
        tasks = []
        for i, when in enumerate(due):
            delay = when - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(i)))
        await asyncio.gather(*tasks)
    return [r for r in out if r is not None]
