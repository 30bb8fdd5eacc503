"""Choose the batch sizes of each graph pool from recorded measurements.

From the measurements, a memory and a capture-time budget, the expected batch-size
distribution and accept length: (1) the crossover, (2) each pool's top, (3) the sizes below each
top that minimise padding waste within both shared budgets (capture.padding), under the
engine's graph-pool memory model (``MemoryModel``) and with one-time compilation kept out of
capture times. docs/design.md, "Choosing the batch sizes", says why each step is as it is.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
import textwrap
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

from capture.distribution import BatchDistribution
from capture.measurements import GraphMeasurement, Measurements
from dual_graph_worker.core.jsonio import need_field, need_mapping, need_number
from capture.padding import DEFAULT_WORK_LIMIT, PoolMemory, PoolProblem, expected_waste, solve
from capture.units import format_bytes
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import GraphKey, Mode
from dual_graph_worker.core.calibration import CalibrationTable


# A graph's own share of a graph pool where the measurements cannot tell it: one 2 MiB segment
# of the caching allocator (about 2 MiB a graph between SGLang's H200 servers).
SEGMENT_BYTES = 2 << 20
# A graph pool per mode without total_pool_bytes: the H200 servers measured 1.6-1.9x the pools'
# largest graphs alone (docs/design.md); 2 keeps the budget on the safe side.
FALLBACK_PEAK_FACTOR = 2.0
# A capture_s above this multiple of its mode's median is one-time compilation, not per graph.
COMPILE_OUTLIER_FACTOR = 5.0
_TABLE_WIDTH = 100


class TuningError(ConfigError):
    """The inputs admit no valid choice (budget too small, speculation never pays, ...)."""


class PoolWords(NamedTuple):
    every: str      # where every graph's memory is counted
    chosen: str     # what the chosen graphs' figure is
    saved: str      # the memory a smaller choice saves


POOL_WORDS = {"shared": PoolWords("in one shared pool", "shared pool", "shared-pool"),
              "per-mode": PoolWords("in a graph pool per mode", "by the model", "graph-pool")}


@dataclass(frozen=True)
class MemoryModel:
    """memory(S) = peak_factor x (largest isolated pool_bytes of each graph pool's keys in S)
    + per_graph_bytes x |S| (docs/design.md, "Memory").

    pools "shared": both modes in one graph pool (the reference engine), peak_factor 1;
    per_graph_bytes = ceil((total - peak) / keys) from the measurements' every-key-together
    capture. pools "per-mode": a graph pool per mode, the spec runners' together (SGLang),
    measured as a server measures them, runner buffers and all; per_graph_bytes = SEGMENT_BYTES
    and peak_factor = (total - per_graph_bytes x keys) / (spec peak + decode peak), at least 1.
    source "fallback": no total_pool_bytes was recorded (SEGMENT_BYTES a graph, and
    FALLBACK_PEAK_FACTOR per mode). `measured_*` say what the fit was made from."""

    per_graph_bytes: int
    source: str
    pools: str = "shared"
    peak_factor: float = 1.0
    measured_total_bytes: Optional[int] = None
    measured_peak_bytes: Optional[int] = None     # the peaks' sum: one per graph pool
    measured_keys: Optional[int] = None

    SOURCES = ("total_pool_bytes", "fallback")
    KINDS = {"shared": "shared-pool", "per-mode": "pool-per-mode"}   # pools -> JSON kind

    def __post_init__(self) -> None:
        if self.source not in self.SOURCES:
            raise ConfigError(f"memory model source must be one of {list(self.SOURCES)}, got "
                              f"{self.source!r}")
        if self.pools not in self.KINDS:
            raise ConfigError(f"memory model pools must be one of {list(self.KINDS)}, got "
                              f"{self.pools!r}")
        if self.shared and self.peak_factor != 1.0:
            raise ConfigError(f"a shared-pool memory model counts its peak once: peak_factor "
                              f"must be 1, got {self.peak_factor!r}")
        self.pool_memory()    # checks per_graph_bytes and peak_factor

    @property
    def shared(self) -> bool:
        return self.pools == "shared"

    def pool_memory(self) -> PoolMemory:
        """The model as the solver applies it to (spec, decode) problems."""
        return PoolMemory(self.per_graph_bytes, self.peak_factor, self.shared)

    @classmethod
    def from_measurements(cls, m: Measurements) -> "MemoryModel":
        # SGLang keeps a graph pool per runner; the reference engine one for every graph.
        if m.meta.get("engine") == "sglang":
            return cls._per_mode(m)
        if m.total_pool_bytes is None:
            return cls(SEGMENT_BYTES, "fallback")
        peak = max(g.pool_bytes for g in m.graphs)
        per_graph = max(0, math.ceil((m.total_pool_bytes - peak) / len(m.graphs)))
        return cls(per_graph, "total_pool_bytes", measured_total_bytes=m.total_pool_bytes,
                   measured_peak_bytes=peak, measured_keys=len(m.graphs))

    @classmethod
    def _per_mode(cls, m: Measurements) -> "MemoryModel":
        if m.total_pool_bytes is None:
            return cls(SEGMENT_BYTES, "fallback", "per-mode", FALLBACK_PEAK_FACTOR)
        peaks = sum(max(g.pool_bytes for g in m.graphs if g.key.mode is mode) for mode in Mode)
        # One together-capture fits one parameter: the factor; a graph's share stays a segment.
        rest = m.total_pool_bytes - SEGMENT_BYTES * len(m.graphs)
        factor = max(1.0, rest / peaks) if peaks else 1.0
        return cls(SEGMENT_BYTES, "total_pool_bytes", "per-mode", factor, m.total_pool_bytes,
                   peaks, len(m.graphs))

    def memory(self, graphs: Iterable[GraphMeasurement]) -> int:
        chosen = list(graphs)
        return self.pool_memory().bytes([[g.pool_bytes for g in chosen if g.key.mode is mode]
                                         for mode in (Mode.SPEC, Mode.DECODE)])

    @property
    def words(self) -> "PoolWords":
        """How this layout's memory is named in tables and reports."""
        return POOL_WORDS[self.pools]

    def tops_text(self, tops: tuple[int, int]) -> str:
        """The peak part of the (spec top, decode top) choice, spelled out."""
        if self.shared:
            return f"one shared pool: the larger top's isolated {format_bytes(max(tops))}"
        return (f"a pool per mode: {self.peak_factor:.2f} x (the tops' isolated "
                f"{format_bytes(tops[0])} + {format_bytes(tops[1])})")

    def rows_note(self) -> str:
        """How a tuning table's per-pool rows relate to its chosen/all rows."""
        if self.shared:
            return ("(spec, decode: each pool's graphs alone; chosen, all: both pools in one "
                    "shared pool, so their memory is not the sum of the rows; all: every "
                    "measured graph, its waste over the same pool ranges)")
        return ("(spec, decode: each pool's graphs in its own graph pool; chosen, all: both "
                "pools, their memory the sum of the rows; all: every measured graph, its waste "
                "over the same pool ranges)")

    def short_formula(self) -> str:
        """formula() in a plot title's few words."""
        per_graph = f"{format_bytes(self.per_graph_bytes)}/graph"
        if self.shared:
            return f"shared pool of all: largest + {per_graph}"
        return f"a pool per mode: {self.peak_factor:.2f} x each mode's largest + {per_graph}"

    def formula(self) -> str:
        graphs = f"{format_bytes(self.per_graph_bytes)} x graphs"
        if self.shared:
            return f"shared pool = largest isolated pool of the chosen graphs + {graphs}"
        return (f"a pool per mode = {self.peak_factor:.2f} x (largest isolated spec key + "
                f"largest isolated decode key of the chosen) + {graphs}")

    def describe(self) -> str:
        if self.source == "fallback":
            why = ("2 MiB a graph is one allocator segment each, conservative" if self.shared
                   else f"{FALLBACK_PEAK_FACTOR:g}x the peaks and a segment a graph, "
                        "conservative on the H200")
            return f"{self.formula()} (fallback: the measurements have no total_pool_bytes; {why})"
        total = (f"from total_pool_bytes: all {self.measured_keys} keys captured together took "
                 f"{format_bytes(self.measured_total_bytes or 0)}")
        if self.shared:
            return (f"{self.formula()} ({total}, the largest alone "
                    f"{format_bytes(self.measured_peak_bytes or 0)})")
        return (f"{self.formula()} ({total} as a server measures its pools, the two modes' "
                f"largest keys alone {format_bytes(self.measured_peak_bytes or 0)}; one "
                "together-capture fits the factor, a graph's own share is one allocator segment)")

    def to_json(self) -> dict:
        out: dict = {"kind": self.KINDS[self.pools], "per_graph_bytes": self.per_graph_bytes,
                     "source": self.source}
        if not self.shared:
            out["peak_factor"] = self.peak_factor
        if self.source == "total_pool_bytes":
            out.update(measured_total_bytes=self.measured_total_bytes,
                       measured_peak_bytes=self.measured_peak_bytes,
                       measured_keys=self.measured_keys)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = "memory_model") -> "MemoryModel":
        d = need_mapping(data, where)
        pools = next((p for p, kind in cls.KINDS.items() if d.get("kind") == kind), None)
        if pools is None:
            raise ConfigError(f"{where}.kind must be one of {list(cls.KINDS.values())}, got "
                              f"{d.get('kind')!r}")
        source = need_field(d, "source", str, where)
        extra = {} if source != "total_pool_bytes" else {
            k: need_field(d, k, int, where)
            for k in ("measured_total_bytes", "measured_peak_bytes", "measured_keys")}
        factor = 1.0 if pools == "shared" else need_number(d, "peak_factor", where,
                                                            allow_zero=False)
        return cls(need_field(d, "per_graph_bytes", int, where), source, pools, factor, **extra)


class CaptureOutlier(NamedTuple):
    """A capture time replaced by its mode's median: one-time compilation, not per graph."""

    key: GraphKey
    measured_s: float
    median_s: float

    def to_json(self) -> dict:
        return {"mode": self.key.mode.value, "bs": self.key.bs, "measured_s": self.measured_s,
                "used_s": self.median_s}


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


def capped(bs: Optional[int], cap: Optional[int]) -> Optional[int]:
    """A batch size under an optional cap (--spec-max-bs)."""
    return bs if bs is None or cap is None else min(bs, cap)


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
              ) -> tuple[Measurements, list[CaptureOutlier], MemoryModel]:
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


def format_table(r: TuningResult) -> str:
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
    lines += wrap_note(f"memory model: {r.memory_model.describe()}; 'isolated sum' is each graph's "
                   "pool captured alone, summed (no sharing), shown for comparison only")
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
