"""`pdtool launch [+recipe=NAME] [overrides...]`: render a job folder and start it.

launcher=slurm submits the batch script with sbatch and prints the job id and the log folder;
launcher=local runs every process under pdtool's supervisor on this machine, streams status,
waits for health and stops everything on Ctrl-C or when a process dies. `--dry-run` renders
and prints what would run (the #SBATCH header too), writing and starting nothing. `-m` sweeps
(`decode.instances=1,2`) submit one job per combination and print a table of job ids.
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
    if spec.launcher == "slurm":
        for line in rendered.text.splitlines():
            if line.startswith("#SBATCH "):
                print(f"  {line}")
    where = (
        "address of allocation node k (Slurm NodeAddr)" if spec.launcher == "slurm" else "127.0.0.1"
    )
    print(f"  RUN_DIR={rendered.out}  LOG_DIR=$RUN_DIR/logs/<run>  HOSTS[k]={where}")
    for p in spec.all():
        print(f"\n# {p.name}: {p.comment}")
        print(display(p.argv))


def run(args: argparse.Namespace) -> int:
    combos, code = render.combinations(args)
    if code:
        return code
    if len(combos) > 1:
        return sweep(args, combos)
    (overrides, out, suffix), = combos
    rendered, code = render.render_or_explain(overrides, out, suffix, write=not args.dry_run,
                                              check_host=not args.dry_run)
    if rendered is None:
        return code
    if args.dry_run:
        print_dry_run(rendered)
        print("(dry run: nothing written, nothing started)")
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
    from pdtool.launch.restart import RestartPolicy
    from pdtool.launch.supervisor import Supervisor

    sup = Supervisor.for_job(
        rendered,
        preflight=args.preflight,
        # --smoke checks one start: a restart would hide the failure it is there to show
        restart=None if args.smoke else RestartPolicy.of(rendered.cfg.launcher),
    )
    smoke = None
    if args.smoke:
        from pdtool.adapters import adapter
        from pdtool.engines.reference.client import (
            DEFAULT_SMOKE_PROMPT,
            SMOKE_MAX_TOKENS,
            reference_oracle,
        )
        from pdtool.engines.reference.client import smoke as send

        prompt = args.smoke_prompt or DEFAULT_SMOKE_PROMPT
        model = rendered.cfg.model.name
        # the reference engine's model, in this process: what the deployment must return
        oracle = (reference_oracle(rendered.plan, prompt, SMOKE_MAX_TOKENS)
                  if adapter(rendered.cfg).oracle_here
                  else f"not checked: engine={rendered.spec.engine} computes with its own "
                       "kernels, not the reference model")

        def smoke(url: str) -> int:
            return send(url, prompt, model=model, oracle=oracle)

    return sup.run(exit_when_healthy=args.exit_when_healthy, smoke=smoke)


def sweep(args: argparse.Namespace, combos) -> int:
    """`launch -m`: one job per combination, each in its own folder, submitted one after the
    other; a table of job ids at the end. Only for Slurm (local deployments share the ports
    of this machine); --dry-run shows each and writes nothing."""
    from pdtool.commands._common import console

    rows = []
    worst = 0
    for i, (overrides, out, suffix) in enumerate(combos):
        print(f"--- run {i}: {' '.join(overrides)}")
        rendered, code = render.render_or_explain(overrides, out, suffix,
                                                  write=not args.dry_run)
        if rendered is None:
            rows.append((i, overrides, "-", "not rendered"))
            worst = max(worst, code)
            continue
        if args.dry_run:
            print_dry_run(rendered)
            rows.append((i, overrides, str(rendered.out), "dry run"))
            continue
        if rendered.spec.launcher != "slurm":
            print("pdtool: ERROR: launch -m starts one job per combination: launcher=slurm "
                  "only (local deployments would share this machine's ports); use render -m")
            return 2
        from pdtool.launch.slurm import SubmitError, submit

        try:
            sub = submit(rendered.script, exit_when_healthy=args.exit_when_healthy,
                         preflight=args.preflight)
        except SubmitError as e:
            print(f"pdtool: ERROR: {e}")
            rows.append((i, overrides, str(rendered.out), "sbatch refused"))
            worst = max(worst, 1)
            continue
        print(f"submitted job {sub.job_id} for run {i}: {rendered.out}")
        rows.append((i, overrides, str(rendered.out), sub.job_id))
    from rich.table import Table

    t = Table(title=f"{len(rows)} job(s)", pad_edge=False)
    for col in ("run", "overrides", "job folder", "job id"):
        t.add_column(col, overflow="fold")
    for i, overrides, out, job in rows:
        t.add_row(str(i), " ".join(overrides), out, job)
    console().print(t)
    if args.dry_run:
        print("(dry run: nothing written, nothing started)")
    return worst
