"""Which model a RankSpec's `model` fields describe, and building one TP rank of it.

`{"path": DIR, "kv_dtype": ...}` is a Hugging Face checkpoint folder (hf.py); anything else is
the built-in tiny model's TinyConfig fields (model.py).
"""

from __future__ import annotations

from typing import Any

from .hf import HFConfig, HFModel
from .model import TP, TinyConfig, TinyModel

ModelConfig = TinyConfig | HFConfig


def model_config(fields: dict[str, Any]) -> ModelConfig:
    if fields.get("path"):
        return HFConfig.load(fields["path"], fields.get("kv_dtype", "float32"))
    return TinyConfig(**fields)


def build_model(cfg: ModelConfig, tp: TP | None = None) -> TinyModel:
    return HFModel(cfg, tp) if isinstance(cfg, HFConfig) else TinyModel(cfg, tp)
