"""cffi (API mode) build script for `transfer._fabric`, the private libfabric binding.

Why API mode: most `fi_*` calls are `static inline` wrappers around function-pointer tables, so
they only exist to a C compiler. Why a C source and not one Python call per `fi_*` call: the hot
paths (submitting thousands of page writes, draining the completion queue and counting CQ data per
transfer slot) cost ~1 µs per page through cffi, which caps small pages far below the copy speed
(docs/libfabric.md). Here they are C loops; cffi releases the GIL around every call.

The C lives in transfer/csrc/, one file per concern (domain.c: getinfo/fabric/domain;
endpoint.c: CQ/AV/endpoint; mr.c: registration; cuda.c: the CUDA driver, dlopen'ed for CUDA
registrations only; cq.c: draining and slot counting; write.c: batched writes over lanes;
progress.c: lane threads; util.c). Its public header pd.h holds the one declaration list:
cffi's cdef is read from it (`cdef_text`), never written here.

Built at install time by setup.py (only when `rdma/fabric.h` is found), or by hand from the
repository root: `python transfer/_fabric_build.py`.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from cffi import FFI

MODULE = "transfer._fabric"
CSRC = Path("transfer") / "csrc"       # relative to the repository root (setuptools wants that)
HEADER = CSRC / "pd.h"
# The C builds without a warning under these (tests/test_fabric.py compiles it with -Werror;
# PDTOOL_FABRIC_WERROR=1 makes this build do the same). Not -Werror by default: a newer
# compiler's new warning must not fail a user's install.
WARNINGS = ["-Wall", "-Wextra", *(["-Werror"] if os.environ.get("PDTOOL_FABRIC_WERROR") else [])]
_BEGIN, _END = "/* PD_CDEF_BEGIN */", "/* PD_CDEF_END */"
_DEFINE = re.compile(r"^#define\s+(PD_\w+)\s.*$", re.MULTILINE)


def cdef_text(header: Path | None = None) -> str:
    """The declarations cffi reads: pd.h's region between the PD_CDEF markers, each
    `#define PD_X value` turned into `#define PD_X ...` (cffi asks the compiler for the value),
    so no prototype is written twice."""
    text = (header or _root() / HEADER).read_text()
    try:
        region = text[text.index(_BEGIN) + len(_BEGIN):text.index(_END)]
    except ValueError:
        raise SystemExit(f"{HEADER}: the {_BEGIN} / {_END} markers are missing") from None
    return _DEFINE.sub(r"#define \1 ...", region)


def c_sources() -> list[str]:
    """The binding's C files, relative to the repository root."""
    return sorted(str(p.relative_to(_root())) for p in (_root() / CSRC).glob("*.c"))


def _root() -> Path:
    return Path(__file__).resolve().parent.parent


def _pkg_config(flag: str) -> list[str]:
    try:
        out = subprocess.run(
            ["pkg-config", flag, "libfabric"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return shlex.split(out)


def include_dirs() -> list[str]:
    """Where to look for `rdma/fabric.h`: $PDTOOL_FABRIC_INCLUDE alone when set (os.pathsep
    separated; for a libfabric in an odd place), else pkg-config, $CPATH/$C_INCLUDE_PATH and the
    system dirs (incl. the EFA installer's /opt/amazon/efa/include)."""
    override = os.environ.get("PDTOOL_FABRIC_INCLUDE")
    if override is not None:
        return [d for d in override.split(os.pathsep) if d]
    dirs = [f[2:] for f in _pkg_config("--cflags-only-I") if f.startswith("-I")]
    for var in ("CPATH", "C_INCLUDE_PATH"):
        dirs += [d for d in os.environ.get(var, "").split(os.pathsep) if d]
    dirs += ["/usr/local/include", "/usr/include", "/opt/amazon/efa/include"]
    return dirs


def find_header(dirs: list[str] | None = None) -> Path | None:
    """Path of `rdma/fabric.h` in the first directory that has it, or None (libfabric absent)."""
    for d in include_dirs() if dirs is None else dirs:
        p = Path(d) / "rdma" / "fabric.h"
        if p.is_file():
            return p
    return None


def _library_dirs() -> list[str]:
    dirs = [f[2:] for f in _pkg_config("--libs-only-L") if f.startswith("-L")]
    efa = Path("/opt/amazon/efa/lib")
    if efa.is_dir():
        dirs.append(str(efa))
    return dirs


def make_builder() -> FFI:
    """The cffi builder: the module's own C is only `#include "pd.h"`; the code lives in
    transfer/csrc/*.c, compiled into the same extension."""
    builder = FFI()
    builder.cdef(cdef_text())
    header = find_header()
    inc = [str(header.parent.parent)] if header else []
    builder.set_source(
        MODULE,
        '#include "pd.h"\n',
        sources=c_sources(),
        libraries=["fabric", "dl"],
        include_dirs=[str(CSRC), *(d for d in inc if d != "/usr/include")],
        library_dirs=_library_dirs(),
        runtime_library_dirs=_library_dirs(),
        define_macros=[("_GNU_SOURCE", None)],
        extra_compile_args=["-O2", "-std=gnu11", *WARNINGS, "-pthread"],
        extra_link_args=["-pthread"],
    )
    return builder


ffibuilder = make_builder()

if __name__ == "__main__":
    # Run from anywhere: builds transfer/_fabric.abi3.so in the checkout.
    os.chdir(_root())
    built = Path(ffibuilder.compile(tmpdir=".", verbose="-v" in sys.argv))
    for leftover in Path("transfer").rglob("_fabric*.o"):
        leftover.unlink()
    for leftover in CSRC.glob("*.o"):
        leftover.unlink()
    # Same file name as a pip/setuptools build (cffi compiles against the limited API), so a
    # later `pip install -e .` replaces it instead of being shadowed by a higher-priority suffix.
    for other in Path("transfer").glob("_fabric.*.so"):
        if other.resolve() != built.resolve():
            other.unlink()
    built.rename(built.with_name("_fabric.abi3.so"))
