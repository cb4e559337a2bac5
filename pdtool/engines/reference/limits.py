"""What the reference CPU engine can run, as pure checks (no torch: `pdtool validate` uses them).

The same checks guard the worker at start-up (fromplan), so a config that validates clean never
fails inside the engine, and a plan edited by hand still gets a message naming the key.
"""

from __future__ import annotations

from typing import Any

#: plan/config KV dtypes the engine has CPU kernels for, and their torch names
TORCH_KV_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def model_problems(model: Any, kv_dtype: str, role: str) -> list[tuple[str, str]]:
    """(config key, problem) pairs for the model and one role's KV dtype."""
    out: list[tuple[str, str]] = []
    if model.vocab_size != 256:
        out.append(("model.vocab_size",
                    f"the reference engine is byte-level (256), got {model.vocab_size}"))
    if kv_dtype not in TORCH_KV_DTYPES:
        out.append((f"{role}.kv_dtype",
                    f"the reference engine supports {sorted(TORCH_KV_DTYPES)}, got {kv_dtype!r}"))
    mla = model.attention == "mla"
    if mla and model.kv_lora_rank < 1:
        out.append(("model.kv_lora_rank",
                    f"an MLA model needs a latent width >= 1, got {model.kv_lora_rank}"))
    rope = model.qk_rope_head_dim if mla else model.head_dim
    if rope < 2 or rope % 2:
        key = "model.qk_rope_head_dim" if mla else "model.head_dim"
        out.append((key, f"RoPE rotates pairs, needs an even width >= 2, got {rope}"))
    return out


def instance_problems(model: Any, inst: Any, role: str) -> list[tuple[str, str]]:
    """(config key, problem) pairs for one role's parallelism and chunking."""
    out: list[tuple[str, str]] = []
    if inst.dp != 1:
        out.append((f"{role}.dp", f"the reference engine runs dp=1, got {inst.dp}"))
    if inst.chunked_prefill_size % inst.page_size:
        out.append((f"{role}.chunked_prefill_size",
                    f"{inst.chunked_prefill_size} is not a multiple of "
                    f"{role}.page_size={inst.page_size}"))
    if inst.tp < 1 or model.num_q_heads % inst.tp or model.intermediate_size % inst.tp:
        out.append((f"{role}.tp",
                    f"tp={inst.tp} must divide model.num_q_heads={model.num_q_heads} and "
                    f"model.intermediate_size={model.intermediate_size}"))
    return out
