"""`transfer.gpu_memory`: how KV in GPU memory reaches the fabric (pure: no libfabric, no CUDA).

Values:
  direct  the provider registers the GPU's memory (FI_HMEM, FI_HMEM_CUDA); writes go
          GPU -> NIC -> GPU. Needs a libfabric built with CUDA and a provider with FI_HMEM
          (efa, verbs;ofi_rxm, shm built with CUDA). tcp;ofi_rxm, sockets and udp never offer it.
  staged  KV goes through registered host memory: device -> host bounce buffers on the sender,
          a host landing pool and host -> device on the receiver (transfer/staging.py). Works
          with every provider; costs two PCIe copies.
  auto    (default) direct when the provider, on the node, opens FI_HMEM endpoints and
          registers the rank's KV pools (the attempt is the registration itself, on the rank's
          GPU: transfer/sglang/staging_plane.py `kv_path`), else staged.

Host-side callers (validate, plan) and workers under `auto` use `choose_gpu_memory` without a
probe: they know the provider's name only, so `auto` there is "direct if the node can, else
staged", and the rank decides when it registers its pools. Workers under `direct` pass the
probe's answer (`transfer.fabric.gpu_direct_support`) to refuse a node that cannot before the
engine starts.
"""

from __future__ import annotations

from dataclasses import dataclass

GPU_MEMORY_MODES = ("auto", "direct", "staged")
# Providers that never register device memory, whatever the build (no FI_HMEM in their code).
NO_HMEM_PROVIDERS = frozenset({"tcp;ofi_rxm", "tcp", "sockets", "udp;ofi_rxd", "udp"})
KEY = "transfer.gpu_memory"


@dataclass(frozen=True)
class GpuMemoryChoice:
    """The path KV takes (`direct`, `staged`, or `undecided` on the host side for `auto` with
    a provider that may or may not have CUDA support on the node) and why, for start lines,
    `pdtool plan` and `launch --preflight`."""

    mode: str
    path: str
    reason: str

    def line(self) -> str:
        return f"{KEY}={self.mode}: {self.path} ({self.reason})"


def _check_mode(mode: str) -> None:
    if mode not in GPU_MEMORY_MODES:
        raise ValueError(f"{KEY}: expected one of {', '.join(GPU_MEMORY_MODES)}, got {mode!r}")


def gpu_memory_problem(mode: str, provider: str) -> str | None:
    """What validate refuses: an unknown value, or `direct` with a provider that can never
    register GPU memory. None when the setting can run (a `direct` with a provider that may
    lack CUDA support on the node is checked again by the worker at start-up)."""
    if mode not in GPU_MEMORY_MODES:
        return f"{KEY}: expected one of {', '.join(GPU_MEMORY_MODES)}, got {mode!r}"
    if mode == "direct" and provider in NO_HMEM_PROVIDERS:
        return (f"{KEY}=direct: provider {provider} cannot register GPU memory (no FI_HMEM); "
                f"use {KEY}=staged or auto, or a provider with FI_HMEM (efa, verbs;ofi_rxm)")
    return None


def choose_gpu_memory(mode: str, provider: str,
                      probe: tuple[bool, str] | None = None) -> GpuMemoryChoice:
    """The path for KV in GPU memory. `probe`: the node's answer from
    `transfer.fabric.gpu_direct_support(provider)` (workers), or None (host side).
    ValueError for what `gpu_memory_problem` refuses, and for `direct` when the probe says no."""
    _check_mode(mode)
    problem = gpu_memory_problem(mode, provider)
    if problem:
        raise ValueError(problem)
    if mode == "staged":
        return GpuMemoryChoice(mode, "staged", "chosen: KV through registered host memory")
    if provider in NO_HMEM_PROVIDERS:
        return GpuMemoryChoice(mode, "staged", f"{provider} has no FI_HMEM")
    if probe is None:
        if mode == "direct":
            return GpuMemoryChoice(mode, "direct", f"{provider} registers GPU memory; checked "
                                   f"at start-up")
        return GpuMemoryChoice(mode, "undecided", f"direct if {provider} on the node "
                               f"registers the KV pools' GPU memory (FI_HMEM), else staged; "
                               f"each rank tries at start")
    ok, why = probe
    if ok:
        return GpuMemoryChoice(mode, "direct", f"{provider} registers CUDA memory (FI_HMEM)")
    if mode == "direct":
        raise ValueError(f"{KEY}=direct: {provider} cannot register GPU memory here: {why}; use "
                         f"{KEY}=staged or auto")
    return GpuMemoryChoice(mode, "staged", f"{provider} cannot register CUDA memory here: {why}")
