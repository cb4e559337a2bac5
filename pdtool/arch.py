"""A Hugging Face checkpoint folder's `config.json`, read into what the reference engine runs.

Torch-free and engine-neutral: composition fills `model.*` from it (`pdtool.compose`), the
reference engine loads what it describes (`engines.reference.hf`). That engine runs the
decoder-only architectures it implements exactly: Llama, Qwen2 and Qwen3 (GQA, RMSNorm,
SwiGLU, RoPE with `default`, `linear` or `llama3` scaling, Qwen2's q/k/v biases, Qwen3's
per-head q/k RMSNorm, tied embeddings). Anything else is a `CheckpointError` naming the field
of config.json, so a checkpoint the engine would compute differently from transformers never
starts.

`plan_fields` maps the same numbers onto the `model.*` config keys, so a plan of a checkpoint
folder sizes exactly the model the engine loads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")
FILES = ("config.json", "tokenizer.json")


class CheckpointError(ValueError):
    """The folder is not a checkpoint the reference engine runs; the text names the field."""


@dataclass(frozen=True)
class Arch:
    """The architecture numbers of one checkpoint (plain data: it travels in RankSpec)."""

    model_type: str
    num_layers: int
    hidden: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    rope_type: str
    rope_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_max: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tied: bool
    max_context: int
    dtype: str  # the weights' dtype as saved

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_local(path: str) -> bool:
    """`model.path` names a folder on this machine (the engine loads it), not a hub id such as
    `org/name`: the reference engine downloads nothing, and for a hub id it builds the built-in
    random-weight model in the shape the model.* keys give (as for the SGLang recipes)."""
    return bool(path) and (Path(path).expanduser().is_dir()
                           or path.startswith(("/", "./", "../", "~")))


def is_hub_id(path: str) -> bool:
    """`model.path` is a Hugging Face Hub id (`org/name`), not a folder here nor a builtin."""
    import re

    return not is_local(path) and re.fullmatch(r"[\w.-]+/[\w.-]+", path) is not None


def read_arch(path: str | Path) -> Arch:
    """The architecture of the checkpoint in `path`, or a CheckpointError naming the field."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"model.path: {str(path)!r} is not a folder")
    for name in FILES:
        if not (folder / name).is_file():
            raise CheckpointError(f"model.path: {folder} has no {name}")
    if not list(folder.glob("*.safetensors")):
        raise CheckpointError(f"model.path: {folder} has no *.safetensors weights")
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"model.path: {folder}/config.json is not JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"model.path: {folder}/config.json is not a JSON object")
    return _arch(cfg, f"{folder}/config.json")


def _arch(cfg: dict[str, Any], where: str) -> Arch:
    def get(key: str, kind: type, default: Any = None) -> Any:
        value = cfg.get(key, default)
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise CheckpointError(f"{where}: {key} must be a {kind.__name__}, got {value!r}")
        return value

    mt = cfg.get("model_type")
    if mt not in ARCHITECTURES:
        raise CheckpointError(f"{where}: model_type {mt!r} is not one the reference engine "
                              f"runs ({', '.join(ARCHITECTURES)})")
    if get("hidden_act", str, "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {cfg['hidden_act']!r}: only silu (SwiGLU)")
    if cfg.get("use_sliding_window") or (mt != "llama" and cfg.get("sliding_window")
                                          and cfg.get("use_sliding_window") is not False):
        raise CheckpointError(f"{where}: use_sliding_window: sliding-window attention is not "
                              f"implemented")
    heads = get("num_attention_heads", int)
    kv = get("num_key_value_heads", int, heads)
    hidden = get("hidden_size", int)
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = dict(cfg.get("rope_parameters") or {})
    rope.update(cfg.get("rope_scaling") or {})  # older configs: rope_theta + rope_scaling
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"{where}: rope_type {rope_type!r} is not implemented "
                              f"({', '.join(ROPE_TYPES)})")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if heads < 1 or kv < 1 or heads % kv:
        raise CheckpointError(f"{where}: num_attention_heads={heads} must be a multiple of "
                              f"num_key_value_heads={kv}")
    if head_dim % 2:
        raise CheckpointError(f"{where}: head_dim={head_dim}: RoPE rotates pairs")
    eps = get("rms_norm_eps", float, 1e-6)
    return Arch(
        model_type=mt, num_layers=get("num_hidden_layers", int), hidden=hidden,
        num_q_heads=heads, num_kv_heads=kv, head_dim=int(head_dim),
        intermediate=get("intermediate_size", int), vocab_size=get("vocab_size", int),
        rms_eps=eps, rope_theta=float(theta), rope_type=rope_type,
        rope_factor=float(rope.get("factor", 1.0)),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max=int(rope.get("original_max_position_embeddings", 8192)),
        qkv_bias=mt == "qwen2" or bool(cfg.get("attention_bias", False)),
        o_bias=mt == "llama" and bool(cfg.get("attention_bias", False)),
        mlp_bias=mt == "llama" and bool(cfg.get("mlp_bias", False)),
        qk_norm=mt == "qwen3",
        tied=bool(cfg.get("tie_word_embeddings", False)),
        max_context=get("max_position_embeddings", int, 0),
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
    )


_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def plan_fields(arch: Arch) -> dict[str, Any]:
    """`model.*` config keys of the checkpoint (what the plan sizes memory from)."""
    per_layer = (arch.hidden * arch.head_dim * (2 * arch.num_q_heads + 2 * arch.num_kv_heads)
                 + 3 * arch.hidden * arch.intermediate)
    embeds = arch.vocab_size * arch.hidden * (1 if arch.tied else 2)
    return {
        "attention": "gqa" if arch.num_kv_heads < arch.num_q_heads else "mha",
        "num_layers": arch.num_layers, "hidden_size": arch.hidden,
        "num_q_heads": arch.num_q_heads, "num_kv_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim, "intermediate_size": arch.intermediate,
        "vocab_size": arch.vocab_size, "context_length": arch.max_context or 4096,
        "dtype": _DTYPE_NAMES.get(arch.dtype, "bf16"),
        "num_params_b": (arch.num_layers * per_layer + embeds) / 1e9,
    }
