"""Padding waste: hand-computed cases, and both optimisers against brute force."""

from __future__ import annotations

import itertools
import math
import random
from typing import Mapping, Optional

import pytest

from capture.distribution import parse_distribution
from capture.padding import PoolMemory, PoolProblem, expected_waste, solve, waste_curve
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import Mode


def _problem(mode: Mode, sizes, tpr: int, mem=None, cap=None) -> PoolProblem:
    n = len(sizes)
    return PoolProblem(mode, tuple(sizes), tpr, tuple(mem or [1] * n), tuple(cap or [0.1] * n))


def test_waste_hand_computed() -> None:
    uniform8 = {b: 1 / 8 for b in range(1, 9)}
    # bs 1..4 -> 4 pads 3+2+1+0, bs 5..8 -> 8 pads 3+2+1+0: 12 padded requests / 8.
    assert expected_waste([4, 8], uniform8, 1) == pytest.approx(1.5)
    # Spec mode, K = 3: every padded request computes 4 tokens.
    assert expected_waste([4, 8], uniform8, 4) == pytest.approx(6.0)
    assert expected_waste([8], uniform8, 1) == pytest.approx(28 / 8)
    two_points = {3: 0.5, 8: 0.5}
    assert expected_waste([4, 8], two_points, 1) == pytest.approx(0.5)
    assert expected_waste([8], two_points, 1) == pytest.approx(2.5)
    assert expected_waste([3, 8], two_points, 1) == 0.0
    # Mass above the pool's top is not this pool's waste.
    assert expected_waste([4], two_points, 1) == pytest.approx(0.5)


def test_waste_curve_hand_computed() -> None:
    uniform8 = {b: 1 / 8 for b in range(1, 9)}
    curve = waste_curve(_problem(Mode.DECODE, [1, 2, 4, 6, 8], 1), uniform8)
    assert [p.k for p in curve] == [1, 2, 3, 4, 5]
    assert curve[0].sizes == (8,) and curve[0].waste == pytest.approx(28 / 8)
    assert curve[1].sizes == (4, 8) and curve[1].waste == pytest.approx(12 / 8)
    assert curve[-1].sizes == (1, 2, 4, 6, 8) and curve[-1].waste == pytest.approx(3 / 8)
    assert all(a.waste >= b.waste for a, b in zip(curve, curve[1:]))


def _subsets_with_top(n: int):
    for r in range(n):
        for rest in itertools.combinations(range(n - 1), r):
            yield rest + (n - 1,)


def _random_probs(rng: random.Random, top: int) -> Mapping[int, float]:
    w = {b: rng.random() for b in range(1, top + 1) if rng.random() < 0.7} or {1: 1.0}
    total = sum(w.values())
    return {b: v / total for b, v in w.items()}


def test_waste_curve_matches_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(40):
        cands = sorted(rng.sample(range(1, 33), rng.randint(1, 7)))
        probs = _random_probs(rng, 32)
        tpr = rng.choice([1, 4])
        curve = waste_curve(_problem(Mode.SPEC, cands, tpr), probs)
        for point in curve:
            brute = min(expected_waste([cands[i] for i in s], probs, tpr)
                        for s in _subsets_with_top(len(cands)) if len(s) == point.k)
            assert point.waste == pytest.approx(brute, abs=1e-12)
            assert expected_waste(point.sizes, probs, tpr) == pytest.approx(point.waste)


def test_pool_memory() -> None:
    # One shared pool: the largest isolated footprint, once, plus the per-graph residue for
    # every graph.
    shared = PoolMemory(3)
    assert shared.bytes([[10, 40], [20]]) == 40 + 3 * 3
    assert PoolMemory(0).bytes([[7], []]) == 7
    assert PoolMemory(5).bytes([[], []]) == 0
    # A graph pool per problem: each pool's peak, adding up, times the factor (rounded up).
    per_pool = PoolMemory(3, peak_factor=1.5, shared=False)
    assert per_pool.bytes([[10, 40], [20]]) == 90 + 3 * 3
    assert per_pool.bytes([[10, 41], []]) == 62 + 3 * 2
    assert per_pool.peak_bytes([40, 20]) == 90 and shared.peak_bytes([40, 20]) == 40
    for bad in (dict(per_graph_bytes=-1), dict(per_graph_bytes=1, peak_factor=0.9),
                dict(per_graph_bytes=1, peak_factor=float("inf"))):
        with pytest.raises(ConfigError):
            PoolMemory(**bad)


