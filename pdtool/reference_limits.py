"""What the reference CPU engine can run, as pure checks (no torch: `pdtool validate` uses them).

The same checks guard the worker at start-up (fromplan), so a config that validates clean never
fails inside the engine, and a plan edited by hand still gets a message naming the key.
"""

from __future__ import annotations

from typing import Any

#: plan/config KV dtypes the engine has CPU kernels for, and their torch names
TORCH_KV_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: the messenger's hidden-state rows per rank (link.py): a prefill instance holds at most this
#: many requests at once (its default `max_running_requests`), a decode rank this many transfers
AUX_ROWS = 256
#: requests a decode (or aggregated) instance runs at once with max_running_requests=0
DEFAULT_MAX_RUNNING = 64
#: on cluster.device=cuda the engine's GQA/MHA decode attention is FlashInfer's paged decode over
#: HND pages: the KV dtypes it reads and the head dims its kernels are built for (FlashInfer's
#: `include/flashinfer/utils.cuh` dispatches 64, 128 and 256; vLLM's FlashInfer backend lists
#: the same three)
FLASHINFER_KV_DTYPES = ("fp16", "bf16")
FLASHINFER_HEAD_DIMS = (64, 128, 256)
#: KV pages one rank allocates at most, whatever the memory budget says: the CPU engine needs
#: far less than a GPU's budget, and this keeps its processes small (the plan shows the cap)
MAX_KV_PAGES = 4096


def checkpoint_problems(model: Any) -> list[tuple[str, str]]:
    """`model.path`: a checkpoint folder the engine runs, whose config.json the model.* keys
    agree with (the plan sizes memory from the keys, the engine loads the folder)."""
    from pdtool.arch import CheckpointError, plan_fields, read_arch

    try:
        fields = plan_fields(read_arch(model.path))
    except CheckpointError as exc:
        return [("model.path", str(exc))]
    if model.attention == "mla":
        return [("model.attention", "a checkpoint folder runs as gqa/mha here, got mla")]
    return [(f"model.{key}", f"{model.path}/config.json says {fields[key]}, the config says "
                             f"{getattr(model, key)}")
            for key in ("num_layers", "hidden_size", "num_q_heads", "num_kv_heads", "head_dim",
                        "intermediate_size", "vocab_size")
            if getattr(model, key) != fields[key]]


def model_problems(model: Any, kv_dtype: str, role: str) -> list[tuple[str, str]]:
    """(config key, problem) pairs for the model and one role's KV dtype."""
    out: list[tuple[str, str]] = []
    if kv_dtype not in TORCH_KV_DTYPES:
        out.append((f"{role}.kv_dtype",
                    f"the reference engine supports {sorted(TORCH_KV_DTYPES)}, got {kv_dtype!r}"))
    if model.num_experts:
        out.append(("model.num_experts",
                    f"the reference engine runs dense models (an MLP without experts; a MoE "
                    f"model runs with engine=sglang), got {model.num_experts}"))
    from pdtool.arch import is_local

    if is_local(model.path):
        if model.seed:
            out.append(("model.seed",
                        f"the weights come from model.path's checkpoint (the seed draws only "
                        f"the built-in model's), got {model.seed}"))
        return checkpoint_problems(model) + out
    if model.vocab_size != 256:
        out.append(("model.vocab_size",
                    f"the built-in model is byte-level (256; model.path=DIR serves a "
                    f"checkpoint), got {model.vocab_size}"))
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
    if role == "prefill" and inst.max_running_requests > AUX_ROWS:
        out.append((f"{role}.max_running_requests",
                    f"a reference prefill instance holds at most {AUX_ROWS} requests at once "
                    f"(the messenger's hidden-state rows), got {inst.max_running_requests}"))
    if inst.tp < 1 or model.num_q_heads % inst.tp or model.intermediate_size % inst.tp:
        out.append((f"{role}.tp",
                    f"tp={inst.tp} must divide model.num_q_heads={model.num_q_heads} and "
                    f"model.intermediate_size={model.intermediate_size}"))
    return out


def device_problems(model: Any, kv_dtype: str, inst: Any, role: str,
                    device: str) -> list[tuple[str, str]]:
    """(config key, problem) pairs for running one role on `device` (cluster.device): on cuda
    the pages are HND and, but for MLA (torch attention over the latent), decode attention is
    FlashInfer's, which reads only its dtypes and head dims."""
    if device != "cuda":
        return []
    out: list[tuple[str, str]] = []
    if inst.kv_layout != "HND":
        out.append((f"{role}.kv_layout",
                    f"the GPU path reads FlashInfer's HND pages, got {inst.kv_layout}"))
    if model.attention == "mla":
        return out
    if kv_dtype not in FLASHINFER_KV_DTYPES:
        readable = " or ".join(FLASHINFER_KV_DTYPES)
        out.append((f"{role}.kv_dtype",
                    f"FlashInfer's decode reads {readable} pages, got {kv_dtype}"))
    if model.head_dim not in FLASHINFER_HEAD_DIMS:
        out.append(("model.head_dim", f"FlashInfer's decode is built for head dims "
                                      f"{list(FLASHINFER_HEAD_DIMS)}, got {model.head_dim}"))
    return out
