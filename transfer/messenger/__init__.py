"""The KV messenger: prefill and decode sides of the DESIGN §4 protocol over libfabric.

For bench/transfer.py: `transfer.messenger.loopback.measure_transfer(provider, page_bytes,
total_bytes, ...)` moves pages between two real processes through the full protocol (REQUEST
over the control plane, per-layer progress, counted writes, ABORT-free completion) and returns
the GB/s the decoder observed.

Importing this package does not load libfabric; the messengers load it when started, and its
absence raises transfer.fabric.FabricUnavailableError naming the missing package.
"""

from .common import (
    DecodeConfig,
    MessengerError,
    PrefillConfig,
    PrefillResult,
    TransferState,
    TransferStatus,
)
from .decode import DecodeMessenger
from .prefill import PrefillMessenger, PrefillRequest

__all__ = [
    "DecodeConfig",
    "DecodeMessenger",
    "MessengerError",
    "PrefillConfig",
    "PrefillMessenger",
    "PrefillRequest",
    "PrefillResult",
    "TransferState",
    "TransferStatus",
]
