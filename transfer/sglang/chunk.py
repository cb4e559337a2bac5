"""What one `add_transfer_request` call hands the prefill side (`conn.PdtoolKVSender`), queued
whole or per layer (`layer_stream.LayerPart`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Chunk:
    """One `add_transfer_request` call. `kv_indices` may be a pinned host tensor still being
    filled by a device->host copy until `indices_event`; `wait_event` guards the pages
    themselves (early send of a cached prefix under overlap scheduling)."""

    room: int
    kv_indices: Any
    index_slice: slice
    is_last: bool
    aux_index: int | None
    wait_event: Any = None
    indices_event: Any = None
