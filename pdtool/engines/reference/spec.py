"""`RankSpec`: everything one reference-engine process needs, as plain data.

Its own module so that both the plan side (fromplan: plan → RankSpec) and the serving side
(serve: RankSpec → processes) import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdtool.reference_limits import MAX_KV_PAGES

if TYPE_CHECKING:
    from .models import ModelConfig


@dataclass
class RankSpec:
    """Everything one reference-engine rank needs (pure data, JSON round-trips)."""

    role: str  # prefill | decode | front
    instance: int = 0
    tp: int = 1
    rank: int = 0
    host: str = "127.0.0.1"  # this process binds here
    leader_host: str = "127.0.0.1"  # the instance's rank 0 (gloo rendezvous)
    dist_port: int = 0
    http_port: int = 0
    page_size: int = 4
    layout: str = "HND"  # the KV pages' layout (the role's kv_layout = transfer.layout)
    device: str = "cpu"  # cpu, or cuda:N, the rank's plan GPU (weights there, FlashInfer decode)
    num_pages: int = MAX_KV_PAGES
    chunk: int = 16
    max_running: int = 0  # requests in flight at once (role.max_running_requests); 0: default
    model: dict[str, Any] = field(default_factory=dict)  # models.model_config's fields
    secret_hex: str = ""
    messenger: dict[str, Any] = field(default_factory=dict)  # passed to the messenger adapter
    peer: int = 0  # decode: the prefill instance it pairs with
    decoders: list[str] = field(default_factory=list)  # front: decode leaders' /health URLs
    allow_faults: bool = False  # decode: honour GEN "faults" (test hooks, engine.Faults)
    context: int = 0  # the model's own limit on prompt + new tokens (0: the caches decide)
    model_name: str = "reference"  # front: the name /v1/models serves
    tokenizer: str = ""  # front: checkpoint folder whose tokenizer it uses ("": bytes)

    @property
    def cfg(self) -> ModelConfig:
        from .models import model_config

        return model_config(self.model)

    @property
    def secret(self) -> bytes:
        return bytes.fromhex(self.secret_hex)
