"""Padding waste of a set of captured batch sizes, and the optimisers that choose the set.

A step of `bs` requests replays the smallest captured size p >= bs and computes (p - bs) padded
requests for nothing, each `tokens_per_request` tokens wide (K+1 in spec mode, 1 in decode). The
expected waste of a pool with sizes S (top = max S) is

    W(S) = tokens_per_request * sum_{bs <= top} P(bs) * (pad_S(bs) - bs)      [tokens per step]

Mass above the top is not this pool's concern (the tuner decides what serves it). W splits into
independent segments between consecutive chosen sizes a < b:  seg(a, b) = sum_{a < bs <= b}
P(bs) * (b - bs), so choosing S is a shortest path over the sorted candidates:
- `waste_curve`: the classic 1-D optimal partition DP, min W with exactly k sizes, for every k;
- `solve`: min total W over several pools sharing a memory and a capture-time budget. Costs are
  additive per chosen graph, so this is a resource-constrained shortest path; it keeps, at every
  candidate, the Pareto set of (waste, memory, time) partial choices. That is exact; a Pareto set
  larger than `max_labels` is thinned (the result says `exact=False`), which bounds the run time
  on pathological inputs (hundreds of candidates with unrelated costs) without ever breaking a
  budget: every kept label is checked against both budgets exactly.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional, Sequence

from dual_graph_worker.errors import ConfigError
from dual_graph_worker.modes import Mode

DEFAULT_MAX_LABELS = 20000


@dataclass(frozen=True)
class PoolProblem:
    """One pool to size: sorted candidates whose last entry (the top) must be captured."""

    mode: Mode
    candidates: tuple[int, ...]
    tokens_per_request: int
    memory_bytes: tuple[int, ...]     # per candidate, aligned with `candidates`
    capture_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ConfigError(f"{self.mode.value} pool has no candidate batch sizes")
        if list(self.candidates) != sorted(set(self.candidates)):
            raise ConfigError(f"{self.mode.value} candidates must be sorted and distinct, got "
                              f"{self.candidates}")
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
    memory_bytes: int
    capture_s: float
    exact: bool

    @property
    def total_waste(self) -> float:
        return sum(self.waste)


class _Prefix:
    """Prefix sums of P(bs) and bs*P(bs): seg(a, b) in O(1)."""

    def __init__(self, probs: Mapping[int, float], top: int) -> None:
        mass, moment = [0.0], [0.0]
        for bs in range(1, top + 1):
            p = probs.get(bs, 0.0)
            mass.append(mass[-1] + p)
            moment.append(moment[-1] + bs * p)
        self._mass, self._moment = mass, moment

    def seg(self, lo: int, hi: int) -> float:
        """sum over lo < bs <= hi of P(bs) * (hi - bs)."""
        m = self._mass[hi] - self._mass[lo]
        return max(0.0, hi * m - (self._moment[hi] - self._moment[lo]))


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


def waste_curve(problem: PoolProblem, probs: Mapping[int, float]) -> tuple[CurvePoint, ...]:
    """For k = 1..len(candidates): the minimum waste with exactly k sizes (top included)."""
    c = problem.candidates
    n, pre, tpr = len(c), _Prefix(probs, problem.top), problem.tokens_per_request
    inf = float("inf")
    # best[k][j]: min waste covering bs <= c[j] with k sizes, the largest being c[j].
    best = [[inf] * n for _ in range(n + 1)]
    prev = [[-1] * n for _ in range(n + 1)]
    for j in range(n):
        best[1][j] = pre.seg(0, c[j])
    for k in range(2, n + 1):
        for j in range(k - 1, n):
            for i in range(k - 2, j):
                w = best[k - 1][i] + pre.seg(c[i], c[j])
                if w < best[k][j]:
                    best[k][j], prev[k][j] = w, i
    out = []
    for k in range(1, n + 1):
        sizes, j = [], n - 1
        for kk in range(k, 0, -1):
            sizes.append(c[j])
            j = prev[kk][j]
        out.append(CurvePoint(k, tpr * best[k][n - 1], tuple(reversed(sizes))))
    return tuple(out)


class _Label(NamedTuple):
    waste: float
    memory: int
    time: float
    pool: int
    bs: int                      # 0: the start label of a pool (nothing chosen in it yet)
    parent: Optional["_Label"]


def solve(problems: Sequence[PoolProblem], probs: Mapping[int, float], memory_budget: int,
          time_budget: float, max_labels: int = DEFAULT_MAX_LABELS) -> Optional[Solution]:
    """Min total waste over all pools with sum(memory) <= memory_budget and sum(capture time)
    <= time_budget, each pool keeping its top. None when even the tops alone do not fit."""
    # Resources the tops of later pools will need for sure: prune partial choices that cannot
    # leave room for them.
    tops_mem = [p.memory_bytes[-1] for p in problems]
    tops_time = [p.capture_s[-1] for p in problems]
    exact = True
    labels = [_Label(0.0, 0, 0.0, -1, 0, None)]
    for pi, prob in enumerate(problems):
        reserve_mem = sum(tops_mem[pi + 1:])
        reserve_time = sum(tops_time[pi + 1:])
        starts = [_Label(l.waste, l.memory, l.time, pi, 0, l) for l in labels]
        labels, pool_exact = _solve_pool(prob, probs, starts, memory_budget - reserve_mem,
                                         time_budget - reserve_time, max_labels)
        exact &= pool_exact
        if not labels:
            return None
    best = min(labels, key=lambda l: (l.waste, l.memory, l.time))
    return _unwind(best, problems, probs, exact)


def _solve_pool(prob: PoolProblem, probs: Mapping[int, float], starts: list[_Label],
                mem_cap: int, time_cap: float, max_labels: int) -> tuple[list[_Label], bool]:
    c, pre, tpr = prob.candidates, _Prefix(probs, prob.top), prob.tokens_per_request
    n = len(c)
    at: list[list[_Label]] = []
    exact = True
    for j in range(n):
        is_top = j == n - 1
        # Room the top of this pool still needs when we stop at a non-top size.
        need_mem = 0 if is_top else prob.memory_bytes[-1]
        need_time = 0.0 if is_top else prob.capture_s[-1]
        cands = []
        for lo, src in itertools.chain([(0, starts)], ((c[i], at[i]) for i in range(j))):
            w = tpr * pre.seg(lo, c[j])
            for l in src:
                mem = l.memory + prob.memory_bytes[j]
                t = l.time + prob.capture_s[j]
                if mem + need_mem <= mem_cap and t + need_time <= time_cap + 1e-12:
                    cands.append(_Label(l.waste + w, mem, t, l.pool, c[j], l))
        front = _pareto(cands)
        if len(front) > max_labels:
            front, exact = _thin(front, max_labels, mem_cap, time_cap), False
        at.append(front)
    return at[-1], exact


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


def _thin(front: list[_Label], max_labels: int, mem_cap: int, time_cap: float) -> list[_Label]:
    """Keep the least wasteful label per cell of a grid over (memory, time): an approximation
    used only when the exact Pareto set grows past `max_labels`."""
    g = max(1, int(max_labels ** 0.5))
    cells: dict[tuple[int, int], _Label] = {}
    for l in front:  # front is sorted by waste: the first label of a cell is its best
        cell = (int(g * l.memory / max(mem_cap, 1)), int(g * l.time / max(time_cap, 1e-12)))
        cells.setdefault(cell, l)
    return sorted(cells.values(), key=lambda l: (l.waste, l.memory, l.time))


def _unwind(label: _Label, problems: Sequence[PoolProblem], probs: Mapping[int, float],
            exact: bool) -> Solution:
    chosen: list[list[int]] = [[] for _ in problems]
    node: Optional[_Label] = label
    while node is not None:
        if node.bs:
            chosen[node.pool].append(node.bs)
        node = node.parent
    sizes = tuple(tuple(sorted(s)) for s in chosen)
    # Recompute per-pool waste directly: labels only carry the running total.
    wastes = tuple(expected_waste(s, probs, p.tokens_per_request)
                   for p, s in zip(problems, sizes))
    return Solution(sizes, wastes, label.memory, label.time, exact)
