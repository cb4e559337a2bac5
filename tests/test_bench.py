"""`pdtool bench`'s figures on fixed request records (no server, no clocks), its argument
checks through the real command line, and the order a comparison interleaves its rounds."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pdtool.bench.args import compare_sets
from pdtool.bench.lengths import Lengths, SpecError, parse_lengths, prompts
from pdtool.bench.stats import (
    Record,
    SloError,
    busy_instance_seconds,
    meets,
    parse_slo,
    percentile,
    ratio_advice,
    stage_rates,
    summarize,
    ttft_added,
)
from pdtool.commands.bench import interleave, target_modes, twin_offsets, twin_overrides


def rec(start: float, stamps: list[float], tokens: list[int] | None = None, inp: int = 10,
        error: str = "") -> Record:
    return Record(start=start, input_tokens=inp, stamps=stamps,
                  tokens=tokens or [1] * len(stamps), end=stamps[-1] if stamps else start + 1,
                  error=error)


def test_percentiles_interpolate_like_numpy():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 7.5]
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0


def test_one_request_ttft_tpot_itl_e2e():
    r = rec(1.0, [1.1, 1.2, 1.4], tokens=[1, 2, 1])  # 4 tokens, the middle chunk carries two
    assert r.ttft == pytest.approx(0.1)
    assert r.e2e == pytest.approx(0.4)
    assert r.tpot == pytest.approx(0.3 / 3)
    assert r.itls == pytest.approx([0.1, 0.2])
    assert rec(0.0, [0.5]).tpot is None  # one token: no time per output token


def test_summary_of_fixed_records():
    rs = [rec(0.0, [0.1, 0.2, 0.3]), rec(0.0, [0.2, 0.4, 0.6]),
          rec(0.5, [], error="HTTP 503: no decode instance is up")]
    s = summarize([rs])
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"] == {"HTTP 503: no decode instance is up": 1}
    assert s["duration_s"] == pytest.approx(1.5)  # the failed one ends at start + 1
    assert s["output_tokens"] == 6 and s["input_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(2 / 1.5)
    assert s["output_throughput"] == pytest.approx(6 / 1.5)
    assert s["ttft_ms"]["p50"] == pytest.approx(150.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(100 + 100 * 0.99)
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert s["itl_ms"]["p50"] == pytest.approx(150.0)
    assert s["e2e_ms"]["p90"] == pytest.approx(300 + 300 * 0.9)
    assert summarize([])["requests"] == 0


def test_an_interleaved_target_is_timed_by_its_own_rounds():
    """A comparison runs A B, B A: the 10 s B ran between A's two rounds are not A's time.
    (Taking first send to last end over all of A's rounds halved its throughput.)"""
    first = [rec(0.0, [0.5, 1.0]), rec(0.0, [0.5, 1.0])]
    second = [rec(11.0, [11.5, 12.0]), rec(11.0, [11.5, 12.0])]
    s = summarize([first, second])
    assert s["duration_s"] == pytest.approx(2.0)
    assert s["request_throughput"] == pytest.approx(4 / 2.0)
    assert s["output_throughput"] == pytest.approx(8 / 2.0)


def test_ttft_added_pairs_the_same_prompts():
    base = [rec(0.0, [0.100]), rec(1.0, [1.200]), rec(2.0, [2.300]), rec(3.0, [3.9])]
    other = [rec(0.0, [0.103]), rec(1.0, [1.210]), rec(2.0, [2.301]),
             rec(3.0, [], error="HTTP 503: down")]
    got = ttft_added(other, base)
    assert got["pairs"] == 3  # the failed request's pair is left out
    assert got["p50"] == pytest.approx(3.0)  # differences 3, 10, 1 ms
    assert got["baseline_ttft_p50_ms"] == pytest.approx(200.0)
    assert got["relative_p50"] == pytest.approx(3.0 / 200.0)
    assert ttft_added([], base)["pairs"] == 0 and ttft_added([], base)["p50"] is None


def test_goodput_counts_requests_within_every_slo():
    fast = rec(0.0, [0.05, 0.06, 0.07])
    slow_start = rec(0.0, [0.5, 0.51, 0.52])
    slow_steps = rec(0.0, [0.05, 0.25, 0.45])
    failed = rec(0.0, [], error="boom")
    slo = parse_slo("ttft_ms=100,tpot_ms=50")
    assert slo == {"ttft_ms": 100.0, "tpot_ms": 50.0}
    assert [meets(r, slo) for r in (fast, slow_start, slow_steps, failed)] == \
        [True, False, False, False]
    s = summarize([[fast, slow_start, slow_steps, failed]], slo)
    assert s["good_requests"] == 1
    assert s["goodput"] == pytest.approx(1 / s["duration_s"])
    assert meets(slow_steps, {}) and not meets(failed, {})  # no SLO: every finished request


@pytest.mark.parametrize("text, why", [("ttft=5", "KEY one of"), ("ttft_ms=fast", "milliseconds"),
                                       ("tpot_ms=-1", "positive"), ("ttft_ms", "KEY=MILLISECONDS")])
def test_bad_slo_names_the_key(text: str, why: str):
    with pytest.raises(SloError, match=why):
        parse_slo(text)


def test_busy_instance_seconds_caps_at_the_instances():
    two_overlapping = [(0.0, 2.0), (1.0, 3.0)]
    assert busy_instance_seconds(two_overlapping, 1) == pytest.approx(3.0)  # the union
    assert busy_instance_seconds(two_overlapping, 2) == pytest.approx(4.0)  # each its own
    assert busy_instance_seconds([(0.0, 1.0)], 4) == pytest.approx(1.0)  # one busy of four


def test_ratio_advice_balances_request_rates():
    # prefill: 1000 input tokens in 1 s on one instance; decode: two requests of 10 outputs
    # (9 after the first token) stepping for 1 s each on two instances -> 9 tokens/s each
    rs = [rec(0.0, [0.5 + 0.1 * i for i in range(10)], inp=500),
          rec(0.5, [1.0 + 0.1 * i for i in range(10)], inp=500)]
    rates = stage_rates(rs, prefill_instances=1, decode_instances=2)
    assert rates.prefill_tokens_s == pytest.approx(1000 / 1.0)
    assert rates.decode_tokens_s == pytest.approx(18 / (0.9 + 0.9))
    assert (rates.mean_input, rates.mean_output) == (500, 9)
    # one prefill instance serves 1000/500 = 2 req/s; one decode 10/9 req/s -> 1.8 decodes
    adv = ratio_advice(rates, prefill_instances=1)
    assert adv.decode_per_prefill == pytest.approx(1.8)
    assert (adv.decode_instances, adv.override) == (2, "decode.instances=2")
    assert ratio_advice(rates, prefill_instances=3).override == "decode.instances=5"
    assert stage_rates([rec(0.0, [], error="x")], 1, 1) is None


def test_ratio_spread_says_how_far_the_advice_moves_within_a_run():
    from pdtool.bench.stats import SPREAD_MIN_REQUESTS, SPREAD_SLICES, ratio_spread

    def run(prefill_s: list[float]) -> list[Record]:
        # one request after another: its prefill, then 10 tokens 0.1 s apart
        return [rec(3.0 * i, [3.0 * i + p + 0.1 * k for k in range(10)], inp=500)
                for i, p in enumerate(prefill_s)]

    n = SPREAD_SLICES * SPREAD_MIN_REQUESTS
    # the same requests throughout: every slice gives the whole run's ratio
    same = run([0.5] * n)
    whole = ratio_advice(stage_rates(same, 1, 1), 1).decode_per_prefill
    assert ratio_spread(same, 1, 1) == pytest.approx((whole, whole))
    # prefill twice as slow in the last quarter: one prefill instance feeds half as many
    # decode instances there
    lo, hi = ratio_spread(run([0.5] * (n - n // 4) + [1.0] * (n // 4)), 1, 1)
    assert (lo, hi) == pytest.approx((whole / 2, whole))
    assert ratio_spread(same[:n - 1], 1, 1) is None  # a slice short of its minimum


def test_lengths_parse_draw_and_prompts():
    assert parse_lengths("64", "--isl") == Lengths(64, 64)
    assert parse_lengths("32-2000", "--isl") == Lengths(32, 2000)
    assert parse_lengths("16-256:log", "--osl") == Lengths(16, 256, True)
    for bad in ("", "abc", "10-5", "0", "5-"):
        with pytest.raises(SpecError, match="--isl"):
            parse_lengths(bad, "--isl")
    draw = Lengths(32, 2000, True).draw(np.random.default_rng(3), 500)
    assert min(draw) >= 32 and max(draw) <= 2000
    assert np.median(draw) < (32 + 2000) / 2  # log-uniform: most prompts short
    a = prompts(np.random.default_rng(7), [5, 300], vocab=256)
    assert [len(p) for p in a] == [5, 300] and all(0 <= t < 256 for p in a for t in p)
    assert a == prompts(np.random.default_rng(7), [5, 300], vocab=256)  # seeded
    # a shared prefix (a system prompt): the same first tokens, the rest differs
    b = prompts(np.random.default_rng(7), [40, 64, 300], vocab=256, shared=32)
    assert [len(p) for p in b] == [40, 64, 300]
    assert b[0][:32] == b[1][:32] == b[2][:32] and b[0][32:40] != b[1][32:40]
    with pytest.raises(SpecError, match=r"--shared-prefix: 40 tokens .* shortest prompt \(40"):
        prompts(np.random.default_rng(7), [40, 64], vocab=256, shared=40)


def test_interleave_alternates_targets_and_covers_every_request():
    plan = interleave(["disaggregated", "aggregated"], list(range(10)), rounds=4)
    ab, ba = ["disaggregated", "aggregated"], ["aggregated", "disaggregated"]
    assert [t for t, _ in plan] == ab + ba + ab + ba
    for target in ("disaggregated", "aggregated"):
        got = [i for t, part in plan if t == target for i in part]
        assert got == list(range(10))
    assert len(interleave(["a", "b"], [0, 1], rounds=8)) == 4  # never more rounds than requests


def test_each_compared_twin_moves_every_port():
    from pdtool.compose import load_config

    cfg, _ = load_config(["+recipe=tiny-local"])
    compare = compare_sets(["aggregated", "transfer=tcp transfer.timeout_s=30"])
    assert compare == [("aggregated", ["mode=aggregated"]),
                       ("transfer=tcp transfer.timeout_s=30",
                        ["transfer=tcp", "transfer.timeout_s=30"])]
    assert target_modes(cfg, compare) == {"disaggregated": "disaggregated",
                                          "aggregated": "aggregated",
                                          "transfer=tcp transfer.timeout_s=30": "disaggregated"}
    for k, (_, extra) in enumerate(compare, start=1):
        over = twin_overrides(cfg, ["+recipe=tiny-local"], extra, offset=1000 * k)
        assert over[:1 + len(extra)] == ["+recipe=tiny-local", *extra]
        assert f"router.port={cfg.router.port + 1000 * k}" in over
        assert f"decode.http_port={cfg.decode.http_port + 1000 * k}" in over
        twin, _ = load_config(over)
        assert twin.prefill.http_port == cfg.prefill.http_port + 1000 * k
    assert load_config(twin_overrides(cfg, [], ["mode=aggregated"], 100))[0].mode == \
        "aggregated"


def test_compared_twins_share_no_port_with_the_base_or_each_other():
    """tiny-local's aggregated twin moved by a plain 1000 put its prefill HTTP port (31000) on
    the base's decode HTTP port: `pdtool bench --launch --compare aggregated` failed with
    "Address already in use" on the recipe's own ports."""
    from pdtool.compose import load_config
    from pdtool.ports import deployment_ports

    base = ["+recipe=tiny-local"]
    cfg, _ = load_config(base)
    compare = compare_sets(["aggregated", "decode.instances=3"])
    seen = deployment_ports(cfg)
    for (_, extra), offset in zip(compare, twin_offsets(cfg, base, compare), strict=True):
        twin, _ = load_config(twin_overrides(cfg, base, extra, offset))
        ports = deployment_ports(twin)
        assert not ports & seen, sorted(ports & seen)
        seen |= ports


def test_twins_keep_out_of_the_ephemeral_ports():
    """Three twins of sglang-local moved up by 1000s reached 33301, inside Linux's ephemeral
    range (32768-60999): an outgoing connection held it and the nixl twin's router could not
    bind its metrics listener. Twins go down instead where up would enter the range."""
    from pdtool.compose import load_config
    from pdtool.ports import deployment_ports

    base = ["+recipe=sglang-local"]
    cfg, _ = load_config(base)
    compare = compare_sets(["transfer.backend=mooncake", "transfer.backend=nixl", "aggregated"])
    avoid = range(32768, 61000)
    offsets = twin_offsets(cfg, base, compare, avoid)
    assert offsets[0] > 0 > offsets[1]  # up while it stays below the range, then down
    seen = deployment_ports(cfg)
    for (_, extra), offset in zip(compare, offsets, strict=True):
        ports = deployment_ports(load_config(twin_overrides(cfg, base, extra, offset))[0])
        assert not [p for p in ports if p in avoid] and not ports & seen, (offset, sorted(ports))
        seen |= ports


def test_frozen_sglang_servers_keep_the_routers_connections(tmp_path):
    """A compared SGLang deployment frozen between its rounds for longer than uvicorn's 5 s
    keep-alive closed the router's pooled connection as the router reused it: one request
    waited 120 s. Every launched deployment's servers keep idle connections for the run."""
    from pdtool.commands.bench import frozen_server_overrides
    from pdtool.compose import load_config
    from pdtool.launch.engines import FROZEN_KEEP_ALIVE_S
    from pdtool.render import render

    base = ["+recipe=sglang-local"]
    cfg, _ = load_config(base)
    compare = compare_sets(["transfer.backend=mooncake"])
    extra = frozen_server_overrides(cfg, compare)
    rendered, findings = render(twin_overrides(cfg, [*base, *extra], compare[0][1], 1000),
                                tmp_path / "job")
    assert rendered is not None, findings
    for proc in rendered.spec.procs:  # the SGLang servers
        argv = " ".join(map(str, proc.argv))
        assert f"SGLANG_TIMEOUT_KEEP_ALIVE={FROZEN_KEEP_ALIVE_S}" in argv, proc.name
    assert frozen_server_overrides(cfg, []) == []  # nothing is frozen without a comparison
    assert frozen_server_overrides(load_config(["+recipe=tiny-local"])[0], compare) == []


def bench_cli(*args: str) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([sys.executable, "-m", "pdtool.cli", "bench", *args], capture_output=True,
                       text=True, timeout=120, check=False)
    assert "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    return p


@pytest.mark.parametrize("args, why", [
    (["--isl", "ten"], "--isl: expected N, A-B"),
    (["--osl", "9-3"], "--osl: expected 1 <= A <= B"),
    (["--concurrency", "0"], "--concurrency: expected integers >= 1"),
    (["--concurrency", "2,x"], "--concurrency: expected integers"),
    (["--rate", "0"], "--rate: expected positive"),
    (["--requests", "0"], "--requests: expected at least 1"),
    (["--slo", "ttft=3"], "--slo: expected KEY=MILLISECONDS"),
    (["--url", "http://x", "--launch"], "--url and --launch"),
    (["--compare", "aggregated"], "--compare aggregated: needs --launch"),
    (["--compare", "aggregated", "--compare", "transfer=tcp", "--compare-url", "http://x"],
     "--compare transfer=tcp: needs --launch"),
    (["--compare", "tcp"], "expected KEY=VALUE overrides"),
    (["--compare", "aggregated", "--compare", "mode=aggregated", "--launch"], "given twice"),
    (["--compare-url", "http://x"], "--compare-url: only with --compare"),
    (["mode=aggregated", "--compare", "aggregated", "--compare-url", "http://x"],
     "--compare aggregated: the deployment is already mode=aggregated"),
])
def test_bad_arguments_give_one_clear_line(args: list[str], why: str):
    p = bench_cli(*args)
    assert p.returncode == 2, p.stdout + p.stderr
    assert why in " ".join(p.stderr.split()), p.stderr


def test_sglang_twin_on_the_same_gpus_is_refused(tmp_path):
    """--launch --compare starts both deployments side by side: with SGLang they would take the
    same GPUs, so the command says to start the aggregated one apart and pass its URL."""
    p = bench_cli("+recipe=tiny-local", "engine=sglang", "model.seed=0", "transfer=tcp",
                  "cluster.device=cuda", f"launcher.output_dir={tmp_path}", "--launch",
                  "--compare", "aggregated")
    assert p.returncode == 2, p.stdout + p.stderr
    err = " ".join(p.stderr.split())
    assert "would start the deployments on the same GPUs" in err and "--compare-url" in err
    assert not list(tmp_path.iterdir())  # refused before anything was rendered or started


def test_a_config_validate_refuses_is_refused_before_anything_starts(tmp_path):
    p = bench_cli("engine.kind=vllm", f"launcher.output_dir={tmp_path}", "--launch")
    assert p.returncode == 2, p.stdout + p.stderr
    err = " ".join(p.stderr.split())
    assert "engine.kind" in err and "'vllm' is not one of" in err, err
    assert "Traceback" not in err and "internal error" not in err
    assert not list(tmp_path.iterdir())


def test_no_deployment_is_a_clear_error(tmp_path):
    from pdtool.engines.reference.local import free_port

    p = bench_cli(f"--url=http://127.0.0.1:{free_port()}", "--requests", "1",
                  "--out", str(tmp_path))
    assert p.returncode == 1
    assert "no deployment answers at http://127.0.0.1:" in " ".join(p.stderr.split())


def test_concurrency_and_rate_are_exclusive():
    p = bench_cli("--concurrency", "2", "--rate", "3")
    assert p.returncode == 2 and "not allowed with argument" in p.stderr


def test_text_prompts_tokenize_back_to_the_drawn_lengths(tmp_path, monkeypatch):
    """sglang-router takes text prompts: made of whole-word tokens, they tokenize back to the
    drawn length exactly (decoded random ids came back 60 % longer). On a fresh machine (an
    empty cache) the builtin checkpoint is built first: `bench --launch` makes its prompts
    before anything starts, and stopped there."""
    from tokenizers import Tokenizer

    monkeypatch.setenv("PDTOOL_CACHE", str(tmp_path))

    from pdtool.checkpoints import ensure
    from pdtool.commands.bench import text_prompts

    rng = np.random.default_rng(3)
    lengths = [1, 17, 64, 300]
    texts = text_prompts(prompts(rng, lengths, 320), "builtin:tiny-llama")
    tok = Tokenizer.from_file(f"{ensure('builtin:tiny-llama')}/tokenizer.json")
    assert [len(tok.encode(t, add_special_tokens=False).ids) for t in texts] == lengths
    assert text_prompts(prompts(np.random.default_rng(3), lengths, 320),
                        "builtin:tiny-llama") == texts  # the same seed, the same prompts


def test_a_token_with_no_text_still_counts():
    """A token whose text is empty (a partial UTF-8 sequence the server holds back) arrived on
    every deployment for one 900-token prompt at max_tokens=1: the stream's chunks carry no
    text and the usage says one token. It is one token at the last chunk, not a failure."""
    import asyncio

    from openai.types import Completion, CompletionChoice, CompletionUsage

    from pdtool.bench.load import Request, one

    def chunk(text: str | None, usage: dict | None = None) -> Completion:
        # built unvalidated, as the client builds streamed chunks (finish_reason may be None)
        choices = [] if text is None else [CompletionChoice.model_construct(
            index=0, text=text, finish_reason="length" if usage else None)]
        return Completion.model_construct(
            id="c", object="text_completion", created=0, model="m", choices=choices,
            usage=CompletionUsage.model_construct(**usage) if usage else None)

    class Completions:
        def __init__(self, chunks: list[Completion]) -> None:
            self.chunks = chunks

        async def create(self, **_kw):
            async def stream():
                for c in self.chunks:
                    yield c
            return stream()

    ticks = iter(range(100))
    usage = {"prompt_tokens": 900, "completion_tokens": 1, "total_tokens": 901}
    for chunks in ([chunk(""), chunk(None, usage)], [chunk("", usage)]):
        api = type("Api", (), {"completions": Completions(chunks)})()
        rec = asyncio.run(one(api, "m", Request("some text", 1), lambda: float(next(ticks))))
        assert rec.ok and rec.tokens == [1] and rec.input_tokens == 900, rec


def test_plot_of_one_token_outputs_warns_of_nothing(tmp_path, recwarn):
    """osl 1 has no TPOT or ITL: those panels say so instead of an empty legend's warning."""
    import matplotlib  # noqa: F401  (the load extra, scripts/install.sh: fail, never skip)

    from pdtool.bench.plot import plot

    records = [Record(start=0.0, input_tokens=64, stamps=[0.2 + i / 100], tokens=[1],
                      end=0.21 + i / 100) for i in range(4)]
    out = plot(tmp_path / "latency.png", [("disaggregated", records, summarize([records]))])
    assert out.stat().st_size > 0
    assert not [w for w in recwarn if "legend" in str(w.message)]
