"""Tables and plots of the suite's results (pure apart from matplotlib)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Mapping, NamedTuple, Optional, Sequence

from bench.plots import Panel, Series, line_chart


def _sweep(res: Optional[Mapping]) -> Mapping:
    """An engine result's sweep task ({} when it has none)."""
    return (res or {}).get("tasks", {}).get("sweep") or {}


def _table_head(first: str, levels: Sequence[int]) -> list[str]:
    return ["| " + first + " | " + " | ".join(str(c) for c in levels) + " |",
            "|---|" + "---|" * len(levels)]


class Throughput(NamedTuple):
    """Sweep results as a table: every concurrency level, and per engine its tok/s at each."""

    levels: list[int]
    table: dict[str, dict[int, float]]


def throughput_rows(engines: Mapping[str, Mapping]) -> Throughput:
    """The sweep results' Throughput."""
    table: dict[str, dict[int, float]] = {}
    levels: set[int] = set()
    for name, res in engines.items():
        pts = _sweep(res).get("points", [])
        table[name] = {int(p["concurrency"]): float(p["tok_s"]) for p in pts}
        levels.update(table[name])
    return Throughput(sorted(levels), table)


def markdown_throughput(levels: Sequence[int], table: Mapping[str, Mapping[int, float]],
                        note: str = "") -> str:
    rows = _table_head("engine", levels)
    for name, vals in table.items():
        cells = [f"{vals[c]:.0f}" if c in vals else "-" for c in levels]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    best = []
    for c in levels:
        have = {n: v[c] for n, v in table.items() if c in v}
        best.append(max(have, key=have.get) if have else "-")
    rows.append("| best | " + " | ".join(best) + " |")
    return (note + "\n\n" if note else "") + "\n".join(rows) + "\n"


# Engines run with a server setting the plain and EAGLE-3 baselines do not have end in one of
# these; each compares with the plain (and EAGLE-3) engine of the same suffix when it ran.
RADIX = "-radix"
SETTING_SUFFIXES = (RADIX,)


def baseline(name: str, kind: str, names) -> str:
    """The `kind` engine ("plain" or "eagle3") that `name` is compared with: the one run with
    the same server setting (e.g. dual-radix -> plain-radix) when the suite ran it, else the
    default `kind`; a setting's own `kind` engine (plain-radix) is compared with the default."""
    for suffix in SETTING_SUFFIXES:
        if name.endswith(suffix) and kind + suffix in names and name != kind + suffix:
            return kind + suffix
    return kind


