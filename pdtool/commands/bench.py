"""`pdtool bench [overrides] (--concurrency N | --rate R) --requests N --isl DIST --osl DIST`.

Drives a streamed OpenAI-completions load against a running deployment (`--url`, default the
config's router port on this machine) or one it starts and stops itself (`--launch`, the same
supervisor as `pdtool launch`), then prints and writes what it measured: results.json and
latency.png in `--out` (default: the job folder with --launch, else
<launcher.output_dir>/bench-<timestamp>). Comma lists sweep (`--concurrency 1,4,16`); every
load point and every target gets the same seeded prompts.

`--compare OVERRIDES` (repeatable) runs the same load against the deployment with those
overrides too (`aggregated` is mode=aggregated; `transfer.backend=nixl` SGLang's nixl backend),
interleaved round by round (A B C, C B A, ...) so drift on a shared machine hits all alike;
each target's figures come from its own rounds, printed side by side, with the TTFT each adds
over the aggregated one (or over the first) prompt by prompt.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdtool.bench.args import BenchError, check_args
from pdtool.bench.args import add_arguments as add_bench_options

NAME = "bench"
HELP = "measure a deployment under an OpenAI-compatible load (TTFT, TPOT, throughput, goodput)"

COMPARE_PORT_KEYS = ("router.port", "prefill.http_port", "prefill.bootstrap_port",
                     "prefill.dist_init_port", "decode.http_port", "decode.dist_init_port")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdtool.commands._common import add_overrides_argument

    add_overrides_argument(p)
    add_bench_options(p)


def twin_overrides(cfg: Any, overrides: list[str], extra: list[str], offset: int) -> list[str]:
    """The overrides of a compared deployment: the base's, then `extra`, then every port moved
    by `offset` so the deployments run side by side on one machine. Refused where it would
    compare a deployment with itself."""
    if "mode=aggregated" in extra and not hasattr(cfg, "mode"):
        raise BenchError("--compare aggregated: this pdtool's config has no `mode` key "
                         "(the aggregated mode of the engine); nothing to compare against")
    if "mode=aggregated" in extra and cfg.mode == "aggregated":
        raise BenchError("--compare aggregated: the deployment is already mode=aggregated; "
                         "drop mode=aggregated to compare the disaggregated one with it")
    moved = []
    for key in COMPARE_PORT_KEYS:
        section, _, name = key.partition(".")
        port = getattr(getattr(cfg, section), name, None)
        if isinstance(port, int) and port > 0:
            moved.append(f"{key}={port + offset}")
    return [*overrides, *extra, *moved]


def ephemeral_ports() -> range:
    """The ports this machine hands out to outgoing connections (Linux
    `ip_local_port_range`); empty where it cannot be read."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return range(0)
    return range(lo, hi + 1)


def twin_offsets(cfg: Any, overrides: list[str],
                 compare: list[tuple[str, list[str]]],
                 avoid: range = range(0)) -> list[int]:
    """For each compared deployment, the nearest multiple of 1000 (up first, then down) its
    ports move by so that none of them is a port of the base deployment or of a compared one
    before it (every port of each, instances and derived listeners included:
    `ports.deployment_ports`), and, where some offset allows it, none in `avoid`
    (`ephemeral_ports()`: there any outgoing connection may hold the port when the twin
    starts; sglang-router's metrics listener on 33301 was taken that way). A base deployment
    whose own ports are in that range gets the nearest free offset. A plain 1000 * k put
    tiny-local's aggregated twin's prefill HTTP port (30000 + 1000) on the base's decode HTTP
    port (31000)."""
    from pdtool.compose import load_config
    from pdtool.ports import deployment_ports

    taken = deployment_ports(cfg)
    offsets = []
    for _label, extra in compare:
        twin = load_config([*overrides, *extra])[0] or cfg
        ports = deployment_ports(twin)
        free = [off for k in range(1, 64) for off in (k * 1000, -k * 1000)
                if min(ports) + off >= 1024 and max(ports) + off <= 65535
                and not taken & {p + off for p in ports}]
        if not free:
            raise BenchError("--compare: no free port range beside the deployment's own; "
                             "move router.port and the roles' http/dist-init ports")
        offset = next((off for off in free if not any(p + off in avoid for p in ports)),
                      free[0])
        taken |= {p + offset for p in ports}
        offsets.append(offset)
    return offsets


