"""The plan → RankSpec adapter (what `pdtool.worker` hands the reference engine), no processes."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from helpers.pdtool_cfg import recipe

from pdtool.engines.reference.fromplan import SpecError, spec_from_context
from pdtool.plan import build_plan, to_json
from pdtool.worker import parse_args, resolve
from transfer.wire import write_secret


@pytest.fixture(autouse=True)
def secret(tmp_path, monkeypatch):
    path = tmp_path / "secret.key"
    key = write_secret(path)
    monkeypatch.setenv("PDTOOL_SECRET_FILE", str(path))
    return key


def _ctx(plan, role: str, index: int = 0, rank: int = 0):
    """The worker's context as `pdtool.worker` builds it: from the job's plan.json (the plan
    after its JSON round trip) and the rendered line's arguments."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        path.write_text(to_json(plan))
        argv = ["--plan", str(path), "--role", role, "--host", "127.0.0.1"]
        if role != "router":
            argv += ["--instance", str(index), "--rank", str(rank)]
        return resolve(parse_args(argv))


def test_tiny_local_specs_pair_decoders_with_the_prefill(secret):
    plan = build_plan(recipe("tiny-local", "prefill.tp=2", "model=tiny-mla",
                             "router.request_timeout_s=90"))
    p1 = spec_from_context(_ctx(plan, "prefill", 0, 1))
    assert (p1.role, p1.tp, p1.rank, p1.page_size, p1.chunk) == ("prefill", 2, 1, 4, 16)
    assert p1.dist_port == plan.role_instances("prefill")[0].dist_init_port
    assert p1.cfg.attention == "mla" and p1.cfg.cache_heads == 1 and p1.cfg.num_layers == 4
    assert p1.cfg.kv_dtype == "float32" and p1.secret == secret
    d1 = spec_from_context(_ctx(plan, "decode", 1))
    assert d1.peer == 0 and d1.http_port == plan.role_instances("decode")[1].http_port
    assert d1.link.prefill_tp == 2 and d1.link.decode_tp == 1
    assert d1.link.prefill == [f"http://127.0.0.1:{p1.http_port}/health"]
    assert not d1.allow_faults  # test hooks stay off unless the deployment's env sets them
    # the prefill lead's control socket is the instance's bootstrap port; rank 1 takes any
    p0 = spec_from_context(_ctx(plan, "prefill", 0, 0))
    assert p0.link.control_port == plan.role_instances("prefill")[0].bootstrap_port
    assert p1.link.control_port == 0
    front = spec_from_context(_ctx(plan, "router"))
    assert front.role == "front" and front.http_port == plan.router.port and front.link is None
    assert front.request_timeout_s == 90
    assert front.decoders == [f"http://127.0.0.1:{i.http_port}/health"
                              for i in plan.role_instances("decode")]


@pytest.mark.parametrize(("override", "key"), [
    ("model.vocab_size=32000", "model.vocab_size"),
    ("prefill.kv_dtype=fp8_e4m3", "prefill.kv_dtype"),
    ("prefill.tp=8", "prefill.tp"),  # 4 query heads cannot be split 8 ways
    ("model.head_dim=15", "model.head_dim"),
    ("prefill.max_running_requests=257", "prefill.max_running_requests"),  # the aux rows
])
def test_what_the_engine_cannot_run_names_the_key(override, key):
    plan = build_plan(recipe("tiny-local", override))
    with pytest.raises(SpecError, match=f"^{key}"):
        spec_from_context(_ctx(plan, "prefill"))


def test_liveness_timeouts_reach_the_messenger_settings(secret):
    """transfer.peer_timeout_s / heartbeat_s (reliability issue), transfer.lanes and
    transfer.connect_timeout_s travel plan -> RankSpec, as set (a shorter start-up wait too)."""
    plan = build_plan(recipe("tiny-local", "transfer.peer_timeout_s=2.5",
                             "transfer.heartbeat_s=0.25", "transfer.lanes=3",
                             "transfer.connect_timeout_s=7"))
    spec = spec_from_context(_ctx(plan, "decode", 1))
    assert spec.link.peer_timeout_s == 2.5 and spec.link.heartbeat_s == 0.25
    assert spec.link.lanes == 3 and spec.link.connect_timeout_s == 7


