"""The job folder's Prometheus scrape config: every `/metrics` the deployment serves.

Written as `prometheus.yml` by pdtool's supervisor once the hosts are known (the allocation's
addresses, under Slurm), so `prometheus --config.file
JOB_DIR/prometheus.yml` (or its `scrape_configs` pasted into a site's Prometheus) scrapes the
deployment with each target labelled by role and instance:

* the reference engine: its OpenAI front (requests, TTFT/TPOT/end-to-end histograms) and each
  instance lead (the KV messenger's counters);
* SGLang: sglang-router's exporter (`router.metrics_port` in the plan), and each instance's
  HTTP port when its launch line has `--enable-metrics` (SGLang's own metrics; off unless
  asked, as in SGLang).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pdtool.adapters import engine_adapter

FILE = "prometheus.yml"


def scrape_config(cfg: Any, plan: Any, hosts: list[str]) -> dict[str, Any]:
    """The `scrape_configs` of the deployment, `hosts[k]` the address of allocation node k."""
    targets: list[tuple[str, str, dict[str, str]]] = []
    r = plan.router
    engine = engine_adapter(plan.engine)
    # a front without an exporter of its own serves /metrics on its port
    front = r.port if r.metrics_port is None else r.metrics_port
    targets.append((engine.front_job, f"{hosts[r.node]}:{front}", {"role": "router"}))
    flag = engine.metrics_flag
    for inst in plan.instances:
        rc = getattr(cfg, inst.role)
        if flag is None or flag in [*cfg.engine.extra_args, *rc.extra_args]:
            targets.append((engine.instances_job, f"{hosts[inst.nodes[0]]}:{inst.http_port}",
                            {"role": inst.role, "instance": inst.name}))
    jobs: dict[str, list[dict[str, Any]]] = {}
    for job, target, labels in targets:
        jobs.setdefault(job, []).append({"targets": [target],
                                         "labels": {"deployment": cfg.launcher.job_name,
                                                    **labels}})
    return {"scrape_configs": [{"job_name": job, "metrics_path": "/metrics",
                                "static_configs": groups} for job, groups in jobs.items()]}


def write(run_dir: Path, cfg: Any, plan: Any, hosts: list[str]) -> Path:
    import yaml

    path = run_dir / FILE
    path.write_text("# the deployment's /metrics (pdtool.launch.scrape)\n" +
                    yaml.safe_dump(scrape_config(cfg, plan, hosts), sort_keys=False))
    return path


def write_or_warn(run_dir: Path, cfg: Any, plan: Any, hosts: list[str]) -> None:
    """`write`, where a failure is one warning line: metrics are a convenience, and the
    deployment goes on without the file."""
    try:
        write(run_dir, cfg, plan, hosts)
    except (OSError, ValueError, IndexError) as e:
        print(f"pdtool: warning: {FILE} not written: {e}", file=sys.stderr, flush=True)
