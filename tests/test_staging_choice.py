"""transfer.gpu_memory: the rule validate applies, the host-side plan line, and the worker's
choice from the real probe of this machine's libfabric (Debian 1.17: no CUDA)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from transfer.gpu_memory import GPU_MEMORY_MODES, choose_gpu_memory, gpu_memory_problem


def test_validate_refuses_unknown_values_and_direct_without_fi_hmem():
    assert GPU_MEMORY_MODES == ("auto", "direct", "staged")
    assert "expected one of auto, direct, staged" in gpu_memory_problem("gpu", "efa")
    msg = gpu_memory_problem("direct", "tcp;ofi_rxm")
    assert "transfer.gpu_memory=direct" in msg and "FI_HMEM" in msg and "staged" in msg
    for mode in GPU_MEMORY_MODES:
        assert gpu_memory_problem(mode, "efa") is None
        assert gpu_memory_problem(mode, "shm") is None  # may have CUDA on the node
    assert gpu_memory_problem("staged", "tcp;ofi_rxm") is None
    with pytest.raises(ValueError, match="expected one of"):
        choose_gpu_memory("yes", "shm")


def test_host_side_choice_names_the_path_or_what_decides_it():
    assert choose_gpu_memory("auto", "tcp;ofi_rxm").path == "staged"
    assert choose_gpu_memory("staged", "efa").path == "staged"
    assert choose_gpu_memory("direct", "efa").path == "direct"
    auto = choose_gpu_memory("auto", "efa")
    assert auto.path == "undecided" and "FI_HMEM" in auto.line()
    assert auto.line().startswith("transfer.gpu_memory=auto: undecided")


def test_worker_choice_follows_the_probe_of_this_libfabric():
    """The probe needs no GPU and no CUDA: here (no CUDA in libfabric) auto stages and direct
    is refused with the probe's reason; the host-side module never loads libfabric."""
    from transfer.fabric import gpu_direct_support

    probe = gpu_direct_support("shm")
    assert probe[0] is False
    auto = choose_gpu_memory("auto", "shm", probe)
    assert auto.path == "staged" and "Function not implemented" in auto.reason
    with pytest.raises(ValueError, match=r"transfer\.gpu_memory=direct: shm cannot"):
        choose_gpu_memory("direct", "shm", probe)
    assert choose_gpu_memory("direct", "shm", (True, "")).path == "direct"
    code = ("import sys, transfer.gpu_memory\n"
            "print(any(m.startswith(('transfer.fabric', 'transfer._fabric', 'torch')) "
            "for m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