def _brute_force(problems, probs, mem_budget, time_budget, memory) -> Optional[float]:
    """Every subset (tops kept), memory by the model written out: the peak of all graphs in one
    shared pool, else each problem's peak added up."""
    best = None
    for choice in itertools.product(*(_subsets_with_top(len(p.candidates)) for p in problems)):
        iso = [[p.memory_bytes[i] for i in s] for p, s in zip(problems, choice)]
        n = sum(len(g) for g in iso)
        peak = max(max(g) for g in iso) if memory.shared else sum(max(g) for g in iso)
        mem = math.ceil(memory.peak_factor * peak) + memory.per_graph_bytes * n
        t = sum(p.capture_s[i] for p, s in zip(problems, choice) for i in s)
        if mem <= mem_budget and t <= time_budget:
            w = sum(expected_waste([p.candidates[i] for i in s], probs, p.tokens_per_request)
                    for p, s in zip(problems, choice))
            best = w if best is None else min(best, w)
    return best


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("work_limit", [1_000_000, 0])
def test_solve_matches_brute_force_under_budgets(work_limit: int, shared: bool) -> None:
    """Exact stage: equal to brute force (both memory layouts). work_limit=0 (heuristic only):
    feasible, never better than the optimum, flagged as not proven unless no budget binds.
    Isolated footprints are random, not growing with bs, so non-top candidates often exceed
    the tops: the peak-level search and its filter are exercised, not only the tops' peaks."""
    rng = random.Random(11)
    levels_seen = 0
    for _ in range(200):
        probs = _random_probs(rng, rng.randint(3, 24))
        problems = []
        for mode, tpr in ((Mode.SPEC, 4), (Mode.DECODE, 1)):
            cands = sorted(rng.sample(range(1, 25), rng.randint(1, 5)))
            problems.append(_problem(mode, cands, tpr, [rng.randint(1, 100) for _ in cands],
                                     [round(rng.uniform(0.1, 2.0), 3) for _ in cands]))
        memory = PoolMemory(rng.choice([0, 1, 5, 10, 20]),
                            1.0 if shared else rng.choice([1.0, 1.25, 1.5, 2.0]), shared)
        mem_budget = rng.randint(30, 160) if shared else rng.randint(40, 400)
        time_budget = rng.uniform(1.0, 6.0)
        brute = _brute_force(problems, probs, mem_budget, time_budget, memory)
        sol = solve(problems, probs, mem_budget, time_budget, memory=memory,
                    work_limit=work_limit)
        if brute is None:
            assert sol is None
            continue
        assert sol is not None
        iso = [[p.memory_bytes[p.candidates.index(b)] for b in sizes]
               for p, sizes in zip(problems, sol.sizes)]
        assert sol.memory_bytes == memory.bytes(iso)
        tops = [p.memory_bytes[-1] for p in problems]
        levels_seen += (max(map(max, iso)) > max(tops) if shared
                        else any(max(g) > t for g, t in zip(iso, tops)))
        assert sol.memory_bytes <= mem_budget and sol.capture_s <= time_budget * (1 + 1e-9)
        assert all(s[-1] == p.top for s, p in zip(sol.sizes, problems))
        for p, sizes, w in zip(problems, sol.sizes, sol.waste):
            assert w == pytest.approx(expected_waste(sizes, probs, p.tokens_per_request))
        if work_limit or sol.exact:   # exact without search: everything wanted fits
            assert sol.exact and sol.total_waste == pytest.approx(brute, abs=1e-9)
        else:
            assert sol.total_waste >= brute - 1e-9
    assert levels_seen > 5   # optima whose peak is a non-top candidate above the tops


def test_solve_takes_everything_when_it_fits_and_only_tops_when_tight() -> None:
    probs = parse_distribution("uniform:1-16", 16).probs
    spec = _problem(Mode.SPEC, [2, 4, 8], 4, [10, 20, 40], [1.0, 1.0, 1.0])
    dec = _problem(Mode.DECODE, [4, 8, 16], 1, [5, 10, 20], [0.5, 0.5, 0.5])
    # One shared pool: the largest graph (spec 8: 40) + 5 a graph. Everything: 40 + 6 * 5.
    roomy = solve([spec, dec], probs, 70, 100.0, memory=PoolMemory(5))
    assert roomy.sizes == ((2, 4, 8), (4, 8, 16)) and roomy.exact and roomy.memory_bytes == 70
    tight = solve([spec, dec], probs, 50, 100.0, memory=PoolMemory(5))   # exactly the two tops
    assert tight.sizes == ((8,), (16,)) and tight.memory_bytes == 50
    # Hand-computed: spec [8] over bs 1..8 (uniform 1/16 each): 4 * 28/16; decode [16]: 120/16.
    assert tight.waste == pytest.approx((4 * 28 / 16, 120 / 16))
    assert solve([spec, dec], probs, 49, 100.0, memory=PoolMemory(5)) is None
    assert solve([spec, dec], probs, 1000, 1.4, memory=PoolMemory(5)) is None   # tops need 1.5 s
    # No per-graph residue: memory is the largest graph whatever else is chosen.
    free = solve([spec, dec], probs, 40, 100.0, memory=PoolMemory(0))
    assert free.sizes == roomy.sizes and free.memory_bytes == 40


