"""The policy matrix's report.md sections (the grid of ratios and its other readings, the
machine around the cells, runs on a slow host, where each engine's scheduler ran) and its
heatmap, from the records and cells of matrix_records.py.
"""

from __future__ import annotations

import statistics
import textwrap
from pathlib import Path
from typing import Optional

from bench.sglang import host_speed
from bench.sglang.matrix_records import READINGS, Workload


# A cell under this ratio is a miss: bold in the grid and the heatmap, counted under "Lowest".
MISS = 0.98
# A run whose host probe read this much above the matrix's median ran on a slow host.
SLOW_HOST = 1.25
# A run under this share of its cell's fastest run of the same engine is a slow run.
SLOW_RUN = 0.97


def cell_of(r: dict) -> tuple:
    """A ratio record's cell: (accept, input, output, concurrency)."""
    return (r["accept_len"], r["input_len"], r["output_len"], r["concurrency"])


def _by_cell(cells: list[dict]) -> dict[tuple, dict]:
    """Ratio records by their cell."""
    return {cell_of(r): r for r in cells}


def report(cells: list[dict], accepts: list[float], workloads: list[Workload],
           note: str) -> str:
    return "\n".join([f"# Policy matrix: worker / max(plain, EAGLE-3)\n\n{note}\n"]
                     + _grid(cells, accepts, workloads)) + "\n"


def matrix_report(cells: list[dict], other: dict[str, Optional[list[dict]]], recs: list[dict],
                  accepts: list[float], workloads: list[Workload], note: str) -> str:
    """report.md: the grid, its other readings (`READINGS`: the matrix JSON's keys to their
    cells), the machine and the runs on a slow host."""
    return (report(cells, accepts, workloads, note)
            + "".join(reading_report(key, other.get(key), accepts, workloads) for key in READINGS)
            + machine_report(recs) + slow_host_report(recs) + placement_report(recs))


def _marks(cell: dict) -> str:
    """A ratio's marks in the grid and the heatmap: † a baseline from another run, ‡ fewer
    rounds than its call asked."""
    return ("†" if cell.get("cross_run") else "") + ("‡" if cell.get("cut_short") else "")


def reading_report(key: str, cells: Optional[list[dict]], accepts: list[float],
                   workloads: list[Workload]) -> str:
    """The grid again as READINGS[key] reads it, or "" where none were kept."""
    if not cells:
        return ""
    return "\n".join([f"\n## {READINGS[key][1]}\n"]
                     + _grid(cells, accepts, workloads, median=False)) + "\n"


def _grid(cells: list[dict], accepts: list[float], workloads: list[Workload],
          median: bool = True) -> list[str]:
    lines = []
    cols = [(w, c) for w in workloads for c in w.concurrency]
    lines.append("| accept | " + " | ".join(f"{w.name} C={c}" for w, c in cols) + " |")
    lines.append("|---|" + "---|" * len(cols))
    index = _by_cell(cells)
    for a in accepts:
        row = []
        for w, c in cols:
            r = index.get((a, w.input_len, w.output_len, c))
            text = "-" if r is None else (f"**{r['ratio']:.3f}**" if r["ratio"] < MISS
                                          else f"{r['ratio']:.3f}")
            row.append(text + ("" if r is None else _marks(r)))
        lines.append(f"| {a:g} | " + " | ".join(row) + " |")
    if any(r.get("cross_run") for r in cells):
        lines.append("\n† a baseline from another run (records marked `from`).")
    if any(r.get("cut_short") for r in cells):
        lines.append("\n‡ fewer rounds than its call asked (the budget ran out)" + (
            ": the slower middle run of an even count, or the one run, stands for the median."
            if median else "."))
    if cells:
        worst = min(cells, key=lambda r: r["ratio"])
        lines.append(f"\nLowest: {worst['ratio']:.3f} at accept {worst['accept_len']:g}, "
                     f"{worst['input_len']} in / {worst['output_len']} out, "
                     f"C={worst['concurrency']}; cells below {MISS}: "
                     f"{sum(r['ratio'] < MISS for r in cells)} of {len(cells)}.")
    return lines


def slow_host_report(recs: list[dict]) -> str:
    """Per engine, its repeated cells' runs on a slow host (the probe SLOW_HOST x the matrix's
    median or more) against its other runs, each as tok/s over its cell's fastest run: an engine
    a slow host slows shows a lower figure there; and how many of all its runs were slow runs
    (under SLOW_RUN of that) of those the probe saw, whatever it read."""
    runs = [(r["engine"], tok / max(r["runs_tok_s"]), ms)
            for r in recs if "from" not in r and len(r.get("runs_host_ms") or []) > 1
            for tok, ms in zip(r["runs_tok_s"], r["runs_host_ms"]) if ms is not None]
    if not runs:
        return ""
    base = statistics.median(ms for _, _, ms in runs)
    lines = ["\n## Runs on a slow host\n",
             f"Host probe median {base:.1f} ms over the repeated cells' runs; a run at "
             f">= {SLOW_HOST:g}x that ran on a slow host. tok/s over its cell's fastest run "
             f"(median, lowest), and the runs under {SLOW_RUN:g} of it:\n",
             "| engine | slow-host runs | their speed | other runs | their speed | slow runs |",
             "|---|---|---|---|---|---|"]
    for engine in sorted({e for e, _, _ in runs}):
        slow = [v for e, v, ms in runs if e == engine and ms >= SLOW_HOST * base]
        rest = [v for e, v, ms in runs if e == engine and ms < SLOW_HOST * base]
        every = [v for e, v, _ in runs if e == engine]
        lines.append(f"| {engine} | {len(slow)} | {_spread(slow)} | {len(rest)} | "
                     f"{_spread(rest)} | {sum(v < SLOW_RUN for v in every)} of {len(every)} |")
    return "\n".join(lines) + "\n"


