"""Host (CPU) KV buffers backed by transparent huge pages.

On shm the decoder's messenger copies every page with process_vm_readv out of the prefill's
memory, and the kernel pins and walks that memory one page-table entry at a time: with 4 KiB pages
a copy costs about 0.26 CPU s/GiB on the dev box, with 2 MiB pages 0.19 (a plain memcpy is not
affected). A KV cache is large, long-lived and touched everywhere, the case huge pages exist
for. numpy already advises its large arrays this way; `torch.zeros` does not, so CPU engines and
tests allocate their KV buffers here.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from typing import Any


def host_buffer(shape: tuple[int, ...], dtype: Any) -> Any:
    """A zeroed, contiguous torch tensor in its own anonymous mapping advised MADV_HUGEPAGE.

    The mapping lives as long as the tensor. Where the kernel has no transparent huge pages the
    advice is refused and the buffer is simply made of small pages.
    """
    import torch

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        # no THP in this kernel: small pages work, they are only slower to copy over CMA
        with contextlib.suppress(OSError):
            region.madvise(advice)
    flat = torch.frombuffer(region, dtype=torch.uint8, count=nbytes)
    # Fault every page in now, at start-up: a huge page's first touch may compact memory
    # (defrag=madvise), which inside the first transfer cost 5x its copy time on the dev box.
    flat.zero_()
    return flat.view(dtype).view(shape)