def test_solve_filters_a_candidate_larger_than_the_tops() -> None:
    # Decode bs 2 is (oddly) larger alone than both tops: choosing it raises the whole shared
    # pool to its size, so it is chosen only when the budget has room for that peak.
    probs = {1: 0.5, 2: 0.5}
    spec = _problem(Mode.SPEC, [1, 2], 4, [5, 30], [0.1, 0.1])
    dec = _problem(Mode.DECODE, [1, 2, 4], 1, [10, 90, 20], [0.1, 0.1, 0.1])
    small = solve([spec, dec], probs, 60, 10.0, memory=PoolMemory(2))
    assert small.sizes == ((1, 2), (1, 4)) and small.memory_bytes == 30 + 4 * 2
    assert small.total_waste == pytest.approx(1.0) and small.exact
    everything = solve([spec, dec], probs, 100, 10.0, memory=PoolMemory(2))
    assert everything.sizes == ((1, 2), (1, 2, 4)) and everything.memory_bytes == 90 + 5 * 2
    assert everything.total_waste == 0.0
    # One graph short of everything: keep the large decode bs 2, drop decode bs 1 (waste 0.5)
    # rather than spec bs 1 (waste 2) or bs 2 itself (waste 1).
    short = solve([spec, dec], probs, 99, 10.0, memory=PoolMemory(2))
    assert short.sizes == ((1, 2), (2, 4)) and short.memory_bytes == 90 + 4 * 2
    assert short.total_waste == pytest.approx(0.5) and short.exact


def test_solve_on_dense_candidates_stays_fast_and_feasible() -> None:
    # 120 candidates with unrelated costs: beyond the exact stage's work limit on purpose.
    rng = random.Random(3)
    probs = parse_distribution("uniform:1-120", 120).probs
    cands = list(range(1, 121))
    dec = _problem(Mode.DECODE, cands, 1, [rng.randint(10, 100) for _ in cands],
                   [rng.uniform(0.1, 0.3) for _ in cands])
    spec = _problem(Mode.SPEC, cands[:30], 4, [rng.randint(30, 200) for _ in range(30)],
                    [rng.uniform(0.3, 0.6) for _ in range(30)])
    sol = solve([spec, dec], probs, 1500, 6.0, memory=PoolMemory(40), work_limit=20_000)
    assert sol is not None and not sol.exact
    assert sol.memory_bytes <= 1500 and sol.capture_s <= 6.0 * (1 + 1e-9)
    tops_only = expected_waste([30], probs, 4) + expected_waste([120], probs, 1)
    assert sol.total_waste < 0.2 * tops_only


def test_a_graph_pool_per_problem_pays_each_peak() -> None:
    # Decode bs 2 is larger alone than the decode top but smaller than the spec top: free in one
    # shared pool (under the spec peak), 10 more bytes in a decode pool of its own.
    probs = {1: 0.5, 2: 0.5}
    spec = _problem(Mode.SPEC, [1, 2], 4, [5, 40], [0.1, 0.1])
    dec = _problem(Mode.DECODE, [1, 2, 4], 1, [10, 30, 20], [0.1, 0.1, 0.1])
    shared = solve([spec, dec], probs, 70, 10.0, memory=PoolMemory(2))
    assert shared.sizes == ((1, 2), (1, 2, 4)) and shared.memory_bytes == 40 + 5 * 2
    per_pool = PoolMemory(2, shared=False)
    tight = solve([spec, dec], probs, 70, 10.0, memory=per_pool)
    # 40 + 30 + 5 x 2 = 80 is over: decode bs 2 goes (bs 2 pads to 4), the rest fits in 68.
    assert tight.sizes == ((1, 2), (1, 4)) and tight.memory_bytes == 40 + 20 + 4 * 2
    assert tight.total_waste == pytest.approx(1.0) and tight.exact
    roomy = solve([spec, dec], probs, 80, 10.0, memory=per_pool)
    assert roomy.sizes == shared.sizes and roomy.memory_bytes == 80
    # The factor scales the peaks, not the per-graph shares: 1.5 x 60 + 2 x 2 for the tops.
    scaled = PoolMemory(2, peak_factor=1.5, shared=False)
    assert solve([spec, dec], probs, 93, 10.0, memory=scaled) is None
    tops = solve([spec, dec], probs, 94, 10.0, memory=scaled)
    assert tops.sizes == ((2,), (4,)) and tops.memory_bytes == 94