def target_modes(cfg: Any, compare: list[tuple[str, list[str]]]) -> dict[str, str]:
    """Target name -> its mode (disaggregated | aggregated), the base deployment first."""
    modes = {cfg.mode: cfg.mode}
    for label, extra in compare:
        modes[label] = "aggregated" if "mode=aggregated" in extra else cfg.mode
    return modes


# -- running ------------------------------------------------------------------------------------

def build_requests(cfg: Any, settings: dict, n: int, seed: int) -> list[Any]:
    import numpy as np

    from pdtool.bench.lengths import SpecError, prompts
    from pdtool.bench.load import Request

    rng = np.random.default_rng(seed)
    isl = settings["isl"].draw(rng, n)
    osl = settings["osl"].draw(rng, n)
    try:
        ids = prompts(rng, isl, cfg.model.vocab_size, settings["shared_prefix"])
    except SpecError as exc:
        raise BenchError(str(exc)) from None
    from pdtool.adapters import adapter

    if adapter(cfg).prompts_as_text:
        ids = text_prompts(ids, cfg.model.path)
    return [Request(p, o) for p, o in zip(ids, osl, strict=True)]


def text_prompts(ids: list[list[int]], model_path: str) -> list[str]:
    """The prompts as text: sglang-router's /v1/completions takes a string, not token ids
    (HTTP 422 "prompt: data did not match any variant of StringOrArray"). Random ids decode to
    stray bytes that tokenize back into far more tokens (64 became 102-112 with the tiny
    tokenizer), so each drawn id picks one of the checkpoint's whole-word tokens instead
    (a space, then printable text, that tokenizes back to itself alone): words joined by
    spaces tokenize back to exactly the drawn length. Each request also records the server's
    prompt_tokens. A builtin checkpoint is built first where it is not in the cache yet (the
    bench makes its prompts before `--launch` starts anything: on a fresh machine the folder
    did not exist, and the bench stopped there)."""
    from pdtool.checkpoints import CheckpointBuildError, ensure

    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ensure(model_path))
    except (ImportError, OSError, ValueError, CheckpointBuildError) as exc:
        raise BenchError(f"model.path={model_path}: sglang-router takes text prompts, and its "
                         f"tokenizer cannot be loaded here to make them ({exc}); run the bench "
                         f"where the checkpoint folder is readable") from None
    words = []
    for i in range(len(tok)):
        s = tok.decode([i])
        if len(s) > 1 and s[0] == " " and s[1:].isprintable() and " " not in s[1:] and \
                tok.encode(s, add_special_tokens=False) == [i]:
            words.append(i)
    if len(words) < 2:
        raise BenchError(f"model.path={model_path}: its tokenizer has no whole-word tokens to "
                         f"make text prompts of a known length from")
    return [tok.decode([words[t % len(words)] for t in p]) for p in ids]


def interleave(targets: list[str], requests: list[Any], rounds: int) -> list[tuple[str, range]]:
    """The order of (target, request slice) a comparison runs: the requests in `rounds`
    slices, every target runs each slice, and the order of targets alternates by round
    (A B, B A, A B, ...) so neither always runs first after a pause."""
    n = len(requests)
    rounds = min(rounds, n)
    bounds = [round(i * n / rounds) for i in range(rounds + 1)]
    plan = []
    for k in range(rounds):
        order = targets if k % 2 == 0 else targets[::-1]
        for t in order:
            plan.append((t, range(bounds[k], bounds[k + 1])))
    return plan


