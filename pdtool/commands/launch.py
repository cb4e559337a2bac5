"""`pdtool launch [+recipe=NAME] [overrides...]`: render a job folder and start it.

launcher=slurm submits the batch script with sbatch and prints the job id and the log folder;
launcher=local runs every process under pdtool's supervisor on this machine, streams status,
waits for health and stops everything on Ctrl-C or when a process dies. `--dry-run` renders
and prints what would run, starting nothing.
"""

from __future__ import annotations

import argparse

from pdtool.commands import render

NAME = "launch"
HELP = "render a deployment and start it (sbatch, or processes on this machine)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    render.add_arguments(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="render and print the processes and command lines; start nothing",
    )
    p.add_argument(
        "--exit-when-healthy",
        action="store_true",
        help="start, wait until every process is healthy, then stop (a start check)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="start, send one prompt through the router, print the text with time to first "
        "token and time per output token, stop (exit 0; 1 with the reason if any part failed)",
    )
    p.add_argument("--smoke-prompt", help="the prompt --smoke sends (default: a fixed sentence)")
    p.add_argument(
        "--preflight",
        action="store_true",
        help="workers run only their start-up path (plan, rank, NIC, environment, "
        "placement) and report healthy without starting the engine",
    )


def print_dry_run(rendered) -> None:
    from pdtool.launch.shell import display

    spec = rendered.spec
    print(f"would run {rendered.script} (launcher={spec.launcher}, {spec.job.nodes} node(s)):")
    where = (
        "address of allocation node k (Slurm NodeAddr)" if spec.launcher == "slurm" else "127.0.0.1"
    )
    print(f"  RUN_DIR={rendered.out}  LOG_DIR=$RUN_DIR/logs/<run>  HOSTS[k]={where}")
    for p in spec.all():
        print(f"\n# {p.name}: {p.comment}")
        print(display(p.argv))


def run(args: argparse.Namespace) -> int:
    rendered, code = render.render_or_explain(args.overrides, args.out)
    if rendered is None:
        return code
    if args.dry_run:
        print_dry_run(rendered)
        return 0
    if args.smoke and rendered.spec.launcher != "local":
        print("pdtool: ERROR: --smoke runs the deployment on this machine (launcher=local); "
              "for Slurm, launch it and send a request to the router")
        return 2
    if args.preflight:  # each worker's start line has the path its node's libfabric allows
        print(f"pdtool: preflight: GPU memory: {rendered.plan.transfer.gpu_memory_path}")
    if rendered.spec.launcher == "slurm":
        from pdtool.launch.slurm import SubmitError, submit

        try:
            sub = submit(
                rendered.script, exit_when_healthy=args.exit_when_healthy, preflight=args.preflight
            )
        except SubmitError as e:
            print(f"pdtool: ERROR: {e}")
            return 1
        print(f"submitted job {sub.job_id}" + (f" on cluster {sub.cluster}" if sub.cluster else ""))
        print(f"  job folder: {rendered.out}")
        print(f"  batch log:  {sub.batch_log}")
        print(f"  process logs: {sub.log_dir}/<process>.log")
        return 0
    from pdtool.launch.local import Supervisor

    sup = Supervisor(
        rendered.spec,
        rendered.out,
        health_timeout=rendered.cfg.launcher.health_timeout_s,
        preflight=args.preflight,
    )
    smoke = None
    if args.smoke:
        from pdtool.engines.reference.client import DEFAULT_SMOKE_PROMPT
        from pdtool.engines.reference.client import smoke as send

        prompt = args.smoke_prompt or DEFAULT_SMOKE_PROMPT
        model = rendered.cfg.model.name

        def smoke(url: str) -> int:
            return send(url, prompt, model=model)

    return sup.run(exit_when_healthy=args.exit_when_healthy, smoke=smoke)
