"""The binding's errors. Plain Python: importable where libfabric is not installed (validate,
plan and render name these types without loading the native module)."""

from __future__ import annotations

_INSTALL_HINT = (
    "the libfabric binding transfer._fabric is not available: {why}. It is compiled when pdtool "
    "is installed and needs the system libfabric with its headers: on Debian/Ubuntu "
    "`apt-get install libfabric-dev gcc` (on clusters the EFA installer or MOFED libfabric; "
    "set CPATH/LIBRARY_PATH or pkg-config if it lives elsewhere), then reinstall pdtool "
    "(`pip install -e .`). `pdtool validate/plan/render` work without it."
)


class FabricUnavailableError(ImportError):
    """The compiled binding or the system libfabric (Debian package libfabric-dev) is missing."""


class FabricError(RuntimeError):
    """A libfabric call failed: `call` names it, `errno` is the positive fi errno."""

    def __init__(self, call: str, errno: int, message: str, context: str = "") -> None:
        self.call = call
        self.errno = abs(errno)
        self.provider_message = message
        self.context = context
        text = f"{call} failed: {message}"
        if context:
            text += f" [{context}]"
        super().__init__(text)



class GpuMemoryError(FabricError, NotImplementedError):
    """CUDA memory cannot be registered here (transfer.gpu_memory=direct is impossible): the
    provider or this libfabric build lacks it, or the pointer is not registrable device memory.
    Also a NotImplementedError, what callers caught before CUDA registration existed."""

