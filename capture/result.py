"""What the tuner returns and how it reads: the chosen pools, why, what they cost, as a table.

`TuningResult` and the values it holds (crossover, totals, compile outliers) are computed by
capture.tuner and written to a config by capture.config; `format_table` is the table
`TuningResult.table()` prints, kept with the result it reads (the tuner imports this module, so
the table cannot import the tuner). `wrap_note` wraps capture.report's notes to the same width.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional

from capture.distribution import BatchDistribution
from capture.memory_model import MemoryModel
from capture.units import format_bytes
from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.modes import GraphKey, Mode

# A capture_s above this multiple of its mode's median is one-time compilation, not per graph.
COMPILE_OUTLIER_FACTOR = 5.0
_TABLE_WIDTH = 100


class CaptureOutlier(NamedTuple):
    """A capture time replaced by its mode's median: one-time compilation, not per graph."""

    key: GraphKey
    measured_s: float
    median_s: float

    def to_json(self) -> dict:
        return {"mode": self.key.mode.value, "bs": self.key.bs, "measured_s": self.measured_s,
                "used_s": self.median_s}


class ThroughputPoint(NamedTuple):
    bs: int
    spec_tok_s: float
    decode_tok_s: float

    @property
    def spec_wins(self) -> bool:
        return self.spec_tok_s > self.decode_tok_s


@dataclass(frozen=True)
class Crossover:
    """Predicted throughput at every measured spec bs, and where speculation stops paying
    (`bs`: the largest bs where it wins; None when it never does)."""

    accept_len: float
    points: tuple[ThroughputPoint, ...]
    bs: Optional[int]

    def point(self, bs: int) -> Optional[ThroughputPoint]:
        return next((p for p in self.points if p.bs == bs), None)

    def first_loss_above(self) -> Optional[ThroughputPoint]:
        return next((p for p in self.points if self.bs is not None and p.bs > self.bs), None)

    def losses_below(self) -> tuple[ThroughputPoint, ...]:
        """The sizes below the crossover where decode measured faster: the rule takes the
        largest win, so a noisy win above a loss would otherwise hide that loss."""
        return tuple(p for p in self.points
                     if self.bs is not None and p.bs < self.bs and not p.spec_wins)


class Totals(NamedTuple):
    """A set of graphs: how many, their expected padding waste, memory and capture time."""

    graphs: int
    waste_tokens: float        # expected padded tokens per step, spec pool + decode pool
    memory_bytes: int          # the memory model (MemoryModel) of these graphs together
    capture_s: float
    # Each graph's pool growth captured alone, summed: no pool sharing, so an upper bound.
    isolated_sum_bytes: Optional[int] = None


@dataclass(frozen=True)
class TuningResult:
    """The chosen pools, why (crossover), and what they cost against capturing everything."""

    spec_bs: tuple[int, ...]
    decode_bs: tuple[int, ...]
    crossover: Crossover
    accept_len: float
    num_draft_tokens: int
    distribution: BatchDistribution
    memory_budget_bytes: int
    time_budget_s: float
    chosen_by_mode: Mapping[Mode, Totals]
    # Every measured key of the mode; its waste is taken over the same pool range as the chosen
    # set (graphs beyond the ranges add memory and capture time, never less padding).
    all_by_mode: Mapping[Mode, Totals]
    useful_tokens_by_mode: Mapping[Mode, float]   # expected real tokens per step in each range
    calibration: CalibrationTable
    exact: bool
    gpu_label: str
    fingerprint: str
    synthetic: bool
    chosen: Totals             # both pools together (memory: the model's, not a row sum)
    all_candidates: Totals
    memory_model: MemoryModel
    # Capture times over COMPILE_OUTLIER_FACTOR x their mode's median; replaced by the median
    # in every cost above when exclude_compile_outlier, else only reported.
    capture_outliers: tuple[CaptureOutlier, ...] = ()
    exclude_compile_outlier: bool = True
    one_time_compile_s: Optional[float] = None    # measurements' meta, when measured
    spec_max_bs: Optional[int] = None     # the spec pool's cap below the crossover, if any

    @property
    def crossover_bs(self) -> Optional[int]:
        return self.crossover.bs

    @property
    def threshold_bs(self) -> Optional[int]:
        """The crossover as a threshold prior: never above the spec pool's cap."""
        return capped(self.crossover.bs, self.spec_max_bs)

    def table(self) -> str:
        return format_table(self)


def capped(bs: Optional[int], cap: Optional[int]) -> Optional[int]:
    """A batch size under an optional cap (--spec-max-bs)."""
    return bs if bs is None or cap is None else min(bs, cap)