def measure(targets: dict[str, str], requests: list[Any], settings: dict, args: Any,
            con: Any, warm: list[Any] = (), done: list[dict] | None = None,
            gate: Any = None, focus: Callable[[str | None], None] = lambda _name: None,
            ) -> list[dict]:
    """Run every load point against every target; one entry per (target, load point), also
    appended to `done` as each load point finishes (what an interrupted run still reports).
    The `warm` requests go to each target first, one at a time, and are not recorded (the
    first requests of a fresh process pay for lazy initialisation, allocator growth, caches).
    `gate(apis, models)` (the --verify check) runs first and raises to stop everything.
    `focus(name)` is called before each of a target's rounds and warm-ups, `focus(None)`
    before the gate and once all is measured: launched twins sharing one machine's CPUs run
    one at a time (`_launch_and_bench`)."""
    done = [] if done is None else done
    import asyncio

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from pdtool.bench.args import Pace
    from pdtool.bench.load import client, drive, served_model

    async def go() -> list[dict]:
        apis = {name: client(url, args.timeout) for name, url in targets.items()}
        focus(None)
        models = {name: await served_model(apis[name], url) for name, url in targets.items()}
        if gate is not None:
            await gate(apis, models)
        for name in targets if warm else ():
            focus(name)
            await drive(apis[name], models[name], list(warm), Pace(concurrency=1), args.seed,
                        lambda _r: None)
        results = done
        total = len(settings["paces"]) * len(targets) * len(requests)
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), console=con,
                      transient=False) as bar:
            task = bar.add_task("requests", total=total)
            for pace in settings["paces"]:
                got: dict[str, list] = {name: [] for name in targets}
                for name, part in interleave(list(targets), requests, args.rounds):
                    bar.update(task, description=f"{name} {pace}")
                    focus(name)
                    got[name].append(await drive(apis[name], models[name],
                                                 [requests[i] for i in part], pace, args.seed,
                                                 lambda _r: bar.advance(task)))
                for name in targets:  # records in prompt order, and the rounds they ran in
                    results.append({"target": name, "pace": str(pace), "label": pace.label,
                                    "records": [r for rnd in got[name] for r in rnd],
                                    "rounds": got[name]})
        focus(None)
        for api in apis.values():
            await api.close()
        return results

    return asyncio.run(go())


def verify_gate(cfg: Any, settings: dict, args: Any, con: Any) -> Any:
    """The --verify check as a `measure` gate (None when off): greedy prompts of their own
    (seed + 2, the --isl/--osl lengths) on every target, compared with the model computed
    here (reference engine) or else with the first target (the aggregated one with
    `--compare aggregated`)."""
    if not args.verify:
        return None
    from pdtool.adapters import adapter
    from pdtool.bench.verify import VerifyError, compare, texts
    from pdtool.plan import build_plan

    prompts = build_requests(cfg, settings, args.verify, args.seed + 2)
    limits = [r.max_tokens for r in prompts]
    oracle: list[str] | str = "the reference engine's model is computed here only"
    if adapter(cfg).oracle_here:
        from pdtool.engines.reference.client import oracle_texts

        got = oracle_texts(build_plan(cfg), [r.prompt for r in prompts], limits)
        oracle = got if isinstance(got, str) else [text for text, _ in got]

    async def gate(apis: dict[str, Any], models: dict[str, str]) -> None:
        outs = {name: await texts(api, models[name], [r.prompt for r in prompts], limits)
                for name, api in apis.items()}
        if isinstance(oracle, list):
            reference = ("the model computed here", oracle)
        elif len(outs) > 1:
            first = "aggregated" if "aggregated" in outs else next(iter(outs))
            reference = (first, outs[first])
        else:
            raise VerifyError(f"--verify: nothing to compare with ({oracle}); add "
                              "--compare aggregated to check against a deployment without "
                              "KV transfer")
        bad = compare(outs, reference)
        if bad:
            raise VerifyError(f"--verify: {len(bad)} of {len(prompts) * len(outs)} outputs "
                              "differ; first: " + str(bad[0]))
        con.print(f"verify: {len(prompts)} greedy prompts on {', '.join(outs)}: every text "
                  f"matches {reference[0]}")

    return gate


