"""The front's request validation and the signed front↔decode wire, without processes.

The HTTP surface itself (streaming, errors, models, health) is exercised on a running
deployment in test_reference_serve.py.
"""

from __future__ import annotations

import pytest

from pdtool.engines.reference.front import BadRequest, parse_request
from pdtool.engines.reference.wire import Wire


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{", "body"),
        (b"[]", "body"),
        (b'{"prompt": 3}', "prompt"),
        (b'{"prompt": ""}', "prompt"),
        (b'{"prompt": [1, 300]}', "prompt"),
        (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        (b'{"prompt": "x", "max_tokens": true}', "max_tokens"),
        (b'{"prompt": "x", "stream": "yes"}', "stream"),
    ],
)
def test_bad_requests_name_the_field(body, field):
    with pytest.raises(BadRequest, match=f"^{field}:"):
        parse_request(body)


def test_wire_refuses_forged_and_malformed_messages():
    w = Wire(b"k" * 32)
    frames = w.pack("GEN", {"rid": "a", "tokens": [1, 2], "max_tokens": 3})
    assert w.unpack(frames, ("GEN",)) == ("GEN", {"rid": "a", "tokens": [1, 2], "max_tokens": 3})
    assert Wire(b"x" * 32).unpack(frames, ("GEN",)) is None  # other secret
    assert w.unpack([frames[0] + b"!", frames[1]], ("GEN",)) is None
    assert w.unpack(frames, ("OUT",)) is None
    assert w.rejected == 2