def test_a_peer_timeout_not_above_the_heartbeat_is_refused():
    from helpers.pdtool_cfg import assert_error

    assert_error(recipe("tiny-local", "transfer.peer_timeout_s=0.5", "transfer.heartbeat_s=0.5"),
                 "transfer.peer_timeout_s", "not longer than transfer.heartbeat_s")


def test_max_running_requests_reaches_each_engine():
    """role.max_running_requests bounds the requests an instance holds at once; 0 leaves the
    engine's default (serve: 64 running on decode, the 256 aux rows on prefill)."""
    plan = build_plan(recipe("tiny-local", "decode.max_running_requests=3",
                             "prefill.max_running_requests=5"))
    assert spec_from_context(_ctx(plan, "decode", 1)).max_running == 3
    assert spec_from_context(_ctx(plan, "prefill")).max_running == 5
    assert spec_from_context(_ctx(build_plan(recipe("tiny-local")), "decode")).max_running == 0


def test_kv_pages_are_what_the_plan_shows():
    """The plan's KV tokens are what a reference rank allocates: at most MAX_KV_PAGES pages
    (the plan says it is the cap), and below the cap the budget decides, so mem_fraction
    changes what runs."""
    from pdtool.reference_limits import MAX_KV_PAGES

    plan = build_plan(recipe("tiny-local"))
    decode = {m.role: m for m in plan.memory}["decode"]
    assert decode.capped and decode.kv_tokens == MAX_KV_PAGES * 4
    assert spec_from_context(_ctx(plan, "decode")).num_pages == MAX_KV_PAGES
    small = build_plan(recipe("tiny-local", "decode.mem_fraction=0.001"))
    decode = {m.role: m for m in small.memory}["decode"]
    assert not decode.capped and 0 < decode.kv_tokens < MAX_KV_PAGES * 4
    assert spec_from_context(_ctx(small, "decode")).num_pages == decode.kv_tokens // 4
    sglang = {m.role: m for m in build_plan(recipe("deepseek-r1")).memory}["decode"]
    assert sglang.kv_cap_tokens == 0 and not sglang.capped  # SGLang sizes its own pool


def test_the_model_context_length_bounds_what_the_front_takes():
    """model.context_length reaches every serving rank (RankSpec.context); the decode lead
    publishes min(its cache, the prefill's, the wire's, this) and the front refuses longer
    requests (serve.decode_context)."""
    from pdtool.engines.reference.serve import decode_context

    plan = build_plan(recipe("tiny-local", "model.context_length=1000"))
    spec = spec_from_context(_ctx(plan, "decode"))
    prefill = spec_from_context(_ctx(plan, "prefill"))
    # as serve_decode calls it: with the prefill lead's published context (its cache) and
    # the model's own limit (none for the built-in model)
    assert spec.context == 1000 == prefill.context
    assert decode_context(spec, prefill.num_pages * prefill.page_size, 0) == 1000


def test_each_rank_runs_on_its_plan_gpu(secret):
    """On a GPU cluster every rank gets its plan GPU as its device (a bare "cuda" put every
    rank of a node on GPU 0); on cpu, cpu. A plan FlashInfer cannot read (the tiny model's
    head dim 16 in fp32 pages) is refused by the worker too, naming the key."""
    gpu = ("tiny-local", "cluster=dgx-h100", "transfer=tcp", "prefill.tp=2")
    with pytest.raises(SpecError, match=r"prefill\.kv_dtype: .*fp16 or bf16 pages, got fp32"):
        spec_from_context(_ctx(build_plan(recipe(*gpu)), "prefill", 0))
    plan = build_plan(recipe(*gpu, "model.head_dim=64", "prefill.kv_dtype=fp16",
                             "decode.kv_dtype=fp16"))
    got = {(i.role, i.index, r.rank): spec_from_context(_ctx(plan, i.role, i.index,
                                                             r.rank)).device
           for i in plan.instances for r in i.ranks}
    assert got == {(i.role, i.index, r.rank): f"cuda:{r.gpu}"
                   for i in plan.instances for r in i.ranks}
    assert sorted(got.values()) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    local = build_plan(recipe("tiny-local"))
    assert spec_from_context(_ctx(local, "decode", 1)).device == "cpu"
