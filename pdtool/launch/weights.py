"""`launcher.model_cache`: a Hub model downloaded once per job, then read offline by every worker.

With `model.path` a Hugging Face Hub id (org/name), every SGLang worker used to download the
weights itself, inside `launcher.health_timeout_s`, once per node (and a container without
the home folder mounted lost its cache). With `launcher.model_cache=DIR` (a folder every node
sees) the job first runs `python -m pdtool.launch.weights --cache DIR MODEL` once: nothing when
the snapshot is already there, else one download (a gated model reads `HF_TOKEN`, which
`launcher.secret_env` delivers through the role's 0600 file). Every worker then runs with
`HF_HOME=DIR` and `HF_HUB_OFFLINE=1`: it reads the cache and never reaches the Hub. Preflight
runs skip the download.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pdtool.arch import is_hub_id
from pdtool.schema import Config


def cached_model(cfg: Config) -> str | None:
    """The Hub id the job fetches into launcher.model_cache, or None."""
    path = cfg.model.path
    return path if cfg.launcher.model_cache and is_hub_id(path) else None


def cache_env(cfg: Config) -> dict[str, str]:
    """The workers' environment: the cache, and the Hub out of reach."""
    if cached_model(cfg) is None:
        return {}
    return {"HF_HOME": cfg.launcher.model_cache, "HF_HUB_OFFLINE": "1"}


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtool.launch.weights",
                                 description="Fetch a Hub model into launcher.model_cache.")
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("model")
    args = ap.parse_args(argv)
    try:
        folder, downloaded = fetch(args.model, args.cache)
    except FetchError as e:
        print(f"pdtool: ERROR: launcher.model_cache: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"model weights: {args.model} {'downloaded into' if downloaded else 'found in'} "
          f"{folder}; workers read it offline", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
