"""Render a validated deployment into a job folder: scripts + resolved config + plan + secret.

Python decides everything (`pdtool.launch.spec` builds every command line as shell words);
Jinja (StrictUndefined, so a missing value fails instead of rendering empty) only prints them,
and every interpolated value goes through the `q` filter (shlex.quote). The folder holds all a
job needs to be re-run without pdtool's config tree:

    job.sbatch | run_local.sh   the script for `launcher.kind`
    config.yaml                 the resolved config
    plan.json                   the plan (what the worker entry loads)
    launch.json                 every process and its command line (what --dry-run prints)
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

from pdtool import __version__, fabric_check
from pdtool.launch import secrets as secret_env_files
from pdtool.launch.benchmark import benchmark_argv
from pdtool.launch.shell import Var, Word, q, words
from pdtool.launch.spec import LaunchError, LaunchSpec, build_launch
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
    """The launcher's script as text."""
    lc = cfg.launcher
    ctx = {
        "version": __version__,
        "recipe": cfg.recipe or "default",
        "run_dir": str(run_dir),
        "python": cfg.engine.python,
        "stop_grace": lc.stop_grace_s,
        "secret_name": SECRET_NAME,
        "secret_files": secret_env_files.file_names(),
        "secret_roles": list(spec.secret_roles),
        "slurm": spec.launcher == "slurm",
        "job": spec.job,
        "setup": spec.setup,
        "venv": lc.venv,
        "venv_activate": spec.venv_activate,
        "fetch": spec.fetch,
        "stage": spec.stage,
        "fabric_check_dir": fabric_check.FOLDER,
        "procs": spec.procs,
        "router_procs": spec.router,
        "health": spec.health(),
        "router_health": spec.router_health(),
        "router_ready": spec.router_ready(),
        "router_url": spec.router_url,
        "health_timeout": lc.health_timeout_s,
        "watchdog_s": lc.watchdog_s,
        "probe_timeout_s": lc.probe_timeout_s,
        "benchmark": benchmark_argv(cfg, spec),
        "verify": lc.verify,
        "groups": spec.groups(),
        # --smoke and benchmarks run through the supervisor with restarts off
        "restart": lc.restart,
        "max_restarts": lc.max_restarts,
        "restart_backoff_s": lc.restart_backoff_s,
        "local_hosts": ["127.0.0.1"] * plan.nodes,
    }
    name = "slurm.sbatch.j2" if spec.launcher == "slurm" else "local.sh.j2"
    return jinja_env().get_template(name).render(**ctx)


def _word_json(w: object) -> object:
    if isinstance(w, Word):
        return {"word": [p if isinstance(p, str) else {"var": p.name} for p in w.parts]}
    if isinstance(w, Var):
        return {"var": w.name}
    return w


def spec_to_dict(spec: LaunchSpec) -> dict[str, Any]:
    """The launch spec as JSON data; shell variables appear as {"var": NAME}."""

    def proc(p):
        return {
            "name": p.name, "role": p.role, "instance": p.instance, "node": p.node,
            "ranks": list(p.ranks), "argv": [_word_json(a) for a in p.argv],
            "engine_argv": [_word_json(a) for a in p.engine_argv],
            "health": _word_json(p.health) if p.health else None,
            "ready": _word_json(p.ready) if p.ready else None,
        }

    return {"launcher": spec.launcher, "engine": spec.engine, "nodes": spec.job.nodes,
            "processes": [proc(p) for p in spec.procs], "router": [proc(p) for p in spec.router]}


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