def target_gpus(cfg: Any, overrides: list[str],
                compare: list[tuple[str, list[str]]]) -> dict[str, int]:
    """Target name -> GPUs its deployment occupies (`schema.deployment_gpus`): a compared
    deployment's own (`--compare decode.instances=3` has more), the base's where its
    overrides change no instance."""
    from pdtool.compose import load_config
    from pdtool.schema import deployment_gpus

    out = {cfg.mode: deployment_gpus(cfg)}
    for label, extra in compare:
        twin = load_config([*overrides, *extra])[0] if extra != ["mode=aggregated"] else cfg
        out[label] = deployment_gpus(twin if twin is not None else cfg)
    return out


def report(results: list[dict], cfg: Any, settings: dict, args: Any, out: Path,
           con: Any) -> dict:
    from dataclasses import replace

    from pdtool.bench.plot import plot
    from pdtool.bench.report import (
        added_text,
        advice_text,
        append_jsonl,
        provenance,
        sweep_table,
        table,
        write_json,
    )
    from pdtool.bench.stats import (
        per_gpu,
        ratio_advice,
        ratio_spread,
        stage_rates,
        summarize,
        ttft_added,
    )

    modes = target_modes(cfg, settings["compare"])
    gpus = target_gpus(cfg, list(args.overrides), settings["compare"])
    for res in results:
        res["summary"] = per_gpu(summarize(res.pop("rounds"), settings["slo"]),
                                 gpus[res["target"]])
        # per-instance prefill and decode rates, and the ratio that balances them, exist only
        # where prefill and decode run on instances of their own
        rates = (stage_rates(res["records"], cfg.prefill.instances, cfg.decode.instances)
                 if modes[res["target"]] == "disaggregated" else None)
        res["rates"] = rates
        res["advice"] = replace(ratio_advice(rates, cfg.prefill.instances),
                                spread=ratio_spread(res["records"], cfg.prefill.instances,
                                                    cfg.decode.instances)) if rates else None
    by_pace: dict[str, dict[str, dict]] = {}
    for res in results:
        by_pace.setdefault(res["pace"], {})[res["target"]] = res
    for pace, per in by_pace.items():
        con.print(table(f"{pace}, isl {settings['isl']}, osl {settings['osl']}",
                        {t: r["summary"] for t, r in per.items()}))
        # the same prompts in the same order on every target: pair them with the baseline's
        base = "aggregated" if "aggregated" in per else next(iter(per))
        for name, res in per.items():
            if name != base:
                res["summary"]["ttft_added_ms"] = ttft_added(res["records"],
                                                             per[base]["records"])
                con.print(added_text([name, base], res["summary"]["ttft_added_ms"]))
        first = next(iter(per.values()))
        if first["advice"] is not None:
            con.print(advice_text(first["rates"], first["advice"], cfg.decode.instances))
    if len(by_pace) > 1:
        con.print(sweep_table([(p, t, r["summary"]) for p, per in by_pace.items()
                               for t, r in per.items()]))
    out.mkdir(parents=True, exist_ok=True)
    plain = {"paces": [str(p) for p in settings["paces"]], "isl": str(settings["isl"]),
             "osl": str(settings["osl"]), "slo": settings["slo"], "seed": args.seed,
             "requests": args.requests, "rounds": args.rounds if args.compare else 1,
             "warmup": args.warmup, "shared_prefix": args.shared_prefix, "verify": args.verify,
             "interrupted": settings.get("interrupted", False),
             "compare": [label for label, _ in settings["compare"]],
             "prefill_instances": cfg.prefill.instances, "decode_instances": cfg.decode.instances,
             "overrides": list(args.overrides)}
    source = provenance(cfg)
    write_json(out / "results.json", plain, results, source)
    if args.jsonl:
        append_jsonl(args.jsonl, plain, results, source)
    multi = len(results) > 1
    title = (f"pdtool bench: {cfg.recipe or 'default'} ({cfg.model.name}), isl {settings['isl']}, "
             f"osl {settings['osl']}, {args.requests} requests per load, "
             f"{source['date'][:16].replace('T', ' ')}" +
             (" (interrupted)" if settings.get("interrupted") else ""))
    png = plot(out / "latency.png", [(f"{r['target']} {r['label']}" if multi else r["target"],
                                      r["records"], r["summary"]) for r in results],
               title=title, slo=settings["slo"])
    con.print(f"wrote {out / 'results.json'} and {png}")
    return {"settings": plain, "runs": [{"target": r["target"], "pace": r["pace"],
                                         "summary": r["summary"]} for r in results]}