def placement_report(recs: list[dict]) -> str:
    """Per engine, where its scheduler ran in its repeated cells' runs (the side sampler's view,
    placement.Placement): the CPUs, runs seen on two or more, and the steal ticks of its CPUs
    in its slow runs (under SLOW_RUN of the cell's fastest) and in the others. A slow spell that
    steal or a move to another CPU explains shows here."""
    runs = [(r["engine"], tok / max(r["runs_tok_s"]) < SLOW_RUN, placed)
            for r in recs if "from" not in r and r.get("runs_placement") and r.get("runs_tok_s")
            for tok, placed in zip(r["runs_tok_s"], r["runs_placement"]) if placed]
    if not runs:
        return ""
    lines = ["\n## Where each engine's scheduler ran\n",
             f"Per run, the CPUs its scheduler was seen on (every {host_speed.PERIOD_S:g} s) "
             f"and their steal ticks; slow runs: under {SLOW_RUN:g} of the cell's fastest.\n",
             "| engine | runs | its CPUs | runs on 2+ CPUs | slow runs | their steal ticks "
             "(median, max) | other runs' (median, max) |",
             "|---|---|---|---|---|---|---|"]
    for engine in sorted({e for e, _, _ in runs}):
        mine = [(slow, placed) for e, slow, placed in runs if e == engine]
        cpus = sorted({c for _, placed in mine for c in placed["cpus"]})
        moved = sum(len(placed["cpus"]) > 1 for _, placed in mine)
        slow = [placed["steal"] for s, placed in mine if s]
        rest = [placed["steal"] for s, placed in mine if not s]
        lines.append(f"| {engine} | {len(mine)} | {', '.join(map(str, cpus))} | {moved} | "
                     f"{len(slow)} | {_ticks(slow)} | {_ticks(rest)} |")
    return "\n".join(lines) + "\n"


def _ticks(values: list[int]) -> str:
    return f"{statistics.median(values):g}, {max(values)}" if values else "-"


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}, {min(values):.3f}" if values else "-"


def machine_report(recs: list[dict]) -> str:
    """Per engine and accept phase, the machine around its cells: a fixed Python workload's
    time before each cell and the side sampler's while it ran (host speed), the GPU's SM clock
    after a cell, the engine's CPU seconds per 1000 output tokens, and the longest collection
    pause of the bench's process (SGLang's tokenizer manager runs in it). A slow spell of the
    host shows in the first two, one of the GPU in the third, one of an engine's own process in
    the fourth, a full collection that held up a batch in the last."""
    groups: dict[tuple, list[dict]] = {}
    for r in recs:
        if r.get("machine") and "from" not in r:
            groups.setdefault((r["engine"], r["accept_len"]), []).append(r)
    if not groups:
        return ""
    lines = ["\n## The machine around the cells\n",
             "| engine | accept | cells | host probe ms (median, max) | host ms during cells "
             "(median, max) | SM MHz (min-max) | CPU s / 1k tokens | bench GC: longest ms |",
             "|---|---|---|---|---|---|---|---|"]
    for (engine, accept), rs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        m = [r["machine"] for r in rs]
        probe = [x["host_probe_ms"] for x in m if "host_probe_ms" in x]
        sm = [x["sm_mhz"] for x in m if "sm_mhz" in x]
        during = [x["host_ms"] for x in m if x.get("host_ms") is not None]
        timed = [r for r in rs if r["machine"].get("cpu_s") is not None]
        cpu = sum(r["machine"]["cpu_s"] for r in timed)
        tokens = sum(r.get("output_tokens_total", r["tok_s"] * r["seconds"]) for r in timed)
        pauses = [gen[2] for x in m for gen in (x.get("bench_gc_ms") or {}).values()]
        lines.append(
            f"| {engine} | {'-' if accept is None else f'{accept:g}'} | {len(rs)} | "
            + (f"{statistics.median(probe):.1f}, {max(probe):.1f}" if probe else "-") + " | "
            + (f"{statistics.median(during):.1f}, {max(during):.1f}" if during else "-") + " | "
            + (f"{min(sm):.0f}-{max(sm):.0f}" if sm else "-") + " | "
            + (f"{1000 * cpu / tokens:.2f}" if tokens and cpu else "-") + " | "
            + (f"{max(pauses):.1f}" if pauses else "-") + " |")
    return "\n".join(lines) + "\n"


def heatmap(cells: list[dict], accepts: list[float], workloads: list[Workload],
            path: Path, note: str) -> None:
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = [(w, c) for w in workloads for c in w.concurrency]
    index = _by_cell(cells)
    at = [[index.get((a, w.input_len, w.output_len, c)) for w, c in cols] for a in accepts]
    grid = np.array([[np.nan if r is None else r["ratio"] for r in row] for row in at])
    fig = Figure(figsize=(1.0 + 0.75 * len(cols), 1.6 + 0.6 * len(accepts)))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.85, vmax=1.15, aspect="auto")
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}{_marks(at[i][j])}", ha="center", va="center",
                        fontsize=8, fontweight="bold" if grid[i, j] < MISS else "normal")
    ax.set_xticks(range(len(cols)), [f"{w.name}\nC={c}" for w, c in cols], fontsize=7)
    ax.set_yticks(range(len(accepts)), [f"accept {a:g}" for a in accepts])
    wrap = max(int(14 * fig.get_size_inches()[0]), 60)     # characters that fit at 8 pt
    ax.set_title("dual-graph worker / max(plain, EAGLE-3) tok/s\n" + textwrap.fill(note, wrap),
                 fontsize=8)
    fig.colorbar(im, ax=ax, fraction=0.02)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
