"""The benchmarks' line charts: named series of (x, y) points on shared axes, one panel each,
drawn with matplotlib's object API on the Agg canvas (no pyplot, no global state). matplotlib
is imported by `line_chart` alone: a benchmark's arguments are checked before it loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence


# Past this many series a legend covers the data: they are told apart by colour alone.
_MOST_LABELS = 16
# A log axis spanning more than this ratio labels its decades alone.
_LABELLED_SPAN = 30.0


@dataclass(frozen=True)
class Series:
    label: str
    x: Sequence[float]
    y: Sequence[float]
    dashed: bool = False
    joined: bool = True       # False: points only (readings that are no curve)
    color: Optional[str] = None   # a matplotlib color; pairs of one quantity share one


@dataclass(frozen=True)
class Panel:
    ylabel: str
    series: Sequence[Series]
    log_y: bool = False
    lines: Sequence[tuple[float, str]] = field(default_factory=tuple)   # (y, label) references


def line_chart(path: str | Path, title: str, xlabel: str, panels: Sequence[Panel],
               log2_x: bool = False, integer_x: bool = False) -> Path:
    """One PNG: `panels` stacked, sharing the x axis (log2 for batch sizes; integer ticks
    for counts)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

    fig = Figure(figsize=(8, 3.2 * len(panels) + 0.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels):
        for s in panel.series:
            ax.plot(s.x, s.y, marker="o", markersize=4, label=s.label, color=s.color,
                    linestyle="none" if not s.joined else "--" if s.dashed else "-")
        for y, label in panel.lines:
            ax.axhline(y, color="gray", linestyle=":", linewidth=1)
            ax.annotate(label, (0.01, y), xycoords=("axes fraction", "data"), fontsize=8,
                        color="gray", va="bottom")
        if integer_x:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if log2_x:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(_plain))
        if panel.log_y:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(_plain))
            lo, hi = ax.get_ylim()
            # Within a decade or so the minor ticks need their numbers; across more they crowd.
            ax.yaxis.set_minor_formatter(FuncFormatter(_plain) if hi < _LABELLED_SPAN * lo
                                         else NullFormatter())
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        if 0 < len(panel.series) <= _MOST_LABELS:
            ax.legend(fontsize="small")
    axes[0].set_title(title, fontsize=10)
    axes[-1].set_xlabel(xlabel)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _plain(value: float, _position: int) -> str:
    """Log axes labelled 64, not 2^6."""
    return f"{value:g}"
