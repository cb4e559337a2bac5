"""Text ↔ token ids for the front: the built-in byte vocabulary, or a checkpoint's tokenizer.

Torch-free (the front imports it and must start fast). A checkpoint folder's `tokenizer.json` is
read with the `tokenizers` library; its `chat_template.jinja` or `tokenizer_config.json` may
carry a Jinja chat template (rendered as transformers renders it: sandboxed, trimmed blocks,
`raise_exception`), and the
end-of-sequence ids come from `generation_config.json` / `config.json`, so a chat model stops at
its end-of-turn token. The byte vocabulary has no template of its own: chat requests to it use
`DEFAULT_CHAT_TEMPLATE`, plain "role: content" lines.

Streams are decoded incrementally: the text of all ids so far, minus what was already sent,
holding back a trailing U+FFFD (a character whose bytes have not all arrived yet).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from . import tokens as byte_tokens

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class TemplateError(ValueError):
    """The chat template refused the messages (its `raise_exception`), or failed to render."""


class ByteTokenizer:
    """The reference model's vocabulary: 256 byte values and EOS."""

    vocab_size = byte_tokens.EOS + 1
    eos_ids: frozenset[int] = frozenset({byte_tokens.EOS})
    chat_template = DEFAULT_CHAT_TEMPLATE
    special: dict[str, str] = {}  # noqa: RUF012 (read-only)

    def encode(self, text: str) -> list[int]:
        return byte_tokens.encode(text)

    def decode(self, ids: list[int]) -> str:
        return byte_tokens.decode(ids)


class HFTokenizer:
    """A checkpoint folder's `tokenizer.json` (+ `tokenizer_config.json`, generation config)."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        folder = Path(folder)
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        tcfg = _read_json(folder / "tokenizer_config.json")
        jinja = folder / "chat_template.jinja"  # where recent transformers save it
        self.chat_template = (jinja.read_text() if jinja.is_file() else _template_of(tcfg)) \
            or DEFAULT_CHAT_TEMPLATE
        self.special = {k: _token_text(tcfg.get(k)) for k in ("bos_token", "eos_token")
                        if _token_text(tcfg.get(k))}
        self.eos_ids = frozenset(eos_ids(folder))
        self.add_special = True

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self.add_special).ids

    def encode_plain(self, text: str) -> list[int]:
        """Rendered chat text already holds its special tokens (transformers does the same)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(path: str) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of `model.path` ("" = the built-in byte model)."""
    return HFTokenizer(path) if path else ByteTokenizer()


def eos_ids(folder: Path) -> list[int]:
    """End-of-sequence ids a checkpoint stops at: generation_config.json, else config.json."""
    out: list[int] = []
    for name in ("generation_config.json", "config.json"):
        raw = _read_json(folder / name).get("eos_token_id")
        out += raw if isinstance(raw, list) else [] if raw is None else [raw]
        if out:
            break
    return [int(x) for x in out]


class StreamText:
    """Incremental detokenizer of one response (see the module docstring). Decodes a window
    from the last point where the text was complete, never the whole output again, so a long
    stream costs linear time: the new text is decode(window) minus decode(window's old part),
    which also keeps the spaces SentencePiece-style decoders drop at a slice's start."""

    def __init__(self, tok: ByteTokenizer | HFTokenizer) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0  # window start: text up to here was complete and sent
        self.read = 0  # ids up to here are sent

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        full = self.tok.decode(self.ids[self.prefix:])
        if not final and full.endswith("\ufffd"):  # a character's bytes still to come
            return ""
        sent = self.tok.decode(self.ids[self.prefix:self.read])
        new = full[len(sent):] if full.startswith(sent) else full
        self.prefix, self.read = self.read, len(self.ids)
        return new


def render_chat(tok: ByteTokenizer | HFTokenizer, messages: list[dict[str, Any]]) -> str:
    """The prompt text of a chat request (the generation prompt appended)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(tok.chat_template).render(
            messages=messages, add_generation_prompt=True, **tok.special)
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise TemplateError(f"the chat template failed: {exc}") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _template_of(tcfg: dict[str, Any]) -> str:
    tpl = tcfg.get("chat_template")
    if isinstance(tpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else ""


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # AddedToken serialised: {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""
