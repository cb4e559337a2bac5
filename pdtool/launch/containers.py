"""`launcher.container_cache`: a registry image imported once into a shared folder as squashfs.

Without it, the job's container setup step has pyxis import `launcher.container_image` from
the registry on every node, for every job: tens of GB pulled per node each time, and a
registry's rate limit met by a large job. With `launcher.container_cache=DIR` (a folder every
node sees) the batch shell first runs `python -m pdtool.launch.containers --cache DIR IMAGE`
on its node: nothing when `DIR/<image>.sqsh` is there, else one `enroot import` into a
temporary name, renamed into place when complete (a job that finds the file finds it whole;
jobs that start together take turns on a lock). The setup step then gives pyxis that file
(`--container-image=DIR/<image>.sqsh`), which each node unpacks from the shared folder.
Registry credentials are enroot's own (`~/.config/enroot/.credentials`).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from pdtool.schema import Config


class ContainerError(RuntimeError):
    pass


def sqsh_name(image: str) -> str:
    """The cache's file for an image reference (pyxis syntax, `[USER@][REGISTRY#]IMAGE[:TAG]`):
    its characters outside [A-Za-z0-9._-] become '+', so two references never share a file."""
    return re.sub(r"[^A-Za-z0-9._-]", "+", image) + ".sqsh"


def cached_image(cfg: Config) -> str | None:
    """The squashfs path the job's steps are given instead of the registry image, or None."""
    lc = cfg.launcher
    if not (lc.container_cache and lc.container_image):
        return None
    return str(Path(lc.container_cache) / sqsh_name(lc.container_image))


def ensure(image: str, cache: Path) -> tuple[Path, bool]:
    """(the squashfs file, whether it was imported now) of `image` in `cache`."""
    dst = cache / sqsh_name(image)
    if dst.is_file():
        return dst, False
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with (cache / f".{dst.name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another job imports the same image
            if dst.is_file():
                return dst, False
            enroot = shutil.which("enroot")
            if enroot is None:
                raise ContainerError(f"enroot is not installed on {os.uname().nodename} (the "
                                     f"batch node), so {image} cannot be imported into {cache}: "
                                     f"import it once where enroot is (enroot import --output "
                                     f"{dst} docker://{image}), or drop launcher.container_cache")
            tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
            res = subprocess.run([enroot, "import", "--output", str(tmp), f"docker://{image}"],
                                 check=False)
            if res.returncode != 0 or not tmp.is_file():
                tmp.unlink(missing_ok=True)
                raise ContainerError(f"enroot import docker://{image} failed (exit "
                                     f"{res.returncode}, see above): check the reference and "
                                     f"the registry's credentials (~/.config/enroot/.credentials)")
            os.replace(tmp, dst)
    except OSError as e:  # a full or read-only cache folder
        raise ContainerError(f"{image}: import into {cache} failed: {e}") from None
    return dst, True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtool.launch.containers",
                                 description="Import a container image into "
                                             "launcher.container_cache once.")
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("image")
    args = ap.parse_args(argv)
    try:
        path, imported = ensure(args.image, args.cache)
    except ContainerError as e:
        print(f"pdtool: ERROR: launcher.container_cache: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"container image {args.image}: {'imported into' if imported else 'found in'} {path}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
