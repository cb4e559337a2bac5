"""Real checkpoints: tiny random Llama / Qwen2 / Qwen3 folders served disaggregated, token for
token equal to transformers' own greedy `generate` on the same folder.

Each case is a real deployment (prefill and decode processes, gloo TP, KV pages over the
libfabric messenger) with chunked prefill (16-token chunks, prompts up to ~9 chunks): prefill
TP2 -> decode TP1, TP1 -> TP2 and equal TP, over shm and tcp;ofi_rxm.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.hf_checkpoints import TEXT, deployment, greedy, make_checkpoint

from pdtool.engines.reference.local import get_json
from pdtool.engines.reference.models import build_model, model_config
from pdtool.engines.reference.oracle import generate
from pdtool.engines.reference.tokenizer import HFTokenizer

PROMPTS = [TEXT, TEXT[:40], TEXT[7:] * 2, "fox", "ab"]
NEW = 12


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_engine_model_equals_transformers(tmp_path, arch):
    """In-process: the engine's model on the checkpoint, whole prompt in one pass."""
    folder = make_checkpoint(tmp_path / arch, arch)
    tok = HFTokenizer(folder)
    cfg = model_config({"path": str(folder)})
    model = build_model(cfg)
    for text in PROMPTS[:3]:
        prompt = tok.encode(text)
        assert generate(cfg, prompt, NEW, model) == greedy(folder, prompt, NEW), text


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "prefill_tp", "decode_tp", "provider"), [
    ("llama", 2, 1, "shm"),
    ("qwen2", 1, 2, "tcp;ofi_rxm"),
    ("qwen3", 2, 2, "shm"),
])
def test_disaggregated_equals_transformers(tmp_path, arch, prefill_tp, decode_tp, provider):
    folder = make_checkpoint(tmp_path / arch, arch)
    tok = HFTokenizer(folder)
    prompts = [tok.encode(t) for t in PROMPTS]
    assert max(len(p) for p in prompts) > 4 * 16  # several prefill chunks
    want = [greedy(folder, p, NEW) for p in prompts]
    dep, url, leaders = deployment(folder, tmp_path / "dep", prefill_tp, decode_tp, provider)
    try:
        def ask(prompt: list[int]) -> dict:
            code, body = get_json(f"{url}/v1/completions",
                                  {"prompt": prompt, "max_tokens": NEW, "temperature": 0})
            assert code == 200, body
            return body

        with ThreadPoolExecutor(3) as pool:
            bodies = list(pool.map(ask, prompts))
        for p, w, b in zip(prompts, want, bodies, strict=True):
            assert b["pdtool"]["token_ids"] == w, tok.decode(p)
            assert b["choices"][0]["text"] == tok.decode(w)
        decode = get_json(f"{leaders[1]}/stats")[1]
        assert decode["prompt_tokens_seen"] == len(prompts)  # the decoder never ran a prompt
    finally:
        dep.stop()


@pytest.mark.slow
def test_hf_local_recipe_launches_a_checkpoint_folder(tmp_path):
    """`pdtool launch +recipe=hf-local model.path=DIR --smoke`, as the README says; the plan's
    model keys come from DIR/config.json."""
    import json
    import subprocess
    import sys

    from pdtool.engines.reference.local import free_port_overrides

    folder = make_checkpoint(tmp_path / "llama", "llama")
    ports = free_port_overrides()
    res = subprocess.run(
        [sys.executable, "-m", "pdtool.cli", "launch", "+recipe=hf-local",
         f"model.path={folder}", *ports, "--smoke", "--out", str(tmp_path / "job")],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "smoke passed: stopping" in res.stdout
    # a real checkpoint: checked against the model loaded in the launcher, no noise caveat
    assert "smoke: checked: the text equals the model's greedy output" in res.stdout
    assert "random weights" not in res.stdout
    plan = json.loads((tmp_path / "job" / "plan.json").read_text())
    assert plan["model"]["num_layers"] == 2 and plan["model"]["head_dim"] == 16
    assert plan["model"]["path"] == str(folder)


def test_validate_names_what_a_folder_lacks(tmp_path):
    import subprocess
    import sys

    (tmp_path / "empty").mkdir()
    res = subprocess.run([sys.executable, "-m", "pdtool.cli", "validate", "+recipe=hf-local",
                          f"model.path={tmp_path / 'empty'}"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": "400"})
    assert res.returncode != 0 and "model.path" in res.stdout + res.stderr
    assert "has no config.json" in res.stdout + res.stderr, res.stdout
