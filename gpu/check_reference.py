"""The reference engine's GPU path on one GPU: FlashInfer over transferred HND pages, the
progress word under CUDA-graph replay, and a one-GPU disaggregated deployment against
transformers.

Run by gpu/check.sh after the libfabric binding is built; `--cpu` runs what a CPU can (the
transfer and the torch reference of step 1, the deployment of step 3 on the CPU) and names the
rest as not run. Each step prints one line; the JSON summary goes to --json. Exit 0 only when
every step that ran held.

  1. fabric + FlashInfer: a "prefill" process holds two TP shards (2 KV heads each) of HND
     pages `[pages, 2, heads, page, dim]` and writes decode rank 0's pages (4 heads, TP1) over
     shm with `transfer.layout.write_plan`: two writes per page and source shard (its K run and
     its V run), counted by the decoder. The decoder checks the bytes, maps the pages into the
     GPU (`transfer.cudahost`) and runs FlashInfer's BatchDecodeWithPagedKVCacheWrapper
     (kv_layout="HND") on them against `attention.paged_decode_torch` in float32.
  2. graph progress: a prefill forward pass of the tiny model (8 layers, wide enough that a
     layer takes a while) captured in a CUDA graph and replayed; a watcher thread polls the
     progress word the GPU stream writes after each layer's output projection, and when layer
     0 is reported issues layer 0's page writes to a decode endpoint (as the messenger thread
     does). Checks: the word goes through every layer of the replayed pass in order, and the
     layer-0 writes were issued before the last layer was reported.
  3. deployment: a tiny random Qwen3 checkpoint (head_dim 64, fp16 cache) served by one
     prefill and one decode process on the same GPU (cluster.device=cuda: weights on the GPU,
     FlashInfer decode, pages over the real messenger); greedy completions equal transformers'
     `generate` (float64) token for token.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # helpers.hf_checkpoints: the tests' checkpoint builder

WAIT_S = 120.0
HEADS, SHARDS, PAGE, DIM, PAGES = 4, 2, 16, 64, 64


# --------------------------------------------------------------------------- 1. fabric
def _global_pages(seed: int) -> Any:
    """Every head's HND pages [PAGES, 2, HEADS, PAGE, DIM], fp16, from a seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn((PAGES, 2, HEADS, PAGE, DIM), generator=g).to(torch.float16)


