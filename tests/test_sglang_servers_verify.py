"""launcher.verify on real SGLang servers: a pair whose KV arrives damaged is named before the
deployment serves.

`pdtool launch +recipe=sglang-local` with three decode servers, one of which damages the first
KV page of every request once it landed (the SGLang backend's test hook
PDTOOL_SGLANG_CORRUPT_INSTANCE, as a faulty NIC or host would). Every health check passes and
every request answers HTTP 200; launcher.verify sends its greedy prompts through each of the
three prefill->decode pairs, finds the one whose tokens differ from the other two, and the
launch fails naming it, the prompt and the first differing token.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from helpers.sglang_servers import START_TIMEOUT_S, Served

pytestmark = pytest.mark.sglang_servers


@pytest.mark.slow
def test_a_damaged_pair_is_named_before_the_deployment_serves(tmp_path: Path) -> None:
    # four servers load their weights at once here: on CPU, SGLang 0.5.23 counted the others'
    # loads as a server's own weights and once stopped a decode at start-up when pdtool
    # rendered the plan's fraction (pdtool.adapters.sglang.CPU_MEM_FRACTION_STATIC)
    served = Served(tmp_path, "decode.instances=3", "launcher.verify=2",
                    "+launcher.env.decode.PDTOOL_SGLANG_CORRUPT_INSTANCE=1",
                    "--exit-when-healthy")
    p = subprocess.run(served.argv, capture_output=True, text=True,
                       timeout=START_TIMEOUT_S + 180, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out[-4000:]
    assert "healthy: router" in out and "deployment ready" not in out  # never served
    (error,) = [line for line in out.splitlines() if "ERROR: launcher.verify" in line]
    print(error)
    named = re.findall(r"prompt (\d+) through (prefill-\d -> decode-\d): differs from the "
                       r"tokens of 2 other pair\(s\) at token (\d+)", error)
    assert [(prompt, pair) for prompt, pair, _ in named] == \
        [("0", "prefill-0 -> decode-1"), ("1", "prefill-0 -> decode-1")], error
    assert "stopped: every process of the deployment has exited" in out
