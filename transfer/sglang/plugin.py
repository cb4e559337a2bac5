"""The `sglang.srt.plugins` entry point: teach SGLang the transfer backend name `pdtool`.

SGLang (since 0.5.11) runs every general plugin in each process it spawns (launcher, tokenizer,
schedulers, detokenizer) before parsing arguments or building the engine, then applies the hooks
the plugins registered. SGLang 0.5.23 has no backend registry, so three steps are needed:

1. extend the `--disaggregation-transfer-backend` choices (the CLI rejects unknown names);
2. add a `PDTOOL` member to the `TransferBackend` enum (schedulers call
   `TransferBackend(server_args.disaggregation_transfer_backend)`, which raises otherwise);
3. an AROUND hook on `disaggregation.utils.get_kv_class` that answers with our classes for
   `TransferBackend.PDTOOL` and defers to SGLang for every other backend. `HookRegistry` also
   rebinds the `from ... import get_kv_class` copies in prefill.py/decode.py/disagg_service.py.

An AROUND hook on `Scheduler.on_idle` lets a scheduler with nothing to run sleep while its
rooms of this backend wait for their transfer, instead of spinning (`idle_wait.py`).

Per-layer KV streaming adds two more AROUND hooks (`Scheduler.run_batch`,
`AttentionBackend.forward`; `layer_stream.py`), unless PDTOOL_LAYER_STREAM=off. They are thin
here: a process without a prefill manager of this backend pays an attribute lookup per batch
and a dictionary lookup per attention call.

The backend classes are imported lazily on first use, so a process that never selects `pdtool`
(or runs without libfabric) pays nothing beyond this module.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from transfer import workerenv
from transfer.sglang import BACKEND_NAME, SGLANG_VERSION

logger = logging.getLogger(__name__)

GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
ON_IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"
ATTENTION_FORWARD = "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward"
LAYER_STREAM = "transfer.sglang.layer_stream"


def _add_cli_choice() -> None:
    from sglang.srt.arg_groups import choices

    if BACKEND_NAME not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND_NAME])


def _add_enum_member() -> Any:
    """Add TransferBackend.PDTOOL to the already-built enum (it has no registry).

    `setattr` on an Enum class is refused, so fill the lookup tables EnumMeta reads; identity,
    `TransferBackend("pdtool")`, hashing and iteration then behave as for a built-in member.
    """
    from sglang.srt.disaggregation.utils import TransferBackend

    member = TransferBackend._value2member_map_.get(BACKEND_NAME)
    if member is not None:
        return member
    member = object.__new__(TransferBackend)
    member._name_ = BACKEND_NAME.upper()
    member._value_ = BACKEND_NAME
    TransferBackend._value2member_map_[BACKEND_NAME] = member
    TransferBackend._member_map_[member._name_] = member
    TransferBackend._member_names_.append(member._name_)
    type.__setattr__(TransferBackend, member._name_, member)
    return member


def backend_classes() -> dict[Any, Any]:
    """KVClassType -> our class (imports the backend, hence libfabric, on first call)."""
    from sglang.srt.disaggregation.base import KVArgs
    from sglang.srt.disaggregation.utils import KVClassType

    from transfer.sglang import conn

    return {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: conn.PdtoolKVManager,
        KVClassType.SENDER: conn.PdtoolKVSender,
        KVClassType.RECEIVER: conn.PdtoolKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.PdtoolKVBootstrapServer,
    }


def get_kv_class_hook(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """AROUND hook on get_kv_class: ours for `pdtool`, SGLang's answer for anything else."""
    if getattr(transfer_backend, "value", transfer_backend) == BACKEND_NAME:
        return backend_classes().get(class_type)
    return original(transfer_backend, class_type)


def run_batch_hook(original: Any, sched: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Scheduler.run_batch: per-layer KV streaming (layer_stream.py) where this rank's
    prefill manager is ours and has it on; SGLang's run_batch unchanged otherwise."""
    q = getattr(sched, "disagg_prefill_bootstrap_queue", None)
    stream = getattr(getattr(q, "kv_manager", None), "layer_stream", None)
    if stream is None:
        return original(sched, batch, *args, **kwargs)
    return sys.modules[LAYER_STREAM].run_batch(stream, original, sched, batch, *args, **kwargs)


def on_idle_hook(original: Any, sched: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Scheduler.on_idle: where this scheduler's KV manager is ours, its wait for the
    rooms in flight (`idle_wait.py`); SGLang's on_idle unchanged otherwise."""
    out = original(sched, *args, **kwargs)
    q = getattr(sched, "disagg_prefill_bootstrap_queue", None) or \
        getattr(sched, "disagg_decode_prealloc_queue", None)
    wait = getattr(getattr(q, "kv_manager", None), "idle_wait", None)
    if wait is not None:
        wait(sched)
    return out


def attention_hook(original: Any, backend: Any, q: Any, k: Any, v: Any, layer: Any,
                   forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND AttentionBackend.forward: after a layer's attention, tell the layer stream (one
    dictionary lookup when no prefill manager of ours streams in this process)."""
    out = original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    ls = sys.modules.get(LAYER_STREAM)
    if ls is not None and ls._active is not None:
        ls.after_attention(backend, layer, forward_batch)
    return out


def _register_once(target: str, hook: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, [])):
        HookRegistry.register(target, hook, HookType.AROUND)


def register() -> None:
    """Entry point (`sglang.srt.plugins`): idempotent; SGLang applies the hook afterwards."""
    import sglang

    if getattr(sglang, "__version__", None) != SGLANG_VERSION:
        logger.warning(
            "pdtool's transfer backend is built for sglang==%s, found sglang==%s; "
            "the disaggregation interface changes between releases",
            SGLANG_VERSION, getattr(sglang, "__version__", "?"),
        )
    _add_cli_choice()
    _add_enum_member()
    _register_once(GET_KV_CLASS, get_kv_class_hook)
    _register_once(ON_IDLE, on_idle_hook)
    if workerenv.LAYER_STREAM.get() != "off":  # per-layer KV streaming (layer_stream.py)
        _register_once(RUN_BATCH, run_batch_hook)
        _register_once(ATTENTION_FORWARD, attention_hook)
    logger.info("pdtool: registered --disaggregation-transfer-backend %s", BACKEND_NAME)
