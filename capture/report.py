"""What the measurements say and what the tuner chose: a text table and three PNG plots.

The table gives each key's measured numbers, marks capture times the tuner treats as one-time
compilation (`capture.tuner.find_compile_outliers`), and totals memory with the tuner's memory
model (`capture.memory_model.MemoryModel`), next to the measured every-key-together pool and the
sum of isolated pools.

- memory_capture.png: pool memory and capture time per candidate graph (chosen ones solid);
- waste_vs_graphs.png: each pool's minimum padding waste as its number of graphs grows (the
  unconstrained DP optimum), with the budget-constrained choice marked;
- latency.png: replay latency per mode vs bs, and predicted tok/s with the crossover marked.
Figures are built on `matplotlib.figure.Figure` with the Agg canvas, never pyplot, so nothing
touches matplotlib's global figure registry or the process's display settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, NamedTuple, Optional

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from capture.distribution import BatchDistribution
from capture.measurements import Measurements
from capture.padding import expected_waste, waste_curve
from capture.memory_model import MemoryModel
from capture.result import COMPILE_OUTLIER_FACTOR, Crossover, wrap_note
from capture.tuner import (check_accept_len, find_compile_outliers, find_crossover, plan_pools,
                           pool_problem, replace_capture_s, totals)
from capture.units import format_bytes
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import GraphKey, Mode

_COLORS: Mapping[Mode, str] = MappingProxyType({Mode.SPEC: "tab:orange", Mode.DECODE: "tab:blue"})
MiB = float(1 << 20)


@dataclass(frozen=True)
class Chosen:
    """The pools a config chose (None in a report of the measurements alone)."""

    spec_bs: tuple[int, ...]
    decode_bs: tuple[int, ...]

    def keys(self) -> frozenset[GraphKey]:
        return frozenset([GraphKey(Mode.SPEC, b) for b in self.spec_bs]
                         + [GraphKey(Mode.DECODE, b) for b in self.decode_bs])

    def sizes(self, mode: Mode) -> tuple[int, ...]:
        return self.spec_bs if mode is Mode.SPEC else self.decode_bs


class ReportFiles(NamedTuple):
    table: Path
    memory_capture_png: Path
    waste_png: Path
    latency_png: Path


def graph_table(m: Measurements, chosen: Optional[Chosen] = None,
                exclude_compile_outlier: bool = True) -> str:
    """One row per measured key: capture time, isolated pool memory, replay latency, chosen or
    not; then totals with the tuner's memory model and capture-time treatment."""
    picked = chosen.keys() if chosen else frozenset()
    outliers = find_compile_outliers(m)
    flagged = {o.key for o in outliers}
    rows = [f"{'key':>14}{'capture s':>12}{'pool alone':>13}{'replay ms':>11}{'chosen':>8}"]
    notes = []
    for g in sorted(m.graphs, key=lambda g: g.key):
        mark = ("yes" if g.key in picked else "") if chosen else "-"
        star = "*" if g.key in flagged else " "
        rows.append(f"{g.key.label():>14}{g.capture_s:>11.3f}{star}"
                    f"{format_bytes(g.pool_bytes):>13}{1e3 * g.replay_s:>11.3f}{mark:>8}")
    used = replace_capture_s(m, outliers) if exclude_compile_outlier else m
    model = MemoryModel.from_measurements(m)
    every = totals(m.graphs, 0.0, model)
    capture = f"{every.capture_s:.2f} s capture as measured"
    if outliers:
        capture += (f", {sum(g.capture_s for g in used.graphs):.2f} s with the * values (over "
                    f"{COMPILE_OUTLIER_FACTOR:g}x their mode's median: one-time compilation) "
                    + ("replaced by that median, as the tuner does" if exclude_compile_outlier
                       else "kept (--no-exclude-compile-outlier)"))
    notes.append(f"{len(m.graphs)} graphs, {capture}")
    together = (f"measured together {format_bytes(m.total_pool_bytes)}; "
                if m.total_pool_bytes is not None else "")
    notes.append(f"pool, every graph {model.words.every}: {format_bytes(every.memory_bytes)} "
                 f"by the tuner's model ({together}isolated sum "
                 f"{format_bytes(every.isolated_sum_bytes)})")
    notes.append(f"memory model: {model.describe()}")
    if chosen:
        mine = totals([g for g in used.graphs if g.key in picked], 0.0, model)
        notes.append(f"chosen: {mine.graphs} graphs, {format_bytes(mine.memory_bytes)} "
                     f"{model.words.chosen} "
                     f"(isolated sum {format_bytes(mine.isolated_sum_bytes)}), "
                     f"{mine.capture_s:.2f} s capture")
    if m.one_time_compile_s is not None:
        notes.append(f"one-time compile warm-up (measured apart, not in any key): "
                     f"{m.one_time_compile_s:.2f} s")
    for note in notes:
        rows += wrap_note(note)
    if m.synthetic:
        rows.append("SYNTHETIC measurements: " + (m.notes or "generated, not measured"))
    return "\n".join(rows)


