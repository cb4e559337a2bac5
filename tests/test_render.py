"""`pdtool render`: every recipe for both launchers, shellcheck-clean scripts, hostile values
reaching processes as single literal arguments, refusal of invalid configs, the 0600 secret."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import run_cli
from helpers.rendered import check_script, launcher_overrides
from hypothesis import given, settings
from hypothesis import strategies as st

from pdtool.compose import load_config, recipe_files
from pdtool.launch import secrets
from pdtool.launch.shell import Var, q, word, words
from pdtool.launch.spec import spec_from_dict
from pdtool.launch.supervisor import from_job_folder
from pdtool.plan import build_plan, compress_cpus, expand_cpus, from_json
from pdtool.render import SECRET_NAME, render, write_job_folder

HERE = Path(__file__).parent
RECIPES = sorted(recipe_files())


@pytest.mark.parametrize("launcher", ["local", "slurm"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_renders(recipe: str, launcher: str, tmp_path: Path) -> None:
    rendered, findings = render(launcher_overrides(recipe, launcher), tmp_path / "job")
    assert rendered is not None, [f for f in findings if f.severity == "error"]
    out = rendered.out
    script = out / ("job.sbatch" if launcher == "slurm" else "run_local.sh")
    assert rendered.script == script and os.access(script, os.X_OK)
    check_script(script)
    # the folder is self-contained: plan loads back, config and launch spec are there
    plan = from_json((out / "plan.json").read_text())
    assert plan.recipe == recipe and plan.launcher == launcher
    assert "model:" in (out / "config.yaml").read_text()
    launch = json.loads((out / "launch.json").read_text())
    names = [p["name"] for p in launch["processes"]]
    assert len(names) == len(set(names)) and names
    # one process per instance node (SGLang) or per rank (reference); the script hands over
    # to the supervisor, which runs exactly what launch.json lists: the rendered spec
    assert spec_from_dict(launch) == rendered.spec
    text = script.read_text()
    assert 'exec "${PDTOOL_PYTHON}" -m pdtool.launch.supervisor "${RUN_DIR}"' in text
    if launcher == "slurm":
        assert f"#SBATCH --nodes={plan.nodes}" in text
        for p in rendered.spec.all():  # each its own job step, logging to LOG_DIR/NAME.log
            assert p.argv[0] == "srun" and f"--job-name={p.name}" in p.argv, p.argv
            assert any(str(a).startswith("--relative=") for a in p.argv)
    assert stat.S_IMODE((out / SECRET_NAME).stat().st_mode) == 0o600


def test_render_is_reproducible(tmp_path: Path) -> None:
    over = launcher_overrides("deepseek-r1", "slurm")
    a, _ = render(over, tmp_path / "a")
    b, _ = render(over, tmp_path / "b")
    for name in ("plan.json", "config.yaml"):
        assert (a.out / name).read_text() == (b.out / name).read_text()
    sa = a.script.read_text().replace(str(a.out), "DIR")
    sb = b.script.read_text().replace(str(b.out), "DIR")
    assert sa == sb
    # the secret is per deployment, and re-rendering a folder keeps it (running jobs use it)
    assert (a.out / SECRET_NAME).read_text() != (b.out / SECRET_NAME).read_text()
    before = (a.out / SECRET_NAME).read_text()
    render(over, tmp_path / "a")
    assert (a.out / SECRET_NAME).read_text() == before


def test_cli_refuses_invalid_config(tmp_path: Path) -> None:
    out = tmp_path / "job"
    res = run_cli("render", "+recipe=tiny-local", "prefill.tp=3", "--out", str(out))
    assert res.returncode == 1
    assert "not rendered" in res.stderr and "prefill.tp" in res.stderr
    assert "Traceback" not in res.stderr
    assert not out.exists()


def test_cli_render_never_prints_the_secret(tmp_path: Path) -> None:
    out = tmp_path / "job"
    res = run_cli("render", "+recipe=tiny-local", "--out", str(out))
    assert res.returncode == 0, res.stderr
    secret = (out / SECRET_NAME).read_text().strip()
    assert len(bytes.fromhex(secret)) == 32
    assert secret not in res.stdout + res.stderr
    for f in out.iterdir():
        if f.is_file() and f.name != SECRET_NAME:
            assert secret not in f.read_text()
    # the script hands over to the supervisor, which passes the key's path (not the key) to
    # every process as PDTOOL_SECRET_FILE
    assert "pdtool.launch.supervisor" in (out / "run_local.sh").read_text()


def job_processes(run_dir: Path) -> list[int]:
    """Live processes started for a job folder (the scripts export PDTOOL_RUN_DIR)."""
    mark = f"PDTOOL_RUN_DIR={run_dir}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if (d.name.isdigit() and mark in (d / "environ").read_bytes().split(b"\0")
                    and (d / "stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


HOSTILE = {
    "path": "/models/my model's \"dir\"/$(touch PWNED)/;rm -rf x;`touch PWNED2`\nline2 $HOME *",
    "name": "name with spaces; $(id) `id` 'q' \"dq\" \\ && || > out <in | tee",
    "env": "v a l;$(touch PWNED3)`x`'\"\n\t$PATH",
}


def hostile_cfg(launcher: str):
    # ports of their own: a server of another test on the default ports would answer /health
    cfg, findings = load_config(["+recipe=tiny-local", "engine=sglang", "model.seed=0",
                                 "cluster.device=cuda", f"launcher={launcher}",
                                 "cluster.nodes=4", "launcher.health_timeout_s=2",
                                 "transfer=tcp", "prefill.http_port=38100",
                                 "decode.http_port=38110", "prefill.bootstrap_port=38120",
                                 "prefill.dist_init_port=38130", "decode.dist_init_port=38140",
                                 "router.port=38150"])
    assert cfg is not None, findings
    cfg.model.path = HOSTILE["path"]
    cfg.model.name = HOSTILE["name"]
    cfg.launcher.env.prefill["PDTOOL_TEST_HOSTILE"] = HOSTILE["env"]
    cfg.engine.python = str(HERE / "helpers" / "argv_dump.py")
    return cfg


@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_hostile_values_render_shellcheck_clean(launcher: str, tmp_path: Path) -> None:
    cfg = hostile_cfg(launcher)
    rendered = write_job_folder(cfg, build_plan(cfg), tmp_path / "job")
    check_script(rendered.script)


@pytest.mark.slow
def test_hostile_values_reach_processes_as_single_arguments(tmp_path: Path) -> None:
    """Run the rendered local script with an interpreter that records its argv: every hostile
    value arrives as exactly one argument, byte for byte, and nothing in it was executed."""
    cfg = hostile_cfg("local")
    rendered = write_job_folder(cfg, build_plan(cfg), tmp_path / "job")
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    env = {**os.environ, "ARGV_DUMP_DIR": str(dumps), "PDTOOL_PYTHON": sys.executable}
    proc = subprocess.Popen(["bash", str(rendered.script)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
        left = job_processes(rendered.out)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        for pid in job_processes(rendered.out):
            os.kill(pid, 9)
    res = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert left == [], "processes outlived the script"
    # nobody serves health, so the script times out after 2 s and stops everything
    assert res.returncode == 1, res.stdout + res.stderr
    assert "never healthy" in res.stderr
    records = [json.loads(p.read_text()) for p in dumps.glob("*.json")]
    workers = [r for r in records if "pdtool.worker" in r["argv"]]
    assert len(workers) == len(rendered.spec.procs) == 3
    for r in workers:
        argv = r["argv"]
        engine = argv[argv.index("--") + 1:]
        assert engine[1:3] == ["-m", "sglang.launch_server"]
        assert engine[engine.index("--model-path") + 1] == HOSTILE["path"]
        assert engine[engine.index("--served-model-name") + 1] == HOSTILE["name"]
        role = argv[argv.index("--role") + 1]
        if role == "prefill":
            assert r["env"]["PDTOOL_TEST_HOSTILE"] == HOSTILE["env"]
    for f in ("PWNED", "PWNED2", "PWNED3"):
        assert not (tmp_path / f).exists() and not (rendered.out / f).exists()


def test_shellcheck_is_installed() -> None:
    assert shutil.which("shellcheck"), "install Debian's shellcheck (scripts/install.sh does)"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(exclude_categories=("Cs",),
                                               exclude_characters="\0"), max_size=40),
                min_size=1, max_size=4))
def test_quoted_words_are_single_literal_arguments(values: list[str]) -> None:
    """Whatever the text, bash receives each quoted word as exactly that one argument, and a
    Word mixing literals with a variable expands only the variable."""
    line = words(values) + " " + q(word("<", Var("X"), values[0]))
    res = subprocess.run(["bash", "-c", f'X="a b"; printf "%s\\0" {line}'],
                         capture_output=True, timeout=10)
    assert res.returncode == 0, res.stderr
    got = res.stdout.decode("utf-8", "surrogateescape").split("\0")[:-1]
    assert got == [*values, "<a b" + values[0]]


def test_slurm_job_folder_with_percent_is_refused(tmp_path: Path) -> None:
    rendered, findings = render(launcher_overrides("deepseek-r1", "slurm"), tmp_path / "a%jb")
    assert rendered is None
    assert findings[-1].key == "launcher.output_dir" and "%" in findings[-1].message


def sbatch_header(script: Path) -> list[str]:
    return [line.split(" ", 1)[1] for line in script.read_text().splitlines()
            if line.startswith("#SBATCH ")]


def test_shared_nodes_ask_for_what_the_processes_use(tmp_path: Path) -> None:
    """launcher.exclusive=false: the job asks for the busiest node's CPUs, the memory and the
    GPUs; each step asks for its ranks' CPUs (Slurm chose which CPUs the job has: no mask)."""
    over = [*launcher_overrides("llama-3.1-70b", "slurm"), "launcher.exclusive=false",
            "launcher.mem=400G"]
    rendered, findings = render(over, tmp_path / "job")
    assert rendered is not None, findings
    head = sbatch_header(rendered.script)
    assert "--exclusive" not in head and "--mem=0" not in head
    # p5: 96 CPUs per NUMA node, 4 GPUs each, so a node of 8 ranks uses all 192
    assert {"--ntasks-per-node=1", "--cpus-per-task=192", "--mem=400G",
            "--gpus-per-node=8"} <= set(head)
    dec = next(p for p in rendered.spec.procs if p.name == "decode-1.n0")
    assert "--cpus-per-task=96" in dec.argv
    assert not [a for a in dec.argv if str(a).startswith(("--cpu-bind", "--gres", "--gpus"))]


