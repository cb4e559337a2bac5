"""transfer: the KV messenger of pdtool (never imports pdtool).

Light on import: `pdtool validate/plan` import `transfer.routes` and must stay fast and work
without libfabric, so the names below load their module on first use. Only the messengers'
threads load the libfabric binding (transfer.fabric), whose absence raises a clear error.

    parallel   ParallelDims                                                (GPUs, heads per rank)
    routes     ShardSpec, Slice, routes_for, pages_for                     (who sends which heads)
    geometry   PagePool, AuxBuffer, expected_writes, writes_per_page       (pools, write counts)
    layout     KVLayout, write_plan, AuxSpec                               (HND/NHD offsets)
    wire       Envelope, WireError, read_secret, write_secret             (signed control planes)
    slots      SlotTable                                                   (decoder slots)
    messenger  PrefillMessenger, DecodeMessenger, PrefillConfig, DecodeConfig, TransferStatus
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ShardSpec": "routes", "Slice": "routes", "RouteError": "routes", "routes_for": "routes",
    "candidate_sources": "routes", "pages_for": "routes", "sendable": "routes",
    "ParallelDims": "parallel",
    "PagePool": "geometry", "AuxBuffer": "geometry", "writes_per_page": "geometry",
    "expected_writes": "geometry", "slice_ops": "geometry",
    "KVLayout": "layout", "LayoutError": "layout", "AuxSpec": "layout", "write_plan": "layout",
    "Envelope": "wire", "WireError": "wire",
    "read_secret": "wire", "write_secret": "wire", "generate_secret": "wire",
    "SlotTable": "slots",
    "PrefillMessenger": "messenger", "DecodeMessenger": "messenger",
    "PrefillConfig": "messenger", "DecodeConfig": "messenger", "PrefillRequest": "messenger",
    "PrefillResult": "messenger", "TransferState": "messenger", "TransferStatus": "messenger",
    "MessengerError": "messenger",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'transfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value
