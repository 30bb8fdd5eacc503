"""Choose the batch sizes of each graph pool from recorded measurements.

Inputs: measurements (capture time, pool memory and replay latency per candidate (mode, bs)), a
memory budget, a capture-time budget, the expected batch-size distribution and the expected
accepted length (tokens per request per spec step, 1..K+1).

1. Crossover: the largest measured bs where speculation is predicted to beat plain decode,
   bs * accept_len / t_spec(bs) > bs / t_decode(bs) (the goodput policy's own prediction). Spec
   graphs above it would never be replayed by the goodput policy: they are memory for nothing.
2. Pool tops. Decode: the smallest decode candidate covering the largest batch size the
   distribution can produce. A batch above the decode top would run eagerly; the measurements do
   not price an eager step (its cost is launch overhead, not padding), so the tuner FORBIDS it
   rather than guessing a penalty: a distribution reaching past every decode candidate is an
   error telling the user to measure larger sizes or cap the distribution. Spec: the crossover,
   or less when the distribution never reaches it; the decode top is raised to cover the spec top.
3. Inside each pool, choose the sizes below the top that minimise expected padding waste
   (padded tokens per step, `capture.padding`) with both budgets shared by the two pools: a
   resource-constrained shortest path over the candidates, proven optimal on realistic inputs
   (`TuningResult.exact`), a Lagrangian near-optimum past a work limit.
Each pool's waste is taken over the distribution restricted to its range 1..top: the decode pool
also serves small batches whenever speculation is off (low acceptance, KV pressure, a user pin),
so its small sizes matter too.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple, Optional, Sequence

from capture.distribution import BatchDistribution
from capture.measurements import GraphMeasurement, Measurements
from capture.padding import DEFAULT_WORK_LIMIT, PoolProblem, expected_waste, solve
from capture.units import format_bytes
from dual_graph_worker.errors import ConfigError
from dual_graph_worker.modes import GraphKey, Mode
from dual_graph_worker.policy import CalibrationTable


class TuningError(ConfigError):
    """The inputs admit no valid choice (budget too small, speculation never pays, ...)."""


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


@dataclass(frozen=True)
class PoolPlan:
    """The two pool problems (candidates up to each top, with their costs) and the crossover."""

    crossover: Crossover
    spec: PoolProblem
    decode: PoolProblem


class Totals(NamedTuple):
    """A set of graphs: how many, their expected padding waste, memory and capture time."""

    graphs: int
    waste_tokens: float        # expected padded tokens per step, spec pool + decode pool
    memory_bytes: int          # sum of isolated pool growth: an upper bound on the shared pool
    capture_s: float


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
    measured_total_pool_bytes: Optional[int]

    @property
    def crossover_bs(self) -> Optional[int]:
        return self.crossover.bs

    @property
    def chosen(self) -> Totals:
        return _sum_totals(self.chosen_by_mode.values())

    @property
    def all_candidates(self) -> Totals:
        return _sum_totals(self.all_by_mode.values())

    def table(self) -> str:
        return format_table(self)


def find_crossover(measurements: Measurements, accept_len: float) -> Crossover:
    """Rank the modes at every measured spec bs. Decode latency is the one of the smallest
    measured decode size >= bs: bs itself when measured in both modes (the usual case), else
    the graph a decode step of bs would replay if every candidate were captured, which is what
    the goodput policy compares at run time. A spec bs above every decode size is not ranked."""
    by_key = measurements.by_key()
    dec_sizes = measurements.sizes(Mode.DECODE)
    points = []
    for bs in measurements.sizes(Mode.SPEC):
        i = bisect.bisect_left(dec_sizes, bs)
        if i == len(dec_sizes):
            continue
        dec = by_key[GraphKey(Mode.DECODE, dec_sizes[i])]
        spec = by_key[GraphKey(Mode.SPEC, bs)]
        points.append(ThroughputPoint(bs, bs * accept_len / spec.replay_s, bs / dec.replay_s))
    wins = [p.bs for p in points if p.spec_wins]
    return Crossover(accept_len, tuple(points), max(wins) if wins else None)


def plan_pools(measurements: Measurements, distribution: BatchDistribution,
               accept_len: float) -> PoolPlan:
    """Crossover and pool tops (steps 1-2 of the module docstring); raises TuningError."""
    k = measurements.num_draft_tokens
    if not 1.0 <= accept_len <= k + 1:
        raise TuningError(f"accept length must be in 1..K+1 = 1..{k + 1} tokens per request per "
                          f"spec step (bonus token included), got {accept_len}")
    crossover = find_crossover(measurements, accept_len)
    if crossover.bs is None:
        best = max(crossover.points, key=lambda p: p.spec_tok_s / p.decode_tok_s, default=None)
        detail = (f" (best ratio at bs={best.bs}: {best.spec_tok_s:.0f} vs "
                  f"{best.decode_tok_s:.0f} tok/s)" if best else
                  " (no spec bs is covered by a decode measurement)")
        raise TuningError(f"at accept length {accept_len:g} speculation loses to plain decode at "
                          f"every measured batch size{detail}; serve without speculation, or "
                          "re-tune with the accept length your draft model really reaches")
    dec_sizes = measurements.sizes(Mode.DECODE)
    need = distribution.max_bs
    if need > dec_sizes[-1]:
        raise TuningError(
            f"the batch-size distribution reaches bs={need} but the largest measured decode graph "
            f"is bs={dec_sizes[-1]}; batches above the decode pool would run eagerly, which the "
            "tuner does not allow (no measurement prices an eager step): measure larger decode "
            f"batch sizes, or cap the distribution at {dec_sizes[-1]} (e.g. uniform:1-"
            f"{dec_sizes[-1]}) and cap max running requests to match")
    spec_sizes = [b for b in measurements.sizes(Mode.SPEC) if b <= crossover.bs]
    spec_top = spec_sizes[-1] if spec_sizes[-1] < need else spec_sizes[
        bisect.bisect_left(spec_sizes, need)]
    decode_top = dec_sizes[bisect.bisect_left(dec_sizes, max(need, spec_top))]
    return PoolPlan(crossover, pool_problem(measurements, Mode.SPEC, spec_top),
                    pool_problem(measurements, Mode.DECODE, decode_top))


def tune(measurements: Measurements, memory_budget_bytes: int, time_budget_s: float,
         distribution: BatchDistribution, accept_len: float,
         work_limit: int = DEFAULT_WORK_LIMIT) -> TuningResult:
    """Steps 1-3 of the module docstring. Raises TuningError when no valid choice exists."""
    if memory_budget_bytes <= 0 or time_budget_s <= 0:
        raise TuningError(f"budgets must be > 0, got memory {memory_budget_bytes} bytes and "
                          f"capture time {time_budget_s} s")
    plan = plan_pools(measurements, distribution, accept_len)
    probs = distribution.probs
    sol = solve((plan.spec, plan.decode), probs, memory_budget_bytes, time_budget_s, work_limit)
    if sol is None:
        raise TuningError(_infeasible_message(plan, memory_budget_bytes, time_budget_s))
    spec_bs, decode_bs = sol.sizes
    by_key = measurements.by_key()
    chosen_by_mode, all_by_mode, useful = {}, {}, {}
    for prob, sizes, waste in zip((plan.spec, plan.decode), sol.sizes, sol.waste):
        mine = [by_key[GraphKey(prob.mode, b)] for b in sizes]
        every = [g for g in measurements.graphs if g.key.mode is prob.mode]
        chosen_by_mode[prob.mode] = _totals(mine, waste)
        all_by_mode[prob.mode] = _totals(
            every, expected_waste(prob.candidates, probs, prob.tokens_per_request))
        useful[prob.mode] = prob.tokens_per_request * sum(
            p * b for b, p in probs.items() if b <= prob.top)
    keys = [GraphKey(Mode.SPEC, b) for b in spec_bs] + [GraphKey(Mode.DECODE, b)
                                                        for b in decode_bs]
    calibration = CalibrationTable(
        {k: by_key[k].replay_s for k in keys}, measurements.num_draft_tokens,
        source="synthetic" if measurements.synthetic else "measured")
    return TuningResult(
        spec_bs=spec_bs, decode_bs=decode_bs, crossover=plan.crossover, accept_len=accept_len,
        num_draft_tokens=measurements.num_draft_tokens, distribution=distribution,
        memory_budget_bytes=memory_budget_bytes, time_budget_s=time_budget_s,
        chosen_by_mode=chosen_by_mode, all_by_mode=all_by_mode, useful_tokens_by_mode=useful,
        calibration=calibration, exact=sol.exact, gpu_label=measurements.gpu.describe(),
        fingerprint=measurements.model.fingerprint, synthetic=measurements.synthetic,
        measured_total_pool_bytes=measurements.total_pool_bytes)


def _totals(graphs: Sequence[GraphMeasurement], waste: float) -> Totals:
    return Totals(len(graphs), waste, sum(g.pool_bytes for g in graphs),
                  sum(g.capture_s for g in graphs))


def _sum_totals(parts: Iterable[Totals]) -> Totals:
    parts = list(parts)
    return Totals(sum(p.graphs for p in parts), sum(p.waste_tokens for p in parts),
                  sum(p.memory_bytes for p in parts), sum(p.capture_s for p in parts))


def pool_problem(m: Measurements, mode: Mode, top: int) -> PoolProblem:
    """The measured candidates of `mode` up to `top` (a measured size) with their costs."""
    if top not in m.sizes(mode):
        raise TuningError(f"no {mode.value} graph was measured at bs={top}; measured sizes: "
                          f"{list(m.sizes(mode))}")
    sizes = tuple(b for b in m.sizes(mode) if b <= top)
    by_key = m.by_key()
    graphs = [by_key[GraphKey(mode, b)] for b in sizes]
    return PoolProblem(mode, sizes, mode.tokens_per_request(m.num_draft_tokens),
                       tuple(g.pool_bytes for g in graphs), tuple(g.capture_s for g in graphs))


def _infeasible_message(plan: PoolPlan, mem_budget: int, time_budget: float) -> str:
    mem = plan.spec.memory_bytes[-1] + plan.decode.memory_bytes[-1]
    t = plan.spec.capture_s[-1] + plan.decode.capture_s[-1]
    over = []
    if mem > mem_budget:
        over.append(f"--memory-budget to at least {format_bytes(mem)} (now "
                    f"{format_bytes(mem_budget)})")
    if t > time_budget:
        over.append(f"--time-budget to at least {t:.2f} s (now {time_budget:g} s)")
    return (f"the smallest valid choice, spec bs={plan.spec.top} plus decode bs="
            f"{plan.decode.top} (each pool must keep its top), needs {format_bytes(mem)} and "
            f"{t:.2f} s of capture: over budget. Raise {' and '.join(over)}, or cap the "
            "batch-size distribution lower")


def format_table(r: TuningResult) -> str:
    cross = r.crossover
    at = cross.point(cross.bs) if cross.bs is not None else None
    loss = cross.first_loss_above()
    lines = [
        f"capture tuning: {r.gpu_label}, model {r.fingerprint}, K={r.num_draft_tokens}"
        + ("  [SYNTHETIC measurements: not for deployment]" if r.synthetic else ""),
        f"accept length {r.accept_len:.2f}; batch sizes {r.distribution.description} "
        f"(mean {r.distribution.mean():.1f}, max {r.distribution.max_bs})",
        f"crossover: speculation pays up to bs={cross.bs}"
        + (f" ({at.spec_tok_s:.0f} vs {at.decode_tok_s:.0f} tok/s)" if at else "")
        + (f"; decode wins at bs={loss.bs} ({loss.spec_tok_s:.0f} vs {loss.decode_tok_s:.0f})"
           if loss else ""),
        f"budgets: memory {format_bytes(r.memory_budget_bytes)}, capture time "
        f"{r.time_budget_s:g} s"
        + ("" if r.exact else "  (not proven optimal: work limit reached; Lagrangian choice)"),
        "",
        f"{'':8}{'graphs':>8}{'waste tok/step':>16}{'waste %':>9}{'memory':>12}{'capture':>10}",
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
        "(all: every measured graph; its waste over the same pool ranges)",
        f"saved {a.graphs - c.graphs} graphs, {format_bytes(a.memory_bytes - c.memory_bytes)} "
        f"and {a.capture_s - c.capture_s:.2f} s of capture, for "
        f"{c.waste_tokens - a.waste_tokens:+.2f} padded tokens per step",
        "",
        f"spec bs   ({len(r.spec_bs)}): {' '.join(map(str, r.spec_bs))}",
        f"decode bs ({len(r.decode_bs)}): {' '.join(map(str, r.decode_bs))}",
    ]
    if r.measured_total_pool_bytes is not None:
        lines.append(f"note: memory sums isolated captures (an upper bound); capturing every key "
                     f"into one shared pool measured {format_bytes(r.measured_total_pool_bytes)}")
    return "\n".join(lines)


def _row(name: str, t: Totals, pct: str) -> str:
    return (f"{name:8}{t.graphs:>8}{t.waste_tokens:>16.2f}{pct:>9}"
            f"{format_bytes(t.memory_bytes):>12}{t.capture_s:>9.2f}s")