def format_table(r: TuningResult) -> str:
    """The table `dgw capture-tune` prints: inputs, crossover, notes, costs per pool, the lists."""
    cross = r.crossover
    at = cross.point(cross.bs) if cross.bs is not None else None
    loss = cross.first_loss_above()
    detail = [f"{at.spec_tok_s:.0f} vs {at.decode_tok_s:.0f} tok/s"] if at else []
    below = cross.losses_below()
    if below:
        detail.append(f"decode faster at bs={','.join(str(p.bs) for p in below)}")
    lines = [
        f"capture tuning: {r.gpu_label}, model {r.fingerprint}, K={r.num_draft_tokens}"
        + ("  [SYNTHETIC measurements: not for deployment]" if r.synthetic else ""),
        f"accept length {r.accept_len:.2f}; batch sizes {r.distribution.description} "
        f"(mean {r.distribution.mean():.1f}, max {r.distribution.max_bs})",
        f"crossover: speculation pays up to bs={cross.bs}"
        + (f" ({'; '.join(detail)})" if detail else "")
        + (f"; decode wins at bs={loss.bs} ({loss.spec_tok_s:.0f} vs {loss.decode_tok_s:.0f})"
           if loss else "")
        + (f"; spec pool capped at bs={r.spec_max_bs} (--spec-max-bs)"
           if r.threshold_bs != cross.bs else ""),
        f"budgets: memory {format_bytes(r.memory_budget_bytes)}, capture time "
        f"{r.time_budget_s:g} s"
        + ("" if r.exact else "  (not proven optimal: work limit reached; Lagrangian choice)"),
    ]
    lines += wrap_note(f"memory model: {r.memory_model.describe()}; 'isolated sum' is each "
                       "graph's pool captured alone, summed (no sharing), shown for comparison "
                       "only")
    for note in _capture_notes(r):
        lines += wrap_note(note)
    lines += [
        "",
        f"{'':8}{'graphs':>8}{'waste tok/step':>16}{'waste %':>9}{'memory':>12}"
        f"{'isolated sum':>14}{'capture':>10}",
    ]
    for mode in (Mode.SPEC, Mode.DECODE):
        t, useful = r.chosen_by_mode[mode], r.useful_tokens_by_mode[mode]
        # No batch in the pool's range (e.g. every batch above the crossover): no percentage.
        pct = f"{100 * t.waste_tokens / useful:.1f}%" if useful > 0 else "-"
        lines.append(_row(mode.value, t, pct))
    c, a = r.chosen, r.all_candidates
    lines += [
        _row("chosen", c, ""),
        _row("all", a, ""),
    ]
    lines += wrap_note(r.memory_model.rows_note(), indent="")
    saved_iso = (a.isolated_sum_bytes or 0) - (c.isolated_sum_bytes or 0)
    lines += wrap_note(f"saved {a.graphs - c.graphs} graphs, "
                       f"{format_bytes(a.memory_bytes - c.memory_bytes)} of "
                       f"{r.memory_model.words.saved} memory "
                       f"({format_bytes(saved_iso)} by the isolated sum) and "
                       f"{a.capture_s - c.capture_s:.2f} s of capture, for "
                       f"{c.waste_tokens - a.waste_tokens:+.2f} padded tokens per step")
    lines += [
        "",
        f"spec bs   ({len(r.spec_bs)}): {' '.join(map(str, r.spec_bs))}",
        f"decode bs ({len(r.decode_bs)}): {' '.join(map(str, r.decode_bs))}",
    ]
    return "\n".join(lines)


def _capture_notes(r: TuningResult) -> list[str]:
    out = []
    if r.one_time_compile_s is not None:
        out.append(f"capture time: a one-time compile warm-up of {r.one_time_compile_s:.2f} s was "
                   "measured apart (paid once at start-up, not per graph; not in the budget)")
    if r.capture_outliers:
        listed = "; ".join(f"{o.key.mode.value} bs={o.key.bs} {o.measured_s:.3f} s -> "
                           f"{o.median_s:.3f} s" for o in r.capture_outliers)
        n = len(r.capture_outliers)
        head = (f"capture time: {n} value{'s' if n > 1 else ''} over "
                f"{COMPILE_OUTLIER_FACTOR:g}x {'their' if n > 1 else 'its'} mode's median ")
        if r.exclude_compile_outlier:
            once = sum(o.measured_s - o.median_s for o in r.capture_outliers)
            out.append(head + f"REPLACED by that median: {listed}. The first capture of a mode "
                       f"pays one-time Triton JIT compilation (~{once:.2f} s here), once at "
                       "start-up whatever is chosen, not per graph, so it is not counted "
                       "(--no-exclude-compile-outlier keeps the measured values)")
        else:
            out.append(head + f"kept as measured (--no-exclude-compile-outlier): {listed}")
    return out


def wrap_note(text: str, indent: str = "  ") -> list[str]:
    """A note as report lines: the table's width, continuation lines indented."""
    return textwrap.wrap(text, _TABLE_WIDTH, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False)


def _row(name: str, t: Totals, pct: str) -> str:
    iso = format_bytes(t.isolated_sum_bytes) if t.isolated_sum_bytes is not None else "-"
    return (f"{name:8}{t.graphs:>8}{t.waste_tokens:>16.2f}{pct:>9}"
            f"{format_bytes(t.memory_bytes):>12}{iso:>14}{t.capture_s:>9.2f}s")
