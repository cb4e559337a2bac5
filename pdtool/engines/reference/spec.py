"""`RankSpec`: everything one reference-engine process needs, as plain data, and its `LinkSpec`:
how the rank reaches its peers through the KV messenger.

Its own module so that both the plan side (fromplan: plan → RankSpec) and the serving side
(serve: RankSpec → processes) import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdtool.reference_limits import MAX_KV_PAGES
from pdtool.schema import TransferConfig

if TYPE_CHECKING:
    from .models import ModelConfig


#: the one home of the transfer defaults (the config schema's): a RankSpec written by hand (tests,
#: the soak harness) behaves like a planned one wherever it says nothing
_TRANSFER = TransferConfig()


@dataclass
class LinkSpec:
    """What a rank's messenger adapter (link.py) needs from the plan (fromplan.link_spec)."""

    prefill_tp: int  # attention TP of the prefill instances (the shard spec of the senders)
    decode_tp: int
    # decode: every prefill instance lead's /health URL, where it publishes its ranks' control
    # addresses (link.py reads them at start and again after a restart)
    prefill: list[str] = field(default_factory=list)
    provider: str = _TRANSFER.provider
    domain: str | None = None  # the NIC the plan chose for this rank's GPU (None: any)
    timeout_s: float = _TRANSFER.timeout_s
    connect_timeout_s: float = _TRANSFER.connect_timeout_s
    peer_timeout_s: float = _TRANSFER.peer_timeout_s
    heartbeat_s: float = _TRANSFER.heartbeat_s
    lanes: int = _TRANSFER.lanes
    control_port: int = 0  # prefill lead: its instance's bootstrap port (0: any free port)
    announce_bytes: int = 0  # prefill: KV bytes between announcements (0: link's default)


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
    link: LinkSpec | None = None  # prefill and decode: the messenger's settings
    peer: int = 0  # decode: the prefill instance it pairs with
    decoders: list[str] = field(default_factory=list)  # front: decode leaders' /health URLs
    allow_faults: bool = False  # decode: honour GEN "faults" (test hooks, engine.Faults)
    corrupt_page: list[int] | None = None  # decode, with allow_faults: damage this page always
    context: int = 0  # the model's own limit on prompt + new tokens (0: the caches decide)
    model_name: str = "reference"  # front: the name /v1/models serves
    tokenizer: str = ""  # front: checkpoint folder whose tokenizer it uses ("": bytes)
    request_timeout_s: float = 1800.0  # front: a request unanswered this long fails (504)

    def __post_init__(self) -> None:
        if isinstance(self.link, dict):  # read back from JSON (serve.py)
            self.link = LinkSpec(**self.link)

    @property
    def cfg(self) -> ModelConfig:
        from .models import model_config

        return model_config(self.model)

    @property
    def secret(self) -> bytes:
        return bytes.fromhex(self.secret_hex)
