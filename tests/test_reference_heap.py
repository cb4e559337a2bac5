"""A serving rank's heap keeps what a forward pass frees (pdtool/engines/reference/heap.py):
counted in page faults, which say it without timing anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# the tiny-local model prefilling 2,000 tokens in 16-token passes, twice; prints the minor page
# faults of the second prefill (the first one grows the heap either way)
PREFILL = """
import resource, sys, torch
from pdtool.engines.reference.cache import PagedKV
from pdtool.engines.reference.fromplan import model_fields
from pdtool.engines.reference.heap import MMAP_THRESHOLD_START as START, keep_freed_memory, \
    set_heap_thresholds
from pdtool.engines.reference.model import Batch
from pdtool.engines.reference.models import build_model, model_config
from pdtool.render import prepare
torch.set_num_threads(1)
if sys.argv[1] == "keep":
    assert keep_freed_memory()
else:  # glibc's starting thresholds, held: left to adapt, glibc raises them as it sees large
    # chunks freed and absorbs most of what this prefill frees (a few hundred faults)
    assert set_heap_thresholds(START, START)
_cfg, plan, _findings = prepare(["+recipe=tiny-local"])
inst = plan.role_instances("prefill")[0]
cfg = model_config(model_fields(plan.model, inst.kv_dtype, "prefill"))  # as serve._start_rank
P = inst.page_size
model = build_model(cfg)
kv = PagedKV(cfg, len(model.kv_heads), 2000 // P + 8, P)
pages = kv.pages.alloc(2000 // P + 1)
tokens = [i % 256 for i in range(2000)]
def prefill():
    with torch.no_grad():
        for lo in range(0, 2000, 16):
            model.forward(Batch.build([(tokens[lo:lo + 16], lo, pages)], P), kv.layers, P)
prefill()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
prefill()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    res = subprocess.run([sys.executable, "-c", PREFILL, mode], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return int(res.stdout.split()[-1])


@pytest.mark.slow
def test_a_rank_heap_keeps_the_pages_a_forward_pass_frees() -> None:
    default, kept = _faults("held"), _faults("keep")
    # at glibc's starting thresholds a pass's large temporaries are unmapped and the heap
    # trimmed, so the pass faults them back in page by page (88,000-104,000 faults here);
    # kept, the second prefill finds them mapped
    assert default > 10000, default
    assert kept < default / 20, (kept, default)
