"""Render a validated deployment into a job folder: scripts + resolved config + plan + secret.

Python decides everything (`pdtool.launch.spec` builds every command line as shell words,
written to launch.json, which pdtool's supervisor runs). The scripts do the site's set-up and
hand over to the supervisor; Jinja (StrictUndefined, so a missing value fails instead of
rendering empty) prints their few values through the `q` filter (shlex.quote). The folder holds
all a job needs to be re-run without pdtool's config tree:

    job.sbatch | run_local.sh   the script for `launcher.kind` (set-up, then the supervisor)
    config.yaml                 the resolved config
    plan.json                   the plan (what the worker entry loads)
    launch.json                 every process and its command line (what the supervisor runs
                                and --dry-run prints)
    secret.key                  per-deployment control-plane secret, mode 0600, never printed
    secret-<role>.env           secret environment variables, mode 0600 (pdtool.launch.secrets)
                                (both removed when the deployment stops)
    logs/                       one folder per run, one log per process
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdtool import __version__
from pdtool.launch import secrets as secret_env_files
from pdtool.launch.shell import q, words
from pdtool.launch.spec import LaunchError, LaunchSpec, build_launch, spec_to_dict
from pdtool.paths import templates_dir
from pdtool.rules import validate
from pdtool.rules.finding import Finding, error, has_errors

SCRIPT_NAMES = {"slurm": "job.sbatch", "local": "run_local.sh"}
SECRET_NAME = secret_env_files.KEY_FILE


@dataclass
class Rendered:
    out: Path
    script: Path
    spec: LaunchSpec
    plan: Any
    cfg: Any
    text: str = ""  # the script, for a dry run (nothing written)


def _comment(value: object) -> str:
    """Jinja filter for text inside a `# ...` comment: no line breaks or control characters."""
    return "".join(c if c.isprintable() else " " for c in str(value))


def jinja_env():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        # bash uses `${#array[@]}`: Jinja comments are {## ... ##} in pdtool templates
        comment_start_string="{##",
        comment_end_string="##}",
    )
    env.filters["q"] = q
    env.filters["words"] = words
    env.filters["comment"] = _comment
    return env


def script_text(cfg: Any, plan: Any, spec: LaunchSpec, run_dir: Path) -> str:
    """The launcher's script as text: the site's set-up (Slurm: the allocation's nodes, the
    container, launcher.setup, the virtualenv), then the hand-over to pdtool's supervisor,
    which runs what launch.json lists."""
    ctx = {
        "version": __version__,
        "recipe": cfg.recipe or "default",
        "run_dir": str(run_dir),
        "python": cfg.engine.python,
        "secret_files": secret_env_files.file_names(),
        "job": spec.job,
        "setup": spec.setup,
        "venv": cfg.launcher.venv,
        "venv_activate": spec.venv_activate,
    }
    name = "slurm.sbatch.j2" if spec.launcher == "slurm" else "local.sh.j2"
    return jinja_env().get_template(name).render(**ctx)


def build_job(cfg: Any, plan: Any, out: Path) -> tuple[Rendered, str, dict[str, dict[str, str]]]:
    """(what `out` would hold, the script's text, the secrets by role), writing nothing:
    `pdtool launch --dry-run` shows this, `write_job_folder` writes it."""
    out = Path(out).resolve()
    try:
        secret_env = secret_env_files.secrets_by_role(cfg, os.environ)
    except secret_env_files.SecretError as e:
        raise LaunchError(str(e)) from e
    spec = build_launch(cfg, plan, str(out), frozenset(secret_env))
    text = script_text(cfg, plan, spec, out)
    rendered = Rendered(out=out, script=out / SCRIPT_NAMES[spec.launcher], spec=spec, plan=plan,
                        cfg=cfg)
    return rendered, text, secret_env


def write_job_folder(cfg: Any, plan: Any, out: Path) -> Rendered:
    """Render scripts, config, plan and secret into `out` (created if needed). A builtin
    checkpoint (`model.path=builtin:NAME`) is built into the cache first, if it is not there
    yet: the job's command lines name its folder."""
    from pdtool.checkpoints import ensure
    from pdtool.compose import config_to_yaml
    from pdtool.plan import to_json

    ensure(cfg.model.path)
    rendered, text, secret_env = build_job(cfg, plan, out)
    out, spec = rendered.out, rendered.spec
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    script = out / SCRIPT_NAMES[spec.launcher]
    script.write_text(text)
    script.chmod(0o755)
    (out / "config.yaml").write_text(config_to_yaml(secret_env_files.redacted(cfg)))
    (out / "plan.json").write_text(to_json(plan) + "\n")
    (out / "launch.json").write_text(json.dumps(spec_to_dict(spec), indent=2) + "\n")
    secret_env_files.ensure_key(out)
    secret_env_files.write_files(out, secret_env)
    return rendered


def prepare(overrides: list[str]) -> tuple[Any, Any, list[Finding]]:
    """(cfg, plan, findings): compose, validate and plan; cfg/plan are None on any error."""
    from pdtool.compose import load_config
    from pdtool.plan import PlanError, build_plan

    cfg, findings = load_config(list(overrides))
    if cfg is None:
        return None, None, findings
    findings = validate(cfg)
    if has_errors(findings):
        return cfg, None, findings
    try:
        plan = build_plan(cfg)
    except PlanError as e:
        return cfg, None, [*findings, error("<plan>", str(e))]
    return cfg, plan, findings


def render(overrides: list[str], out: Path) -> tuple[Rendered | None, list[Finding]]:
    """Compose + validate + plan + write the job folder. `(None, findings)` when refused."""
    cfg, plan, findings = prepare(overrides)
    if plan is None:
        return None, findings
    try:
        return write_job_folder(cfg, plan, out), findings
    except LaunchError as e:
        key, _, msg = str(e).partition(": ")
        return None, [*findings, error(key, msg or str(e))]
