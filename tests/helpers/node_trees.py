"""Recorded node topologies as sysfs trees and an `nvidia-smi`, for `pdtool discover`.

The facts are docs/topologies.md's (AWS p5 and p5en, NVIDIA DGX H100); the tree has the
shape Linux gives it: /sys/devices/pci<host bridge>/<root port>/<switch up>/<switch down>/<device>,
/sys/bus/pci/devices/<bdf> linking there, /sys/class/infiniband/<dev>/device linking to the
NIC's folder (its driver a link to /sys/bus/pci/drivers/<driver>), ports/1/{state,rate,
link_layer}, numa_node files, /sys/devices/system/node/node<N>/cpulist.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Switch:
    numa: int
    gpus: list[tuple[int, int]]  # (GPU index, bus)
    # (name, driver, bus, gbps, state, link layer)
    nics: list[tuple[str, str, int, int, str, str]] = field(default_factory=list)


@dataclass
class NodeTree:
    gpu_name: str
    gpu_mib: int
    numa_cpus: list[str]
    switches: list[Switch]

    def smi_text(self) -> str:
        """What `nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id --format=csv,
        noheader,nounits` prints on this node."""
        return "".join(f"{i}, {self.gpu_name}, {self.gpu_mib}, 00000000:{bus:02X}:00.0\n"
                       for i, bus in sorted(g for sw in self.switches for g in sw.gpus))

    def write(self, root: Path, bindir: Path) -> None:
        sysfs = root / "sys"
        for n, cpus in enumerate(self.numa_cpus):
            d = sysfs / "devices/system/node" / f"node{n}"
            d.mkdir(parents=True)
            (d / "cpulist").write_text(cpus + "\n")
        smt = sysfs / "devices/system/cpu/smt"
        smt.mkdir(parents=True)
        (smt / "active").write_text("1\n")
        for k, sw in enumerate(self.switches):
            host = f"pci0000:{k * 16:02x}"
            port = sysfs / "devices" / host / f"0000:{k * 16:02x}:01.0" / \
                f"0000:{k * 16 + 1:02x}:00.0"
            for j, (_, bus) in enumerate(sw.gpus):
                self._device(sysfs, port, j, bus, sw.numa)
            for j, (name, driver, bus, gbps, state, layer) in enumerate(sw.nics, len(sw.gpus)):
                dev = self._device(sysfs, port, j, bus, sw.numa)
                drv = sysfs / "bus/pci/drivers" / driver
                drv.mkdir(parents=True, exist_ok=True)
                os.symlink(drv, dev / "driver")
                ib = sysfs / "class/infiniband" / name
                (ib / "ports/1").mkdir(parents=True)
                os.symlink(dev, ib / "device")
                (ib / "ports/1/state").write_text(f"{4 if state == 'ACTIVE' else 1}: {state}\n")
                (ib / "ports/1/rate").write_text(f"{gbps} Gb/sec (4X)\n")
                (ib / "ports/1/link_layer").write_text(layer + "\n")
        bindir.mkdir(parents=True, exist_ok=True)
        smi_path = bindir / "nvidia-smi"
        smi_path.write_text(f"#!/bin/sh\ncat <<'END'\n{self.smi_text()}END\n")
        smi_path.chmod(0o755)

    @staticmethod
    def _device(sysfs: Path, port: Path, j: int, bus: int, numa: int) -> Path:
        """An endpoint at `bus` below downstream port j of the switch under `port`."""
        down = port / f"0000:{port.name[5:7]}:{j:02x}.0"
        dev = down / f"0000:{bus:02x}:00.0"
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(f"{numa}\n")
        link = sysfs / "bus/pci/devices" / dev.name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(dev, link)
        return dev


def _efa(names: range, gbps: int) -> list[tuple[str, str, int, int, str, str]]:
    return [(f"rdmap{b}s0", "efa", b, gbps, "ACTIVE", "Unspecified") for b in names]


def p5() -> NodeTree:
    """One GPU and 4 EFAv2 (100 Gb/s) per switch; GPUs 0-3 on NUMA 0."""
    first = (79, 96, 113, 130, 147, 164, 181, 198)
    return NodeTree("NVIDIA H100 80GB HBM3", 81920, ["0-47,96-143", "48-95,144-191"],
                    [Switch(g // 4, [(g, b + 4)], _efa(range(b, b + 4), 100))
                     for g, b in enumerate(first)])


def p5en() -> NodeTree:
    """Two GPUs and 4 EFAv3 (200 Gb/s) per switch."""
    first = (85, 110, 135, 160)
    return NodeTree("NVIDIA H200", 144384, ["0-47,96-143", "48-95,144-191"],
                    [Switch(k // 2, [(2 * k, b + 4), (2 * k + 1, b + 5)],
                            _efa(range(b, b + 4), 200)) for k, b in enumerate(first)])


def dgx_h100(down: str = "") -> NodeTree:
    """One ConnectX-7 (400 Gb/s InfiniBand) per GPU switch, and storage/management mlx5
    ports on switches of their own; `down`: a compute port whose link is down."""
    buses = (24, 64, 79, 94, 154, 192, 206, 220)
    names = ("mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11")
    switches = [Switch(g // 4, [(g, b + 3)], [(n, "mlx5_core", b, 400,
                                               "DOWN" if n == down else "ACTIVE", "InfiniBand")])
                for g, (b, n) in enumerate(zip(buses, names, strict=True))]
    storage = [("mlx5_1", 41), ("mlx5_2", 42), ("mlx5_7", 170), ("mlx5_8", 171)]
    switches += [Switch(int(b > 128), [], [(n, "mlx5_core", b, 200, "ACTIVE", "Ethernet")])
                 for n, b in storage]
    return NodeTree("NVIDIA H100 80GB HBM3", 81559, ["0-55,112-167", "56-111,168-223"],
                    switches)
