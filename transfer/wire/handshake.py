"""What a HELLO carries besides its fields: a compatibility hash of the deployment facts
both sides must agree on, and the first fact they disagree on (for the error message).

Each side computes the same facts from its own view (`facts` of the messenger: sharding of
both roles, page geometry, layers, provider, aux rows); equal hashes mean one deployment, and
a receiver then skips every deployment-level check. A different hash is explained field by
field, once per peer, instead of re-checking static fields in every request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import msgpack

from .envelope import PROTOCOL_VERSION

COMPAT_BYTES = 16


def compat_hash(facts: Mapping[str, Any]) -> bytes:
    """16 bytes of SHA-256 over the protocol version and the facts (keys sorted)."""
    data = msgpack.packb([PROTOCOL_VERSION, sorted(facts.items())], use_bin_type=True)
    return hashlib.sha256(data).digest()[:COMPAT_BYTES]


def first_difference(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> str:
    """'' when equal, else the first differing fact, named: `page_size: this side has 16,
    the peer 32`."""
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if a != b:
            return f"{key}: this side has {a!r}, the peer {b!r}"
    return ""