@dataclass(frozen=True)
class PoolTops:
    """Each pool's top batch size; `fallback` says why they are each mode's largest measured
    size instead of the tuner's (None when they are the config's or the tuner's)."""

    tops: Mapping[Mode, int]
    fallback: Optional[str] = None

    def __getitem__(self, mode: Mode) -> int:
        return self.tops[mode]


def pool_tops(m: Measurements, distribution: BatchDistribution, accept_len: float,
              chosen: Optional[Chosen]) -> PoolTops:
    """Each pool's top: the chosen list's, else where the tuner would put it, else (inputs the
    tuner refuses) each mode's largest measured size, so a report still draws."""
    if chosen is not None:
        return PoolTops({Mode.SPEC: chosen.spec_bs[-1], Mode.DECODE: chosen.decode_bs[-1]})
    largest = {mode: m.sizes(mode)[-1] for mode in Mode}
    why = []
    if find_crossover(m, accept_len).bs is None:
        why.append(f"speculation wins at no measured batch size at accept length "
                   f"{accept_len:g}")
    if distribution.max_bs > largest[Mode.DECODE]:
        why.append(f"the distribution reaches bs={distribution.max_bs}, above the largest "
                   f"measured decode size {largest[Mode.DECODE]}")
    if why:
        return PoolTops(largest, f"pool tops: each mode's largest measured size (spec "
                                 f"{largest[Mode.SPEC]}, decode {largest[Mode.DECODE]}), not "
                                 f"the tuner's, since {' and '.join(why)}; the tuner would "
                                 "refuse these inputs")
    plan = plan_pools(m, distribution, accept_len)
    return PoolTops({Mode.SPEC: plan.spec.top, Mode.DECODE: plan.decode.top})


def pool_table(m: Measurements, distribution: BatchDistribution, accept_len: float,
               chosen: Optional[Chosen] = None, exclude_compile_outlier: bool = True) -> str:
    """Per pool: its graphs' memory (isolated sum) and capture time against the expected padding
    waste, for every candidate up to the pool's top and for the chosen list. Capture times as
    graph_table counts them (a compile outlier replaced by its mode's median, unless told not)."""
    tops = pool_tops(m, distribution, accept_len, chosen)
    used = replace_capture_s(m, find_compile_outliers(m)) if exclude_compile_outlier else m
    by_key, model = used.by_key(), MemoryModel.from_measurements(m)
    rows = [f"{'pool':>7}{'graphs':>8}{'memory alone':>14}{'capture s':>11}"
            f"{'waste tok/step':>16}  batch sizes"]
    for mode in (Mode.SPEC, Mode.DECODE):
        prob = pool_problem(m, mode, tops[mode])
        lists = [("all", prob.candidates)]
        if chosen is not None:
            lists.append(("chosen", chosen.sizes(mode)))
        for name, sizes in lists:
            t = totals([by_key[GraphKey(mode, b)] for b in sizes],
                       expected_waste(sizes, distribution.probs, prob.tokens_per_request), model)
            rows.append(f"{mode.value:>7}{t.graphs:>8}{format_bytes(t.isolated_sum_bytes):>14}"
                        f"{t.capture_s:>11.2f}{t.waste_tokens:>16.2f}  "
                        f"{name}: {','.join(map(str, sizes))}")
    if tops.fallback:
        rows += wrap_note(tops.fallback)
    return "\n".join(rows)


def write_report(m: Measurements, out_dir: str | Path, distribution: BatchDistribution,
                 accept_len: float, chosen: Optional[Chosen] = None,
                 exclude_compile_outlier: bool = True) -> ReportFiles:
    # Bad input is refused before the folder exists, so a failed report leaves nothing behind.
    check_accept_len(accept_len, m.num_draft_tokens)
    if chosen is not None:
        unknown = chosen.keys() - set(m.by_key())
        if unknown:
            raise ConfigError(f"the config chose graphs that were never measured: "
                              f"{sorted(k.label() for k in unknown)}; report with the "
                              "measurements the config was tuned from")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    crossover = find_crossover(m, accept_len)
    files = ReportFiles(out / "report.txt", out / "memory_capture.png",
                        out / "waste_vs_graphs.png", out / "latency.png")
    files.table.write_text(graph_table(m, chosen, exclude_compile_outlier) + "\n\n"
                           + pool_table(m, distribution, accept_len, chosen,
                                        exclude_compile_outlier) + "\n")
    plot_memory_and_capture(m, chosen, files.memory_capture_png)
    plot_waste_curves(m, distribution, accept_len, chosen, files.waste_png)
    plot_latency(m, crossover, files.latency_png)
    return files