@pytest.mark.parametrize(("directive", "extra", "want"), [
    ("gpus-per-node", [], ["--gpus-per-node=8"]),
    ("gres", [], ["--gres=gpu:8"]),
    ("none", ["--gres=gpu:h100:8"], ["--gres=gpu:h100:8"]),
])
def test_one_gpu_request_in_the_header_and_none_in_the_steps(tmp_path: Path, directive,
                                                             extra, want) -> None:
    """launcher.gpu_directive picks how the job asks (sites and Slurm versions refuse one or
    the other); a site's own option in sbatch_extra is the only one with `none`; the steps ask
    nothing and inherit the job's GPUs (checked on the emulated cluster in
    test_slurm_launch.py)."""
    over = [*launcher_overrides("llama-3.1-70b", "slurm"), f"launcher.gpu_directive={directive}",
            f"launcher.sbatch_extra=[{','.join(repr(e) for e in extra)}]"]
    rendered, findings = render(over, tmp_path / "job")
    assert rendered is not None, findings
    head = sbatch_header(rendered.script)
    assert [o for o in head if o.startswith(("--gres", "--gpus"))] == want
    for p in rendered.spec.procs + rendered.spec.router:
        assert not [a for a in p.argv if str(a).startswith(("--gres", "--gpus"))], p.name


