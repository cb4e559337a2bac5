"""transfer.wire: the one signed wire format of pdtool's control planes.

    envelope   Envelope, Protocol, Message, PROTOCOL_VERSION, HISTORY   (sign, version, replay)
    secret     read_secret, write_secret, check_secret                  (the deployment secret)
    fields     WireError and the field checkers schemas are built from
    handshake  compat_hash, first_difference                            (HELLO's static facts)
    messenger  MESSENGER: HELLO/REQUEST/ABORT/ABORTED/PING/PONG of transfer.messenger
    channel    Channel, ControlFaults, check_bind_host                  (signed ZeroMQ sockets)
    sglang     SGLANG, Frames: the SGLang backend's HELLO/META frames

The reference engine's front <-> decode protocol is built from the same pieces in
pdtool/engines/reference/wire.py. PROTOCOL.md lists every message, who sends it and when.
"""

from .envelope import (
    DEFAULT_MAX_BYTES,
    HISTORY,
    PROTOCOL_VERSION,
    Envelope,
    Message,
    Protocol,
    Sessions,
)
from .fields import (
    WireError,
    bool_field,
    bytes_field,
    float_field,
    int_field,
    list_field,
    map_field,
    optional,
    str_field,
)
from .handshake import compat_hash, first_difference
from .secret import check_secret, generate_secret, read_secret, write_secret

__all__ = [
    "DEFAULT_MAX_BYTES", "HISTORY", "PROTOCOL_VERSION", "Envelope", "Message", "Protocol",
    "Sessions", "WireError", "bool_field", "bytes_field", "check_secret", "compat_hash",
    "first_difference", "float_field", "generate_secret", "int_field", "list_field",
    "map_field", "optional", "read_secret", "str_field", "write_secret",
]
