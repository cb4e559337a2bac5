"""The per-deployment secret every envelope is signed with.

`pdtool render` writes it once per deployment (32 random bytes as hex, mode 0600); workers get
the file's path, never the secret itself (argv and environments show up in `ps`, crash dumps
and job printouts). There is no unsigned mode: a missing or short secret refuses to start with
the reason, instead of signing with an empty key that every peer would accept.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Any

from .fields import WireError

MIN_SECRET_BYTES = 16


def generate_secret() -> bytes:
    return secrets.token_bytes(32)


def write_secret(path: str | os.PathLike[str], secret: bytes | None = None) -> bytes:
    """Create a secret file readable by its owner only (mode 0600); returns the secret."""
    secret = secret if secret is not None else generate_secret()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret.hex().encode() + b"\n")
    os.chmod(path, 0o600)
    return secret


def read_secret(path: str | os.PathLike[str]) -> bytes:
    """Load a secret written by `write_secret`; refuses files others can read."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text().strip()
    except OSError as exc:
        raise WireError(f"secret file {p}: cannot read it ({exc.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise WireError(f"secret file {p}: mode {oct(mode & 0o777)} lets others read it; "
                        f"run `chmod 600 {p}`")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise WireError(f"secret file {p}: expected hex text") from None
    check_secret(secret)
    return secret


def check_secret(secret: Any) -> bytes:
    """The secret, or WireError: none given (refuse to start) or too short."""
    if secret is None or secret == b"" or secret == "":
        raise WireError("secret: no deployment secret given; refusing to start unsigned (give "
                        "the 0600 file `pdtool render` writes, e.g. PDTOOL_SECRET_FILE)")
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise WireError(f"secret: need at least {MIN_SECRET_BYTES} random bytes")
    return secret
