"""The C heap of a CPU serving rank: memory a forward pass frees stays in the process.

glibc's malloc serves an allocation above its mmap threshold (128 KiB at first, raised as such
chunks are freed, up to 32 MiB) with its own mapping and unmaps it on free, and it gives the
top of the heap back to the kernel once more than the trim threshold lies free there. A forward
pass allocates and frees the same temporaries every layer (gathered pages, attention scores),
so every pass faulted them back in page by page: 55,000 to 190,000 minor page faults per
2,000-token prefill of the tiny model, about a third of its time on the dev box. (Since GQA
attention became one fused call, a tiny-local prefill frees little enough that glibc's raised
thresholds absorb most of it, a few hundred faults; the MLA variant, whose attention still
spells out its scores, faulted 33 to 94,000 times, depending on the order its first chunks came
and went.) With the mmap threshold at glibc's maximum and no trimming, the heap keeps those
pages and, after the first prompt, a prefill takes no faults. The price is that a rank's heap
stays at its largest footprint, which a serving process reaches again with the next long prompt
anyway (the role jemalloc or tcmalloc play for CPU inference elsewhere, without a preloaded
library).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_START = 128 << 10  # glibc's first mmap (and trim) threshold
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit: 4 MiB * sizeof(long)
NEVER_TRIM = (1 << 31) - 1     # mallopt takes an int


def set_heap_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """Set (and so hold: glibc stops adapting them) this process's mmap and trim thresholds;
    False where the C library has no `mallopt` (not glibc) or refuses a value, and then
    nothing changed but what it took."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(M_TRIM_THRESHOLD, trim_threshold))


def keep_freed_memory() -> bool:
    """Tune this process's glibc heap as the module docstring says (`set_heap_thresholds`)."""
    return set_heap_thresholds(MMAP_THRESHOLD_MAX, NEVER_TRIM)
