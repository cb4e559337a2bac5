"""The prefill's progress word: one word, two writers (the engine thread on a CPU, the GPU
stream on cuda), read by the messenger thread; shareable between processes by file.

The GPU writer is one fenced 32-bit store into the word's low half, enqueued through the CUDA
driver; here the same store is made from the host (`HostLayerStore`), which checks the
word's layout (the device store itself needs a GPU: gpu/check.sh, step graph_progress)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from pdtool.engines.reference.cache import PagedKV
from pdtool.engines.reference.model import Batch, TinyConfig, TinyModel
from transfer.messenger import common
from transfer.progress import LAYER_MASK, PASS_SHIFT, HostLayerStore, ProgressWord


def test_one_home_for_the_word_format():
    assert (common.PASS_SHIFT, common.LAYER_MASK) == (PASS_SHIFT, LAYER_MASK) == (32, 0xFFFFFFFF)


def test_the_layer_store_keeps_the_pass_the_host_began():
    word = ProgressWord()
    writer = HostLayerStore(word)
    word.array[0] = 7 << PASS_SHIFT  # PrefillMessenger.begin_pass (host)
    for layer in range(3):
        writer.layer_done(layer)
        assert word.value == (7 << PASS_SHIFT) | (layer + 1)
    word.array[0] = 8 << PASS_SHIFT  # the next pass: the same stores report pass 8
    writer.layer_done(0)
    assert word.value == (8 << PASS_SHIFT) | 1


def _child(path: str, q) -> None:
    w = ProgressWord.attach(path)
    q.put(w.value)
    w.array[0] = (5 << PASS_SHIFT) | 2


@pytest.mark.slow
def test_a_word_in_a_file_is_one_word_for_every_process(tmp_path):
    path = str(tmp_path / "progress")
    lead = ProgressWord(path)
    lead.array[0] = (4 << PASS_SHIFT) | 9
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_child, args=(path, q))
    p.start()
    assert q.get(timeout=60) == (4 << PASS_SHIFT) | 9
    p.join(60)
    assert p.exitcode == 0 and lead.value == (5 << PASS_SHIFT) | 2
    lead.close()
    assert not (tmp_path / "progress").exists()


def test_the_model_reports_each_layer_after_its_output_projection_once():
    """CPU writer: the caller's callback, once per layer in order; with a stream writer the
    callback is not called (the word has one writer at a time)."""
    cfg = TinyConfig(num_layers=3)
    model = TinyModel(cfg)
    kv = PagedKV(cfg, 2, 8, 4)
    seen: list[int] = []
    model.forward(Batch.build([(list(b"hello"), 0, [0, 1])], 4), kv.layers, 4, seen.append)
    assert seen == [0, 1, 2]
    model.progress_writer = HostLayerStore(kv.progress)
    kv.progress.array[0] = 3 << PASS_SHIFT
    model.forward(Batch.build([(list(b"hello"), 0, [2, 3])], 4), kv.layers, 4, seen.append)
    assert seen == [0, 1, 2] and kv.progress.value == (3 << PASS_SHIFT) | 3
