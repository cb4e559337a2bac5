"""The sizing model's constants per GPU kind: data in conf/sizing/hardware.yaml, not code.

Each entry holds a GPU's datasheet figures (peak dense FLOPs by weight dtype, HBM and GPU-link
bandwidth) and the efficiencies and overheads fitted to published measurements, with the
source of each fit. `pdtool size --calibrate results.json` refits the efficiencies from the
user's own `pdtool bench` results and writes an entry of the same shape. docs/sizing.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pdtool.paths import conf_dir


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: dict[str, float]  # dense, by weight dtype (bf16, fp8, fp16, fp32)
    hbm_tbps: float  # memory bandwidth, TB/s
    link_gbps: float  # GPU-to-GPU link inside a node, GB/s per direction (NVLink)
    prefill_mfu: float  # share of peak FLOPs a prefill reaches
    decode_mbu: float  # share of HBM bandwidth a decode step reaches
    decode_mfu: float  # share of peak FLOPs a decode step's matmuls reach
    prefill_overhead_ms: float  # per prefill forward pass (chunk): scheduling, launch
    step_overhead_ms: float  # per decode step: scheduling, launch, sampling
    comm_eff: float = 0.7  # share of link (or NIC) bandwidth a collective reaches
    overlap: float = 0.0  # share of the shorter of compute and collectives hidden behind the other
    nic_eff: float = 0.8  # share of NIC line rate a KV write stream reaches
    write_us: float = 2.0  # per KV write (posting and completing one RMA operation)
    default_nic_gbps: float = 100.0  # a NIC with no speed in the preset (Gbit/s)
    sources: dict[str, str] = field(default_factory=dict)  # constant -> where it comes from

    def peak(self, dtype: str) -> float:
        """FLOP/s for matmuls on weights of `dtype` (fp16 as bf16; a GPU without an fp8 figure
        runs fp8 weights at its bf16 rate)."""
        t = self.peak_tflops
        return 1e12 * t.get(dtype, t.get("bf16", next(iter(t.values()))))

    def with_fit(self, **fit: float) -> Hardware:
        return replace(self, **fit)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class HardwareError(ValueError):
    pass


def hardware_file() -> Path:
    return conf_dir() / "sizing" / "hardware.yaml"


def load_table(path: Path | None = None) -> dict[str, Hardware]:
    """Every entry of the calibration file (conf/sizing/hardware.yaml, or `path`), by name."""
    import yaml

    path = path or hardware_file()
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise HardwareError(f"{path}: {e}") from None
    names = {f.name for f in fields(Hardware)}
    out = {}
    for name, entry in raw.items():
        unknown = set(entry) - names
        if unknown:
            raise HardwareError(f"{path}: {name}: unknown constant(s) {sorted(unknown)} "
                                f"(known: {sorted(names - {'name'})})")
        try:
            out[name] = Hardware(name=name, **entry)
        except TypeError as e:
            raise HardwareError(f"{path}: {name}: {e}") from None
    return out


def for_gpu(gpu_type: str, path: Path | None = None) -> Hardware:
    """The entry for a cluster preset's `cluster.gpu_type`."""
    table = load_table(path)
    if gpu_type not in table:
        raise HardwareError(f"cluster.gpu_type={gpu_type!r} has no entry in "
                            f"{path or hardware_file()} (entries: {sorted(table)}): add one, or "
                            f"fit one from your own `pdtool bench` results with --calibrate")
    return table[gpu_type]