def plot_memory_and_capture(m: Measurements, chosen: Optional[Chosen], path: Path) -> None:
    graphs = sorted(m.graphs, key=lambda g: g.key)
    picked = chosen.keys() if chosen else frozenset()
    x = range(len(graphs))
    # Unchosen bars fade when a config is shown; all are solid in a measurements-only report.
    colors = [to_rgba(_COLORS[g.key.mode], 1.0 if chosen is None or g.key in picked else 0.3)
              for g in graphs]
    fig = _figure(2, 1, (max(8.0, 0.22 * len(graphs)), 7.0))
    ax_mem, ax_t = fig.axes
    for ax, values, label in ((ax_mem, [g.pool_bytes / MiB for g in graphs], "pool MiB"),
                              (ax_t, [g.capture_s for g in graphs], "capture s")):
        ax.bar(list(x), values, color=colors)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    for o in find_compile_outliers(m):
        i = next(i for i, g in enumerate(graphs) if g.key == o.key)
        ax_t.annotate(f"one-time compile\n(tuner: median {o.median_s:.3f} s)",
                      (i, o.measured_s), xytext=(6, -4), textcoords="offset points",
                      fontsize=7, va="top")
    ax_t.set_xticks(list(x))
    ax_t.set_xticklabels([g.key.label() for g in graphs], rotation=90, fontsize=6)
    ax_mem.set_xticks([])
    title = (f"graph pool memory per key captured alone "
             f"({MemoryModel.from_measurements(m).short_formula()}) and capture time")
    ax_mem.set_title(title + ("; faded: not chosen" if chosen else ""), fontsize=9)
    _legend(ax_mem)
    _save(fig, path)


def plot_waste_curves(m: Measurements, distribution: BatchDistribution, accept_len: float,
                      chosen: Optional[Chosen], path: Path) -> None:
    tops = pool_tops(m, distribution, accept_len, chosen)
    fig = _figure(1, 2, (11.0, 4.2))
    for ax, mode in zip(fig.axes, (Mode.SPEC, Mode.DECODE)):
        prob = pool_problem(m, mode, tops[mode])
        curve = waste_curve(prob, distribution.probs)
        wastes = [p.waste for p in curve]
        ax.plot([p.k for p in curve], wastes, "o-", ms=3, color=_COLORS[mode],
                label="DP optimum for k graphs")
        if chosen is not None:
            sizes = chosen.sizes(mode)
            w = expected_waste(sizes, distribution.probs, prob.tokens_per_request)
            ax.plot([len(sizes)], [w], "k*", ms=12, label=f"chosen: {len(sizes)} graphs")
        ax.set_title(f"{mode.value} pool, bs 1..{prob.top}")
        ax.set_xlabel("graphs in pool (k)")
        ax.set_ylabel("expected padded tokens / step")
        # Log only when the curve spans decades (and never reaches 0): else linear reads better.
        if min(wastes) > 0 and max(wastes) / min(wastes) > 20:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"padding waste vs number of graphs ({distribution.description}, accept "
                 f"length {accept_len:g})")
    _save(fig, path)


def plot_latency(m: Measurements, crossover: Crossover, path: Path) -> None:
    fig = _figure(1, 2, (11.0, 4.2))
    ax_lat, ax_tps = fig.axes
    for mode in Mode:
        sizes = m.sizes(mode)
        ax_lat.plot(sizes, [1e3 * m.get(mode, b).replay_s for b in sizes], "o-", ms=3,
                    color=_COLORS[mode], label=mode.value)
    ax_lat.set_xlabel("batch size")
    ax_lat.set_ylabel("step latency (ms, graph replay)")
    ax_lat.set_title("replay latency per mode")
    pts = crossover.points
    ax_tps.plot([p.bs for p in pts], [p.spec_tok_s for p in pts], "o-", ms=3,
                color=_COLORS[Mode.SPEC], label=f"spec (accept {crossover.accept_len:g})")
    ax_tps.plot([p.bs for p in pts], [p.decode_tok_s for p in pts], "o-", ms=3,
                color=_COLORS[Mode.DECODE], label="decode")
    if crossover.bs is not None:
        ax_tps.axvline(crossover.bs, color="k", ls="--", lw=1,
                       label=f"crossover bs={crossover.bs}")
    ax_tps.set_xlabel("batch size")
    ax_tps.set_ylabel("predicted tok/s")
    ax_tps.set_title("predicted throughput at the measured spec sizes")
    for ax in (ax_lat, ax_tps):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path)


def _figure(rows: int, cols: int, size: tuple[float, float]) -> Figure:
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    fig.subplots(rows, cols)
    return fig


def _legend(ax: Axes) -> None:
    ax.legend(handles=[Patch(color=c, label=mode.value) for mode, c in _COLORS.items()],
              fontsize=8)


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=110)
