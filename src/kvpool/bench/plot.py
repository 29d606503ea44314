"""Shared PNG helper for the benchmarks: panels of grouped bars (matplotlib, no display).

Each benchmark builds :class:`Panel` objects (one metric each) and calls
:func:`save_panels`; a value of ``None`` leaves its bar out (an absent column).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Panel:
    """One chart: ``labels`` on the x axis, one bar per ``series`` entry and label.

    series: {series name: [value or None per label]}; log: logarithmic y axis.
    """

    title: str
    labels: list[str]
    series: dict[str, list[float | None]] = field(default_factory=dict)
    ylabel: str = ""
    log: bool = False


def save_panels(path: str, panels: list[Panel], title: str = "") -> str:
    """Draw ``panels`` stacked vertically into a PNG at ``path``; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in tests
    import matplotlib.pyplot as plt

    panels = [p for p in panels if p.labels] or [Panel("no data", ["-"], {})]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 3.6 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        _bars(ax, panel)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _bars(ax, panel: Panel) -> None:
    n = max(1, len(panel.series))
    width = 0.8 / n
    for i, (name, values) in enumerate(panel.series.items()):
        xs = [j + (i - (n - 1) / 2) * width for j, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(range(len(panel.labels)))
    ax.set_xticklabels(panel.labels, rotation=30, ha="right", fontsize=8)
    ax.set_title(panel.title, fontsize=10)
    ax.set_ylabel(panel.ylabel)
    if panel.log and any(v for vals in panel.series.values() for v in vals if v):
        ax.set_yscale("log")
    if panel.series:  # beside the axes, never over the bars
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
