"""Padding waste of a set of captured batch sizes, and the optimisers that choose the set.

``expected_waste`` is W(S), the padded tokens per step a pool's sizes cost under a batch-size
distribution; ``waste_curve`` is the 1-D optimal-partition DP (least waste for every size count);
``solve`` chooses several pools' sizes under a shared memory and capture-time budget, memory by
``PoolMemory`` (a Lagrangian heuristic, then an exact branch-and-bound per peak level,
``exact=False`` past ``work_limit``). docs/design.md, "Choosing the batch sizes", derives it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional, Sequence

import numpy as np

from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import Mode

DEFAULT_WORK_LIMIT = 1_000_000
_PRICE_DIRECTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)   # weight of memory vs time in the price
_BISECT_STEPS = 30
_EPS = 1e-9


@dataclass(frozen=True)
class PoolProblem:
    """One pool to size: sorted candidates whose last entry (the top) must be captured."""

    mode: Mode
    candidates: tuple[int, ...]
    tokens_per_request: int
    memory_bytes: tuple[int, ...]     # per candidate, aligned with `candidates`: the graph
                                      # pool growth capturing it ALONE (isolated footprint)
    capture_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ConfigError(f"{self.mode.value} pool has no candidate batch sizes")
        if list(self.candidates) != sorted(set(self.candidates)) or self.candidates[0] < 1:
            raise ConfigError(f"{self.mode.value} candidates must be distinct sizes >= 1 in "
                              f"ascending order, got {self.candidates}")
        if not len(self.candidates) == len(self.memory_bytes) == len(self.capture_s):
            raise ConfigError("candidates, memory_bytes and capture_s must align")

    @property
    def top(self) -> int:
        return self.candidates[-1]


class CurvePoint(NamedTuple):
    k: int
    waste: float
    sizes: tuple[int, ...]


class Solution(NamedTuple):
    sizes: tuple[tuple[int, ...], ...]   # per pool, in the order given to `solve`
    waste: tuple[float, ...]             # per pool, expected padded tokens per step
    memory_bytes: int                    # PoolMemory of every pool's chosen graphs
    capture_s: float
    exact: bool                          # True: proven optimal

    @property
    def total_waste(self) -> float:
        return sum(self.waste)


def expected_waste(sizes: Sequence[int], probs: Mapping[int, float],
                   tokens_per_request: int) -> float:
    """W(sizes) computed directly, batch size by batch size (the reference the DPs must match)."""
    if not sizes:
        return 0.0
    ordered = sorted(sizes)
    total = 0.0
    for bs, p in probs.items():
        if bs <= ordered[-1]:
            padded = ordered[bisect.bisect_left(ordered, bs)]
            total += p * (padded - bs)
    return tokens_per_request * total


class _Segments:
    """seg(a, b) * tokens_per_request for every pair of a pool's candidates, precomputed.

    Row 0 is the start (a = 0, nothing smaller chosen); row i + 1 is candidate i. `cost[r][j]`
    is the waste of serving the batch sizes in (row r's size, candidates[j]] with candidates[j].
    """

    def __init__(self, prob: PoolProblem, probs: Mapping[int, float]) -> None:
        mass, moment = [0.0], [0.0]
        for bs in range(1, prob.top + 1):
            p = probs.get(bs, 0.0)
            mass.append(mass[-1] + p)
            moment.append(moment[-1] + bs * p)
        lows = (0,) + prob.candidates
        tpr = prob.tokens_per_request
        inf = float("inf")
        self.cost = [[tpr * max(0.0, hi * (mass[hi] - mass[lo]) - (moment[hi] - moment[lo]))
                      if lo < hi else inf for hi in prob.candidates] for lo in lows]
        self.matrix = np.array(self.cost)

    def path_waste(self, idx: Sequence[int]) -> float:
        rows = [0] + [i + 1 for i in idx[:-1]]
        return sum(self.cost[r][j] for r, j in zip(rows, idx))


def waste_curve(problem: PoolProblem, probs: Mapping[int, float]) -> tuple[CurvePoint, ...]:
    """For k = 1..len(candidates): the minimum waste with exactly k sizes (top included)."""
    c, seg = problem.candidates, _Segments(problem, probs).cost
    n, inf = len(c), float("inf")
    # best[k][j]: min waste covering bs <= c[j] with k sizes, the largest being c[j].
    best = [[inf] * n for _ in range(n + 1)]
    prev = [[-1] * n for _ in range(n + 1)]
    for j in range(n):
        best[1][j] = seg[0][j]
    for k in range(2, n + 1):
        for j in range(k - 1, n):
            for i in range(k - 2, j):
                w = best[k - 1][i] + seg[i + 1][j]
                if w < best[k][j]:
                    best[k][j], prev[k][j] = w, i
    out = []
    for k in range(1, n + 1):
        sizes, j = [], n - 1
        for kk in range(k, 0, -1):
            sizes.append(c[j])
            j = prev[kk][j]
        out.append(CurvePoint(k, best[k][n - 1], tuple(reversed(sizes))))
    return tuple(out)


@dataclass(frozen=True)
class PoolMemory:
    """Graph memory of a choice (one set of graphs per PoolProblem): peak_factor x the largest
    isolated footprint of each graph pool + per_graph_bytes a graph. `shared`: every problem's
    graphs in one graph pool (one peak: smaller graphs reuse the largest one's blocks); else a
    graph pool per problem (a peak each, adding up)."""

    per_graph_bytes: int
    peak_factor: float = 1.0
    shared: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.per_graph_bytes, int) or self.per_graph_bytes < 0:
            raise ConfigError(f"per_graph_bytes must be an integer >= 0, got "
                              f"{self.per_graph_bytes!r}")
        if not 1.0 <= self.peak_factor < math.inf:
            raise ConfigError(f"peak_factor must be a finite number >= 1, got "
                              f"{self.peak_factor!r}")

    def peak_bytes(self, peaks: Sequence[int]) -> int:
        """`peaks`: each problem's largest isolated footprint (0 for none)."""
        return math.ceil(self.peak_factor * (max(peaks, default=0) if self.shared
                                             else sum(peaks)))

    def bytes(self, isolated: Sequence[Sequence[int]]) -> int:
        """`isolated`: per problem, the isolated footprints of its chosen graphs."""
        return (self.peak_bytes([max(g, default=0) for g in isolated])
                + self.per_graph_bytes * sum(len(g) for g in isolated))


class _Budget(NamedTuple):
    memory: int
    time: float

    def fits(self, memory: float, time: float) -> bool:
        return memory <= self.memory and time <= self.time * (1 + 1e-12)


def solve(problems: Sequence[PoolProblem], probs: Mapping[int, float], memory_budget: int,
          time_budget: float, *, memory: PoolMemory,
          work_limit: int = DEFAULT_WORK_LIMIT) -> Optional[Solution]:
    """Min total waste over all pools with memory.bytes(chosen) <= memory_budget
    (`PoolProblem.memory_bytes` are the isolated footprints) and sum(capture time) <=
    time_budget, each pool keeping its top. None when even the tops alone do not fit.
    `work_limit` bounds the exact search over all peak levels together (label extensions); past
    it the result is the stage-1 choice, `exact=False`."""
    best: Optional[Solution] = None
    exact = True
    work = [0]             # label extensions so far, shared by every level's exact search
    per_graph = memory.per_graph_bytes
    for level in _peak_levels(problems, memory, memory_budget):
        room = memory_budget - memory.peak_bytes(level)
        if room < per_graph * len(problems):
            break          # not even the tops fit beside this peak; higher levels fit less
        subs = [_below_level(p, cap, per_graph) for p, cap in zip(problems, level)]
        if best is not None and sum(expected_waste(q.candidates, probs, q.tokens_per_request)
                                    for q in subs) >= best.total_waste - _EPS:
            continue       # even every candidate of this level, for free, does not beat best
        # Memory is now a count of graphs; with no per-graph cost it is no constraint at all.
        sub_budget = room if per_graph > 0 else 1
        sol = _solve_additive(subs, probs, sub_budget, time_budget, work_limit, work)
        if sol is None:
            break          # the tops' capture time alone is over budget: same at every level
        exact = exact and sol.exact
        sol = _with_pool_memory(problems, sol, memory)
        if best is None or sol.total_waste < best.total_waste - _EPS or (
                sol.total_waste <= best.total_waste + _EPS
                and (sol.memory_bytes, sol.capture_s) < (best.memory_bytes, best.capture_s)):
            best = sol
    return None if best is None else best._replace(exact=exact)


def _peak_levels(problems: Sequence[PoolProblem], memory: PoolMemory,
                 budget: int) -> list[tuple[int, ...]]:
    """Per level, each problem's cap on isolated footprints; cheapest peak first. Every top is
    chosen, so a graph pool's peak is its largest top's footprint or a larger candidate's: the
    optimum's own peaks are one of the levels (one cap for all problems in a shared pool)."""
    if memory.shared:
        floor = max(p.memory_bytes[-1] for p in problems)
        caps = sorted({floor} | {m for p in problems for m in p.memory_bytes
                                 if floor < m <= budget})
        levels = [(c,) * len(problems) for c in caps]
    else:
        levels = list(itertools.product(*(
            sorted({p.memory_bytes[-1]} | {m for m in p.memory_bytes
                                           if p.memory_bytes[-1] < m <= budget})
            for p in problems)))
    if memory.per_graph_bytes == 0:
        # Memory is then the peaks alone: a fitting level whose caps are all at least another's
        # admits every choice that one does, so only the maximal ones are searched.
        fits = [v for v in levels if memory.peak_bytes(v) <= budget]
        levels = [v for v in fits if not any(w != v and all(a >= b for a, b in zip(w, v))
                                             for w in fits)]
    return sorted(levels, key=memory.peak_bytes)


def _below_level(prob: PoolProblem, level: int, per_graph_bytes: int) -> PoolProblem:
    """The candidates whose isolated footprint is <= level (the top always is), each costing
    per_graph_bytes of memory."""
    keep = [i for i, m in enumerate(prob.memory_bytes) if m <= level]
    return PoolProblem(prob.mode, tuple(prob.candidates[i] for i in keep),
                       prob.tokens_per_request, tuple(per_graph_bytes for _ in keep),
                       tuple(prob.capture_s[i] for i in keep))


def _with_pool_memory(problems: Sequence[PoolProblem], sol: Solution,
                      memory: PoolMemory) -> Solution:
    isolated = [[p.memory_bytes[p.candidates.index(b)] for b in sizes]
                for p, sizes in zip(problems, sol.sizes)]
    return sol._replace(memory_bytes=memory.bytes(isolated))


def _solve_additive(problems: Sequence[PoolProblem], probs: Mapping[int, float],
                    memory_budget: int, time_budget: float,
                    work_limit: int, work: list[int]) -> Optional[Solution]:
    """Min total waste with sum(memory) <= memory_budget and sum(capture time) <= time_budget,
    each pool keeping its top (memory additive per graph). None when the tops do not fit."""
    budget = _Budget(memory_budget, time_budget)
    segs = [_Segments(p, probs) for p in problems]
    if not budget.fits(sum(p.memory_bytes[-1] for p in problems),
                       sum(p.capture_s[-1] for p in problems)):
        return None
    stage1 = _lagrangian(problems, segs, budget)
    if stage1.unconstrained:
        return _solution(problems, segs, stage1.choice, exact=True)
    incumbent = _greedy_fill(problems, segs, budget, stage1.choice)
    proven = _branch_and_bound(problems, segs, budget, incumbent, stage1.prices, work_limit,
                               work)
    chosen, exact = (proven, True) if proven is not None else (incumbent, False)
    return _solution(problems, segs, chosen, exact)


# ---- stage 1: Lagrangian prices + greedy fill ------------------------------------------------

Choice = tuple[tuple[int, ...], ...]   # per pool: indices of chosen candidates, ascending


class _Price(NamedTuple):
    """A Lagrange multiplier pair: choosing candidate j costs
    lam * (theta * memory_j / memory_budget + (1 - theta) * time_j / time_budget)."""

    lam: float
    theta: float

    def vectors(self, problems: Sequence[PoolProblem], budget: _Budget) -> list[np.ndarray]:
        return [self.lam * (self.theta * np.asarray(p.memory_bytes, dtype=float) / budget.memory
                            + (1 - self.theta) * np.asarray(p.capture_s) / budget.time)
                for p in problems]

    def slack_value(self, memory: float, time: float, budget: _Budget) -> float:
        """Price of the budget left after using (memory, time)."""
        return self.lam * (self.theta * (1 - memory / budget.memory)
                           + (1 - self.theta) * (1 - time / budget.time))


def _cost(problems: Sequence[PoolProblem], choice: Choice) -> tuple[int, float]:
    mem = sum(p.memory_bytes[i] for p, idx in zip(problems, choice) for i in idx)
    t = sum(p.capture_s[i] for p, idx in zip(problems, choice) for i in idx)
    return mem, t


def _waste(segs: Sequence[_Segments], choice: Choice) -> float:
    return sum(s.path_waste(idx) for s, idx in zip(segs, choice))


def _priced_path(seg: _Segments, price: np.ndarray) -> tuple[tuple[int, ...], float]:
    """Shortest path start -> top where choosing candidate j costs price[j] on top of its
    segment's waste: (chosen indices, waste + price of the path)."""
    n = len(price)
    dist = np.full(n + 1, np.inf)
    dist[0] = 0.0
    prev = np.zeros(n, dtype=np.int64)
    for j in range(n):
        v = dist[: j + 1] + seg.matrix[: j + 1, j]
        r = int(np.argmin(v))
        dist[j + 1], prev[j] = v[r] + price[j], r
    idx, j = [], n - 1
    while j >= 0:
        idx.append(j)
        j = int(prev[j]) - 1
    return tuple(reversed(idx)), float(dist[n])


class _Stage1(NamedTuple):
    choice: Choice               # the best feasible priced choice
    prices: list[_Price]         # per price direction, the multiplier with the best dual bound
    unconstrained: bool          # the least wasteful choice of all fits: optimal, no trade-off


def _lagrangian(problems: Sequence[PoolProblem], segs: Sequence[_Segments],
                budget: _Budget) -> _Stage1:
    """Stage 1; stage 2 uses the prices to bound what a partial choice can still achieve."""
    tops_only: Choice = tuple((len(p.candidates) - 1,) for p in problems)
    best, best_w = tops_only, _waste(segs, tops_only)
    duals: dict[float, tuple[float, _Price]] = {}

    def priced(price: _Price) -> bool:
        nonlocal best, best_w
        paths = [_priced_path(s, v) for s, v in zip(segs, price.vectors(problems, budget))]
        choice = tuple(idx for idx, _ in paths)
        # Dual bound: every feasible choice wastes at least sum(priced paths) - lam.
        dual = sum(d for _, d in paths) - price.lam
        if dual > duals.get(price.theta, (-np.inf, price))[0]:
            duals[price.theta] = (dual, price)
        ok = budget.fits(*_cost(problems, choice))
        w = _waste(segs, choice)
        if ok and w < best_w - _EPS:
            best, best_w = choice, w
        return ok

    if priced(_Price(0.0, 0.5)):
        return _Stage1(best, [], unconstrained=True)
    scale = max(best_w, 1e-12)   # prices are in waste units per whole budget
    for theta in _PRICE_DIRECTIONS:
        lo, hi = 0.0, scale
        for _ in range(60):     # grow the price until the choice fits
            if priced(_Price(hi, theta)):
                break
            lo, hi = hi, 2 * hi
        else:
            continue  # this direction never fits (it prices only the slack resource)
        for _ in range(_BISECT_STEPS):
            mid = 0.5 * (lo + hi)
            if priced(_Price(mid, theta)):
                hi = mid
            else:
                lo = mid
    return _Stage1(best, [p for _, p in duals.values() if p.lam > 0], unconstrained=False)


def _greedy_fill(problems: Sequence[PoolProblem], segs: Sequence[_Segments], budget: _Budget,
                 choice: Choice) -> Choice:
    """Add graphs that still fit, best waste reduction per budget fraction first."""
    chosen = [list(idx) for idx in choice]
    mem, t = _cost(problems, choice)
    while True:
        best = None
        for pi, (p, s) in enumerate(zip(problems, segs)):
            have = chosen[pi]
            for j in range(len(p.candidates)):
                pos = bisect.bisect_left(have, j)
                if pos < len(have) and have[pos] == j:
                    continue
                m2, t2 = mem + p.memory_bytes[j], t + p.capture_s[j]
                if not budget.fits(m2, t2):
                    continue
                lo_row = 0 if pos == 0 else have[pos - 1] + 1
                nxt = have[pos]   # the top is always chosen, so a next one exists
                gain = s.cost[lo_row][nxt] - s.cost[lo_row][j] - s.cost[j + 1][nxt]
                use = p.memory_bytes[j] / budget.memory + p.capture_s[j] / budget.time
                score = gain / max(use, 1e-12)
                if gain > _EPS and (best is None or score > best[0]):
                    best = (score, pi, j, m2, t2)
        if best is None:
            return tuple(tuple(idx) for idx in chosen)
        _, pi, j, mem, t = best
        bisect.insort(chosen[pi], j)


# ---- stage 2: exact branch-and-bound over Pareto labels --------------------------------------

class _Label(NamedTuple):
    waste: float
    memory: int
    time: float
    pool: int
    index: int                   # candidate index in its pool; -1: start of the pool
    parent: Optional["_Label"]


class _WorkLimit(Exception):
    pass


@dataclass(frozen=True)
class _TailBound:
    """Lower bounds on the waste still to come after a partial choice that ends at candidate j
    of pool p, having used (memory, time):
    - every remaining candidate chosen for free: `free[p][j]`;
    - for each price: (priced shortest path from j to the end) - (price of the budget left),
      valid because any feasible completion uses at most the budget left."""

    free: list[list[float]]
    priced: list[tuple[_Price, list[list[float]]]]
    budget: _Budget

    def __call__(self, pool: int, j: int, memory: float, time: float) -> float:
        lb = self.free[pool][j]
        for price, back in self.priced:
            lb = max(lb, back[pool][j] - price.slack_value(memory, time, self.budget))
        return lb


def _tail_bound(problems: Sequence[PoolProblem], segs: Sequence[_Segments], budget: _Budget,
                prices: Sequence[_Price]) -> _TailBound:
    zero = [np.zeros(len(p.candidates)) for p in problems]
    free = _backward(segs, zero)
    return _TailBound(free, [(pr, _backward(segs, pr.vectors(problems, budget)))
                             for pr in prices], budget)


def _backward(segs: Sequence[_Segments], prices: Sequence[np.ndarray]) -> list[list[float]]:
    """out[p][j]: min priced waste from 'candidate j of pool p is the last chosen' to the end of
    the last pool; out[p][-1] (index n) is the pool's start (nothing chosen in it yet)."""
    out: list[list[float]] = [[] for _ in segs]
    after = 0.0   # the start of the next pool
    for p in range(len(segs) - 1, -1, -1):
        m, price = segs[p].matrix, prices[p]
        n = len(price)
        d = np.zeros(n)
        d[n - 1] = after
        for j in range(n - 2, -1, -1):
            d[j] = float(np.min(m[j + 1, j + 1:] + price[j + 1:] + d[j + 1:]))
        start = float(np.min(m[0, :] + price + d))
        out[p] = list(d) + [start]
        after = start
    return out


def _branch_and_bound(problems: Sequence[PoolProblem], segs: Sequence[_Segments],
                      budget: _Budget, incumbent: Choice, prices: Sequence[_Price],
                      work_limit: int, work: list[int]) -> Optional[Choice]:
    """The optimal choice, or None when proving it would take the step counter `work` past
    `work_limit`."""
    inc_waste, inc_cost = _waste(segs, incumbent), _cost(problems, incumbent)
    bound = inc_waste * (1 + 1e-12) + _EPS
    tail = _tail_bound(problems, segs, budget, prices)
    tops_mem = [p.memory_bytes[-1] for p in problems]
    tops_time = [p.capture_s[-1] for p in problems]
    labels = [_Label(0.0, 0, 0.0, -1, -1, None)]
    try:
        for pi, (prob, seg) in enumerate(zip(problems, segs)):
            reserve = _Budget(budget.memory - sum(tops_mem[pi + 1:]),
                              budget.time - sum(tops_time[pi + 1:]))
            starts = [_Label(l.waste, l.memory, l.time, pi, -1, l) for l in labels]
            labels = _pool_labels(pi, prob, seg, starts, reserve, tail, bound, work, work_limit)
    except _WorkLimit:
        return None
    if not labels:
        return incumbent  # nothing can beat the incumbent: it is optimal
    best = min(labels, key=lambda l: (l.waste, l.memory, l.time))
    # Prefer the incumbent unless strictly less wasteful, or as wasteful and cheaper.
    if best.waste < inc_waste - _EPS or (best.waste <= inc_waste + _EPS
                                         and (best.memory, best.time) < inc_cost):
        return _unwind(best, len(problems))
    return incumbent


def _pool_labels(pi: int, prob: PoolProblem, seg: _Segments, starts: list[_Label],
                 cap: _Budget, tail: _TailBound, bound: float, work: list[int],
                 work_limit: int) -> list[_Label]:
    n = len(prob.candidates)
    at: list[list[_Label]] = []
    for j in range(n):
        is_top = j == n - 1
        # Room the top of this pool still needs when we stop at a non-top size.
        need_mem = 0 if is_top else prob.memory_bytes[-1]
        need_time = 0.0 if is_top else prob.capture_s[-1]
        cands = []
        for row, src in enumerate([starts] + at):   # every row so far lies below candidate j
            w = seg.cost[row][j]
            for l in src:
                work[0] += 1
                mem = l.memory + prob.memory_bytes[j]
                t = l.time + prob.capture_s[j]
                waste = l.waste + w
                if (cap.fits(mem + need_mem, t + need_time)
                        and waste + tail(pi, j, mem, t) <= bound):
                    cands.append(_Label(waste, mem, t, pi, j, l))
            if work[0] > work_limit:
                raise _WorkLimit
        at.append(_pareto(cands))
    return at[-1]


def _pareto(labels: list[_Label]) -> list[_Label]:
    """Labels no other label beats on all of (waste, memory, time): a sweep in waste order
    against a 2-D (memory, time) staircase of what was kept so far."""
    labels = sorted(labels, key=lambda l: (l.waste, l.memory, l.time))
    ms: list[int] = []       # staircase: memory increasing ...
    ts: list[float] = []     # ... time strictly decreasing
    kept = []
    for l in labels:
        i = bisect.bisect_right(ms, l.memory) - 1
        if i >= 0 and ts[i] <= l.time:
            continue  # an earlier (no more wasteful) label uses no more memory and time
        kept.append(l)
        pos = bisect.bisect_left(ms, l.memory)
        end = pos
        while end < len(ms) and ts[end] >= l.time:
            end += 1
        ms[pos:end], ts[pos:end] = [l.memory], [l.time]
    return kept


def _unwind(label: _Label, num_pools: int) -> Choice:
    chosen: list[list[int]] = [[] for _ in range(num_pools)]
    node: Optional[_Label] = label
    while node is not None:
        if node.index >= 0:
            chosen[node.pool].append(node.index)
        node = node.parent
    return tuple(tuple(sorted(idx)) for idx in chosen)


def _solution(problems: Sequence[PoolProblem], segs: Sequence[_Segments], choice: Choice,
              exact: bool) -> Solution:
    mem, t = _cost(problems, choice)
    return Solution(tuple(tuple(p.candidates[i] for i in idx) for p, idx in zip(problems, choice)),
                    tuple(s.path_waste(idx) for s, idx in zip(segs, choice)), mem, t, exact)
