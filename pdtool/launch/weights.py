"""`launcher.model_cache`: a Hub model downloaded once per job, then read offline by every worker.

With `model.path` a Hugging Face Hub id (org/name), every SGLang worker used to download the
weights itself, inside `launcher.health_timeout_s`, once per node (and a container without
the home folder mounted lost its cache). With `launcher.model_cache=DIR` (a folder every node
sees) the job first runs `python -m pdtool.launch.weights --cache DIR MODEL` once: nothing when
the snapshot is already there, else one download (a gated model reads `HF_TOKEN`, which
`launcher.secret_env` delivers through the role's 0600 file). Every worker then runs with
`HF_HOME=DIR` and `HF_HUB_OFFLINE=1`: it reads the cache and never reaches the Hub. Preflight
runs skip the download.

With `launcher.stage_to=DIR` as well (a folder on each node's own disk), one task per node then
copies the snapshot from the shared cache into DIR, in the same layout, in parallel over its
files, and checks every copied file against the name the Hub gave it (a blob is named by its
SHA-256, or its git SHA-1 for small files); the workers read DIR. A node that holds a verified
copy already (its `.pdtool-staged-<commit>` list) copies nothing, and jobs that share a node
take turns on a lock.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdtool.arch import is_hub_id
from pdtool.schema import Config


def cached_model(cfg: Config) -> str | None:
    """The Hub id the job fetches into launcher.model_cache, or None."""
    path = cfg.model.path
    return path if cfg.launcher.model_cache and is_hub_id(path) else None


def cache_env(cfg: Config) -> dict[str, str]:
    """The workers' environment: the cache (the node's staged copy with launcher.stage_to),
    and the Hub out of reach."""
    if cached_model(cfg) is None:
        return {}
    return {"HF_HOME": cfg.launcher.stage_to or cfg.launcher.model_cache, "HF_HUB_OFFLINE": "1"}


class FetchError(RuntimeError):
    pass


def fetch(model: str, cache: Path) -> tuple[Path, bool]:
    """(the snapshot folder, whether it was downloaded now) of `model` in the Hugging Face
    cache under `cache` (HF_HOME layout: cache/hub/models--org--name)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
    except ImportError:
        raise FetchError(f"huggingface_hub is not installed for {sys.executable} (the job's "
                         f"PDTOOL_PYTHON): pip install huggingface_hub there") from None

    hub = cache / "hub"
    try:
        return Path(snapshot_download(model, cache_dir=hub, local_files_only=True)), False
    except LocalEntryNotFoundError:
        if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
            raise FetchError(f"{model} is not in {hub}, and HF_HUB_OFFLINE is set here: "
                             f"download it once with network access, or unset it") from None
    try:
        return Path(snapshot_download(model, cache_dir=hub)), True
    except GatedRepoError:
        raise FetchError(f"{model} is gated: accept its terms on the Hub and give the job a "
                         f"token (launcher.secret_env=[HF_TOKEN], from this shell or "
                         f"launcher.env)") from None
    except RepositoryNotFoundError:
        raise FetchError(f"{model}: no such model on the Hub (or it is private: "
                         f"launcher.secret_env=[HF_TOKEN])") from None
    except OSError as e:  # the network, a full or read-only cache folder
        raise FetchError(f"{model}: download into {hub} failed: {e}") from None


#: files copied at once on a node (a node-local NVMe array wants several streams)
COPY_THREADS = 8
_CHUNK = 8 << 20


def _digest(path: Path, name: str) -> str | None:
    """The hash the Hub names blob `name` by (SHA-256 of an LFS file, git SHA-1 of another),
    computed from `path`; None when the name is neither."""
    if len(name) == 64:
        h = hashlib.sha256()
    elif len(name) == 40:
        h = hashlib.sha1(usedforsecurity=False)
        h.update(f"blob {path.stat().st_size}\0".encode())
    else:
        return None
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _copy_verified(src: Path, dst: Path, name: str) -> int:
    """Copy one blob to `dst` through a temporary file, checked against its name (or, for a
    blob not named by a hash, against the source's SHA-256); returns the bytes copied."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.copyfile(src, tmp)
    got, want = _digest(tmp, name), name
    if got is None:
        got, want = _digest(tmp, "0" * 64), _digest(src, "0" * 64)
    if got != want:
        tmp.unlink(missing_ok=True)
        raise FetchError(f"{src} copied to {dst.parent} does not match its hash ({got} != "
                         f"{want}): the shared cache or this node's disk is damaged; delete "
                         f"{src} from launcher.model_cache to fetch it again")
    os.replace(tmp, dst)
    return dst.stat().st_size


def stage(model: str, cache: Path, stage_to: Path) -> tuple[Path, int]:
    """(the staged snapshot folder, bytes copied now) of `model`, copied from the shared
    `cache` (found there offline) into `stage_to` in the same HF_HOME layout, every file
    verified; nothing is copied when a verified copy of this snapshot is there already."""
    snapshot, _ = fetch(model, cache)
    repo = snapshot.parent.parent  # hub/models--org--name
    dst_repo = stage_to / "hub" / repo.name
    files = {f.relative_to(snapshot): f.resolve() for f in sorted(snapshot.rglob("*"))
             if not f.is_dir()}
    blobs = {b.name: b for b in files.values()}
    done = dst_repo / f".pdtool-staged-{snapshot.name}"
    try:
        dst_repo.mkdir(parents=True, exist_ok=True)
        with (dst_repo.parent / f".{repo.name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another job on this node stages the same model
            if done.exists() and all((dst_repo / "blobs" / n).is_file() and
                                     (dst_repo / "blobs" / n).stat().st_size == b.stat().st_size
                                     for n, b in blobs.items()):
                return dst_repo / "snapshots" / snapshot.name, 0
            (dst_repo / "blobs").mkdir(exist_ok=True)
            with ThreadPoolExecutor(COPY_THREADS) as pool:
                copied = sum(pool.map(lambda nb: _copy_verified(nb[1], dst_repo / "blobs" / nb[0],
                                                                nb[0]), blobs.items()))
            for rel, blob in files.items():
                link = dst_repo / "snapshots" / snapshot.name / rel
                link.parent.mkdir(parents=True, exist_ok=True)
                link.unlink(missing_ok=True)
                link.symlink_to(os.path.relpath(dst_repo / "blobs" / blob.name, link.parent))
            shutil.copytree(repo / "refs", dst_repo / "refs", dirs_exist_ok=True)
            done.write_text(json.dumps({n: b.stat().st_size for n, b in blobs.items()}))
    except OSError as e:  # a full or missing local disk
        raise FetchError(f"{model}: staging into {stage_to} failed: {e}") from None
    return dst_repo / "snapshots" / snapshot.name, copied


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtool.launch.weights",
                                 description="Fetch a Hub model into launcher.model_cache, or "
                                             "copy it from there to this node's disk.")
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--stage-to", type=Path, help="copy the cached snapshot to this folder")
    ap.add_argument("model")
    args = ap.parse_args(argv)
    key = "launcher.stage_to" if args.stage_to else "launcher.model_cache"
    try:
        if args.stage_to:
            folder, copied = stage(args.model, args.cache, args.stage_to)
            print(f"model weights on {socket.gethostname()}: "
                  + (f"{copied / 2**30:.2f} GiB copied to {folder}, verified" if copied else
                     f"verified copy found in {folder}"), flush=True)
            return 0
        folder, downloaded = fetch(args.model, args.cache)
    except FetchError as e:
        print(f"pdtool: ERROR: {key}: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"model weights: {args.model} {'downloaded into' if downloaded else 'found in'} "
          f"{folder}; workers read it offline", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
