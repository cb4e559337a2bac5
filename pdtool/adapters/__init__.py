"""One adapter per engine: `adapter(cfg)` answers what the rest of pdtool needs to know about
`engine.kind` (pools, metadata buffers, draft KV, caps, ports, timers, process shape), so no
module outside an adapter branches on the engine's name. Pure: see `base`."""

from __future__ import annotations

from pdtool.adapters.base import EngineAdapter
from pdtool.adapters.reference import ReferenceAdapter
from pdtool.adapters.sglang import SGLangAdapter
from pdtool.schema import Config

#: one per engine schema.ENGINES lists (and one launch half each, pdtool.launch.engines)
ADAPTERS: dict[str, EngineAdapter] = {a.kind: a for a in (ReferenceAdapter(), SGLangAdapter())}


class UnknownEngine(ValueError):
    """engine.kind names no adapter (validate says so first; this guards direct callers)."""


def engine_adapter(kind: str) -> EngineAdapter:
    try:
        return ADAPTERS[kind]
    except KeyError:
        raise UnknownEngine(f"engine.kind: unknown engine {kind!r} "
                            f"({' | '.join(ADAPTERS)})") from None


def adapter(cfg: Config) -> EngineAdapter:
    """The adapter of `cfg.engine.kind`."""
    return engine_adapter(cfg.engine.kind)


__all__ = ["ADAPTERS", "EngineAdapter", "UnknownEngine", "adapter", "engine_adapter"]
