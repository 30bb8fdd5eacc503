"""The timeline PNG: steps as bars coloured by mode, and step duration over time.

Uses matplotlib's object API with the Agg canvas (no pyplot), so plotting touches no global
state and needs no display.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from profiling.timeline import Timeline

MODE_COLORS = MappingProxyType({"spec": "#d95f02", "decode": "#1b9e77"})
OTHER_COLOR = "#7570b3"


def plot_timeline(tl: Timeline, path: Path, title: str) -> Path:
    fig = Figure(figsize=(12, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    bars, durations = fig.subplots(2, 1, sharex=True, height_ratios=(1, 2))

    rows = sorted({(t.name, s.mode) for t in tl.tracks for s in t.steps})
    row_of = {r: i for i, r in enumerate(rows)}
    for track in tl.tracks:
        for graph in (True, False):
            for mode in sorted({s.mode for s in track.steps}):
                steps = [s for s in track.steps if s.mode == mode and s.graph is graph]
                if not steps:
                    continue
                y = row_of[(track.name, mode)]
                color = MODE_COLORS.get(mode, OTHER_COLOR)
                bars.broken_barh([(tl.ms(s.start_ns), s.duration_ns / 1e6) for s in steps],
                                 (y - 0.4, 0.8), facecolors=color,
                                 hatch=None if graph else "///", edgecolor="black" if not graph
                                 else color, linewidth=0.3)
                durations.scatter([tl.ms(s.start_ns) for s in steps],
                                  [s.duration_ns / 1e3 for s in steps], s=10, color=color,
                                  marker="o" if graph else "x",
                                  label=f"{mode}{'' if graph else ' (eager)'}"
                                  + (f" {track.name}" if len(tl.tracks) > 1 else ""))
        if track.steady_start_ns is not None:
            for ax in (bars, durations):
                ax.axvline(tl.ms(track.steady_start_ns), color="gray", linestyle="--",
                           linewidth=0.8)
    bars.set_yticks(range(len(rows)))
    bars.set_yticklabels([mode if len(tl.tracks) == 1 else f"{mode} ({name})"
                          for name, mode in rows])
    bars.set_ylim(-0.6, max(len(rows), 1) - 0.4)
    bars.set_title(title)
    durations.set_xlabel("time since first event (ms); dashed: steady state begins")
    durations.set_ylabel("step duration (us)")
    if tl.steps:
        durations.legend(loc="upper right", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