def test_a_gpu_option_in_sbatch_extra_beside_the_directive_is_refused() -> None:
    from helpers.pdtool_cfg import compose

    from pdtool.rules import validate

    base = ("+recipe=llama-3.1-70b", "launcher=slurm")
    for opt in ("--gres=gpu:8", "--gpus-per-node=8", "--gpus=16", "-G16"):
        (err,) = [f for f in validate(compose(*base, f"launcher.sbatch_extra=['{opt}']"))
                  if f.severity == "error"]
        assert err.key == "launcher.sbatch_extra.0" and "gpu_directive=none" in err.fix
    assert not [f for f in validate(compose(*base, "launcher.sbatch_extra=['--gres=nvme:1']"))
                if f.severity == "error"]
    (warn,) = [f for f in validate(compose(*base, "launcher.gpu_directive=none"))
               if f.key == "launcher.gpu_directive"]
    assert warn.severity == "warning" and "asks for no GPUs" in warn.message


def test_exclusive_steps_take_the_nodes_cpus_not_the_presets(tmp_path: Path) -> None:
    """An exclusive step holds every CPU of its node, however many (the preset's 192 is never
    asked), and its worker binds itself to its share of them (PDTOOL_CPUS_FROM_NODE; the
    emulated cluster checks the binding in tests/test_slurm_launch.py)."""
    rendered, findings = render(launcher_overrides("llama-3.1-70b", "slurm"), tmp_path / "job")
    assert rendered is not None, findings
    head = sbatch_header(rendered.script)
    assert {"--exclusive", "--mem=0", "--gpus-per-node=8", "--ntasks-per-node=1"} <= set(head)
    for p in [*rendered.spec.procs, *rendered.spec.router]:
        assert {"--whole", "--cpu-bind=none"} <= set(p.argv), p.name
        assert not [a for a in p.argv if str(a).startswith(("--cpus-per-task", "--physcpubind"))]
        assert ("PDTOOL_CPUS_FROM_NODE=1" in p.argv) == (p.role != "router")
    # the reference engine keeps numactl for memory only
    rendered, _ = render([*launcher_overrides("tiny-local", "slurm")], tmp_path / "ref")
    assert {a for p in rendered.spec.procs for a in p.argv
            if str(a).startswith("--membind")} == {"--membind=0"}
    assert not [a for p in rendered.spec.procs for a in p.argv
                if str(a).startswith("--physcpubind")]


