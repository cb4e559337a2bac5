#!/usr/bin/env python3
"""GPU check (not CI): serve a small random model with SGLang prefill + decode through `pdtool`.

Run on a machine with one CUDA GPU, SGLang 0.5.23 with its CUDA dependencies, libfabric and
pdtool installed (`pip install -e .` registers the plugin entry point). Nothing is downloaded:
the model is a random-weight Llama (GQA) written to a temporary folder, and requests carry token
ids (`--skip-tokenizer-init`).

Steps, each bounded in time:
  1. write the model (seeded weights, so every process loads the same bytes);
  2. baseline: one ordinary SGLang server, greedy outputs for a few prompts, then stopped; the
     same with `--speculative-algorithm NGRAM`;
  3. PD: a prefill server and a decode server on the same GPU with
     `--disaggregation-transfer-backend pdtool` (libfabric `shm`), the same prompts sent to both
     with a shared bootstrap room (what sglang_router does);
  4. the decode restarted with `--speculative-algorithm NGRAM` (speculative decoding without
     draft-model KV, which the backend serves) and the prompts sent again;
  5. per-layer KV streaming (PREPARED, NOT RUN YET: no GPU where it was written): prefill
     and plain decode restarted with PDTOOL_LAYER_STREAM=on (under `auto` CUDA pools do not
     stream until this phase has passed), the prompts sent again; the prefill's log must say
     a forward streamed (its CUDA events recorded after each layer's attention and waited on
     by the layer thread) and must not say it fell back;
  6. with --eagle (NOT RUN YET: written without a GPU): a random one-layer EAGLE draft (its own
     KV pool, 2 KV heads beside the target's 4) is written too; a baseline server with
     `--speculative-algorithm EAGLE`, then prefill and decode both restarted with it and
     PDTOOL_DRAFT_LAYERS=1 (as the plan sets it), so the draft's KV pages travel as two more
     layer buffers per request;
  7. PASS when every PD completion equals its baseline (plain, NGRAM, layer streaming, EAGLE)
     token for token — a wrong or missing KV page changes greedy tokens of a random model at
     once. For EAGLE the draft's own pages only change which drafted tokens are accepted, which
     greedy verification hides; what the phase proves is that SGLang's scheduler registers the
     draft pool with the backend, its buffers are counted (a wrong count fails the request) and
     the target's tokens stay exact.
What it covers beyond CPU tests: a GQA (non-MLA) decode built by SGLang's own scheduler, which
gives the backend no KV head counts (it learns them from the prefill's answer to its
registration); CUDA KV pools; the early send of a radix-cached prefix under the default overlap
scheduler (the chunk's `wait_event`, a real CUDA event, is synchronised before its pages are
read) and page ids handed over as a pinned host tensor (`indices_event`); with step 5, the
CUDA branch of per-layer streaming (events, the page ids' pinned copy before the forward).
Prints one JSON line with the outcome; exit status 0 only on PASS. Server logs go to --out.

    python gpu/sglang_check.py --out /tmp/pdtool-gpu [--keep-model DIR] [--eagle]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROMPTS = [[(7 * i + j * 13) % 1000 + 3 for j in range(n)] for i, n in
           enumerate((5, 17, 64, 200, 333))]  # lengths around and across 16-token pages
# sent after PROMPTS[3]: its first 200 tokens are in the prefill's radix cache, so the prefill
# sends those pages early, guarded by the event of the forward that may still write them
# (overlap scheduling, SGLang's default): wait_event must be honoured or tokens differ
PROMPTS.append(PROMPTS[3] + [(11 * j) % 1000 + 3 for j in range(57)])
MAX_NEW = 24
BASE_PORT, PREFILL_PORT, DECODE_PORT, BOOTSTRAP_PORT = 30000, 30001, 30002, 8998


def write_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2816,  # head_dim 128
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=4096, torch_dtype="bfloat16",
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)


def write_eagle_draft(path: Path) -> None:
    """A random EAGLE draft for the model above, in the layout SGLang's LlamaForCausalLMEagle
    loads (`models/llama_eagle.py`): one decoder layer without its input norm, `fc` over
    [embedding, target hidden], names without the `model.` prefix; 2 KV heads (the target has
    4), so its KV pool has a geometry of its own."""
    import json as _json

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2816,
                      num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=4096, torch_dtype="bfloat16",
                      bos_token_id=1, eos_token_id=2)
    sd = LlamaForCausalLM(cfg).to(torch.bfloat16).state_dict()
    weights = {k.removeprefix("model."): v.contiguous() for k, v in sd.items()
               if "input_layernorm" not in k or ".0." not in k}
    weights["fc.weight"] = (torch.randn(1024, 2048) * 0.02).to(torch.bfloat16)
    weights["fc.bias"] = torch.zeros(1024, dtype=torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"))
    conf = cfg.to_dict()
    conf["architectures"] = ["LlamaForCausalLMEagle"]
    (path / "config.json").write_text(_json.dumps(conf))


def eagle_args(draft: Path) -> list[str]:
    return ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(draft),
            "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "3"]


def preflight_hmem(provider: str) -> str:
    """The GPU memory path the backend takes here, decided in seconds: `direct` when libfabric
    registers CUDA memory, else `staged` (KV through registered host memory)."""
    import torch

    from transfer import fabric

    buf = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    try:
        with fabric.Endpoint(provider, hmem=True) as ep:
            ep.register(buf.data_ptr(), buf.numel(), iface="cuda", device=buf.device.index or 0)
    except (NotImplementedError, fabric.FabricError):
        return "staged"
    return "direct"


def launch(model: Path, port: int, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
           "--port", str(port), "--host", "127.0.0.1", "--skip-tokenizer-init",
           "--page-size", "16", "--mem-fraction-static", "0.25", "--disable-cuda-graph",
           "--tp", "1", "--base-gpu-id", "0", *extra]
    fh = open(log, "w")  # noqa: SIM115 - lives as long as the server
    return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(port: int, proc: subprocess.Popen, deadline: float) -> None:
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"server on port {port} not healthy in time")


def post(port: int, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def body(ids: list[int], **extra: object) -> dict:
    return {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW,
                                                   "ignore_eos": True}, **extra}


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def pd_generate(ids: list[int], room: int, bootstrap_port: int) -> list[int]:
    """Send to prefill and decode at once with one bootstrap room, as sglang_router does."""
    from concurrent.futures import ThreadPoolExecutor

    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
             "bootstrap_room": room}
    with ThreadPoolExecutor(2) as ex:
        fp = ex.submit(post, PREFILL_PORT, body(ids, **extra))
        fd = ex.submit(post, DECODE_PORT, body(ids, **extra))
        fp.result()
        return fd.result()["output_ids"]


def mismatches(got: list[list[int]], want: list[list[int]]) -> list[int]:
    """Indices of the prompts whose PD output differs from the baseline's."""
    return [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]


