"""pdtool's SGLang plugin seen from SGLang 0.5.23 itself, and the validate rule for SGLang pools.

The plugin is found through the installed entry point (`pip install -e .` registers it), the
way every SGLang process finds it; each check runs in a fresh interpreter so SGLang's
process-wide hook registry starts empty.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import sglang  # noqa: F401  (scripts/install.sh --test installs it: fail, never skip)
from helpers.pdtool_cfg import assert_error, compose, recipe

from pdtool.rules import validate


def _python(code: str, timeout: int = 240) -> str:
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_server_help_lists_pdtool_backend() -> None:
    res = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if "--disaggregation-transfer-backend {" in ln)
    choices = line.split("{", 1)[1].split("}", 1)[0].split(",")
    assert "pdtool" in choices and "mooncake" in choices


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_entry_point_registers_backend_in_a_fresh_sglang_process() -> None:
    out = _python("""
        from importlib.metadata import entry_points
        eps = [e.value for e in entry_points(group="sglang.srt.plugins") if e.name == "pdtool"]
        assert eps == ["transfer.sglang.plugin:register"], eps

        import sglang.srt.managers.disagg_service as svc  # binds get_kv_class before the hooks
        from sglang.srt.plugins import load_plugins
        load_plugins()
        load_plugins()  # idempotent, as SGLang calls it from several places

        from sglang.srt.disaggregation import utils
        from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
        from sglang.srt.server_args import prepare_server_args
        from transfer.sglang import conn

        backend = TransferBackend("pdtool")
        assert backend is TransferBackend.PDTOOL and backend in list(TransferBackend)
        for mod in (utils, svc):  # the hook reached SGLang's `from ... import` copies too
            assert mod.get_kv_class(backend, KVClassType.MANAGER) is conn.PdtoolKVManager
            assert mod.get_kv_class(backend, KVClassType.RECEIVER) is conn.PdtoolKVReceiver
        from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
        from sglang.srt.managers.scheduler import Scheduler
        from transfer.sglang import plugin
        def wraps_with(fn, hook):  # wrappers in fn's __wrapped__ chain that call `hook`
            n = 0
            while fn is not None:
                n += any(c.cell_contents is hook for c in (fn.__closure__ or ()))
                fn = getattr(fn, "__wrapped__", None)
            return n
        # per-layer KV streaming: both hooks applied, once (load_plugins ran twice)
        assert wraps_with(AttentionBackend.forward, plugin.attention_hook) == 1
        assert wraps_with(Scheduler.run_batch, plugin.run_batch_hook) == 1
        assert wraps_with(Scheduler.on_idle, plugin.on_idle_hook) == 1  # idle_wait.py
        fake = utils.get_kv_class(TransferBackend.FAKE, KVClassType.MANAGER)
        assert fake.__name__ == "FakeKVManager"  # other backends still answered by SGLang
        args = prepare_server_args(["--model-path", "dummy", "--disaggregation-mode", "prefill",
                                    "--disaggregation-transfer-backend", "pdtool"])
        print("backend", args.disaggregation_transfer_backend)
    """)
    assert "backend pdtool" in out


@pytest.mark.parametrize("overrides", [
    (),                                                      # TP8 -> TP4: slices packed
    ("engine=sglang", "prefill.tp=4", "decode.tp=4"),        # equal TP: one write per page
    ("engine=reference",),                                   # HND pools, no SGLang
])
def test_validate_quiet_when_sglang_pages_stay_contiguous(overrides) -> None:
    cfg = recipe("llama-3.1-70b", *overrides)
    assert not [f for f in validate(cfg) if "engine=sglang" in f.message]


def test_validate_quiet_for_mla_on_sglang() -> None:
    cfg = compose("+recipe=deepseek-r1", "engine=sglang")
    assert not [f for f in validate(cfg) if "engine=sglang" in f.message]


@pytest.mark.parametrize(("key", "argv", "fragment"), [
    ("engine.extra_args", ["--speculative-algorithm", "DFLASH"], "rules of its own"),
    ("decode.extra_args", ["--pp-size=2"], "pipeline parallelism"),
    ("prefill.extra_args", ["--enable-kv-cache-sharding", "--trust-remote-code"],
     "KV cache sharding"),
])
def test_validate_refuses_sglang_flags_the_backend_cannot_carry(key, argv, fragment) -> None:
    cfg = recipe("llama-3.1-70b", "prefill.tp=4")
    group, field = key.split(".")
    setattr(getattr(cfg, group), field, argv)
    f = assert_error(cfg, key, fragment, "pdtool SGLang transfer backend")
    assert argv[0].split("=")[0] in f.fix


def test_validate_accepts_size_one_and_unrelated_sglang_flags() -> None:
    cfg = recipe("llama-3.1-70b", "prefill.tp=4")
    cfg.decode.extra_args = ["--pp-size", "1", "--attn-cp-size=1", "--trust-remote-code"]
    assert not [f for f in validate(cfg) if f.severity == "error"]


@pytest.mark.parametrize(("key", "argv", "typed"), [
    ("decode.extra_args", ["--page-size", "32"], "decode.page_size"),
    ("prefill.extra_args", ["--tp=2"], "prefill.tp"),
    ("engine.extra_args", ["--kv-cache-dtype", "fp8_e5m2"], "prefill/decode.kv_dtype"),
    ("engine.extra_args", ["--disaggregation-transfer-backend", "nixl"], "transfer.backend"),
])
def test_validate_refuses_flags_pdtool_renders_naming_the_key(key, argv, typed) -> None:
    """A flag pdtool renders from a typed key, repeated in extra_args, silently won (SGLang
    keeps the last value): the plan and the backend's write counts described another
    deployment. Refused, naming the key to set instead."""
    cfg = recipe("llama-3.1-70b", "prefill.tp=4")
    group, field = key.split(".")
    setattr(getattr(cfg, group), field, argv)
    f = assert_error(cfg, key, f"rendered from {typed}")
    assert f"set {typed}" in f.fix
