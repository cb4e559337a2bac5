"""The KV messenger: prefill and decode sides of the protocol in docs/messenger.md, over libfabric.

The multi-process harness that drives both sides on one machine (tests, bench/transfer.py) is
`transfer.testing.loopback`.

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
