"""Secret environment variables: 0600 files in the job folder, read by each step as it starts.

A value typed as `+launcher.env.all.HF_TOKEN=...` would otherwise sit in every srun line
(visible in `ps` on every node), in job.sbatch, config.yaml and launch.json. A variable is
secret when its name looks like one (`SECRET_NAME`) or is listed in `launcher.secret_env`; a
listed name missing from `launcher.env` is taken from the environment `pdtool render`/`launch`
runs in, so it never has to be typed at all. Each role's secrets go to
`secret-<role>.env` (mode 0600, `export NAME='value'` lines, quoted); its processes start as
`bash -c '. "$0" && exec "$@"' <file> <command...>`, so the values exist only in the process
environment. The saved config shows `REDACTED` in their place.

Beside them, `secret.key` (`KEY_FILE`) holds the deployment's control-plane key (0600).

A job folder keeps its secrets only while the job runs: pdtool's supervisor removes every one
of them when the deployment stops (`remove`; a script that fails before it hands over, too),
so the folders that pile up under launcher.output_dir hold none. A later run of the same folder
gets a fresh control-plane key at its start (`ensure_key`); the environment secrets cannot be
re-made, so such a run stops before anything starts and says to render the job again
(`missing`).
"""

from __future__ import annotations

import copy
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from pdtool.launch.shell import Var, Word, word
from pdtool.schema import Config

#: names that are secrets whatever launcher.secret_env says
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL", re.I)
ROLES = ("prefill", "decode", "router")
REDACTED = "REDACTED (secret-<role>.env in the job folder)"
KEY_FILE = "secret.key"


class SecretError(ValueError):
    """A listed secret has no value; the message names the key."""


def is_secret(cfg: Config, name: str) -> bool:
    return bool(SECRET_NAME.search(name)) or name in cfg.launcher.secret_env


def role_env(cfg: Config, rname: str) -> dict[str, str]:
    """launcher.env.all + launcher.env.<role>, secrets included."""
    env = dict(cfg.launcher.env.all)
    env.update(getattr(cfg.launcher.env, rname))
    return env


def split(cfg: Config, rname: str) -> tuple[dict[str, str], dict[str, str]]:
    """(plain, secret) variables of a role."""
    env = role_env(cfg, rname)
    plain = {k: v for k, v in env.items() if not is_secret(cfg, k)}
    return plain, {k: v for k, v in env.items() if is_secret(cfg, k)}


def secrets_by_role(cfg: Config, environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """Role -> its secret variables (listed names missing from launcher.env from `environ`)."""
    out = {}
    for rname in ROLES:
        _, secret = split(cfg, rname)
        for name in cfg.launcher.secret_env:
            if name in secret:
                continue
            if name not in environ:
                raise SecretError(
                    f"launcher.secret_env: {name} has no value: set it in launcher.env or "
                    "export it in the shell that runs pdtool")
            secret[name] = environ[name]
        if secret:
            out[rname] = secret
    return out


def file_name(rname: str) -> str:
    return f"secret-{rname}.env"


def file_text(secret: Mapping[str, str]) -> str:
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in secret.items())


def write_files(out: Path, by_role: Mapping[str, Mapping[str, str]]) -> list[Path]:
    """Write (or rewrite) each role's file with mode 0600; remove files of roles without any."""
    written = []
    for rname in ROLES:
        path = out / file_name(rname)
        if rname not in by_role:
            path.unlink(missing_ok=True)
            continue
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(file_text(by_role[rname]))
        written.append(path)
    return written


def file_names() -> list[str]:
    """Every secret file a job folder may hold: what `remove` deletes."""
    return [KEY_FILE, *(file_name(r) for r in ROLES)]


def ensure_key(run_dir: Path) -> None:
    """A per-deployment control-plane key, created 0600 (kept if the folder already has one,
    so re-rendering a running job's folder does not lock its processes out)."""
    path = Path(run_dir) / KEY_FILE
    if path.exists():
        os.chmod(path, 0o600)
        return
    from transfer.wire.secret import write_secret  # the one writer of the format

    write_secret(path)


def missing(run_dir: Path, roles: Sequence[str]) -> str | None:
    """Why a run of this folder cannot start: a role's secret file is gone (None: all there)."""
    gone = [file_name(r) for r in roles if not (Path(run_dir) / file_name(r)).is_file()]
    if not gone:
        return None
    return (f"{', '.join(gone)} {'is' if len(gone) == 1 else 'are'} gone from {run_dir}: a job "
            "folder's secrets are removed when "
            "its deployment stops. Render the job again (pdtool render / pdtool launch with the "
            "same overrides) to write them")


def remove(run_dir: Path) -> list[str]:
    """Delete the folder's secret files; the names of those that were there."""
    removed = []
    for name in file_names():
        try:
            (Path(run_dir) / name).unlink()
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed


def wrapper(run_dir: Var, rname: str) -> list[str | Word]:
    """Command prefix that loads a role's secrets into the environment, then execs the rest."""
    return ["bash", "-c", '. "$0" && exec "$@"', word(run_dir, f"/{file_name(rname)}")]


def redacted(cfg: Config) -> Config:
    """A copy of the config with every secret value replaced (what config.yaml shows)."""
    out = copy.deepcopy(cfg)
    for part in ("all", *ROLES):
        env = getattr(out.launcher.env, part)
        for k in list(env):
            if is_secret(cfg, k):
                env[k] = REDACTED
    return out
