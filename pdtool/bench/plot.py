"""The PNG of a bench run: latency distributions (TTFT, TPOT, ITL, E2E) per target and load
point, and for a sweep over concurrency or rate, output throughput against latency."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pdtool.bench.stats import Record, percentile

PANELS = (("TTFT", lambda r: [r.ttft]), ("TPOT", lambda r: [r.tpot]),
          ("ITL", lambda r: r.itls), ("end-to-end", lambda r: [r.e2e]))


def _values(records: Sequence[Record], pick) -> list[float]:
    return [1000 * v for r in records if r.ok for v in pick(r) if v is not None]


def plot(path: Path, series: list[tuple[str, list[Record], dict]]) -> Path:
    """series: (label, records, summary) per target and load point, in run order. Writes `path`
    (PNG) and returns it. Empirical CDFs rather than histograms: tails stay readable and
    several series overlay without hiding each other."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the plot needs matplotlib: pip install 'pdtool[load]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = len(series) > 1
    ncols = len(PANELS) + (1 if sweep else 0)
    fig, axes = plt.subplots(1, ncols, figsize=(4.2 * ncols, 3.6), squeeze=False)
    for ax, (name, pick) in zip(axes[0], PANELS, strict=False):
        for label, records, _ in series:
            xs = sorted(_values(records, pick))
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    if sweep:
        ax = axes[0][-1]
        groups: dict[str, list[tuple[float, float]]] = {}
        for label, records, summary in series:
            target = label.rsplit(" ", 1)[0] if " " in label else ""
            ttft = percentile(_values(records, PANELS[0][1]), 50)
            if ttft is not None:
                groups.setdefault(target, []).append((summary["output_throughput"], ttft))
        for target, pts in groups.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=target or None)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_title("throughput vs latency")
        if len(groups) > 1:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
