"""Choose the batch sizes of each graph pool from recorded measurements.

From the measurements, a memory and a capture-time budget, the expected batch-size
distribution and accept length: (1) the crossover, (2) each pool's top, (3) the sizes below each
top that minimise padding waste within both shared budgets (capture.padding), under the
engine's graph-pool memory model (capture.memory_model) and with one-time compilation kept out
of capture times; what it returns, and its table, are capture.result's. docs/design.md,
"Choosing the batch sizes", says why each step is as it is.
"""

from __future__ import annotations

import bisect
import dataclasses
import statistics
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from capture.distribution import BatchDistribution
from capture.measurements import GraphMeasurement, Measurements
from capture.memory_model import MemoryModel
from capture.padding import DEFAULT_WORK_LIMIT, PoolProblem, expected_waste, solve
from capture.result import (COMPILE_OUTLIER_FACTOR, CaptureOutlier, Crossover, ThroughputPoint,
                            Totals, TuningResult, capped)
from capture.units import format_bytes
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import GraphKey, Mode
from dual_graph_worker.core.calibration import CalibrationTable


class TuningError(ConfigError):
    """The inputs admit no valid choice (budget too small, speculation never pays, ...)."""


def find_compile_outliers(m: Measurements, factor: float = COMPILE_OUTLIER_FACTOR
                          ) -> tuple[CaptureOutlier, ...]:
    """Per mode, the keys whose capture_s exceeds `factor` x the mode's median capture_s."""
    out = []
    for mode in (Mode.SPEC, Mode.DECODE):
        graphs = sorted((g for g in m.graphs if g.key.mode is mode), key=lambda g: g.key.bs)
        median = statistics.median(g.capture_s for g in graphs)
        if median > 0:
            out += [CaptureOutlier(g.key, g.capture_s, median) for g in graphs
                    if g.capture_s > factor * median]
    return tuple(out)


def replace_capture_s(m: Measurements, outliers: Iterable[CaptureOutlier]) -> Measurements:
    """The measurements with each outlier's capture_s set to its mode's median."""
    fix = {o.key: o.median_s for o in outliers}
    if not fix:
        return m
    return dataclasses.replace(m, graphs=tuple(
        dataclasses.replace(g, capture_s=fix[g.key]) if g.key in fix else g for g in m.graphs))


@dataclass(frozen=True)
class PoolPlan:
    """The two pool problems (candidates up to each top, with their costs) and the crossover."""

    crossover: Crossover
    spec: PoolProblem
    decode: PoolProblem


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


def check_accept_len(accept_len: float, k: int) -> None:
    """TuningError unless 1 <= accept_len <= K + 1 (the bonus token included)."""
    if not 1.0 <= accept_len <= k + 1:
        raise TuningError(f"accept length must be in 1..K+1 = 1..{k + 1} tokens per request per "
                          f"spec step (bonus token included), got {accept_len}")


def plan_pools(measurements: Measurements, distribution: BatchDistribution,
               accept_len: float, spec_max_bs: Optional[int] = None) -> PoolPlan:
    """Crossover and pool tops (steps 1-2, docs/design.md); raises TuningError. `spec_max_bs`
    caps the spec pool below the replays' crossover: a replay leaves out the host work and
    draft prefills a served step pays, so a server's crossover sits lower than its graphs'."""
    check_accept_len(accept_len, measurements.num_draft_tokens)
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
    top = capped(crossover.bs, spec_max_bs)
    spec_sizes = [b for b in measurements.sizes(Mode.SPEC) if b <= top]
    if not spec_sizes:
        raise TuningError(f"--spec-max-bs {spec_max_bs} is below every measured spec batch size "
                          f"({measurements.sizes(Mode.SPEC)[0]} is the smallest); raise it")
    spec_top = spec_sizes[-1] if spec_sizes[-1] < need else spec_sizes[
        bisect.bisect_left(spec_sizes, need)]
    decode_top = dec_sizes[bisect.bisect_left(dec_sizes, max(need, spec_top))]
    return PoolPlan(crossover, pool_problem(measurements, Mode.SPEC, spec_top),
                    pool_problem(measurements, Mode.DECODE, decode_top))


