"""Expert parallelism (`prefill.ep`, `decode.ep`) and what FP8 block-quantized MoE weights allow.

SGLang splits a routed expert's intermediate columns over the MoE TP group, `tp / ep` GPUs
(`--tp-size`, `--ep-size`; `ep` must divide `tp`). FP8 MoE checkpoints (DeepSeek-V3/R1, Qwen3
FP8: `quantization_config.weight_block_size = [128, 128]`) carry one scale per 128 x 128 block,
so each rank's share of `moe_intermediate_size` must be a whole number of blocks, or the
weights do not load. Qwen3-Coder-480B-FP8 (2560 columns) at TP8 without EP gives each rank
320 columns; `ep=8` keeps every expert whole on one GPU.
"""

from __future__ import annotations

from pdtool.adapters import adapter
from pdtool.rules.finding import Finding, error
from pdtool.schema import ROLES, Config, role

#: FP8 block size of block-quantized MoE checkpoints (weight_block_size), in columns
FP8_BLOCK = 128


def check_ep(cfg: Config) -> list[Finding]:
    """`<role>.ep` >= 1 and divides `<role>.tp`; only for MoE models on engine=sglang."""
    out: list[Finding] = []
    for r in ROLES:
        rc = role(cfg, r)
        if rc.ep == 1:
            continue
        key = f"{r}.ep"
        if not adapter(cfg).expert_parallel or cfg.model.num_experts == 0:
            why = "a dense model has no experts" if cfg.model.num_experts == 0 else \
                f"engine={cfg.engine.kind} has no expert parallelism"
            out.append(error(key, f"{key}={rc.ep}: {why}", f"remove {key} (or set it to 1)"))
        elif rc.ep < 1 or rc.tp % rc.ep:
            out.append(error(key, f"{key}={rc.ep} must be a divisor of {r}.tp={rc.tp} "
                              "(SGLang shards experts over the TP GPUs)",
                              f"set {key}={rc.tp} (one expert group per GPU) or 1"))
    return out


def check_fp8_moe_blocks(cfg: Config) -> list[Finding]:
    """FP8 block-quantized MoE: each rank's expert columns are whole 128-column blocks."""
    m = cfg.model
    if not adapter(cfg).loads_checkpoints:
        return []  # an engine that builds its own random weights builds them unquantized
    if m.dtype != "fp8" or m.num_experts == 0 or m.moe_intermediate_size == 0:
        return []
    out: list[Finding] = []
    for r in ROLES:
        rc = role(cfg, r)
        if rc.ep < 1 or rc.tp % rc.ep:
            continue  # check_ep reports it
        moe_tp = rc.tp // rc.ep
        cols = m.moe_intermediate_size / moe_tp
        if cols % FP8_BLOCK == 0:
            continue
        fix_ep = next(e for e in range(1, rc.tp + 1) if rc.tp % e == 0 and
                      (m.moe_intermediate_size / (rc.tp // e)) % FP8_BLOCK == 0)
        out.append(error(
            f"{r}.ep",
            f"{m.name}'s FP8 experts are quantized in blocks of {FP8_BLOCK} columns; at "
            f"{r}.tp={rc.tp} with {r}.ep={rc.ep} each GPU would hold "
            f"{m.moe_intermediate_size}/{moe_tp} = {cols:g} columns of every expert "
            f"(model.moe_intermediate_size), not a whole number of blocks: the weights do not "
            "load",
            f"set {r}.ep={fix_ep} (expert parallelism keeps experts whole)",
        ))
    return out


ALL = (check_ep, check_fp8_moe_blocks)
