"""Tiny random Hugging Face checkpoints, built here by transformers (nothing is downloaded).

Two uses, one builder:
* `model.path=builtin:NAME` (the `sglang-local*` recipes): a real engine needs a real
  checkpoint folder, and this machine reaches no model hub. `ensure(path)` builds the named
  checkpoint once, deterministically (fixed seed, tokenizer trained on a fixed text), into
  `cache_dir()/NAME-v<BUILD>`; later runs find it there. `local_path(path)` names the folder
  without building it (validate, plan and `--dry-run` stay fast and write nothing).
* the tests: the same builder makes Llama, Qwen2, Qwen3 and DeepSeek-V2 folders, and
  transformers' `generate` on them is the oracle for every engine.

Each folder is what a user's checkpoint looks like: `config.json` and `model.safetensors` from
`save_pretrained`, a `tokenizer.json` (a small byte-level BPE) with `tokenizer_config.json`
(chat template), and `generation_config.json`. Weights are float32, so an engine run at
`--dtype float32` can be compared token for token with transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

TEXT = ("Disaggregated prefill streams KV pages layer by layer; the decoder counts writes, "
        "never waits for a done message. ünïcödé ✓ 0123456789 The quick brown fox jumps.")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 320
ARCHS = ("llama", "qwen2", "qwen3", "deepseek_v2")

#: `model.path=builtin:NAME` -> the architecture it is built as. The recipes' model keys
#: describe the same numbers (tests/test_checkpoints.py reads them back from config.json).
BUILTIN = {"tiny-llama": "llama", "tiny-deepseek-v2": "deepseek_v2"}
BUILTIN_PREFIX = "builtin:"
#: bumped whenever what a builtin name builds changes, so a stale cache folder is never reused
BUILD = 2  # 2: tiny-llama's context 1,024 -> 4,096 (2,000-token prompts in the bench)


class CheckpointBuildError(ValueError):
    """`model.path` names a builtin checkpoint that does not exist; the text lists them."""


def cache_dir() -> Path:
    """Where builtin checkpoints are kept: $PDTOOL_CACHE, else $XDG_CACHE_HOME/pdtool, else
    ~/.cache/pdtool."""
    if os.environ.get("PDTOOL_CACHE"):
        return Path(os.environ["PDTOOL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdtool"


def builtin_name(path: str) -> str | None:
    """NAME when `path` is `builtin:NAME`, else None."""
    return path[len(BUILTIN_PREFIX):] if path.startswith(BUILTIN_PREFIX) else None


def check_builtin(path: str) -> None:
    """CheckpointBuildError when `path` is `builtin:NAME` with a NAME pdtool cannot build."""
    name = builtin_name(path)
    if name is not None and name not in BUILTIN:
        raise CheckpointBuildError(f"model.path: {path!r} is not a builtin checkpoint; builtin: "
                                   f"{', '.join(BUILTIN_PREFIX + n for n in BUILTIN)}")


def local_path(path: str) -> str:
    """The folder an engine loads for `model.path`: a builtin's cache folder (not built
    here), any other value unchanged."""
    name = builtin_name(path)
    if name is None:
        return path
    check_builtin(path)
    return str(cache_dir() / f"{name}-v{BUILD}")


def ensure(path: str) -> str:
    """`local_path(path)`, built first when it is a builtin checkpoint not yet in the cache.
    Built in a temporary folder beside it and renamed, so two runs starting at once never
    see half a checkpoint."""
    folder = Path(local_path(path))
    name = builtin_name(path)
    if name is None or (folder / "config.json").is_file():
        return str(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    try:
        make_checkpoint(tmp, BUILTIN[name])
        try:
            tmp.rename(folder)
        except OSError:  # another run finished first: its folder is the same checkpoint
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


def tokenizer_files(folder: Path) -> int:
    """Train a byte-level BPE on TEXT, save tokenizer.json + tokenizer_config.json; returns
    the end-of-turn id (<|im_end|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT] * 4, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tok.token_to_id("<|im_end|>")


def _config(arch: str, eos: int) -> tuple[Any, type]:
    """The transformers config and model class of a tiny `arch`."""
    import transformers as tf

    common: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "eos_token_id": eos, "initializer_range": 0.2}
    if arch == "llama":  # Llama 3.1's RoPE scaling, untied head; room for 2,000-token prompts
        common["max_position_embeddings"] = 4096
        return tf.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            "rope_theta": 500000.0}), tf.LlamaForCausalLM
    if arch == "qwen2":  # q/k/v biases, tied embeddings
        return tf.Qwen2Config(**common, tie_word_embeddings=True), tf.Qwen2ForCausalLM
    if arch == "qwen3":  # per-head q/k norms, head_dim != hidden / heads
        return (tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True),
                tf.Qwen3ForCausalLM)
    if arch == "deepseek_v2":
        # MLA (one latent KV "head" of kv_lora_rank + qk_rope_head_dim), every layer dense
        # (first_k_dense_replace = layers). SGLang 0.5.23's CPU rotary embedding takes only
        # DeepSeek's yarn (layers/rotary_embedding/factory.py), so yarn with factor 1.0: the
        # plain RoPE, in the form both sides read. SGLang's DeepSeek model also reads the MoE
        # layout keys (models/deepseek_v2.py) even for dense layers: they are written out.
        common.update(num_key_value_heads=4, first_k_dense_replace=2, kv_lora_rank=32,
                      q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16,
                      v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, n_shared_experts=1,
                      rope_parameters={"rope_type": "yarn", "factor": 1.0,
                                       "original_max_position_embeddings": 1024,
                                       "rope_theta": 10000.0, "beta_fast": 32,
                                       "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
        cfg = tf.DeepseekV2Config(**common)
        cfg.eos_token_id = eos  # the constructor keeps DeepSeek's own default
        cfg.moe_layer_freq = 1
        cfg.topk_method = "greedy"
        cfg.scoring_func = "softmax"
        cfg.n_group = 1
        cfg.topk_group = 1
        return cfg, tf.DeepseekV2ForCausalLM
    raise ValueError(f"unknown architecture {arch!r} (one of {', '.join(ARCHS)})")


def make_checkpoint(folder: Path, arch: str, seed: int = 0) -> Path:
    """A tiny `arch` checkpoint in `folder` (see ARCHS), float32, from `seed`."""
    import torch

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    eos = tokenizer_files(folder)
    cfg, cls = _config(arch, eos)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # norms away from 1 and biases away from 0: they must matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(str(folder))
    return folder
