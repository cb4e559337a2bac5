"""Loading the compiled binding (`transfer._fabric`, cffi over transfer/csrc) and the small
helpers every native call uses: the error check, C strings, the error buffer's size. The one
module of the package that fails to import where libfabric is missing."""

from __future__ import annotations

from typing import Any

from .errors import _INSTALL_HINT, FabricError, FabricUnavailableError

try:
    from transfer import _fabric  # type: ignore[attr-defined]
except ImportError as exc:  # the .so is absent, or libfabric.so.1 cannot be loaded
    raise FabricUnavailableError(_INSTALL_HINT.format(why=exc)) from exc

ffi = _fabric.ffi
lib = _fabric.lib

ERRBUF = 512  # bytes of the error text a native call may write


def check(ret: int, call: str, context: str = "", errbuf: Any = None) -> None:
    """FabricError for a non-zero return: the call, the provider's text (from `errbuf` when
    the call wrote one, else fi_strerror) and what was being opened or done."""
    if ret == 0:
        return
    msg = ffi.string(errbuf).decode(errors="replace") if errbuf is not None else ""
    if not msg:
        msg = f"{ffi.string(lib.pd_strerror(ret)).decode()} ({ret})"
    raise FabricError(call, ret, msg, context)


def c_str(s: str | None) -> Any:
    """A C string argument: NULL for None or ''."""
    return s.encode() if s else ffi.NULL
