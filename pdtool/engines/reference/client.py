"""A minimal OpenAI `/v1/completions` streaming client that measures TTFT and TPOT.

Used by `pdtool launch --smoke`: it only speaks the OpenAI wire format (SSE `data:` lines), so
it works against the reference front and an SGLang router alike. Times are measured here, on
the client, from sending the request to each chunk that carries text.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass
class Completion:
    text: str
    tokens: int  # chunks that carried text (one token each with the reference engine)
    ttft_s: float
    tpot_s: float | None
    total_s: float

    def summary(self) -> str:
        tpot = f"{self.tpot_s * 1000:.1f} ms" if self.tpot_s is not None else "n/a"
        return (f"{self.tokens} tokens, TTFT {self.ttft_s * 1000:.1f} ms, TPOT {tpot}, "
                f"total {self.total_s * 1000:.1f} ms")


class SmokeError(RuntimeError):
    """The deployment did not answer a completion; the text says what happened."""


def complete(base_url: str, prompt: str, max_tokens: int = 32, model: str = "reference",
             timeout_s: float = 120.0) -> Completion:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "stream": True}).encode()
    req = urllib.request.Request(f"{base_url.rstrip('/')}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps: list[float] = []
    parts: list[str] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            for raw in resp:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise SmokeError(f"the front answered an error: {chunk['error']}")
                text = chunk["choices"][0].get("text", "")
                n = len(chunk.get("pdtool", {}).get("token_ids", [])) or (1 if text else 0)
                stamps += [time.perf_counter()] * n
                parts.append(text)
    except urllib.error.HTTPError as exc:
        raise SmokeError(f"HTTP {exc.code} from {req.full_url}: "
                         f"{exc.read().decode(errors='replace')[:300]}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise SmokeError(f"no answer from {req.full_url}: {exc}") from None
    end = time.perf_counter()
    if not stamps:
        raise SmokeError("the completion carried no tokens")
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return Completion("".join(parts), len(stamps), stamps[0] - t0, tpot, end - t0)


DEFAULT_SMOKE_PROMPT = "Disaggregated serving: prefill streams KV pages to the decoder, and"
SMOKE_MAX_TOKENS = 32


#: a checkpoint larger than this is not loaded a second time, in the launcher, to check the smoke
ORACLE_MAX_PARAMS_B = 1.0


@dataclass
class Oracle:
    """What the reference engine's model returns for the smoke prompt, computed in-process by
    the plain single-pass path (`oracle.generate`): every deployment of it must match."""

    text: str
    prompt_tokens: int
    random_weights: bool  # the built-in model (model.seed): the text is noise, exact all the same


def reference_oracle(plan: Any, prompt: str, max_tokens: int) -> Oracle | str:
    """The in-process greedy completion of `prompt`, or why it is not computed."""
    texts = oracle_texts(plan, [prompt], max_tokens)
    if isinstance(texts, str):
        return texts
    (text, n), = texts
    return Oracle(text, n, not plan.model.path)


def oracle_texts(plan: Any, prompts: list[str] | list[list[int]],
                 max_tokens: int | list[int]) -> list[tuple[str, int]] | str:
    """(greedy completion text, prompt tokens) of each prompt (text, or token ids), computed
    in-process by the model's plain single-pass path (`oracle.generate`), with the tokenizer
    the front decodes with; or why it is not computed (a checkpoint too large to load twice)."""
    from .fromplan import model_fields
    from .models import build_model, model_config
    from .oracle import generate
    from .tokenizer import ByteTokenizer, load_tokenizer

    if plan.model.path and plan.model.num_params_b > ORACLE_MAX_PARAMS_B:
        return (f"not checked: a {plan.model.num_params_b:g} B-parameter checkpoint is not "
                f"loaded a second time here")
    inst = plan.role_instances("decode")[0] if plan.role_instances("decode") \
        else plan.instances[0]
    mcfg = model_config(model_fields(plan.model, inst.kv_dtype, inst.role))
    tok = load_tokenizer(plan.model.path) if plan.model.path else ByteTokenizer()
    model = build_model(mcfg)
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    out = []
    for prompt, limit in zip(prompts, limits, strict=True):
        ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        out.append((tok.decode(generate(mcfg, ids, limit, model=model)), len(ids)))
    return out


def smoke(base_url: str, prompt: str = DEFAULT_SMOKE_PROMPT, max_tokens: int = SMOKE_MAX_TOKENS,
          model: str = "reference", out: Any = None, oracle: Oracle | str | None = None) -> int:
    """`pdtool launch --smoke`: one streamed completion through the router; prints the text with
    TTFT and TPOT and, given the `oracle` (`reference_oracle`), whether the text is the model's
    own greedy output. Returns 0, or 1 after printing why it failed."""
    out = out or sys.stdout
    length = f"{oracle.prompt_tokens} prompt tokens, " if isinstance(oracle, Oracle) else ""
    print(f"smoke: prompt {prompt!r} ({length}max_tokens {max_tokens}) -> "
          f"{base_url}/v1/completions", file=out, flush=True)
    try:
        c = complete(base_url, prompt, max_tokens, model)
    except SmokeError as exc:
        print(f"pdtool: ERROR: smoke request failed: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"smoke: generated {c.text!r}", file=out)
    print(f"smoke: {c.summary()}", file=out, flush=True)
    if isinstance(oracle, Oracle):
        if c.text != oracle.text:
            pairs = zip(c.text, oracle.text, strict=False)  # the first character that differs
            at = next((i for i, (a, b) in enumerate(pairs) if a != b),
                      min(len(c.text), len(oracle.text)))
            print(f"pdtool: ERROR: smoke output differs from the model's own greedy output "
                  f"from character {at}: served {c.text[at:at + 20]!r}, expected "
                  f"{oracle.text[at:at + 20]!r} (KV corrupted in transfer?)", file=sys.stderr,
                  flush=True)
            return 1
        noise = (" (random weights, model.seed: the text is noise, but exactly the model's)"
                 if oracle.random_weights else "")
        print(f"smoke: checked: the text equals the model's greedy output computed in this "
              f"process{noise}", file=out, flush=True)
    elif oracle:
        print(f"smoke: {oracle}", file=out, flush=True)
    return 0