def run(args: argparse.Namespace) -> int:
    from pdtool.commands._common import (
        EXIT_ERRORS,
        EXIT_USAGE,
        console,
        dump_json,
        print_findings,
    )

    err = console(stderr=True)
    con = console(stderr=args.json)
    try:
        settings = check_args(args)
    except BenchError as exc:
        err.print(f"[bold red]pdtool bench:[/] {exc}")
        return EXIT_USAGE
    from pdtool.bench.load import LoadError
    from pdtool.bench.verify import VerifyError
    from pdtool.budgets import client_budget, parts_text, seconds
    from pdtool.compose import ComposeError, load_config, load_job_config

    if args.job:
        try:
            cfg, problems = load_job_config(args.job), []
        except ComposeError as exc:
            cfg, problems = None, exc.findings
        args.out = args.out or args.job / "bench"
    else:
        cfg, problems = load_config(list(args.overrides))
    if cfg is None:
        err.print("[bold red]pdtool bench:[/] the config does not compose")
        print_findings(err, problems)
        return EXIT_USAGE
    from pdtool.rules import has_errors, validate

    if has_errors(found := validate(cfg)):
        err.print("[bold red]pdtool bench:[/] the config describes no deployment it can load")
        print_findings(err, [f for f in found if f.severity == "error"])
        return EXIT_USAGE
    problem = launch_problem(cfg, settings["compare"]) if args.launch else None
    if problem:
        err.print(f"[bold red]pdtool bench:[/] {problem}")
        return EXIT_USAGE
    budget = client_budget(cfg, args.timeout)
    if cfg.mode == "disaggregated" and not budget.fits:
        err.print(f"[bold yellow]pdtool bench:[/] --timeout {seconds(budget.limit_s)} is less "
                  f"than {parts_text(budget)}: {budget.why}")
    try:
        requests = build_requests(cfg, settings, args.requests, args.seed)
        # other prompts than the measured ones: a prefix cache must not serve those from them
        warm = build_requests(cfg, settings, args.warmup, args.seed + 1) if args.warmup else []
    except BenchError as exc:
        err.print(f"[bold red]pdtool bench:[/] {exc}")
        return EXIT_USAGE
    stamp = time.strftime("%Y%m%d-%H%M%S")

    def bench(targets: dict[str, str], out: Path,
              focus: Callable[[str | None], None] = lambda _name: None) -> int:
        finished: list[dict] = []
        try:
            results = measure(targets, requests, settings, args, con, warm, finished,
                              verify_gate(cfg, settings, args, con), focus)
        except (LoadError, VerifyError) as exc:
            err.print(f"[bold red]pdtool bench:[/] {exc}")
            return EXIT_ERRORS
        except BaseException:  # Ctrl-C (or the supervisor's stop): keep what was measured
            if finished:
                err.print(f"[bold yellow]pdtool bench:[/] interrupted: reporting the "
                          f"{len(finished)} finished run(s); the load point in progress is "
                          "left out")
                report(finished, cfg, {**settings, "interrupted": True}, args, out, con)
            raise
        doc = report(results, cfg, settings, args, out, con)
        if args.json:
            dump_json(doc)
        return 0 if all(r["summary"]["completed"] for r in results) else EXIT_ERRORS

    if not args.launch:
        url = args.url or f"http://127.0.0.1:{cfg.router.port}"
        targets = {cfg.mode: url}
        try:
            for (label, extra), compare_url in zip(settings["compare"], args.compare_url or [],
                                                   strict=True):
                twin_overrides(cfg, [], extra, 0)  # refuses comparing a deployment with itself
                targets[label] = compare_url
        except BenchError as exc:
            err.print(f"[bold red]pdtool bench:[/] {exc}")
            return EXIT_USAGE
        return bench(targets, args.out or Path(cfg.launcher.output_dir) / f"bench-{stamp}")
    return _launch_and_bench(args, cfg, settings["compare"], bench, err)


