"""The worker environment (transfer.workerenv): one list of every `PDTOOL_*` variable, the
worker's writer, the typed readers, and the NIC the plan chose reaching the messenger's
libfabric endpoint through the reference engine's real start-up path."""

from __future__ import annotations

import json
import multiprocessing as mp
import re
from pathlib import Path

import pytest
from helpers.pdtool_cfg import recipe

from pdtool.plan import build_plan, to_json
from pdtool.worker import parse_args, resolve, worker_env
from transfer import workerenv
from transfer.wire import write_secret
from transfer.workerenv import WorkerEnvError

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pdtool", "transfer", "templates", "scripts", "gpu", "bench")
# a PDTOOL_* word that is not a bytes literal (the SGLang backend's b"PDTOOL_STATUS" frame tag)
NAME = re.compile(r'(?<!b")\bPDTOOL_[A-Z][A-Z0-9_]*\b')


def _names_in_sources() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for top in SOURCES:
        for path in (ROOT / top).rglob("*"):
            if path.suffix not in (".py", ".j2", ".sh") or path.name == "workerenv.py":
                continue
            for name in NAME.findall(path.read_text(errors="replace")):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_variable_the_code_names_is_listed_once():
    listed = [v.name for v in workerenv.VARIABLES]
    assert len(listed) == len(set(listed))
    assert not set(listed) & set(workerenv.TOOL_VARIABLES)
    found = _names_in_sources()
    unlisted = {n: sorted(f) for n, f in found.items()
                if n not in workerenv.BY_NAME and n not in workerenv.TOOL_VARIABLES}
    assert not unlisted, f"PDTOOL_* variables missing from transfer/workerenv.py: {unlisted}"
    for v in workerenv.VARIABLES:
        assert v.writer and v.reader and v.meaning, v.name
    doc = (ROOT / "docs" / "worker-environment.md").read_text()
    for v in workerenv.VARIABLES:  # the page's row says what the module says
        assert f"| `{v.name}` | {v.writer} | {v.reader} |" in doc, v.name
        assert v.name in workerenv.__doc__, v.name
    for name in workerenv.TOOL_VARIABLES:
        assert f"| `{name}` |" in doc, f"{name} is not documented in docs/worker-environment.md"


def test_the_near_twins_are_gone():
    found = _names_in_sources()
    for gone in ("PDTOOL_FI_DOMAINS", "PDTOOL_RANKS"):  # written, never read
        assert gone not in found, (gone, found.get(gone))


@pytest.fixture
def plan_file(tmp_path: Path):
    def write(*overrides: str) -> Path:
        path = tmp_path / "plan.json"
        path.write_text(to_json(build_plan(recipe("tiny-local", *overrides))))
        return path
    return write


def _ctx(plan: Path, role: str, instance: int = 0, rank: int = 0):
    return resolve(parse_args(["--plan", str(plan), "--role", role, "--instance", str(instance),
                               "--rank", str(rank)]))


@pytest.mark.parametrize(("transfer", "provider", "nic"),
                         [("shm", "shm", "shm"), ("tcp", "tcp;ofi_rxm", "lo")])
def test_the_worker_writes_identity_and_the_ranks_nic(plan_file, transfer, provider, nic):
    ctx = _ctx(plan_file(f"transfer={transfer}"), "decode", 1)
    env = worker_env(ctx)
    assert env["PDTOOL_PLAN"] == str(ctx.plan_path) and env["PDTOOL_ROLE"] == "decode"
    assert env["PDTOOL_INSTANCE"] == "1" and env["PDTOOL_RANK"] == "0"
    assert env["PDTOOL_NODE_RANK"] == "0"
    assert env["PDTOOL_FI_PROVIDER"] == provider and env["PDTOOL_FI_DOMAIN"] == nic
    assert json.loads(env["PDTOOL_NICS"]) == {str(ctx.ranks[0].gpu): nic}
    pdtool = {k for k in env if k.startswith("PDTOOL_")}
    assert pdtool <= set(workerenv.BY_NAME)
    assert workerenv.domain_for(ctx.ranks[0].gpu, env) == nic
    router = worker_env(_ctx_router(ctx.plan_path))
    assert set(router) == {"PDTOOL_PLAN", "PDTOOL_ROLE"}


