"""The KV messenger: prefill and decode sides of the DESIGN §4 protocol over libfabric.

For bench/transfer.py: `transfer.messenger.loopback.measure_transfer(provider, page_bytes,
total_bytes, *, requests=16, waves=3, num_layers=1, busy_sleep_s=0.0,
prefill_busy_sleep_s=0.0, region_bytes=None)` moves pages between a prefill and a decode
process through the full protocol (signed REQUEST, lead assembly, bind, per-layer progress
word, imm-counted writes, SUCCESS when the decoder's count is reached) after one untimed
warm-up request, and returns {"gbps": best wave, "waves_gbps": [...], "bytes", "ok", ...} on
the decoder's clock. Pass `region_bytes=args.region_mib * MIB` to scatter pages over the same
bounded buffer size the other systems use.

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
