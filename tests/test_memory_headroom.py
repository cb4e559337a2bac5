"""What SGLang keeps outside --mem-fraction-static (pdtool.memory.sglang_headroom, from SGLang
0.5.23's `srt/arg_groups/memory_hook.py`), the warnings built on it, and fixes that never
suggest a mem_fraction that cannot help."""

from __future__ import annotations

from helpers.pdtool_cfg import assert_error, assert_warning, findings_for, recipe

from pdtool.memory import sglang_headroom, uses_deepep


def test_headroom_follows_sglangs_own_sizing_by_hand() -> None:
    # Llama 70B decode, TP4 on 80 GiB: graph batch 512 (TP >= 4) capped by
    # max_running_requests=256 -> 512 MiB of graphs; activations max(256, 2048) x 1.5 MiB;
    # slack 4/8 GiB; 512 + 3072 + 512 + 512 = 4608 MiB, under the 10 GiB floor of a GPU
    # above 60 GiB: 10240 MiB, so at most (81920 - 10240) / 81920 = 0.875
    h = sglang_headroom(recipe("llama-3.1-70b"), "decode")
    assert (h.activations_mb, h.graphs_mb, h.parallel_mb, h.deepep_mb) == (3072, 512, 512, 0)
    assert h.total_mb == 10240 and h.max_fraction(80) == 0.875
    # the prefill reserves its chunk's activations: 8192 x 1.5 MiB + 512 + 8/8 GiB = 13824
    assert sglang_headroom(recipe("llama-3.1-70b"), "prefill").total_mb == 13824
    # DeepSeek decode with DP attention and DeepEP on 141 GiB: 256 x 2 + 256 x 8 x 3 MiB of
    # graphs, 3072 + 1024 + 512, then DeepEP's 2048 on top: 13312 MiB
    h = sglang_headroom(recipe("deepseek-r1-dp-attention"), "decode")
    assert (h.graphs_mb, h.deepep_mb, h.total_mb) == (6656, 2048, 13312)
    assert h.max_fraction(141) == 0.908


def test_a_fraction_past_sglangs_reserve_warns_with_the_figures() -> None:
    w = assert_warning(recipe("llama-3.1-70b", "decode.mem_fraction=0.9"), "decode.mem_fraction",
                       "0.9 of 80 GiB leaves 8.0 GiB", "keeps 10.0 GiB",
                       "at least 10 GiB on a GPU this large")
    assert w.fix == "set decode.mem_fraction=0.875 or lower"
    assert findings_for(recipe("llama-3.1-70b", "decode.mem_fraction=0.875"),
                        "decode.mem_fraction") == []
    # the reference engine keeps its KV in host memory: no SGLang reserve to respect
    assert findings_for(recipe("tiny-local", "decode.mem_fraction=0.99"),
                        "decode.mem_fraction") == []


def test_no_fix_suggests_a_fraction_that_cannot_help() -> None:
    # DeepSeek-R1 on one GPU: ~640 GiB of weights on a 141 GiB GPU
    err = assert_error(recipe("deepseek-r1", "decode.tp=1", "decode.instances=1"),
                       "decode.mem_fraction", "leaves no room for the KV cache")
    assert "mem_fraction" not in err.fix and "decode.tp" in err.fix
    # Llama 70B at a small fraction: raising it is the fix, up to SGLang's own limit
    err = assert_error(recipe("llama-3.1-70b", "decode.mem_fraction=0.3"), "decode.mem_fraction")
    assert "raise decode.mem_fraction (up to 0.875)" in err.fix


def test_deepep_low_latency_on_efa_warns() -> None:
    assert uses_deepep(["--moe-a2a-backend", "deepep"]) and uses_deepep(
        ["--moe-a2a-backend=deepep"]) and not uses_deepep(["--moe-a2a-backend", "none"])
    efa = ("cluster=p5en", "transfer=efa")
    w = assert_warning(recipe("deepseek-r1-dp-attention", *efa), "decode.extra_args",
                       "--deepep-mode low_latency on EFA", "IBGDA")
    assert "--deepep-mode normal" in w.fix
    # prefill's normal kernels are not warned; decode with normal neither; ConnectX is fine
    assert findings_for(recipe("deepseek-r1-dp-attention", *efa), "prefill.extra_args") == []
    normal = ('decode.extra_args=["--moe-a2a-backend","deepep","--deepep-mode","normal"]',)
    assert findings_for(recipe("deepseek-r1-dp-attention", *efa, *normal),
                        "decode.extra_args") == []
    assert findings_for(recipe("deepseek-r1-dp-attention"), "decode.extra_args") == []