def test_local_per_node_processes_are_bound_to_their_ranks_cpus(tmp_path: Path) -> None:
    """launcher=local, engine=sglang: one process drives an instance's ranks on a node;
    numactl binds it to their CPUs and NUMA nodes, as srun's --cpu-bind does on Slurm."""
    # 16 GPUs on one machine, the prefill instance's 8 over both NUMA nodes
    over = [*launcher_overrides("llama-3.1-70b", "local"),
            "cluster.gpu_numa=[0,0,0,0,1,1,1,1,0,0,0,0,1,1,1,1]"]
    rendered, findings = render(over, tmp_path / "job")
    assert rendered is not None, findings
    plan = rendered.plan
    spans = set()
    for p in rendered.spec.procs:
        ranks = [r for i in plan.instances if i.role == p.role and i.index == p.instance
                 for r in i.ranks if r.rank in p.ranks]
        cpus = sorted({c for r in ranks for c in expand_cpus(r.cpus)})
        nodes = ",".join(str(n) for n in sorted({r.numa for r in ranks}))
        at = p.argv.index("numactl")
        assert p.argv[at + 1:at + 3] == [f"--physcpubind={compress_cpus(cpus)}",
                                         f"--membind={nodes}"], p.argv
        assert p.argv.index("sglang.launch_server") > at
        spans.add(nodes)
    assert "0,1" in spans  # an instance over both NUMA nodes of a p5 node


def test_stop_grace_sets_the_scripts_grace_and_the_slurm_signal_lead(tmp_path: Path) -> None:
    """launcher.stop_grace_s: SIGTERM to SIGKILL in the scripts' stop, and the batch script is
    signalled 3 x that + 30 s before the time limit (30 s: --signal=B:TERM@120)."""
    for grace, lead in ((30, 120), (10, 60)):
        over = [*launcher_overrides("llama-3.1-70b", "slurm"), f"launcher.stop_grace_s={grace}"]
        rendered, findings = render(over, tmp_path / f"job{grace}")
        assert rendered is not None, findings
        assert f"--signal=B:TERM@{lead}" in sbatch_header(rendered.script)
        sup, _ = from_job_folder(rendered.out, hosts=None, node_names=None, log_dir=None,
                                 preflight=False, setup_done=True)
        assert sup.stop_grace == grace  # what the script's supervisor gives each stop group


@pytest.mark.parametrize(("over", "key", "fragment"), [
    (["launcher.stop_grace_s=0"], "launcher.stop_grace_s", "must be >= 1"),
    (["launcher.exclusive=false"], "launcher.mem", "gets only the memory it asks"),
    (["launcher.mem=lots"], "launcher.mem", "not a Slurm memory size"),
    (["launcher.gpus_per_node=4"], "launcher.gpus_per_node", "GPUs 0..7"),
    (["launcher.gpus_per_node=16"], "launcher.gpus_per_node", "nodes have 8"),
])
def test_slurm_resource_keys_are_checked(over, key, fragment) -> None:
    from helpers.pdtool_cfg import assert_error, recipe

    cfg = recipe("llama-3.1-70b", *over)
    assert_error(cfg, key, fragment)


