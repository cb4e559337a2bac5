"""Tiny random Hugging Face checkpoints, built by transformers in a folder (nothing downloaded).

Each folder is what a user's checkpoint looks like: `config.json` and `model.safetensors` from
`save_pretrained`, a `tokenizer.json` (a small byte-level BPE trained here with `tokenizers`),
`tokenizer_config.json` with a chat template, and `generation_config.json`. `greedy` is the
oracle: transformers' own `generate`, float64, no sampling.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEXT = ("Disaggregated prefill streams KV pages layer by layer; the decoder counts writes, "
        "never waits for a done message. ünïcödé ✓ 0123456789 The quick brown fox jumps.")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 320


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


def make_checkpoint(folder: Path, arch: str, seed: int = 0) -> Path:
    """A tiny `arch` (llama | qwen2 | qwen3) checkpoint in `folder`."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    folder.mkdir(parents=True, exist_ok=True)
    eos = tokenizer_files(folder)
    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 1024, "eos_token_id": eos, "initializer_range": 0.2}
    if arch == "llama":  # Llama 3.1's RoPE scaling, untied head
        cfg = LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            "rope_theta": 500000.0})
        cls = LlamaForCausalLM
    elif arch == "qwen2":  # q/k/v biases, tied embeddings
        cfg = Qwen2Config(**common, tie_word_embeddings=True)
        cls = Qwen2ForCausalLM
    elif arch == "qwen3":  # per-head q/k norms, head_dim != hidden / heads
        cfg = Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
        cls = Qwen3ForCausalLM
    else:
        raise ValueError(arch)
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


def greedy(folder: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy `generate`, stopped (and cut) at the end-of-sequence id."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64)
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    eos = set(model.generation_config.eos_token_id if isinstance(
        model.generation_config.eos_token_id, list) else [model.generation_config.eos_token_id])
    for i, t in enumerate(new):
        if t in eos:
            return new[:i]
    return new


def deployment(folder: Path | None, tmp: Path, prefill_tp: int = 1, decode_tp: int = 1,
               provider: str = "shm", chunk: int = 16, name: str = "tiny-hf",
               layout: str = "HND"):
    """A RankSpec deployment (prefill instance, one decode instance, front) serving the
    checkpoint in `folder` (None: the built-in tiny model); returns (Deployment, front URL,
    leaders' base URLs, prefill first)."""
    from pdtool.engines.reference.local import Deployment, free_port, new_secret
    from pdtool.engines.reference.spec import RankSpec

    secret = new_secret()
    model = {"path": str(folder)} if folder else {}
    p_dist, p_http, d_dist, d_http, f_http = (free_port() for _ in range(5))
    mess = {"provider": provider, "prefill_tp": prefill_tp, "decode_tp": decode_tp,
            "timeout_s": 60.0, "prefill": [{"health": f"http://127.0.0.1:{p_http}/health"}]}
    common = {"secret_hex": secret, "messenger": mess, "model": model, "page_size": 4,
              "chunk": chunk, "num_pages": 1024, "layout": layout}
    specs = [RankSpec(role="prefill", tp=prefill_tp, rank=r, dist_port=p_dist,
                      http_port=p_http, **common) for r in range(prefill_tp)]
    specs += [RankSpec(role="decode", tp=decode_tp, rank=r, dist_port=d_dist, http_port=d_http,
                       **common) for r in range(decode_tp)]
    specs.append(RankSpec(role="front", http_port=f_http, secret_hex=secret, model_name=name,
                          tokenizer=str(folder or ""),
                          decoders=[f"http://127.0.0.1:{d_http}/health"]))
    dep = Deployment(specs, tmp)
    dep.start()
    return dep, f"http://127.0.0.1:{f_http}", [f"http://127.0.0.1:{u}" for u in (p_http, d_http)]