def tune(measurements: Measurements, memory_budget_bytes: int, time_budget_s: float,
         distribution: BatchDistribution, accept_len: float,
         work_limit: int = DEFAULT_WORK_LIMIT,
         exclude_compile_outlier: bool = True,
         spec_max_bs: Optional[int] = None) -> TuningResult:
    """Steps 1-3 (docs/design.md). Raises TuningError when no valid choice exists."""
    if memory_budget_bytes <= 0 or time_budget_s <= 0:
        raise TuningError(f"budgets must be > 0, got memory {memory_budget_bytes} bytes and "
                          f"capture time {time_budget_s} s")
    measurements, outliers, model = _as_tuned(measurements, exclude_compile_outlier)
    plan = plan_pools(measurements, distribution, accept_len, spec_max_bs)
    probs = distribution.probs
    sol = solve((plan.spec, plan.decode), probs, memory_budget_bytes, time_budget_s,
                memory=model.pool_memory(), work_limit=work_limit)
    if sol is None:
        raise TuningError(_infeasible_message(plan, model, memory_budget_bytes, time_budget_s))
    spec_bs, decode_bs = sol.sizes
    by_key = measurements.by_key()
    chosen_by_mode, all_by_mode, useful = {}, {}, {}
    chosen_graphs: list[GraphMeasurement] = []        # spec pool's, then decode pool's
    for prob, sizes, waste in zip((plan.spec, plan.decode), sol.sizes, sol.waste):
        mine = [by_key[GraphKey(prob.mode, b)] for b in sizes]
        every = [g for g in measurements.graphs if g.key.mode is prob.mode]
        chosen_graphs += mine
        chosen_by_mode[prob.mode] = totals(mine, waste, model)
        all_by_mode[prob.mode] = totals(
            every, expected_waste(prob.candidates, probs, prob.tokens_per_request), model)
        useful[prob.mode] = prob.tokens_per_request * sum(
            p * b for b, p in probs.items() if b <= prob.top)
    chosen = totals(chosen_graphs, sol.total_waste, model)
    assert chosen.memory_bytes == sol.memory_bytes   # the solver and the totals agree
    all_candidates = totals(measurements.graphs,
                            sum(t.waste_tokens for t in all_by_mode.values()), model)
    calibration = CalibrationTable(
        {g.key: g.replay_s for g in chosen_graphs}, measurements.num_draft_tokens,
        source="synthetic" if measurements.synthetic else "measured")
    return TuningResult(
        spec_bs=spec_bs, decode_bs=decode_bs, crossover=plan.crossover, accept_len=accept_len,
        num_draft_tokens=measurements.num_draft_tokens, distribution=distribution,
        memory_budget_bytes=memory_budget_bytes, time_budget_s=time_budget_s,
        chosen_by_mode=chosen_by_mode, all_by_mode=all_by_mode, useful_tokens_by_mode=useful,
        calibration=calibration, exact=sol.exact, gpu_label=measurements.gpu.describe(),
        fingerprint=measurements.model.fingerprint, synthetic=measurements.synthetic,
        chosen=chosen, all_candidates=all_candidates, memory_model=model,
        capture_outliers=outliers, exclude_compile_outlier=exclude_compile_outlier,
        one_time_compile_s=measurements.one_time_compile_s, spec_max_bs=spec_max_bs)


def _as_tuned(m: Measurements, exclude_compile_outlier: bool
              ) -> tuple[Measurements, tuple[CaptureOutlier, ...], MemoryModel]:
    """The measurements as tune() prices them (one-time compilation out), and its model."""
    outliers = find_compile_outliers(m)
    if exclude_compile_outlier:
        m = replace_capture_s(m, outliers)
    return m, outliers, MemoryModel.from_measurements(m)


def priced_graphs(m: Measurements, spec_bs: Sequence[int],
                  decode_bs: Sequence[int]) -> list[GraphMeasurement]:
    """A server's two lists as measured graphs, spec's first. A size the measurements lack is
    priced as the next measured size up (SGLang's spec list is finer than the probe's)."""
    by_key = m.by_key()

    def priced(mode: Mode, bs: int) -> GraphMeasurement:
        sizes = m.sizes(mode)
        i = bisect.bisect_left(sizes, bs)
        if i == len(sizes):
            raise TuningError(f"{mode.value} bs={bs} is above every measured size; measured "
                              f"{mode.value} sizes: {list(sizes)}")
        return by_key[GraphKey(mode, sizes[i])]

    return [priced(Mode.SPEC, int(b)) for b in spec_bs] + \
        [priced(Mode.DECODE, int(b)) for b in decode_bs]


def modelled_cost(m: Measurements, spec_bs: Sequence[int], decode_bs: Sequence[int],
                  exclude_compile_outlier: bool = True) -> Totals:
    """What tune() charges for these two lists, so a budget taken from them is in the units
    tune() checks."""
    m, _, model = _as_tuned(m, exclude_compile_outlier)
    return totals(priced_graphs(m, spec_bs, decode_bs), 0.0, model)


def totals(graphs: Sequence[GraphMeasurement], waste: float, model: MemoryModel) -> Totals:
    return Totals(len(graphs), waste, model.memory(graphs),
                  sum(g.capture_s for g in graphs), sum(g.pool_bytes for g in graphs))


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


def _infeasible_message(plan: PoolPlan, model: MemoryModel, mem_budget: int,
                        time_budget: float) -> str:
    tops = (plan.spec.memory_bytes[-1], plan.decode.memory_bytes[-1])
    mem = model.pool_memory().bytes([[b] for b in tops])
    t = plan.spec.capture_s[-1] + plan.decode.capture_s[-1]
    over = []
    if mem > mem_budget:
        over.append(f"--memory-budget to at least {format_bytes(mem)} (now "
                    f"{format_bytes(mem_budget)})")
    if t > time_budget:
        over.append(f"--time-budget to at least {t:.2f} s (now {time_budget:g} s)")
    return (f"the smallest valid choice, spec bs={plan.spec.top} plus decode bs="
            f"{plan.decode.top} (each pool must keep its top), needs {format_bytes(mem)} "
            f"({model.tops_text(tops)} + 2 x {format_bytes(model.per_graph_bytes)} a graph) "
            f"and {t:.2f} s of capture: over budget. Raise {' and '.join(over)}, or cap the "
            "batch-size distribution lower")
