"""The oracle and a reference-engine deployment for the tiny checkpoints of pdtool.checkpoints.

Each folder is what a user's checkpoint looks like: `config.json` and `model.safetensors` from
`save_pretrained`, a `tokenizer.json` (a small byte-level BPE trained here with `tokenizers`),
`tokenizer_config.json` with a chat template, and `generation_config.json`. `greedy` is the
oracle: transformers' own `generate`, float64, no sampling.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pdtool.checkpoints import TEXT, make_checkpoint, tokenizer_files

__all__ = ["TEXT", "deployment", "greedy", "make_checkpoint", "tokenizer_files"]

def greedy(folder: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy `generate`, stopped (and cut) at the end-of-sequence id."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64)
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    eos = set(model.generation_config.eos_token_id if isinstance(
        model.generation_config.eos_token_id, list) else [model.generation_config.eos_token_id])
    for i, t in enumerate(new):
        if t in eos:
            return new[:i]
    return new


def deployment(folder: Path | None, tmp: Path, prefill_tp: int = 1, decode_tp: int = 1,
               provider: str = "shm", chunk: int = 16, name: str = "tiny-hf",
               layout: str = "HND"):
    """A RankSpec deployment (prefill instance, one decode instance, front) serving the
    checkpoint in `folder` (None: the built-in tiny model); returns (Deployment, front URL,
    leaders' base URLs, prefill first)."""
    from pdtool.engines.reference.local import Deployment, free_port, new_secret
    from pdtool.engines.reference.spec import LinkSpec, RankSpec

    secret = new_secret()
    model = {"path": str(folder)} if folder else {}
    p_dist, p_http, d_dist, d_http, f_http = (free_port() for _ in range(5))
    link = LinkSpec(prefill_tp=prefill_tp, decode_tp=decode_tp, provider=provider,
                    prefill=[f"http://127.0.0.1:{p_http}/health"])
    common = {"secret_hex": secret, "link": link, "model": model, "page_size": 4,
              "chunk": chunk, "num_pages": 1024, "layout": layout}
    specs = [RankSpec(role="prefill", tp=prefill_tp, rank=r, dist_port=p_dist,
                      http_port=p_http, **common) for r in range(prefill_tp)]
    specs += [RankSpec(role="decode", tp=decode_tp, rank=r, dist_port=d_dist, http_port=d_http,
                       **common) for r in range(decode_tp)]
    specs.append(RankSpec(role="front", http_port=f_http, secret_hex=secret, model_name=name,
                          tokenizer=str(folder or ""),
                          decoders=[f"http://127.0.0.1:{d_http}/health"]))
    dep = Deployment(specs, tmp)
    dep.start()
    return dep, f"http://127.0.0.1:{f_http}", [f"http://127.0.0.1:{u}" for u in (p_http, d_http)]


def hub_cache(cache: Path, model: str, folder: Path, commit: str = "0" * 40) -> Path:
    """`folder`'s files as the Hugging Face cache under `cache` (HF_HOME) holds model `model`
    after a download: hub/models--ORG--NAME/blobs named by their hash (SHA-256 for the weights,
    stored with LFS on the Hub; git's SHA-1 for the small files), snapshots/COMMIT/ holding
    relative links to them, refs/main naming the snapshot. Returns the snapshot folder."""
    import hashlib
    import os
    import shutil

    repo = cache / "hub" / ("models--" + model.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    for f in sorted(folder.rglob("*")):
        if f.is_dir():
            continue
        data = f.read_bytes()
        if f.suffix in (".safetensors", ".bin"):
            name = hashlib.sha256(data).hexdigest()
        else:
            name = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        shutil.copyfile(f, repo / "blobs" / name)
        link = snapshot / f.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / name, link.parent))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
