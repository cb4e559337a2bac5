"""The PNG of a bench run: latency distributions (TTFT, TPOT, ITL, E2E) per target and load
point with the SLO drawn, and output tokens/s per GPU against tokens/s per user."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pdtool.bench.stats import Record

PANELS = (("TTFT", lambda r: [r.ttft]), ("TPOT", lambda r: [r.tpot]),
          ("ITL", lambda r: r.itls), ("end-to-end", lambda r: [r.e2e]))


def _values(records: Sequence[Record], pick) -> list[float]:
    return [1000 * v for r in records if r.ok for v in pick(r) if v is not None]


#: --slo keys drawn on the latency panels
SLO_KEYS = {"TTFT": "ttft_ms", "TPOT": "tpot_ms", "ITL": "itl_ms", "end-to-end": "e2e_ms"}


def plot(path: Path, series: list[tuple[str, list[Record], dict]], title: str = "",
         slo: dict[str, float] | None = None) -> Path:
    """series: (label, records, summary) per target and load point, in run order. Writes `path`
    (PNG) and returns it: one figure a person can read on its own (`title`: recipe, lengths,
    date), a grid of empirical CDFs (rather than histograms: tails stay readable and several
    series overlay without hiding each other) with the `slo` limits drawn, and for a sweep
    the capacity view: output tokens/s per GPU against tokens/s per user, each point labelled
    with its load."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the plot needs matplotlib: pip install 'pdtool[load]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = slo or {}
    sweep = len(series) > 1
    fig, grid = plt.subplots(2, 3, figsize=(13.5, 8.0), squeeze=False)
    axes = [*grid[0], *grid[1]]
    for ax, (name, pick) in zip(axes, PANELS, strict=False):
        for label, records, _ in series:
            xs = sorted(_values(records, pick))
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=label)
        limit = slo.get(SLO_KEYS[name])
        if limit is not None:
            ax.axvline(limit, color="red", linestyle="--", linewidth=1, label=f"SLO {limit:g} ms")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.set_title(f"{name}: cumulative distribution", fontsize=9)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=7)
        else:  # e.g. TPOT and ITL at one output token: there are no gaps between tokens
            ax.text(0.5, 0.5, "no values", ha="center", va="center", transform=ax.transAxes)
    ax = axes[len(PANELS)]
    groups: dict[str, list[tuple[float, float, str]]] = {}
    for label, _records, summary in series:
        target, _, load = label.rpartition(" ") if sweep and " " in label else (label, "", "")
        per_gpu, per_user = summary.get("output_throughput_per_gpu"), \
            summary.get("user_tokens_s")
        if per_gpu is not None and per_user is not None:
            groups.setdefault(target, []).append((per_user, per_gpu, load))
    for target, pts in groups.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=target)
        for x, y, load in pts:
            if load:
                ax.annotate(load, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if "tpot_ms" in slo:
        ax.axvline(1000 / slo["tpot_ms"], color="red", linestyle="--", linewidth=1,
                   label=f"SLO: TPOT {slo['tpot_ms']:g} ms")
    ax.set_xlabel("tokens/s per user (1 / mean TPOT)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title("capacity: per GPU against per user", fontsize=9)
    ax.grid(alpha=0.3)
    if groups:
        ax.legend(fontsize=7)
    axes[-1].axis("off")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