def freezes_targets(cfg: Any, compare: list[tuple[str, list[str]]]) -> bool:
    """Whether `--launch --compare` runs one deployment at a time and freezes the others
    (`Supervisor.pause`): on cluster.device=cpu they share this machine's cores."""
    return bool(compare) and cfg.cluster.device == "cpu"


def frozen_server_overrides(cfg: Any, compare: list[tuple[str, list[str]]]) -> list[str]:
    """Overrides for deployments the bench freezes between their rounds (`focus`): the
    environment the engine's servers need to be frozen for a while
    (`EngineLaunch.frozen_env`)."""
    if not freezes_targets(cfg, compare):
        return []
    from pdtool.launch.engines import engine_launch

    return [f"++launcher.env.all.{k}={v}" for k, v in engine_launch(cfg).frozen_env().items()]


def launch_problem(cfg: Any, compare: list[tuple[str, list[str]]]) -> str | None:
    """Why `--launch` cannot start these deployments here, or None."""
    if cfg.launcher.kind != "local":
        return ("--launch runs the deployment on this machine (launcher=local); on Slurm "
                "launch it and pass --url")
    from pdtool.adapters import adapter

    if compare and adapter(cfg).kv_on_gpu and cfg.cluster.device == "cuda":
        # side by side, they would take the same GPUs, each with mem_fraction_static of them
        return (f"--launch --compare with engine={cfg.engine.kind} on GPUs would start the "
                "deployments "
                "on the same GPUs; start each on GPUs of its own (pdtool launch ...) and pass "
                "their routers' URLs with --url and --compare-url")
    return None


def _launch_and_bench(args: argparse.Namespace, cfg: Any, compare: list[tuple[str, list[str]]],
                      bench: Any, err: Any) -> int:
    """Start the deployment and one per --compare, bench them, stop them, each compared
    deployment on ports moved clear of the others' (`twin_offsets`)."""
    from pdtool.commands._common import EXIT_USAGE
    from pdtool.commands.render import render_or_explain
    from pdtool.launch.supervisor import Supervisor

    overrides = [*args.overrides, *frozen_server_overrides(cfg, compare)]
    try:
        twins = [(label, twin_overrides(cfg, overrides, extra, offset))
                 for (label, extra), offset in zip(
                     compare, twin_offsets(cfg, overrides, compare, ephemeral_ports()),
                     strict=True)]
    except BenchError as exc:
        err.print(f"[bold red]pdtool bench:[/] {exc}")
        return EXIT_USAGE
    rendered, code = render_or_explain(overrides, None, check_host=True)
    if rendered is None:
        return code
    out = args.out or rendered.out / "bench"
    # each twin in a job folder inside the first one: two folders named by the same second
    # would be one, and the first deployment's workers would read a twin's plan
    jobs = [(cfg.mode, rendered)]
    for k, (label, twin) in enumerate(twins, start=1):
        job, code = render_or_explain(twin, rendered.out / ("aggregated" if label == "aggregated"
                                                             else f"compare-{k}"))
        if job is None:
            return code
        jobs.append((label, job))

    supervisors: dict[str, Supervisor] = {}

    def focus(name: str | None) -> None:
        """cluster.device=cpu: the twins share this machine's cores, so only the measured one
        runs; the others are frozen (`Supervisor.pause`). None: all run (warm-up, the
        --verify gate, the stop)."""
        if not freezes_targets(cfg, compare) or len(supervisors) < 2:
            return
        for label, sup in supervisors.items():
            if name is None or label == name:
                sup.resume()
        for label, sup in supervisors.items():
            if name is not None and label != name:
                sup.pause()

    def start(k: int, urls: dict[str, str]) -> int:
        """Start jobs[k] (its supervisor stops it when the bench returns), then the next."""
        if k == len(jobs):
            return bench(urls, out, focus)
        name, job = jobs[k]
        supervisor = Supervisor.for_job(job, out=sys.stderr if args.json else sys.stdout)
        supervisors[name] = supervisor
        return supervisor.run(smoke=lambda url: start(k + 1, {**urls, name: url}), task="bench")

    return start(0, {})