def _plan(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = PAGES * 3 // 4
    return rng.choice(PAGES, n, replace=False), rng.choice(PAGES, n, replace=False)


def _prefill_proc(args: argparse.Namespace, conn: Any) -> None:
    from transfer.fabric import Endpoint, RemoteRegion, encode_imm
    from transfer.hostmem import host_buffer
    from transfer.layout import KVLayout, write_plan
    from transfer.routes import ShardSpec, routes_for

    full = _global_pages(args.seed)
    src_pages, dst_pages = _plan(args.seed)
    src, dst = ShardSpec(HEADS, SHARDS), ShardSpec(HEADS, 1)
    shards = []
    for r in range(SHARDS):
        hs = src.heads_of(r)
        t = full[:, :, hs.start:hs.stop].contiguous()
        shards.append(host_buffer(tuple(t.shape), t.dtype).copy_(t))
    ep = Endpoint(args.provider, max_slots=8)
    mrs = [ep.register_buffer(t) for t in shards]
    name, region, dst_layout = conn.recv()
    peer = ep.insert_peer(name)
    remote = RemoteRegion.from_dict(region)
    d_lay = KVLayout.from_dict(dst_layout)
    ops = 0
    for sl in routes_for(src, dst, 0, rng=None):
        s_lay = KVLayout.from_tensor(shards[sl.src_rank], "HND")
        so, do, ln = write_plan(s_lay, d_lay, src_pages, dst_pages, sl)
        ops += ep.write_batch(peer, mrs[sl.src_rank], remote, so, do, ln, encode_imm(1, 1),
                              tag=1, per_op=1, timeout=WAIT_S)
    ep.wait_send(1, ops, WAIT_S)
    conn.send({"ops": ops, "writes_per_page": ops // (len(src_pages) * SHARDS),
               "errors": ep.errors})
    conn.recv()
    ep.close()


def step_fabric_flashinfer(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pdtool.engines.reference.attention import paged_decode_torch, paged_kv_csr
    from transfer.fabric import Endpoint
    from transfer.geometry import expected_writes
    from transfer.hostmem import host_buffer
    from transfer.layout import KVLayout
    from transfer.routes import ShardSpec, routes_for

    src_pages, dst_pages = _plan(args.seed)
    kv = host_buffer((PAGES, 2, HEADS, PAGE, DIM), torch.float16)
    lay = KVLayout.from_tensor(kv, "HND")
    src, dst = ShardSpec(HEADS, SHARDS), ShardSpec(HEADS, 1)
    want = expected_writes(routes_for(src, dst, 0, rng=None), src, dst, layout=lay.pool,
                           page_size=PAGE, num_pages=len(src_pages), num_layers=1)
    ep = Endpoint(args.provider, max_slots=8)
    mr = ep.register_buffer(kv)
    ep.arm(1, 1)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_prefill_proc, args=(args, child))
    proc.start()
    try:
        parent.send((ep.name, mr.descriptor().to_dict(), lay.to_dict()))
        reached = ep.wait_recv(1, want, WAIT_S)
        sender = parent.recv() if parent.poll(WAIT_S) else {"ops": -1}
        parent.send("done")
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
    full = _global_pages(args.seed)
    exact = bool(torch.equal(kv[torch.as_tensor(dst_pages)], full[torch.as_tensor(src_pages)]))
    out: dict[str, Any] = {"expected_writes": want, "received": int(ep.recv_counts[1]),
                           "reached": bool(reached), "sender": sender, "exact": exact}
    # a decode batch over the pages that arrived: request b reads a run of them
    g = torch.Generator().manual_seed(args.seed + 1)
    lens = [1, PAGE, PAGE + 3, 5 * PAGE - 1, 9 * PAGE + 7]
    table = torch.zeros(len(lens), max(math.ceil(n / PAGE) for n in lens), dtype=torch.long)
    at = 0
    for b, n in enumerate(lens):
        k = math.ceil(n / PAGE)
        table[b, :k] = torch.as_tensor(dst_pages[at:at + k])
        at += k
    kv_len = torch.tensor(lens)
    q_heads = 8  # GQA group 2
    q = torch.randn(len(lens), q_heads, DIM, generator=g).to(torch.float16)
    csr = paged_kv_csr(table, kv_len, PAGE)
    ref_cpu = paged_decode_torch(q.double(), kv, *csr)
    out["torch_reference_rows"] = len(lens)
    if args.cpu:
        out["flashinfer"] = "not run (no GPU)"
        ok = (reached and exact and sender.get("ops") == want
              and bool(torch.isfinite(ref_cpu).all()))
    else:
        from pdtool.engines.reference.attention import FlashInferDecode
        from transfer.cudahost import device_alias

        pages_gpu = device_alias(kv)  # the very bytes the fabric wrote, read by the GPU
        fi = FlashInferDecode(q_heads=q_heads, kv_heads=HEADS, head_dim=DIM, page_size=PAGE,
                              kv_dtype=torch.float16, device="cuda")
        fi.plan(table.cuda(), kv_len.cuda())
        got = fi.run(q.cuda(), pages_gpu).float().cpu()
        ref = paged_decode_torch(q.cuda().float(), pages_gpu, *(t.cuda() for t in csr)).cpu()
        err = float((got - ref).abs().max())
        out.update(flashinfer_max_abs_err=err, flashinfer_vs_fp64=float(
            (got.double() - ref_cpu).abs().max()))
        ok = reached and exact and sender.get("ops") == want and err < 2e-2
    out["ok"] = bool(ok and sender.get("writes_per_page") == 2)
    mr.close()
    ep.close()
    return out


# --------------------------------------------------------------------------- 2. graph progress
def step_graph_progress(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pdtool.engines.reference.cache import PagedKV
    from pdtool.engines.reference.model import Batch, TinyConfig, TinyModel
    from transfer.fabric import Endpoint, encode_imm
    from transfer.progress import LAYER_MASK, PASS_SHIFT, GpuProgressWriter

    # --cpu: the same watcher and writes around a plain CPU forward whose progress word is
    # written by the GPU writer's own code on a CPU view of the word (no graph, no mapping)
    dev = "cpu" if args.cpu else "cuda"
    layers, tokens, per_op = 8, (256 if args.cpu else 4096), 4  # ~10 ms a layer on an H200
    width = 256 if args.cpu else 2048
    cfg = TinyConfig(num_layers=layers, hidden=width, num_q_heads=16, num_kv_heads=4,
                     head_dim=128, intermediate=4 * width, dtype="float32", kv_dtype="float16")
    kv = PagedKV(cfg, cfg.num_kv_heads, tokens // PAGE + 1, PAGE, "HND", device=dev)
    model = TinyModel(cfg)
    if args.cpu:
        model.progress_writer = GpuProgressWriter.__new__(GpuProgressWriter)
        model.progress_writer.word = kv.progress
        model.progress_writer.device_word = torch.from_numpy(kv.progress.array)
    else:
        model.to_device("cuda", PAGE, kv.progress, flashinfer=False)  # prefill: torch's
    pages = list(range(tokens // PAGE))
    batch = Batch.build([(list(np.arange(tokens) % 256), 0, pages)], PAGE).to(
        torch.device(dev))
    # a decode endpoint the watcher writes layer 0's pages to, as the messenger would
    dec, pre = Endpoint(args.provider, max_slots=8), Endpoint(args.provider, max_slots=8)
    landing = torch.zeros_like(kv.buffers[0])
    d_mr, s_mr = dec.register_buffer(landing), pre.register_buffer(kv.buffers[0])
    peer = pre.insert_peer(dec.name)
    n = len(pages) * kv.page_bytes()
    so = np.arange(len(pages), dtype=np.uint64) * np.uint64(kv.page_bytes())
    ln = np.full(len(pages), kv.page_bytes(), np.uint64)
    if args.cpu:
        def replay() -> None:
            model.forward(batch, kv.layers, PAGE)

        def sync() -> None:
            pass
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (allocator, cuBLAS)
            for _ in range(2):
                model.forward(batch, kv.layers, PAGE)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model.forward(batch, kv.layers, PAGE)
        replay, sync = graph.replay, torch.cuda.current_stream().synchronize
    results = []
    want_ops = -(-len(pages) // per_op)
    for it in range(1, args.replays + 1):
        dec.arm(1, it)
        got: dict[str, bool] = {}
        # the decode endpoint polls (on shm the receiver does the copies) while the watcher
        # writes: both endpoints live in this process
        rx = threading.Thread(target=lambda got=got: got.update(
            ok=dec.wait_recv(1, want_ops, WAIT_S)))
        rx.start()
        kv.progress.array[0] = (100 + it) << PASS_SHIFT  # PrefillMessenger.begin_pass
        seen: list[tuple[int, int]] = []
        issued: dict[str, int] = {}
        stop = threading.Event()

        def watch(it: int = it, seen: list = seen, issued: dict = issued,
                  stop: threading.Event = stop) -> None:
            last = -1
            while not stop.is_set():
                w = int(kv.progress.array[0])
                if w != last:
                    seen.append((time.perf_counter_ns(), w))
                    last = w
                    if (w & LAYER_MASK) >= 1 and "t" not in issued:
                        issued["ops"] = pre.write_batch(peer, s_mr, d_mr.descriptor(), so, so,
                                                        ln, encode_imm(1, it), tag=1,
                                                        per_op=per_op, timeout=WAIT_S)
                        issued["t"] = time.perf_counter_ns()
                    if (w & LAYER_MASK) == layers:
                        return

        th = threading.Thread(target=watch)
        th.start()
        t0 = time.perf_counter_ns()
        replay()
        sync()
        t_end = time.perf_counter_ns()
        th.join(30)
        stop.set()
        rx.join(WAIT_S + 5)
        arrived = bool(got.get("ok")) and issued.get("ops") == want_ops
        pass_ids = {w >> PASS_SHIFT for _, w in seen}
        order = [w & LAYER_MASK for _, w in seen]
        t_last = next((t for t, w in seen if (w & LAYER_MASK) == layers), None)
        results.append({
            "layers_seen": order, "pass_ids": sorted(pass_ids),
            "monotone": order == sorted(order) and order[-1:] == [layers],
            "distinct_layers": len(set(order) - {0}),
            "layer0_writes_issued_ms": None if "t" not in issued else (issued["t"] - t0) / 1e6,
            "last_layer_seen_ms": None if t_last is None else (t_last - t0) / 1e6,
            "graph_done_ms": (t_end - t0) / 1e6, "layer0_pages_arrived": bool(arrived),
            "bytes": n})
    ok = all(r["monotone"] and r["pass_ids"] == [100 + i + 1]
             and r["distinct_layers"] >= layers // 2 and r["layer0_pages_arrived"]
             and r["layer0_writes_issued_ms"] is not None and r["last_layer_seen_ms"] is not None
             and r["layer0_writes_issued_ms"] < r["last_layer_seen_ms"]
             for i, r in enumerate(results))
    landing_ok = bool(torch.equal(landing, kv.buffers[0]))
    pre.close()
    dec.close()
    return {"ok": bool(ok and landing_ok), "run": "cpu emulation (no graph)" if args.cpu
            else "cuda graph replay", "replays": results, "layer0_bytes_exact": landing_ok}


# --------------------------------------------------------------------------- 3. deployment
def _checkpoint(folder: Path) -> Path:
    """A tiny random Qwen3 checkpoint FlashInfer can read: head_dim 64, 4 query / 2 KV heads."""
    import torch
    from helpers.hf_checkpoints import tokenizer_files
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    eos = tokenizer_files(folder)
    cfg = Qwen3Config(vocab_size=320, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=1024, eos_token_id=eos,
                      initializer_range=0.2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(str(folder))
    return folder


def step_deployment(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from helpers.hf_checkpoints import TEXT, greedy

    from pdtool.engines.reference.hf import HFConfig, HFModel
    from pdtool.engines.reference.local import Deployment, free_port, get_json, new_secret
    from pdtool.engines.reference.oracle import generate
    from pdtool.engines.reference.spec import RankSpec
    from pdtool.engines.reference.tokenizer import load_tokenizer

    folder = _checkpoint(tmp / "ckpt")
    device = "cpu" if args.cpu else "cuda"
    secret = new_secret()
    p_dist, p_http, d_dist, d_http, f_http = (free_port() for _ in range(5))
    mess = {"provider": args.provider, "prefill_tp": 1, "decode_tp": 1, "timeout_s": 120.0,
            "prefill": [{"health": f"http://127.0.0.1:{p_http}/health"}]}
    common = {"secret_hex": secret, "messenger": mess, "page_size": PAGE, "chunk": 4 * PAGE,
              "num_pages": 512, "layout": "HND", "device": device,
              "model": {"path": str(folder), "kv_dtype": "float16"}}
    specs = [RankSpec(role="prefill", dist_port=p_dist, http_port=p_http, **common),
             RankSpec(role="decode", dist_port=d_dist, http_port=d_http, **common),
             RankSpec(role="front", http_port=f_http, secret_hex=secret, model_name="ckpt",
                      tokenizer=str(folder), decoders=[f"http://127.0.0.1:{d_http}/health"])]
    dep = Deployment(specs, tmp / "logs")
    tok = load_tokenizer(str(folder))
    # prompts whose greedy text survives the fp16 cache on the CPU (the engine's own oracle
    # equals transformers' there): a mismatch on the GPU is then the GPU path's, and the
    # fp16 oracle column says whether the cache's rounding alone would explain it
    prompts = ["Disaggregated prefill streams KV pages layer by layer;", "The quick brown fox",
               TEXT[40:], TEXT[::-1]]
    cfg = HFConfig.load(str(folder), "float16")
    oracle = HFModel(cfg)
    rows = []
    try:
        dep.start(timeout_s=420)  # FlashInfer compiles its decode kernel at warm-up
        for text in prompts:
            ids = tok.encode_plain(text)
            code, body = get_json(f"http://127.0.0.1:{f_http}/v1/completions",
                                  {"prompt": ids, "max_tokens": 12}, timeout=300)
            got = body.get("pdtool", {}).get("token_ids") if code == 200 else None
            want = greedy(folder, ids, 12)
            fp16 = generate(cfg, ids, 12, oracle)
            first = next((i for i, (a, b) in enumerate(zip(got or [], want, strict=False))
                          if a != b), None)
            rows.append({"prompt_tokens": len(ids), "status": code, "exact": got == want,
                         "first_difference": first, "got": got, "want": want,
                         "cpu_fp16_oracle_equals_transformers": fp16 == want})
    finally:
        dep.stop()
    return {"ok": all(r["exact"] for r in rows), "device": device, "requests": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="only what runs without a GPU")
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--skip", action="append", default=[],
                    choices=["fabric", "graph", "deployment"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import torch

    summary: dict[str, Any] = {"device": "cpu" if args.cpu else "cuda",
                               "torch": torch.__version__}
    if not args.cpu:
        summary["gpu"] = torch.cuda.get_device_name(0)
        try:
            import flashinfer

            summary["flashinfer"] = flashinfer.__version__
        except ImportError as exc:
            summary["flashinfer"] = f"not importable: {exc}"
    steps = [("fabric", lambda t: step_fabric_flashinfer(args)),
             ("graph", lambda t: step_graph_progress(args)),
             ("deployment", lambda t: step_deployment(args, t))]
    ok = True
    with tempfile.TemporaryDirectory(prefix="pdtool-ref-check-") as tmp:
        for name, fn in steps:
            if name in args.skip:
                summary[name] = {"ok": True, "run": False, "why": "--skip"}
                continue
            t = time.monotonic()
            try:
                res = fn(Path(tmp))
            except Exception as exc:  # one step's failure is reported, the others still run
                res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            res["seconds"] = round(time.monotonic() - t, 1)
            summary[name] = res
            ok = ok and bool(res["ok"])
            brief = {k: v for k, v in res.items() if k not in ("requests", "replays")}
            print(f"{name}: {'ok' if res['ok'] else 'FAILED'} "
                  f"{json.dumps(brief, default=str)[:400]}", flush=True)
    summary["ok"] = ok
    text = json.dumps(summary, indent=2, default=str)
    if args.json:
        args.json.write_text(text)
    print(text)
    print("CHECK " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