def dual_ratios(levels: Sequence[int], table: Mapping[str, Mapping[int, float]]
                ) -> dict[str, dict[str, dict[int, float]]]:
    """{dual engine: {"vs_best": {c: r}, "vs_plain": {c: r}}}: each dual-* engine's tok/s over
    max(plain, eagle3) where both baselines were measured, and over plain where it was (the
    baselines of the same server setting, see `baseline`)."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for name, vals in table.items():
        if not name.startswith("dual"):
            continue
        plain = table.get(baseline(name, "plain", table), {})
        eagle = table.get(baseline(name, "eagle3", table), {})
        best = {c: max(plain[c], eagle[c]) for c in levels if c in plain and c in eagle}
        out[name] = {
            "vs_best": {c: vals[c] / best[c] for c in best if c in vals and best[c] > 0},
            "vs_plain": {c: vals[c] / plain[c] for c in levels if c in vals and plain.get(c)},
        }
    return out


def markdown_ratios(levels: Sequence[int], table: Mapping[str, Mapping[int, float]]) -> str:
    ratios = dual_ratios(levels, table)
    if not ratios:
        return ""
    rows = _table_head("ratio", levels)
    for name, r in ratios.items():
        plain, eagle = baseline(name, "plain", table), baseline(name, "eagle3", table)
        for kind, label in (("vs_best", f"/ max({plain}, {eagle})"), ("vs_plain", f"/ {plain}")):
            cells = [f"{r[kind][c]:.3f}" if c in r[kind] else "-" for c in levels]
            rows.append(f"| {name} {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def decode_phase_ms(engines: Mapping[str, Mapping]) -> dict[str, dict[int, float]]:
    """{engine: {concurrency: ms a token in the decode phase}} from sweeps run with
    prefill_probe: (T(out=N) - T(out=1)) / (N - 1). For one-token steps (plain, and the dual
    worker in decode mode) it is the step time at bs = concurrency with the prefill taken out."""
    out: dict[str, dict[int, float]] = {}
    for name, res in engines.items():
        n = _sweep(res).get("output_len")
        vals = {int(p["concurrency"]): 1000.0 * (p["seconds"] - p["prefill_only_seconds"])
                / (n - 1)
                for p in _probed_points(res) if n and n > 1}
        if vals:
            out[name] = vals
    return out


def _probed_points(res: Optional[Mapping]) -> list[Mapping]:
    """The sweep points timed with a prefill probe."""
    return [p for p in _sweep(res).get("points", [])
            if p.get("prefill_only_seconds") is not None]


def prefill_phase_s(engines: Mapping[str, Mapping]) -> dict[str, dict[int, float]]:
    """{engine: {concurrency: seconds}}: T(out=1), the prefill probe itself (every prompt's
    prefill and one token), the part of a sweep point the decode phase leaves out."""
    out: dict[str, dict[int, float]] = {}
    for name, res in engines.items():
        vals = {int(p["concurrency"]): float(p["prefill_only_seconds"])
                for p in _probed_points(res)}
        if vals:
            out[name] = vals
    return out


def _markdown_phase(title: str, values: Mapping[str, Mapping[int, float]], fmt: str) -> str:
    if not values:
        return ""
    levels = sorted(set().union(*(v.keys() for v in values.values())))
    rows = [title, ""] + _table_head("engine", levels)
    for name, vals in values.items():
        rows.append(f"| {name} | " + " | ".join(
            format(vals[c], fmt) if c in vals else "-" for c in levels) + " |")
        base = baseline(name, "plain", values)
        plain = values.get(base, {})
        if name != base and plain:
            rows.append(f"| {name} / {base} | " + " | ".join(
                f"{vals[c] / plain[c]:.3f}" if c in vals and plain.get(c) else "-"
                for c in levels) + " |")
    return "\n".join(rows) + "\n"


def markdown_decode_phase(engines: Mapping[str, Mapping]) -> str:
    return _markdown_phase("decode phase alone, ms a token: (T(out=N) - T(out=1)) / (N - 1); "
                           "ratio to plain (> 1: slower)", decode_phase_ms(engines), ".2f")


def markdown_prefill_phase(engines: Mapping[str, Mapping]) -> str:
    return _markdown_phase("prefill phase, s: T(out=1) for the whole batch of prompts; ratio "
                           "to plain (> 1: slower)", prefill_phase_s(engines), ".3f")


def decode_log_step_ms(engines: Mapping[str, Mapping], min_windows: int = 2
                       ) -> dict[str, dict[int, float]]:
    """{engine: {batch size: ms a decode step}} from the engines' own decode log (the median
    window's gen throughput at that running batch, decode-mode windows only, see
    workload.parse_decode_log): bs / throughput. Batch sizes with fewer than `min_windows`
    windows are left out (a lone window mostly spans a wave's prefill)."""
    out: dict[str, dict[int, float]] = {}
    for name, res in engines.items():
        windows = (res or {}).get("decode_log") or {}
        medians = {int(bs): statistics.median(tputs) for bs, tputs in windows.items()
                   if len(tputs) >= min_windows}
        vals = {bs: 1000.0 * bs / m for bs, m in medians.items() if m > 0}
        if vals:
            out[name] = vals
    return out


def markdown_decode_log(engines: Mapping[str, Mapping]) -> str:
    return _markdown_phase("decode step, ms, from SGLang's own decode log (median window at "
                           "that running batch, decode-mode windows only); ratio to plain "
                           "(> 1: slower)", decode_log_step_ms(engines), ".2f")


def plot_throughput(levels, table, path: str | Path, title: str) -> Path:
    """tok/s by concurrency, one line an engine."""
    series = [Series(name, [c for c in levels if c in vals], [vals[c] for c in levels if c in vals])
              for name, vals in table.items()]
    return line_chart(path, title, "concurrency (requests)",
                      [Panel("output tokens / s", series)], log2_x=True)


def plot_ramp(steps: Sequence[tuple], phases: Sequence[dict], path: str | Path,
              title: str) -> Optional[Path]:
    """steps: (t, bs, mode) per decode step; phases: {"phase": c, "t_start", "t_end"}."""
    if not steps:
        return None
    # matplotlib's object API on the Agg canvas: no pyplot, so no process-wide backend state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    t0 = min(s[0] for s in steps)
    fig = Figure(figsize=(9, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for mode, color in (("spec", "tab:orange"), ("decode", "tab:blue")):
        pts = [(s[0] - t0, s[1]) for s in steps if s[2] == mode]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=4, c=color,
                       label=f"{mode} step")
    for ph in phases:
        ax.hlines(ph["phase"], ph["t_start"] - t0, ph["t_end"] - t0, colors="gray",
                  linestyles="dashed", linewidth=1)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("running batch size (dashed: client concurrency)")
    ax.set_yscale("log", base=2)
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)


def summary_lines(summary: Mapping[str, object]) -> str:
    width = max((len(k) for k in summary), default=0)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in summary.items())