def generate_all(room_base: int) -> list[list[int]]:
    """Every prompt through the PD pair, each under its own bootstrap room."""
    return [pd_generate(ids, room_base + i, BOOTSTRAP_PORT) for i, ids in enumerate(PROMPTS)]


def pd_args() -> list[str]:
    """What both PD servers run with beside their mode."""
    return ["--disaggregation-transfer-backend", "pdtool",
            "--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)]


def start_pd(procs: list[subprocess.Popen], model: Path, out: Path, tag: str,
             deadline: float, *extra: str) -> list[subprocess.Popen]:
    """A prefill and a decode server with the pdtool backend (`extra` on both), once healthy;
    logs prefill{tag}.log and decode{tag}.log. Both are in `procs` (stopped by the caller)
    before the wait, so a server that never gets healthy is stopped too."""
    pre = launch(model, PREFILL_PORT, out / f"prefill{tag}.log",
                 "--disaggregation-mode", "prefill", *pd_args(), *extra)
    dec = launch(model, DECODE_PORT, out / f"decode{tag}.log",
                 "--disaggregation-mode", "decode", *pd_args(), *extra)
    procs[:] = [pre, dec]
    wait_healthy(PREFILL_PORT, pre, deadline)
    wait_healthy(DECODE_PORT, dec, deadline)
    return [pre, dec]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("pdtool-gpu-check"))
    ap.add_argument("--keep-model", type=Path, default=None)
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--eagle", action="store_true",
                    help="also run the EAGLE (draft-model KV) phase (needs about 4 more minutes)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    deadline = t0 + a.budget_s
    result: dict[str, object] = {"check": "sglang-pd-pdtool", "ok": False}
    procs: list[subprocess.Popen] = []
    try:
        import sglang

        result["sglang"] = sglang.__version__
        from transfer import fabric  # the binding must be built here (pip install -e .)

        result["providers"] = fabric.available_providers()
        result["gpu_memory"] = preflight_hmem("shm")  # the servers inherit it below
        os.environ["PDTOOL_GPU_MEMORY"] = result["gpu_memory"]
        model = a.keep_model or Path(tempfile.mkdtemp(prefix="pdtool-tiny-llama-"))
        if not (model / "config.json").exists():
            write_model(model)
        result["phase"] = "baseline"
        base = launch(model, BASE_PORT, a.out / "baseline.log")
        procs = [base]
        wait_healthy(BASE_PORT, base, deadline)
        want = [post(BASE_PORT, body(ids))["output_ids"] for ids in PROMPTS]
        stop(base)
        # the same with NGRAM: its verify forwards round differently from plain decode steps,
        # so the PD run with NGRAM is compared with this one
        base = launch(model, BASE_PORT, a.out / "baseline-ngram.log",
                      "--speculative-algorithm", "NGRAM")
        procs = [base]
        wait_healthy(BASE_PORT, base, deadline)
        want_ngram = [post(BASE_PORT, body(ids))["output_ids"] for ids in PROMPTS]
        stop(base)
        procs = []

        result["phase"] = "pd"
        os.environ.update({"PDTOOL_FI_PROVIDER": "shm",
                           "PDTOOL_SECRET": f"gpu-check-{random.randrange(1 << 30)}"})
        pre, dec = start_pd(procs, model, a.out, "", deadline)
        result["mismatches"] = mismatches(generate_all(1000), want)

        # speculative decoding without draft-model KV: the decode restarts drafting with
        # NGRAM (the prefill is unchanged; NGRAM drafts from the decode's own tokens)
        result["phase"] = "pd-ngram"
        stop(dec)
        dec = launch(model, DECODE_PORT, a.out / "decode-ngram.log",
                     "--disaggregation-mode", "decode", *pd_args(),
                     "--speculative-algorithm", "NGRAM")
        procs = [pre, dec]
        wait_healthy(DECODE_PORT, dec, deadline)
        result["ngram_mismatches"] = mismatches(generate_all(2000), want_ngram)

        # per-layer KV streaming on CUDA pools (prepared, not run yet): each layer's writes
        # posted after a CUDA event recorded behind its attention (transfer/sglang/
        # layer_stream.py); the post-forward send carries the rest
        result["phase"] = "pd-layer-stream"
        stop(pre, dec)
        os.environ["PDTOOL_LAYER_STREAM"] = "on"
        pre, dec = start_pd(procs, model, a.out, "-layer-stream", deadline)
        result["layer_stream_mismatches"] = mismatches(generate_all(3000), want)
        log = (a.out / "prefill-layer-stream.log").read_text(errors="replace")
        result["layer_streamed"] = "per-layer KV streaming: a forward streamed" in log
        result["layer_fell_back"] = "no attention callback fired" in log
        result["ok"] = not result["mismatches"] and not result["ngram_mismatches"] and \
            not result["layer_stream_mismatches"] and result["layer_streamed"] and \
            not result["layer_fell_back"]

        if a.eagle:  # speculative decoding with draft-model KV (written without a GPU)
            result["phase"] = "baseline-eagle"
            stop(pre, dec)
            draft = model.parent / (model.name + "-eagle")
            if not (draft / "config.json").exists():
                write_eagle_draft(draft)
            base = launch(model, BASE_PORT, a.out / "baseline-eagle.log", *eagle_args(draft))
            procs = [base]
            wait_healthy(BASE_PORT, base, deadline)
            base_out = [post(BASE_PORT, body(ids)) for ids in PROMPTS]
            want_eagle = [o["output_ids"] for o in base_out]
            stop(base)
            result["phase"] = "pd-eagle"
            os.environ.pop("PDTOOL_LAYER_STREAM", None)  # the default again
            os.environ["PDTOOL_DRAFT_LAYERS"] = "1"  # what the plan sets (model.draft_layers)
            pre, dec = start_pd(procs, model, a.out, "-eagle", deadline, *eagle_args(draft))
            result["eagle_mismatches"] = mismatches(generate_all(4000), want_eagle)
            result["ok"] = result["ok"] and not result["eagle_mismatches"]
        result["phase"] = "done"
    except Exception as exc:  # report, do not hide: the lead reads this line
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        stop(*procs)
        result["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