def _ctx_router(plan: Path):
    return resolve(parse_args(["--plan", str(plan), "--role", "router"]))


def test_readers_name_the_variable_they_cannot_read():
    assert workerenv.domain_for(3, {"PDTOOL_NICS": '{"3":"mlx5_3,mlx5_4","4":"mlx5_5"}'}) \
        == "mlx5_3"
    assert workerenv.domain_for(3, {"PDTOOL_FI_DOMAIN": "efa0", "PDTOOL_NICS": "{}"}) == "efa0"
    assert workerenv.domain_for(0, {}) is None
    for bad in ("[1]", "{", '{"x": "eth0"}', '{"0": 1}'):
        with pytest.raises(WorkerEnvError, match=r"^PDTOOL_NICS="):
            workerenv.nics({"PDTOOL_NICS": bad})
    with pytest.raises(WorkerEnvError, match=r"^PDTOOL_INSTANCE='one' is not an integer"):
        workerenv.integer(workerenv.INSTANCE, {"PDTOOL_INSTANCE": "one"})
    assert workerenv.integer(workerenv.RANK, {"PDTOOL_RANK": ""}) is None
    assert workerenv.provider("tcp;ofi_rxm", {}) == "tcp;ofi_rxm"
    assert workerenv.hosts({"PDTOOL_HOSTS": "10.0.0.1 10.0.0.2"}) == ["10.0.0.1", "10.0.0.2"]


def _prefill_start_up(plan: str, secret: str, tamper: dict[str, str], conn) -> None:
    """A fresh process (libfabric reads its FI_* variables once per process, as in a real
    worker) doing the reference engine's own start-up for prefill rank 0: the worker's
    environment, the RankSpec from the plan (fromplan), model, KV cache and the messenger link
    (link.PrefillSide). Sends back (spec's domain, the endpoint's domain or the error)."""
    import os

    from pdtool.engines.reference.cache import PagedKV
    from pdtool.engines.reference.fromplan import spec_from_context
    from pdtool.engines.reference.link import PrefillSide
    from pdtool.engines.reference.model import TP, TinyModel
    from transfer.messenger import MessengerError

    ctx = _ctx(Path(plan), "prefill")
    os.environ.update({**worker_env(ctx), "PDTOOL_SECRET_FILE": secret, **tamper})
    spec = spec_from_context(ctx)
    model = TinyModel(spec.cfg, TP(spec.tp, spec.rank, None))
    kv = PagedKV(spec.cfg, len(model.kv_heads), 64, spec.page_size)
    try:
        link = PrefillSide(spec, kv, model)
    except MessengerError as exc:
        conn.send((spec.link.domain, f"MessengerError: {exc}"))
        return
    try:
        conn.send((spec.link.domain, link.m.fabric_domain))
    finally:
        link.close()


def _start_up(plan: Path, tmp_path: Path, **tamper: str) -> tuple[str, str]:
    write_secret(tmp_path / "secret.key")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_start_up,
                       args=(str(plan), str(tmp_path / "secret.key"), tamper, child))
    proc.start()
    try:
        assert parent.poll(120), "the prefill start-up did not report within 120 s"
        return parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize(("transfer", "nic"), [("shm", "shm"), ("tcp", "lo")])
def test_the_planned_nic_is_the_domain_the_messenger_opens(plan_file, tmp_path, transfer, nic):
    plan = plan_file(f"transfer={transfer}")
    assert _ctx(plan, "prefill").ranks[0].nics == (nic,)
    assert _start_up(plan, tmp_path) == (nic, nic)


@pytest.mark.slow
def test_a_domain_the_provider_lacks_fails_naming_the_key(plan_file, tmp_path):
    domain, error = _start_up(plan_file("transfer=tcp"), tmp_path, PDTOOL_FI_DOMAIN="nosuchnic0")
    assert domain == "nosuchnic0"
    assert re.search(r"MessengerError: .*domain: cannot open provider 'tcp;ofi_rxm' on domain "
                     r"'nosuchnic0'.*fi_info -p", error), error