@pytest.mark.slow
def test_secrets_reach_processes_only_through_0600_files(tmp_path: Path) -> None:
    """A secret-looking launcher.env value and a launcher.secret_env name taken from the shell:
    in no argv, script, saved config or launch.json; in 0600 files; in the processes' env."""
    out, dumps = tmp_path / "job", tmp_path / "dumps"
    dumps.mkdir()
    token, password = "hf_Zq81secret", "pw 'quoted' $(touch PWNED)"
    over = ["+recipe=tiny-local", "engine=sglang", "model.seed=0", "cluster.device=cuda",
            "launcher.health_timeout_s=2", "prefill.http_port=38200", "decode.http_port=38210",
            "prefill.bootstrap_port=38220", "prefill.dist_init_port=38230",
            "decode.dist_init_port=38240", "router.port=38250",
            f"engine.python={HERE / 'helpers' / 'argv_dump.py'}",
            f"+launcher.env.all.HF_TOKEN={token}",
            "launcher.secret_env=[DB_PASS]", "+launcher.env.decode.PLAIN=visible"]
    env = {**os.environ, "DB_PASS": password, "ARGV_DUMP_DIR": str(dumps),
           "PDTOOL_PYTHON": sys.executable}
    res = run_cli("render", *over, "--out", str(out), env=env)
    assert res.returncode == 0, res.stderr
    assert token not in res.stdout + res.stderr
    files = {f.name: f for f in out.iterdir() if f.is_file()}
    for name in ("secret-prefill.env", "secret-decode.env", "secret-router.env"):
        assert stat.S_IMODE(files[name].stat().st_mode) == 0o600
    for name, f in files.items():
        if not name.startswith("secret"):
            text = f.read_text()
            assert token not in text and "pw 'quoted'" not in text, name
    assert "REDACTED" in (out / "config.yaml").read_text()
    proc = subprocess.Popen(["bash", str(out / "run_local.sh")], cwd=tmp_path, env={
        k: v for k, v in env.items() if k != "DB_PASS"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        for pid in job_processes(out):
            os.kill(pid, 9)
    records = [json.loads(p.read_text()) for p in dumps.glob("*.json")]
    workers = [r for r in records if "pdtool.worker" in r["argv"]]
    assert len(workers) == 3
    for r in workers:
        assert r["env"]["HF_TOKEN"] == token and r["env"]["DB_PASS"] == password
        assert not any(token in a or "quoted" in a for a in r["argv"])
        role = r["argv"][r["argv"].index("--role") + 1]
        assert ("PLAIN" in r["env"]) == (role == "decode")
    assert not (tmp_path / "PWNED").exists() and not (out / "PWNED").exists()
    # the deployment stopped (its health wait failed): the folder keeps no secret
    assert not [f.name for f in out.iterdir() if f.name.startswith("secret")]
    # a second run of the folder cannot re-make the environment secrets: it says so and starts
    # nothing
    again = subprocess.run(["bash", str(out / "run_local.sh")], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 1, again.stdout + again.stderr
    assert ("secret-decode.env, secret-prefill.env, secret-router.env are gone" in again.stderr
            and "Render the job again" in again.stderr), again.stderr
    assert len(list(dumps.glob("*.json"))) == len(records)
    assert not (out / "secret.key").exists()


def test_a_rerun_of_a_stopped_folder_gets_a_fresh_control_plane_key(tmp_path: Path) -> None:
    """What the supervisor does first: the key a stopped run removed is made again (0600, a
    new value); a role's environment secrets cannot be, and their absence is named."""
    rendered, _ = render(launcher_overrides("tiny-local", "local"), tmp_path / "job")
    key = rendered.out / "secret.key"
    first = key.read_text()
    assert secrets.remove(rendered.out) == ["secret.key"] and not key.exists()
    assert secrets.missing(rendered.out, ()) is None
    secrets.ensure_key(rendered.out)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.read_text() != first
    assert "secret-decode.env" in secrets.missing(rendered.out, ("decode",))


def test_listed_secret_without_value_is_refused(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NO_SUCH_SECRET_X"}
    res = run_cli("render", "+recipe=tiny-local", "launcher.secret_env=[NO_SUCH_SECRET_X]",
                  "--out", str(tmp_path / "j"), env=env, clear=True)
    assert res.returncode == 1
    assert "launcher.secret_env" in res.stderr and "NO_SUCH_SECRET_X" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_script_options_are_arguments_not_environment(launcher: str, tmp_path: Path) -> None:
    rendered, _ = render(launcher_overrides("tiny-local", launcher), tmp_path / "job")
    text = rendered.script.read_text()
    assert f"RUN_DIR={q(str(rendered.out))}\n" in text  # not ${PDTOOL_RUN_DIR:-...}
    assert "PDTOOL_EXIT_WHEN_HEALTHY:-" not in text
    res = subprocess.run(["bash", str(rendered.script), "--bogus"], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 2 and "usage:" in res.stderr
    if launcher == "slurm":
        assert all(p.argv[:2] == ["srun", "--export=ALL"] for p in rendered.spec.all())


def test_cross_node_loopback_is_refused_and_a_shared_host_nic_warned() -> None:
    from helpers.pdtool_cfg import assert_error, assert_warning, findings_for, recipe

    cfg = recipe("tiny-local", "launcher=slurm", "cluster.nodes=2", "transfer=tcp")
    assert_error(cfg, "transfer.provider", "loopback interface lo between different nodes")
    one = recipe("tiny-local", "launcher=slurm", "cluster.nodes=2", "transfer=tcp",
                 "cluster.one_host=true")
    assert findings_for(one, "transfer.provider") == []
    cfg = recipe("llama-3.1-70b", "transfer=tcp",
                 "cluster.nics=[{name:eth0,kind:tcp,gbps:100}]")
    assert_warning(cfg, "transfer.provider", "all 8 GPUs", "12.5 Gb/s per GPU of 100 Gb/s")


def test_multi_node_instances_get_the_socket_interface(tmp_path: Path) -> None:
    over = [*launcher_overrides("deepseek-r1", "slurm"), "prefill.tp=16", "prefill.nodes=2",
            "cluster.socket_ifname=ens5"]
    rendered, findings = render(over, tmp_path / "job")
    assert rendered is not None, findings
    for p in rendered.spec.procs:
        spans = p.role == "prefill"  # TP16 over two nodes; decode instances are one node each
        assert ("NCCL_SOCKET_IFNAME=ens5" in p.argv) == spans
        assert ("GLOO_SOCKET_IFNAME=ens5" in p.argv) == spans
        assert not [a for a in p.argv if str(a).startswith("NCCL_IB_HCA=")]  # EFA: no IB


def test_a_gpu_site_refuses_a_multi_node_instance_without_its_interface() -> None:
    from helpers.pdtool_cfg import assert_error, findings_for, recipe

    over = ("prefill.tp=16", "prefill.nodes=2", "cluster.nodes=5")
    assert_error(recipe("deepseek-r1", *over), "cluster.socket_ifname", "prefill.nodes=2",
                 "container bridge")
    assert findings_for(recipe("deepseek-r1", *over, "cluster.socket_ifname=ens5"),
                        "cluster.socket_ifname") == []
    assert findings_for(recipe("deepseek-r1"), "cluster.socket_ifname") == []  # one node each


def test_connectx_sites_give_nccl_their_compute_nics(tmp_path: Path) -> None:
    """On a DGX (H200 here; the H100 preset has the same NICs), NCCL's IB transport between
    an instance's nodes is held to the preset's compute NICs by exact name; the storage and
    management mlx5 ports stay out. launcher.env still wins."""
    over = [*launcher_overrides("deepseek-r1", "slurm"), "cluster=dgx-h200", "transfer=verbs",
            "prefill.tp=16", "prefill.nodes=2", "cluster.socket_ifname=bond0"]
    rendered, findings = render(over, tmp_path / "job")
    assert rendered is not None, findings
    want = "NCCL_IB_HCA==mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11"
    for p in rendered.spec.procs:
        assert (want in p.argv) == (p.role == "prefill"), p.name
    rendered, _ = render([*over, "+launcher.env.all.NCCL_IB_HCA=mlx5_0"], tmp_path / "job2")
    prefill = next(p for p in rendered.spec.procs if p.role == "prefill")
    assert "NCCL_IB_HCA=mlx5_0" in prefill.argv and want not in prefill.argv


def test_render_multirun_writes_one_folder_per_combination(tmp_path: Path) -> None:
    res = run_cli("render", "-m", "+recipe=tiny-local", "decode.instances=1,2", "--out",
                  str(tmp_path / "sweep"))
    assert res.returncode == 0, res.stderr
    for i, n in ((0, 1), (1, 2)):
        plan = from_json((tmp_path / "sweep" / str(i) / "plan.json").read_text())
        assert sum(1 for inst in plan.instances if inst.role == "decode") == n


def test_dry_run_shows_the_header_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "job"
    res = run_cli("launch", "+recipe=deepseek-r1", "+launcher.env.all.HF_TOKEN=hf_dryrunsecret",
                  "--dry-run", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "#SBATCH --nodes=4" in res.stdout and "#SBATCH --gpus-per-node=8" in res.stdout
    assert "hf_dryrunsecret" not in res.stdout + res.stderr
    assert not out.exists()


def test_container_mode_imports_once_and_sets_up_every_node(tmp_path: Path) -> None:
    """pyxis is not on this machine: the rendered job's structure. One step per node imports
    the image, names it for the job and runs launcher.setup inside it; every process step
    reuses the named container (no second import), with the job folder and the model mounted
    and the home directory not."""
    over = [*launcher_overrides("deepseek-r1", "slurm"),
            "launcher.container_image=lmsysorg/sglang:v0.5.23-cu129",
            "launcher.container_mounts=[/fsx/models:/models:ro]", "model.path=/models/r1",
            "launcher.setup=[pip install --no-deps /fsx/wheels/pdtool.whl,nvidia-smi -L]"]
    rendered, findings = render(over, tmp_path / "job")
    assert rendered is not None, findings
    check_script(rendered.script)
    text = rendered.script.read_text()
    plan = rendered.plan
    setup = [line for line in text.splitlines() if "--job-name=container-setup" in line]
    assert len(setup) == 1
    assert f"--nodes={plan.nodes} --ntasks-per-node=1" in setup[0]
    assert "--container-image=lmsysorg/sglang:v0.5.23-cu129" in setup[0]
    step = rendered.spec.job.container_setup
    assert step[-3:] == ["bash", "-c", "set -euo pipefail\npip install --no-deps "
                         "/fsx/wheels/pdtool.whl\nnvidia-smi -L"]
    assert text.count("--container-image=") == 1  # imported once per node, by that step
    # setup runs in the container on every node, not in the batch shell on node 0
    assert "# launcher.setup (site shell lines, verbatim)" not in text
    for p in rendered.spec.all():
        argv = [q(a) for a in p.argv]
        assert "--container-name=pdtool-\"${SLURM_JOB_ID}\"" in argv
        assert "--no-container-mount-home" in argv
        assert any(a.startswith("--container-mounts=") and "/fsx/models:/models:ro" in a
                   for a in argv)
        assert not any(a.startswith("--container-image") for a in argv)


def test_container_model_path_must_be_mounted() -> None:
    from helpers.pdtool_cfg import assert_error, recipe

    cfg = recipe("deepseek-r1", "launcher.container_image=img", "model.path=/fsx/r1")
    assert_error(cfg, "model.path", "no launcher.container_mounts entry")


def test_a_container_without_pdtool_is_warned() -> None:
    from helpers.pdtool_cfg import assert_warning, findings_for, recipe

    image = "launcher.container_image=lmsysorg/sglang:v0.5.23-cu129"
    w = assert_warning(recipe("deepseek-r1", image), "launcher.setup",
                       "neither launcher.setup nor launcher.container_mounts mentions pdtool")
    assert "pip install /shared/wheels/pdtool.whl" in w.fix and "--no-deps" not in w.fix
    assert findings_for(recipe("deepseek-r1", image,
                               "launcher.setup=[pip install /fsx/wheels/pdtool.whl]"),
                        "launcher.setup") == []


def test_a_script_that_cannot_hand_over_says_why_and_keeps_no_secret(tmp_path: Path) -> None:
    """run_local.sh with PDTOOL_PYTHON naming no command: it cannot exec the supervisor, so it
    says which variable to fix and removes the job's secrets itself (exit 1, not bash's 127)."""
    rendered, _ = render(launcher_overrides("tiny-local", "local"), tmp_path / "job")
    res = subprocess.run(["bash", str(rendered.script)], capture_output=True, text=True,
                         env={**os.environ, "PDTOOL_PYTHON": "/no/such/python"}, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "PDTOOL_PYTHON=/no/such/python: no such command" in res.stderr
    assert not (rendered.out / SECRET_NAME).exists()
