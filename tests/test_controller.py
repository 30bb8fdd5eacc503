"""The goodput controller, driven through the step planner by a simulated server whose true step
times, acceptance and prompt costs the test sets: it converges from a wrong prior, follows
acceptance, prices prompts and catch-ups, keeps exploration within its budget, and decides the
same on two TP ranks whose timings differ."""

from __future__ import annotations

import itertools
import math
import random
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import pytest

from dual_graph_worker.core.batch_costs import BatchCosts, CatchUpWork
from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.controller import ControllerConfig, GoodputController
from dual_graph_worker.core.regressions import ContextSums, Slope
from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.exploration import ExploreBudget
from dual_graph_worker.core.modes import GraphKey, Mode
from dual_graph_worker.core.planner import StepPlanner
from dual_graph_worker.core.policy import (Admitted, Decision, DraftPrefills, PolicyInputs,
                                           PrefillTime, Reason, StepTime, accepted, same_rank)

K = 3
SPEC = (1, 2, 4, 8, 16, 24, 32, 48)
DECODE = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128)


def t_decode(pb: int) -> float:
    """A plain decode step: bandwidth-bound, nearly flat in the batch (seconds)."""
    return 0.010 + 0.00005 * pb


def t_spec(pb: int) -> float:
    """A speculative step: K+1 tokens a request plus the draft; grows fast with the batch.
    Spec wins while accept > t_spec / t_decode: 1.8 at bs 1, 2.3 at 16, 2.75 at 32, 3.15 at 48
    (the H200's shape: accept 1.5 never wins, 2.0 up to bs ~8, 3.0 up to ~40)."""
    return 0.0175 + 0.00045 * pb


def replay_prior(spec_factor: float = 0.35) -> CalibrationTable:
    """What graph replays at start-up report: the spec step's host work and draft stages are
    missing, so it looks far cheaper than it is (a wrong prior)."""
    lat = {GraphKey(Mode.DECODE, b): 0.8 * t_decode(b) for b in DECODE}
    lat |= {GraphKey(Mode.SPEC, b): spec_factor * t_spec(b) for b in SPEC}
    return CalibrationTable(lat, K, source="synthetic replay prior")


def controller(prior: Optional[CalibrationTable] = None, **kw) -> GoodputController:
    cfg = dict(num_draft_tokens=K, min_dwell_steps=4, max_rows=512)
    cfg.update(kw)
    return GoodputController(ControllerConfig(**cfg), {Mode.SPEC: SPEC, Mode.DECODE: DECODE},
                             prior)


@dataclass
class SimServer:
    """One rank of a server: plans each step, 'runs' it at the true cost (plus this rank's own
    timing noise), and reports what an engine reports. Acceptance is rank-common."""

    policy: GoodputController
    accept: Callable[[int], float] = lambda step: 3.0
    noise: float = 0.0
    seed: int = 0
    catch_up_s_per_token: float = 2e-6
    # The process's first `warm_spec_steps` spec steps take `warm_spec_factor` x their time.
    warm_spec_steps: int = 0
    warm_spec_factor: float = 1.0
    reduce: Callable = lambda v: v
    planner: StepPlanner = field(init=False)
    backlog: int = 0           # lazy catch-up: draft tokens behind
    spec_steps: int = 0
    modes: list = field(default_factory=list)
    reasons: list = field(default_factory=list)
    seconds: float = 0.0
    tokens: float = 0.0

    def __post_init__(self) -> None:
        self.planner = StepPlanner(DispatchTable.build(SPEC, DECODE), self.policy,
                                   reduce=self.reduce)
        self.rng = random.Random(self.seed)

    def step(self, bs: int, rows: Optional[np.ndarray] = None) -> Mode:
        rows = np.arange(bs) if rows is None else rows
        plan = self.planner.plan(bs, rows=rows, catch_up_tokens=self.backlog)
        truth = (t_spec if plan.mode is Mode.SPEC else t_decode)(plan.padded_bs)
        if plan.mode is Mode.SPEC:
            self.spec_steps += 1
            if self.spec_steps <= self.warm_spec_steps:
                truth *= self.warm_spec_factor
        caught = 0
        if plan.mode is Mode.SPEC and self.backlog:
            caught, truth = self.backlog, truth + self.backlog * self.catch_up_s_per_token
            self.backlog = 0
        elif plan.mode is Mode.DECODE:
            self.backlog += bs
        seconds = truth * (1.0 + self.noise * self.rng.uniform(-1, 1))
        self.policy.observe(StepTime(plan.mode, plan.padded_bs, seconds, caught))
        a = self.accept(len(self.modes)) if plan.mode is Mode.SPEC else 1.0
        self.policy.observe(accepted(plan.mode, np.full(bs, a), rows))
        self.modes.append(plan.mode)
        self.reasons.append(plan.reason)
        self.seconds += truth
        self.tokens += a * bs
        return plan.mode

    def run(self, bs: int, steps: int) -> list[Mode]:
        return [self.step(bs) for _ in range(steps)]


def best_mode(bs: int, a: float) -> Mode:
    pad_s = min(s for s in SPEC if s >= bs) if bs <= SPEC[-1] else None
    pad_d = min(s for s in DECODE if s >= bs)
    if pad_s is None:
        return Mode.DECODE
    return Mode.SPEC if bs * a / t_spec(pad_s) > bs / t_decode(pad_d) else Mode.DECODE


def settled(modes: list[Mode], last: int = 100) -> Mode:
    tail = modes[-last:]
    return max(set(tail), key=tail.count)


# ---------------------------------------------------------------- convergence


@pytest.mark.parametrize("bs,accept", [(2, 3.0), (8, 3.0), (32, 3.0), (48, 3.0), (2, 1.5),
                                       (16, 2.0), (4, 2.0)])
def test_converges_to_the_faster_mode_from_a_wrong_prior(bs, accept):
    sim = SimServer(controller(replay_prior()), accept=lambda s: accept, noise=0.05)
    sim.run(bs, 600)
    assert settled(sim.modes) is best_mode(bs, accept), (bs, accept)


def test_without_any_prior_it_measures_both_modes_then_settles():
    sim = SimServer(controller(None), accept=lambda s: 3.0)
    sim.run(48, 300)
    assert {Mode.SPEC, Mode.DECODE} <= set(sim.modes[:100])
    assert settled(sim.modes) is best_mode(48, 3.0) is Mode.DECODE
    sim2 = SimServer(controller(None), accept=lambda s: 3.0)
    sim2.run(2, 300)
    assert settled(sim2.modes) is best_mode(2, 3.0) is Mode.SPEC


def test_goodput_is_within_a_few_percent_of_the_best_static_mode():
    """Across loads and acceptances, what the controller serves vs the best pinned mode."""
    for bs in (1, 4, 16, 24, 32, 64):
        for a in (1.5, 2.0, 3.0, 3.5):
            sim = SimServer(controller(replay_prior()), accept=lambda s, a=a: a, noise=0.03)
            sim.run(bs, 400)            # warm
            sim.seconds = sim.tokens = 0.0
            sim.run(bs, 800)
            best = max(bs * a / t_spec(min(s for s in SPEC if s >= bs)) if bs <= SPEC[-1]
                       else 0.0, bs / t_decode(min(s for s in DECODE if s >= bs)))
            assert sim.tokens / sim.seconds >= 0.97 * best, (bs, a)


def test_follows_acceptance_that_changes_while_serving():
    """Acceptance drops from 3.5 to 1.2 and comes back: the controller leaves speculation once
    the spec steps report it, and finds it again through exploration."""
    phase = lambda s: 3.5 if s < 400 or s >= 1400 else 1.2
    sim = SimServer(controller(replay_prior(), stale_after=128), accept=phase)
    sim.run(8, 2400)
    assert best_mode(8, 3.5) is Mode.SPEC and best_mode(8, 1.2) is Mode.DECODE
    assert settled(sim.modes[:400]) is Mode.SPEC
    drop = sim.modes[400:]
    assert Mode.DECODE in drop[:20], "left speculation within 20 steps of the drop"
    assert settled(sim.modes[1000:1400]) is Mode.DECODE
    back = sim.modes[1400:]
    first_spec_run = next(i for i in range(len(back) - 20)
                          if all(m is Mode.SPEC for m in back[i:i + 20]))
    assert first_spec_run <= 400, "found speculation again within the staleness window"
    assert settled(sim.modes) is Mode.SPEC


def test_per_request_acceptance_weighs_the_batch_it_holds():
    p = controller()
    easy, hard = np.arange(0, 8), np.arange(8, 16)
    p.observe(Admitted(64, np.arange(16)))
    for _ in range(20):
        p.observe(accepted(Mode.SPEC, np.full(8, 4.0), easy))
        p.observe(accepted(Mode.SPEC, np.full(8, 1.0), hard))
    assert p.expected_accept(easy) == pytest.approx(4.0, abs=0.05)
    assert p.expected_accept(hard) == pytest.approx(1.0, abs=0.05)
    mixed = p.expected_accept(np.concatenate([easy[:4], hard]))
    assert 1.5 < mixed < 2.5
    # A new request in a reused row starts from what the latest requests first measured (the
    # hard ones, measured last), not from the old request's estimate nor the token-weighted mean.
    p.observe(Admitted(16, easy[:1]))
    assert p.expected_accept(easy[:1]) < 2.0 < p.state().accept_len


def test_a_batchs_rows_are_read_afresh_unless_nobody_can_write_them():
    """The SGLang worker's rows come read-only, one array per batch, and their list is kept;
    an array that can be written (an engine reusing its buffer) is read every time."""
    p = controller()
    p.observe(Admitted(64, np.arange(8)))
    for _ in range(8):
        p.observe(accepted(Mode.SPEC, np.array([4.0, 4.0, 1.0, 1.0]), np.array([0, 1, 2, 3])))
    frozen = np.array([0, 1])
    frozen.flags.writeable = False
    assert p.expected_accept(frozen) == pytest.approx(4.0, abs=0.05)
    assert p.expected_accept(frozen) == pytest.approx(4.0, abs=0.05)
    buffer = np.array([0, 1])
    assert p.expected_accept(buffer) == pytest.approx(4.0, abs=0.05)
    buffer[:] = (2, 3)                                    # the same array, other requests
    assert p.expected_accept(buffer) == pytest.approx(1.0, abs=0.05)
    p.observe(accepted(Mode.SPEC, [4.0, 4.0], buffer))    # and its steps go to those rows
    assert p.expected_accept(np.array([2])) > 1.2
    # A read-only view sees its base written: it is no array nobody can write.
    base = np.array([0, 1])
    view = base[:]
    view.flags.writeable = False
    assert p.expected_accept(view) == pytest.approx(4.0, abs=0.05)
    base[:] = (4, 5)                                      # rows never measured
    assert p.expected_accept(view) == pytest.approx(p.expected_accept(np.array([6])))


def test_a_single_rank_exchanges_without_a_reducer_as_one_that_copies_does():
    """same_rank hands back the very list it is given: the estimates must be those of a
    reducer that hands back a copy, bit for bit (nothing folded may alias the local sums)."""
    def run(reduce) -> dict:
        p = controller(replay_prior())
        rng = np.random.default_rng(3)
        rows = np.arange(8)
        p.observe(Admitted(512, rows))
        for step in range(200):
            bs = 8 if step < 120 else 4
            d = p.decide(PolicyInputs(bs, bs, bs, 0, rows[:bs], 300 * bs + step))
            p.commit(d)
            p.observe(accepted(d.mode, rng.integers(1, 5, bs).astype(float) if d.mode is
                               Mode.SPEC else np.ones(bs), rows[:bs]))
            p.observe(StepTime(d.mode, bs, rng.uniform(0.008, 0.012), kv_tokens=300 * bs))
            if step % 8 == 7:
                p.exchange(reduce)
        return p.estimates()

    assert run(same_rank) == run(lambda v: list(v))


def test_a_request_admitted_outside_the_batch_leaves_its_acceptance_current():
    p = controller()
    batch, elsewhere = np.arange(4), np.arange(4, 8)
    p.observe(Admitted(64, batch))
    p.commit(Decision(Mode.SPEC, Reason.GOODPUT))
    p.observe(accepted(Mode.SPEC, np.full(4, 2.0), batch))
    p.commit(Decision(Mode.SPEC, Reason.GOODPUT))
    p.observe(Admitted(64, elsewhere))                     # after acceptance was seen
    assert not p._acceptance.newcomers(batch)
    assert p._acceptance.newcomers(np.concatenate([batch, elsewhere[:1]]))


def test_a_request_is_measured_by_the_mean_of_its_first_draws_not_by_one():
    # Forced acceptance 1.5 draws 1, 2, 1, 2, ...: one first draw says 1.0 of every request.
    p = controller()
    rows = np.arange(4)
    for extra in (0, 1, 2, 0, 1, 2, 0, 1):
        p.observe(Admitted(64, rows))
        for draw in (1.0, 2.0, 1.0, 2.0, 1.0, 2.0)[:4 + extra]:
            p.observe(accepted(Mode.SPEC, np.full(4, draw), rows))
    assert p.expected_accept(np.arange(4, 8)) == pytest.approx(1.5, abs=0.05)
    assert p.expected_accept(rows) == pytest.approx(1.5, abs=0.2)
    # Fewer draws than that leave a request to the new-request expectation.
    p.observe(Admitted(64, rows))
    p.observe(accepted(Mode.SPEC, np.full(4, 4.0), rows))
    assert p.expected_accept(rows) == pytest.approx(p.expected_accept(np.arange(4, 8)))


def _alike_requests(seed: int) -> GoodputController:
    """96 requests in rows 0-15 that accept alike: each step's draw 1-4, the draft agreeing on
    half the tokens (1.88 on average), as the CPU demo's toy draft."""
    rng = np.random.default_rng(seed)
    p = controller()
    rows = np.arange(16)
    for _ in range(6):
        p.observe(Admitted(64, rows))
        for _ in range(6):
            p.observe(accepted(Mode.SPEC, np.minimum(rng.geometric(0.5, 16), 4).astype(float),
                               rows))
    return p


def test_a_requests_unlucky_first_draws_do_not_write_it_off_where_requests_accept_alike():
    """On the CPU demo every request accepts alike (the draft agrees on half the tokens: 1.88 a
    step on average), and one request that drew 1, 1, 1, 1 read 1.0 and decoded for 44 steps
    at c=1. Where requests' first estimates spread no more than four draws do, a request's own
    estimate yields to all requests'; where requests differ (easy and hard), it holds."""
    p = _alike_requests(seed=0)
    rows = np.arange(16)
    unlucky = np.arange(16, 17)
    p.observe(Admitted(16, unlucky))
    for _ in range(4):
        p.observe(accepted(Mode.SPEC, np.ones(1), unlucky))
    assert p.estimates().acceptance.own_accept_weight < 0.3
    assert p.expected_accept(unlucky) > 1.6
    q = controller()
    easy, hard = np.arange(0, 8), np.arange(8, 16)
    for _ in range(3):
        q.observe(Admitted(64, rows))
        for _ in range(6):
            q.observe(accepted(Mode.SPEC, np.where(rows < 8, 4.0, 1.0), rows))
    assert q.estimates().acceptance.own_accept_weight == pytest.approx(1.0)
    assert q.expected_accept(hard) == pytest.approx(1.0)
    assert q.expected_accept(easy) == pytest.approx(4.0)


def _differing_requests() -> GoodputController:
    """128 requests in rows 0-63 that differ (accept 1.75 or 3.25) and whose draws are noisy
    (0.75 each side of the request's mean, a draw's variance 0.75)."""
    p = controller()
    for wave in range(8):
        rows = np.arange(16 * (wave % 4), 16 * (wave % 4) + 16)
        p.observe(Admitted(64, rows))
        means = np.where(rows % 2 == 0, 1.75, 3.25)
        for step in range(8):
            p.observe(accepted(Mode.SPEC, means + (0.75 if step % 2 else -0.75), rows))
    return p


def test_a_requests_estimate_is_weighed_by_the_draws_its_average_holds():
    """Requests that differ (accept 1.75 or 3.25) and whose draws are noisy (0.75 each side of
    the request's mean, a draw's variance 0.75): a request's EMA soon holds ~9 draws' worth, and
    is weighed as such, B / (B + var / 9), with B the spread beyond the draws' noise less its
    standard error: ~0.76 (as four draws: 0.58)."""
    p = _differing_requests()
    assert 0.72 < p.estimates().acceptance.own_accept_weight < 0.79


def test_a_request_that_stopped_speculating_keeps_the_noise_of_its_first_draws():
    """Requests that differ (as above): one whose four first draws were all 1 and that then
    decoded is weighed as four draws (both sides together ~0.63), not as the ~9 its EMA would
    hold had it gone on speculating (~0.80: it widened the spread); further spec steps move its
    weight to that. It lies below all requests' acceptance: its side's weights price it."""
    p = _differing_requests()
    row = np.arange(64, 65)
    p.observe(Admitted(16, row))
    for _ in range(4):
        p.observe(accepted(Mode.SPEC, np.ones(1), row))
    for _ in range(30):
        p.observe(accepted(Mode.DECODE, np.ones(1), row))
    estimates = p.estimates().acceptance
    first, full = estimates.own_accept_weight_first, estimates.own_accept_weight
    assert 0.55 < first < 0.7 and 0.72 < full < 0.82
    below = estimates.own_accept_weight_first_below
    assert 0.4 < below < 0.75
    every = p.state().accept_len
    assert p.expected_accept(row) == pytest.approx(every + below * (1.0 - every))
    for _ in range(20):
        p.observe(accepted(Mode.SPEC, np.ones(1), row))
    every = p.state().accept_len
    w = (p.expected_accept(row) - every) / (1.0 - every)
    spread = below / (1.0 - below) / 4.0       # the side's spread in draws' variances
    assert w > below and w == pytest.approx(spread / (spread + 1.0 / 9.0), abs=0.02)


def _few_far_above(seed: int, share: float = 0.1) -> GoodputController:
    """96 requests in rows 0-15 that accept as the CPU demo's toy does: most alike (a draw
    1-4, the draft agreeing on half the tokens), `share` of them in a short cycle the draft
    always agrees on (4 a step)."""
    rng = np.random.default_rng(seed)
    p = controller()
    rows = np.arange(16)
    for _ in range(6):
        p.observe(Admitted(64, rows))
        agreeing = rng.random(16) < share
        for _ in range(6):
            draws = np.minimum(rng.geometric(0.5, 16), 4).astype(float)
            p.observe(accepted(Mode.SPEC, np.where(agreeing, 4.0, draws), rows))
    return p


def test_where_a_few_requests_accept_far_above_the_rest_a_low_first_estimate_yields():
    """The CPU demo's toy: its requests' first estimates spread beyond four draws' noise only
    above their centre (326 requests: below it no wider than the noise, above it 0.38 wider;
    those that first read under 1.3 went on to accept 1.93, the phase 1.91). Weighed as both
    sides together, an unlucky request's 1, 1, 1, 1 kept ~0.6 of its weight and decoded at
    c=1 where speculation was 18% faster. Each side weighed on its own, it yields to all
    requests' acceptance; an agreeing request's 4, 4, 4, 4 holds."""
    lows, highs, pooled = [], [], []
    for seed in range(40):
        p = _few_far_above(seed)
        two = np.array([16, 17])
        p.observe(Admitted(32, two))
        for _ in range(4):
            p.observe(accepted(Mode.SPEC, np.array([1.0, 4.0]), two))
        every = p.state().accept_len
        lows.append((p.expected_accept(two[:1]) - every) / (1.0 - every))
        highs.append((p.expected_accept(two[1:]) - every) / (4.0 - every))
        pooled.append(p.estimates().acceptance.own_accept_weight_first)
    # Over 40 populations each: 0.35-0.50 and 1.16-1.21 of both sides' weight (seeds 0-159).
    assert np.mean(lows) < 0.65 * np.mean(pooled)
    assert np.mean(highs) > 1.08 * np.mean(pooled)


def test_requests_alike_on_both_sides_weigh_both_sides_alike():
    """Where requests differ evenly (two kinds, as many of each), each side's spread is the
    whole one: a request's own estimate is weighed about as both sides together weigh it."""
    estimates = _differing_requests().estimates().acceptance
    for side in (estimates.own_accept_weight_first_below,
                 estimates.own_accept_weight_first_above):
        assert side == pytest.approx(estimates.own_accept_weight_first, abs=0.15)


def test_where_requests_accept_alike_the_noise_of_their_spread_gives_them_little_weight():
    """The spread of ~40 requests' first estimates is itself noisy (~22%): read whole, it passed
    for requests that differ and gave alike requests' noisy estimates weight in 9 of 20
    populations (up to 0.57; on the CPU demo 0.32-0.77 a phase). Less its standard error, the
    weight stays near 0."""
    weights = [_alike_requests(seed).estimates().acceptance.own_accept_weight for seed in range(20)]
    assert np.mean(weights) < 0.07 and sum(w > 0 for w in weights) <= 5


def test_in_a_batch_of_measured_and_new_requests_only_the_measured_are_pulled_together():
    """Requests that accept alike: a measured request's unlucky estimate yields to all requests'
    acceptance; a new one's expectation is what the latest requests first measured."""
    p = _alike_requests(seed=1)
    unlucky, new = np.arange(16, 17), np.arange(17, 18)
    p.observe(Admitted(32, np.concatenate([unlucky, new])))
    for _ in range(4):
        p.observe(accepted(Mode.SPEC, np.ones(1), unlucky))
    w, every, fresh = (p.estimates().acceptance.own_accept_weight_first, p.state().accept_len,
                       p.estimates().acceptance.fresh_accept)
    assert w < 0.3
    assert p.expected_accept(np.concatenate([unlucky, new])) == pytest.approx(
        ((1 - w) * every + w * 1.0 + fresh) / 2)


def test_the_spread_of_requests_is_trusted_only_from_eight_requests_on():
    """Three requests that happened to draw alike say nothing of how requests differ: until
    eight are measured, each request's own estimate counts whole."""
    p = controller()
    for row, draws in enumerate(((1, 2, 1, 2),) * 3):
        p.observe(Admitted(16, np.array([row])))
        for d in draws:
            p.observe(accepted(Mode.SPEC, np.array([float(d)]), np.array([row])))
    assert p.estimates().acceptance.own_accept_weight == 1.0


# ---------------------------------------------------------------- prompts and catch-ups


def _first_prefills(p: GoodputController) -> GoodputController:
    """The process's first prefill of each kind, a first call (1.5-2.5 s on the H200): held
    back, so the prefills a test feeds next are the ones its fits read."""
    for draft in (True, False):
        p.observe(PrefillTime(32, 2.0, draft=draft))
    return p


def _learned(p: GoodputController, bs: int) -> GoodputController:
    """Teach `p` the true step times at bs (both modes) through its own exchange."""
    for mode, t, pb in ((Mode.SPEC, t_spec, 16), (Mode.DECODE, t_decode, 16)):
        for _ in range(4):
            p.observe(StepTime(mode, pb, t(pb)))
    p.exchange(lambda v: v)
    return p


def test_long_prompts_price_the_drafts_prefill_into_speculation():
    """At bs 16 and accept 3 speculation wins on decode steps alone; with 2048-token prompts
    for 64-token answers the draft's prefill of every prompt token makes decode the winner."""
    inputs = PolicyInputs(16, 16, 16, 0, None)
    short = _learned(controller(defers_prefill=True), 16)
    for _ in range(8):
        short.observe(accepted(Mode.SPEC, np.full(16, 3.0)))
    short.exchange(lambda v: v)
    assert short.decide(inputs).mode is Mode.SPEC
    long = _learned(controller(defers_prefill=True), 16)
    # Prefill batches of several sizes, each with a fixed 5 ms overhead: the slopes (30 and
    # 24 us a token) are what the draft adds, not the per-token averages (which the overhead
    # skews for small batches).
    _first_prefills(long)
    for tokens in (2048, 8192, 32768):
        long.observe(PrefillTime(tokens, 0.005 + tokens * 30e-6, draft=True))   # with draft
        long.observe(PrefillTime(tokens, 0.005 + tokens * 24e-6, draft=False))  # deferred
    long.observe(Admitted(32768))
    for _ in range(8):
        long.observe(accepted(Mode.SPEC, np.full(16, 3.0)))
    long.exchange(lambda v: v)
    assert long.prompt_per_output() == pytest.approx(32768 / (8 * 16 * 3))
    assert long.draft_prefill_s_per_token() == pytest.approx(6e-6)
    assert long.decide(inputs).mode is Mode.DECODE
    # A measured catch-up (the same draft extend over many tokens) takes precedence.
    long.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 100_000 * 1e-6, catch_up_tokens=100_000))
    long.exchange(lambda v: v)
    assert long.draft_prefill_s_per_token() == pytest.approx(1e-6, rel=0.01)


def test_once_prompts_are_prefilled_with_the_draft_decode_mode_pays_their_share_too():
    """Deferral turned off while serving (SGLang built a radix cache lazy catch-up cannot keep
    draft-valid): a prompt joining a decoding batch now runs the draft's prefill as well, so
    the long prompts that made decode the winner no longer favour it."""
    inputs = PolicyInputs(16, 16, 16, 0, None)
    p = _first_prefills(_learned(controller(defers_prefill=True), 16))
    for tokens in (2048, 8192, 32768):
        p.observe(PrefillTime(tokens, 0.005 + tokens * 30e-6, draft=True))
        p.observe(PrefillTime(tokens, 0.005 + tokens * 24e-6, draft=False))
    p.observe(Admitted(32768))
    for _ in range(8):
        p.observe(accepted(Mode.SPEC, np.full(16, 3.0)))
    p.exchange(lambda v: v)
    assert p.decide(inputs).mode is Mode.DECODE
    p.observe(DraftPrefills(deferred=False))
    assert p.decide(inputs).mode is Mode.SPEC
    p.observe(DraftPrefills(deferred=True))
    assert p.decide(inputs).mode is Mode.DECODE


def test_the_prompt_share_counts_only_prompts_that_replace_finished_requests():
    """A batch filling up admits its prompts once: only prompts that take finished requests'
    places recur, so only they price the draft's prefill into every output token."""
    p = controller(defers_prefill=True)
    rows = np.arange(16)

    def window(admit: np.ndarray) -> None:
        p.observe(Admitted(2048 * len(admit), admit))
        for _ in range(8):
            p.observe(accepted(Mode.SPEC, np.full(16, 2.0), rows))
        p.exchange(lambda v: v)

    window(rows)
    assert p.prompt_per_output() == 0.0
    window(rows[:0])
    assert p.prompt_per_output() == 0.0
    # Then each window 4 requests finish and 4 new ones take their rows: 4 prompts of 2048
    # tokens per 8 steps x 16 requests x 2 tokens.
    for w in range(100):
        window(rows[4 * (w % 4):4 * (w % 4) + 4])
    assert p.prompt_per_output() == pytest.approx(4 * 2048 / 256, rel=0.02)


def test_the_turnover_between_exchanges_counts_requests_not_rows():
    """Against requests kept whole (a row and its admissions): random admissions and batches,
    an exchange now and then. A row admitted to again holds a new request; one admitted to
    outside the batch changes nothing."""
    rng = np.random.default_rng(0)
    costs, admissions, last = BatchCosts(False, 0.0, 64), np.zeros(64, int), None
    for _ in range(400):
        if rng.random() < 0.5:
            rows = rng.choice(64, rng.integers(1, 4), replace=False)
            costs.admitted(16, rows.tolist())
            admissions[rows] += 1
        batch = rng.choice(64, rng.integers(1, 32), replace=False)
        costs.served(batch, 1.0)
        if rng.random() < 0.3:
            now = {(row, admissions[row]) for row in batch.tolist()}
            want = (len(now), 0) if last is None else (len(now - last), len(last - now))
            assert costs._turnover() == want
            last = now


def test_a_finished_requests_place_taken_an_exchange_later_still_counts_a_drain_does_not():
    p = controller(defers_prefill=True)

    def window(batch: np.ndarray, admit: np.ndarray) -> None:
        p.observe(Admitted(2048 * len(admit), admit))
        for _ in range(8):
            p.observe(accepted(Mode.SPEC, np.full(len(batch), 2.0), batch))
        p.exchange(lambda v: v)

    rows = np.arange(16)
    window(rows, rows)
    # Requests finish at the end of one exchange window and their places are taken in the next.
    for w in range(60):
        gone = rows[4 * (w % 4):4 * (w % 4) + 4]
        window(np.setdiff1d(rows, gone), gone[:0])
        window(rows, gone)
    steady = p.prompt_per_output()
    assert steady == pytest.approx(4 * 2048 / (8 * 2 * (12 + 16)), rel=0.05)
    # The batch drains to 4 requests, then fills up again: the refill is not priced as though it
    # replaced the drained requests (at most the last exchange's departures).
    for left in (12, 8, 4):
        window(rows[:left], rows[:0])
    window(rows, rows[4:])
    assert p.prompt_per_output() < steady


def test_a_switchs_catch_up_is_amortised_over_the_horizon():
    """In decode with a backlog: a marginal spec win does not pay for a large catch-up, a
    clear one does, and so does the same win once the backlog is small."""
    p = _learned(controller(min_dwell_steps=0, switch_horizon=32, margin=0.0), 16)
    for _ in range(8):
        p.observe(accepted(Mode.SPEC, np.full(16, 3.0)))
    p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 200_000 * 1e-6, catch_up_tokens=200_000))
    p.exchange(lambda v: v)
    assert p.catch_up_s_per_token() == pytest.approx(1e-6, rel=0.01)
    p.commit(p.decide(PolicyInputs(16, 16, 16)))       # spec
    # Force decode, as after a burst beyond the spec pool.
    p.commit(p.decide(PolicyInputs(64, None, 64)))
    spec_wins = 3.0 * 16 / t_spec(16) > 16 / t_decode(16)
    assert spec_wins
    assert p.decide(PolicyInputs(16, 16, 16, catch_up_tokens=10)).mode is Mode.SPEC
    assert p.decide(PolicyInputs(16, 16, 16, catch_up_tokens=400_000)).mode is Mode.DECODE


def test_a_wave_of_long_prompts_is_priced_alike_by_the_preview_and_the_plan_after_it():
    """While speculating, a fresh batch's long prompts: the prefill's preview (the draft's
    prefill of them) and the next step's plan (the backlog deferring them left) agree on decode,
    so the draft never runs over them; short prompts leave speculation as it was."""
    p = _learned(controller(min_dwell_steps=0, switch_horizon=32, margin=0.0), 16)
    for _ in range(8):
        p.observe(accepted(Mode.SPEC, np.full(16, 3.0)))
    p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 200_000 * 1e-6, catch_up_tokens=200_000))
    p.exchange(lambda v: v)
    planner = StepPlanner(DispatchTable.build(SPEC, DECODE), p)
    assert planner.plan(16).mode is Mode.SPEC
    assert p.draft_prefill_s_per_token() == pytest.approx(1e-6, rel=0.01)
    assert planner.preview(16, prefill_tokens=16 * 256) is Mode.SPEC
    long = 16 * 32768
    assert planner.preview(16, prefill_tokens=long) is Mode.DECODE
    assert planner.plan(16, catch_up_tokens=long).mode is Mode.DECODE


def test_a_catch_ups_fixed_cost_does_not_pass_for_a_per_token_rate():
    """A catch-up is one more draft forward (~2 ms whatever its size) plus a per-token rate:
    small catch-ups must not make the draft's prompt cost look 100x larger, which priced
    speculation out everywhere on the H200 (policy matrix run 2)."""
    p = _learned(controller(defers_prefill=True), 16)
    for tokens in (4, 16, 4, 2080, 13792, 8):
        p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 2e-3 + tokens * 2e-6,
                           catch_up_tokens=tokens))
        p.exchange(lambda v: v)
    assert p.draft_prefill_s_per_token() == pytest.approx(2e-6, rel=0.05)
    assert p.catch_up_s_per_token() == pytest.approx(2e-6, rel=0.05)
    assert p.catch_up_seconds(4) == pytest.approx(2e-3 + 8e-6, rel=0.05)
    shown = p.estimates().to_json()                 # what /get_server_info reports
    assert shown["catch_up_fixed_s"] == pytest.approx(2e-3, rel=0.05)
    assert shown["step_s"]["spec"][16][1] > 0 and shown["step_s"]["decode"][16][1] > 0
    # Only tiny catch-ups of one size: no rate can be told from their fixed cost, so none is
    # charged per prompt token; a switch still pays what such a catch-up cost.
    q = _learned(controller(defers_prefill=True), 16)
    for _ in range(6):
        q.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 2e-3 + 4 * 2e-6, catch_up_tokens=4))
        q.exchange(lambda v: v)
    assert q.draft_prefill_s_per_token() == 0.0
    assert q.catch_up_seconds(4) == pytest.approx(2e-3 + 8e-6, rel=0.05)


def test_catch_ups_that_fill_the_drafts_kv_alone_are_fitted_on_a_line_of_their_own():
    """An engine whose catch-ups of 2048 tokens and more fill only the draft's K/V, at rates
    like H100 m107's (the whole layer 1 ms + 0.93 us a token; K/V-filling ones 4 ms + 0.35 us,
    their host work no share of the layer's): a line of their own prices both sizes right and
    leaves the whole layer's rate (also the draft prefill's) as it is. One line over both mixes
    the two rates, as the first K/V-only GPU run did (its whole-layer rate read 1.4-3.5 us)."""
    true = {4: 1e-3 + 4 * 0.93e-6, 16: 1e-3 + 16 * 0.93e-6, 1000: 1e-3 + 1000 * 0.93e-6,
            20_000: 4e-3 + 20_000 * 0.35e-6, 60_000: 4e-3 + 60_000 * 0.35e-6}
    priced, rate, kv = {}, {}, {}
    for work in (None, CatchUpWork(2048, 0.25, 8192)):
        p = _learned(controller(defers_prefill=True, catch_up_work=work), 16)
        for tokens in (4, 1000, 20_000, 16, 60_000, 1000, 20_000, 4):
            p.observe(StepTime(Mode.DECODE, 16, t_decode(16)))      # each at a switch
            p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + true[tokens], catch_up_tokens=tokens))
            p.exchange(lambda v: v)
        priced[work is None] = {t: p.catch_up_seconds(t) / s for t, s in true.items()}
        rate[work is None] = p.catch_up_s_per_token()
        kv[work is None] = p.estimates().batch_costs[-2:]
    assert all(r == pytest.approx(1.0, rel=0.05) for r in priced[False].values())
    assert rate[False] == pytest.approx(0.93e-6, rel=0.05)
    assert kv[False] == pytest.approx((4e-3, 0.35e-6), rel=0.05) and kv[True] == (None, None)
    assert max(abs(r - 1.0) for r in priced[True].values()) > 0.2     # one line, two rates


def test_a_draft_token_costs_no_less_than_the_drafts_share_of_a_prefill_token():
    """The H200 (run 19, accept 1.5, 2048x64 C=64): catch-ups of 4-256 tokens fitted a flat
    line (0 a token), so 131k prompt tokens' draft prefill looked free and the worker kept
    speculating, 3.4% behind plain decoding. The draft's share of the weights (~4% for
    Llama-3-8B's EAGLE-3 head) of a prefill token's 24 us is the least a draft token costs,
    unless DGW_DRAFT_FLOOR=0."""
    def learned(share: float) -> GoodputController:
        p = _first_prefills(_learned(controller(defers_prefill=True, draft_share=share,
                                                draft_floor=True), 16))
        for tokens in (2048, 8192, 32768):
            p.observe(PrefillTime(tokens, 0.005 + tokens * 24e-6, draft=True))
        for tokens in (4, 256, 16, 128, 64, 8):
            p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 2e-3, catch_up_tokens=tokens))
            p.exchange(lambda v: v)
        return p
    assert learned(0.0).draft_prefill_s_per_token() == 0.0
    off = _first_prefills(_learned(controller(defers_prefill=True, draft_share=0.04,
                                              draft_floor=False), 16))
    for tokens in (2048, 8192, 32768):
        off.observe(PrefillTime(tokens, 0.005 + tokens * 24e-6, draft=True))
    off.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 2e-3, catch_up_tokens=4))
    off.exchange(lambda v: v)
    assert off.draft_prefill_s_per_token() == 0.0
    floored = learned(0.04)
    assert floored.draft_prefill_s_per_token() == pytest.approx(0.04 * 24e-6, rel=0.01)
    # Catch-ups at switches of 4-512 tokens at a flat 2 ms fit a line of 0 a token: beyond the
    # sizes it has seen, a catch-up's draft tokens cost the floor.
    far = {}
    for share in (0.0, 0.04):
        q = learned(share)
        for tokens in (4, 512, 8, 480, 16, 500):
            q.observe(StepTime(Mode.DECODE, 16, t_decode(16)))
            q.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 2e-3, catch_up_tokens=tokens))
            q.exchange(lambda v: v)
        far[share] = q.catch_up_seconds(100_000)
    assert far[0.0] < 0.01 and far[0.04] > 0.04 * 24e-6 * 90_000
    # Prefills of one size (2048-token prompts in chunks of 8192) give no line: their ratio.
    chunks = _first_prefills(_learned(controller(defers_prefill=True, draft_share=0.04,
                                                 draft_floor=True), 16))
    for _ in range(4):
        chunks.observe(PrefillTime(8192, 8192 * 24e-6, draft=True))
    chunks.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 2e-3, catch_up_tokens=4))
    chunks.exchange(lambda v: v)
    assert chunks.draft_prefill_s_per_token() == pytest.approx(0.04 * 24e-6, rel=0.01)
    # Only prefills without the draft (a decoding server defers it): the draft's share of
    # what a prefill with it would cost.
    deferred = _first_prefills(_learned(controller(defers_prefill=True, draft_share=0.04,
                                                   draft_floor=True), 16))
    for _ in range(4):
        deferred.observe(PrefillTime(8192, 8192 * 24e-6, draft=False))
    deferred.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 2e-3, catch_up_tokens=4))
    deferred.exchange(lambda v: v)
    assert deferred.draft_prefill_s_per_token() == pytest.approx(0.04 / 0.96 * 24e-6, rel=0.01)
    # A share past a third (quantized weights counted as packed) is held to the cap.
    assert learned(0.9).draft_prefill_s_per_token() == pytest.approx(24e-6 / 3, rel=0.01)
    with pytest.raises(ConfigError, match="draft_share"):
        ControllerConfig(num_draft_tokens=K, draft_share=1.0)


def test_the_processs_first_prefill_of_each_kind_is_held_back():
    """The H200 (run 20): the process's first prefill, 32 tokens with the draft, took 2.2 s and,
    with one more of 2048 tokens, read 690 us a token; the floor stood at 28 us a token (~1
    steady) and priced a catch-up of 4192 tokens at 117 ms. Runs 10-26 all start so (1.5-2.5 s),
    and read as a flat line it put the cap on a draft token at 0, pricing catch-ups beyond the
    sizes seen as free (2360 of run 26's 6382 steps). Held back as a first call, and with
    fewer than three prefills no reading, the draft is priced at what its prefills say."""
    p = _learned(controller(defers_prefill=True, draft_share=0.04, draft_floor=True), 16)
    p.observe(PrefillTime(0, 0.001, draft=True))          # an empty one uses up no hold
    p.observe(PrefillTime(32, 2.2, draft=True))
    p.observe(PrefillTime(2048, 0.005 + 2048 * 24e-6, draft=True))
    p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 2e-3, catch_up_tokens=4))
    p.exchange(lambda v: v)
    assert p.draft_prefill_s_per_token() == 0.0
    for tokens in (4096, 8192):
        p.observe(PrefillTime(tokens, 0.005 + tokens * 24e-6, draft=True))
    p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 2e-3, catch_up_tokens=4))
    p.exchange(lambda v: v)
    assert p.draft_prefill_s_per_token() == pytest.approx(0.04 * 24e-6, rel=0.05)


def test_a_prefill_line_that_reads_negative_is_no_rate():
    """Prefills with the draft that ran slower for fewer tokens (a process's first few, ~0.1 s
    whatever their size) fit a negative slope. Read as a flat line's 0 a token, it set the cap
    on a draft token at 0, and a catch-up beyond the sizes seen looked free (run 26: a 93k-token
    catch-up priced at 18 ms took 99). It is no reading: the prefills without the draft give
    the cap and the floor."""
    p = _first_prefills(_learned(controller(defers_prefill=True, draft_share=0.04,
                                            draft_floor=True), 16))
    for tokens, seconds in ((2048, 0.2), (4096, 0.12), (8192, 0.1)):
        p.observe(PrefillTime(tokens, seconds, draft=True))
    for _ in range(4):
        p.observe(PrefillTime(8192, 8192 * 24e-6, draft=False))
    for tokens in (4, 512, 8, 480, 16, 500):
        p.observe(StepTime(Mode.DECODE, 16, t_decode(16)))
        p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 2e-3, catch_up_tokens=tokens))
        p.exchange(lambda v: v)
    share_of_prefill = 0.04 / 0.96 * 24e-6
    assert p.draft_prefill_s_per_token() == pytest.approx(share_of_prefill, rel=0.01)
    assert p.catch_up_seconds(100_000) > share_of_prefill * 90_000


def test_every_rank_holds_back_the_same_first_prefill():
    """The hold is judged on what ranks share (a prefill's kind and tokens): a first call past
    the 16 s a prefill may take on one rank and under it on another still holds back the same
    prefill on both, so the reduced sums stand on the same prefills."""
    ranks = []
    for first_s in (17.0, 15.0):
        p = controller(defers_prefill=True, draft_share=0.04)
        p.observe(PrefillTime(32, first_s, draft=True))
        for tokens in (2048, 4096, 8192):
            p.observe(PrefillTime(tokens, 0.005 + tokens * 24e-6, draft=True))
        ranks.append(p._batch_costs.take_local())
    assert ranks[0] == ranks[1]


def test_a_flat_plain_prefill_line_is_no_reading_of_the_drafts_rate():
    """Where no catch-up is seen, the draft's rate is the difference of the prefill slopes with
    and without it. A line without the draft that reads negative (noise) is no slope: read as 0
    it put the whole prefill's 30 us a token on the draft. The floor stands instead."""
    p = _first_prefills(_learned(controller(defers_prefill=True, draft_share=0.04,
                                            draft_floor=True), 16))
    for tokens in (2048, 8192, 32768):
        p.observe(PrefillTime(tokens, 0.005 + tokens * 30e-6, draft=True))
    for tokens, seconds in ((2048, 0.3), (8192, 0.25), (32768, 0.2)):
        p.observe(PrefillTime(tokens, seconds, draft=False))
    p.exchange(lambda v: v)
    assert p.draft_prefill_s_per_token() == pytest.approx(0.04 * 30e-6, rel=0.01)


def test_the_draft_floor_takes_the_lower_of_its_two_prefill_readings():
    """Prefills with the draft are rare where they are deferred, so their line can stand on a
    few slow ones for minutes; prefills without the draft at a steady 24 us a token bring the
    floor down to the share of theirs."""
    p = _first_prefills(_learned(controller(defers_prefill=True, draft_share=0.04,
                                            draft_floor=True), 16))
    for tokens in (1024, 2048, 4096):
        p.observe(PrefillTime(tokens, 0.005 + tokens * 200e-6, draft=True))
    p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 2e-3, catch_up_tokens=4))
    p.exchange(lambda v: v)
    assert p.draft_prefill_s_per_token() == pytest.approx(0.04 * 200e-6, rel=0.01)
    for _ in range(4):
        p.observe(PrefillTime(8192, 8192 * 24e-6, draft=False))
    p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 2e-3, catch_up_tokens=4))
    p.exchange(lambda v: v)
    assert p.draft_prefill_s_per_token() == pytest.approx(0.04 / 0.96 * 24e-6, rel=0.01)


def _catch_ups(p: GoodputController, bs: int, spec_s: float, decode_s: float,
               prefill_s: Callable[[int], float],
               excesses: list[tuple[int, float]]) -> GoodputController:
    """`p` with both modes measured at `bs` and prefills with the draft of 2k-8k tokens, then a
    speculative step carrying each (catch-up tokens, seconds beyond the step), an exchange
    after each."""
    for mode, seconds in ((Mode.SPEC, spec_s), (Mode.DECODE, decode_s)):
        for _ in range(4):
            p.observe(StepTime(mode, bs, seconds))
    _first_prefills(p)
    for tokens in (2048, 4096, 8192):
        p.observe(PrefillTime(tokens, prefill_s(tokens), draft=True))
    p.exchange(lambda v: v)
    for tokens, excess in excesses:
        p.observe(StepTime(Mode.SPEC, bs, spec_s + excess, catch_up_tokens=tokens))
        p.exchange(lambda v: v)
    return p


def test_a_lone_catch_up_dearer_than_a_prefill_of_its_tokens_is_a_one_time_cost():
    """The H200's first 256x256 C=8 cell (run 13, m31): catch-ups of 32 tokens took 2.8 ms over
    a step, then one of 528 tokens 19.9 ms (its forward's first call at that shape), the next of
    664 tokens 4.1 ms. Taken, the 528 made the draft's rate 12-34 us a token, near the target's
    own prefill (18-24 us), and priced speculation out where it was 9% faster. Held back, the
    rate is the draft's; a second such catch-up of a size in a row is the cost."""
    def catch_ups(excesses: list[tuple[int, float]]) -> GoodputController:
        # bs 8 there; the target's and draft's prefill 17.6 us a token.
        return _catch_ups(controller(defers_prefill=True), 16, 6.9e-3, 5.1e-3,
                          lambda tokens: 0.05 + tokens * 17.6e-6, excesses)

    h200 = [(32, 2.77e-3), (32, 2.77e-3), (528, 19.9e-3), (664, 4.1e-3), (16, 2.6e-3)]
    held = catch_ups(h200)
    # m32: 12.5 ms, after a 32-token one at 9.1 ms held back as its size's first.
    m32 = h200[:2] + [(32, 9.1e-3), (528, 12.5e-3)] + h200[3:]
    assert catch_ups(m32).catch_up_seconds(528) < 5e-3
    assert held.catch_up_s_per_token() == pytest.approx(2.1e-6, rel=0.1)
    assert held.draft_prefill_s_per_token() == pytest.approx(2.1e-6, rel=0.1)
    assert held.catch_up_seconds(528) < 5e-3
    # Two in a row: the draft really is that dear now.
    again = catch_ups(h200[:3] + [(600, 21e-3), (664, 23e-3), (16, 2.6e-3)])
    assert again.catch_up_s_per_token() > 20e-6
    # Out to the sizes it has seen; beyond them no dearer a token than a third of a prefill's.
    reach = again._batch_costs.catch_up_reach
    assert 664 < reach < 2000
    assert again.catch_up_seconds(10_000) == pytest.approx(
        again.catch_up_seconds(int(reach)) + (10_000 - reach) * 17.6e-6 / 3, rel=0.01)
    # A large catch-up far over the small ones' fixed cost but under a prefill's is no outlier.
    big = catch_ups([(32, 2.77e-3), (32, 2.77e-3), (36224, 35e-3), (16, 2.6e-3)])
    assert big.catch_up_s_per_token() == pytest.approx((35e-3 - 2.7e-3) / 36192, rel=0.05)


def test_catch_ups_beyond_the_sizes_seen_are_capped_when_prefills_were_all_one_size():
    """SGLang prefills a wave of long prompts in equal 8192-token chunks: no per-token slope,
    but their ratio is a rate, as the draft's floor reads it. The cap on a draft token beyond
    the catch-ups seen reads it too: a noisy steep fit (47 us a token over 200-600-token
    catch-ups) priced a 20000-token catch-up at 0.94 s, against 0.43 s capped at a third of a
    prefill token and 0.13 s at twice the draft's share of one (the H200's large catch-ups
    read 0.9-1.2x that share)."""
    p = controller(defers_prefill=True, draft_share=0.04)
    for _ in range(4):
        p.observe(StepTime(Mode.SPEC, 16, t_spec(16)))
    p.exchange(lambda v: v)
    for _ in range(10):
        p.observe(PrefillTime(8192, 0.5, draft=False))
        p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 0.004, catch_up_tokens=200))
        p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 0.030, catch_up_tokens=600))
        p.exchange(lambda v: v)
    assert p.catch_up_s_per_token() > 40e-6                    # the fit itself stays steep
    cap = 0.5 / 8192 * 2 * 0.04
    assert p.catch_up_seconds(20_000) == pytest.approx(
        p.catch_up_seconds(800) + (20_000 - 800) * cap, rel=0.05)
    # Twice a share past a sixth would pass a third of a prefill token: held there.
    p._batch_costs._draft_share = 0.25
    assert p._batch_costs.draft_rate_cap() == pytest.approx(0.5 / 8192 / 3)


def test_the_processs_first_catch_up_is_judged_as_a_one_time_cost_too():
    """H200 run 24, m65: the process's first catch-up (512 tokens, in the warm-up) held 16.1 ms
    beyond its step, most of it the first call of the catch-up's index path (19.3 ms of host
    work). Taken as the first sample of the draft's rate, it read 31 us a token, and 6.3 prompt
    tokens an output token priced a speculative token at ~196 us against its ~67: the first
    cell decoded 65 steps where speculation ran 1.6x plain's tok/s. Held back like any lone dear
    catch-up, the next (15408 tokens at 1.6 us a token) sets the rate; two dear ones in a row
    still count."""
    def first_catch_ups(excesses: list[tuple[int, float]]) -> GoodputController:
        # Llama-3-8B's EAGLE-3 head; the target's and draft's prefill ~23 us a token.
        return _catch_ups(controller(defers_prefill=True, draft_share=0.04), 48, 9.6e-3, 6.0e-3,
                          lambda tokens: 0.005 + tokens * 23e-6, excesses)

    held = first_catch_ups([(512, 16.1e-3), (15408, 25.3e-3)])
    assert held.catch_up_s_per_token() < 2e-6
    assert held.draft_prefill_s_per_token() < 2e-6
    assert first_catch_ups([(512, 16.1e-3)]).catch_up_seconds(512) < 2e-3
    # Dear ones in a row (each the second of its kind and size): the draft really is that dear.
    dear = first_catch_ups([(512, 16.1e-3), (600, 18e-3), (664, 20e-3)])
    assert dear.catch_up_s_per_token() > 20e-6


def test_a_switchs_catch_ups_turned_dear_are_learnt_between_cheap_ones_inside_runs():
    """Holding a lone dear catch-up back must not hold every one: at-switch catch-ups that turn
    dear for good count from the second on, whatever cheap catch-ups of deferred prompts inside
    speculative runs come between them."""
    p = controller(defers_prefill=True)
    for mode, seconds in ((Mode.SPEC, 6.9e-3), (Mode.DECODE, 5.1e-3)):
        for _ in range(4):
            p.observe(StepTime(mode, 16, seconds))
    for tokens in (2048, 4096, 8192):
        p.observe(PrefillTime(tokens, 0.05 + tokens * 17.6e-6, draft=True))
    p.exchange(lambda v: v)

    def catch_up(at_switch: bool, tokens: int, excess: float) -> None:
        p.observe(StepTime(Mode.DECODE if at_switch else Mode.SPEC, 16,
                           5.1e-3 if at_switch else 6.9e-3))
        p.observe(StepTime(Mode.SPEC, 16, 6.9e-3 + excess, catch_up_tokens=tokens))
        p.exchange(lambda v: v)

    for tokens in (48, 300, 48, 600):
        catch_up(True, tokens, 0.5e-3 + tokens * 0.6e-6)
    assert p.catch_up_seconds(48) < 1e-3
    for _ in range(6):
        catch_up(True, 48, 14e-3)
        catch_up(False, 40, 0.5e-3)
    assert p.catch_up_seconds(48) > 5e-3


def test_catch_up_rates_come_only_from_sizes_far_enough_apart_and_runs_without_a_switch():
    rng = random.Random(1)
    # Sizes 4 and 8 with 0.2 ms of noise: no slope can be told; no rate is made up from them.
    p = _learned(controller(defers_prefill=True), 16)
    for k in range(12):
        tokens = 4 if k % 2 else 8
        p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 2e-3 + tokens * 2e-6
                           + rng.uniform(-2e-4, 2e-4), catch_up_tokens=tokens))
        p.exchange(lambda v: v)
    assert p.draft_prefill_s_per_token() == 0.0
    assert p.catch_up_seconds(6) == pytest.approx(2e-3 + 12e-6, rel=0.1)
    # Catch-ups at a switch carry ~3 ms more than those inside a speculative run (deferred
    # prompts): the prompt rate comes from the latter, the switch's price from the former.
    q = _learned(controller(defers_prefill=True), 16)
    for tokens in (128, 256, 512):
        q.observe(StepTime(Mode.DECODE, 16, t_decode(16)))
        q.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 5e-3 + tokens * 2e-6,
                           catch_up_tokens=tokens))
        for big in (2048, 4096):
            q.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 2e-3 + big * 2e-6,
                               catch_up_tokens=big))
        q.exchange(lambda v: v)
    assert q.draft_prefill_s_per_token() == pytest.approx(2e-6, rel=0.02)
    assert q.catch_up_seconds(256) == pytest.approx(5e-3 + 256 * 2e-6, rel=0.02)


def test_a_negative_intercept_refits_the_line_through_the_origin():
    s = Slope(min_spread=1.0, decay=1.0)
    for x, y in ((100, 0.0001), (1000, 0.0019), (2000, 0.0039)):   # intercept -0.1 ms
        s.fold(np.array([1.0, x, y, x * x, x * y]))
    intercept, slope = s.fit()
    assert intercept == 0.0 and slope == pytest.approx(
        (100 * 1e-4 + 1000 * 19e-4 + 2000 * 39e-4) / (100 ** 2 + 1000 ** 2 + 2000 ** 2))


def test_a_step_that_carried_the_next_launch_charges_it_to_that_batch():
    """Under overlap a step's cost runs until its result is processed, after the next batch's
    launch: the decode step before a catch-up holds the catch-up's host launch. It is no decode
    sample; its excess is the catch-up's, as the excess before a prefill is the prefill's."""
    p = _learned(controller(), 16)
    for tokens in (16, 64, 256, 1024):
        p.observe(StepTime(Mode.DECODE, 16, t_decode(16) + 0.012, carries_next=True))
        p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 0.001 + tokens * 2e-6,
                           catch_up_tokens=tokens))
        p.exchange(lambda v: v)
    assert p.step_time(Mode.DECODE, 16) == pytest.approx(t_decode(16))
    assert p.estimates().batch_costs.catch_up_fixed_s == pytest.approx(0.013, rel=0.02)
    assert p.catch_up_s_per_token() == pytest.approx(2e-6, rel=0.05)
    q = _first_prefills(controller(defers_prefill=True))
    for tokens in (1024, 4096, 16384):
        q.observe(StepTime(Mode.DECODE, 8, t_decode(8) + 0.004, carries_next=True))
        q.observe(PrefillTime(tokens, tokens * 30e-6, draft=True))
        q.observe(PrefillTime(tokens, 0.004 + tokens * 24e-6, draft=False))
    q.exchange(lambda v: v)
    assert q.draft_prefill_s_per_token() == pytest.approx(6e-6, rel=0.01)


def test_a_carry_across_a_change_of_batch_is_no_catch_ups_cost():
    """As on the H200 over HTTP at C=128: the decode step before a catch-up also processed 87
    finished requests (13.6 ms over its 8 ms); charged to a 2018-token catch-up that took 1.4 ms
    more than a step, it made the draft's rate 7 us a token, five times its own, and priced
    speculation out for 238 steps. A carry counts only where the batch kept its requests."""
    def catch_ups(batch_changes: bool) -> GoodputController:
        p = _learned(controller(), 16)
        for tokens, excess, stall in ((256, -0.0008, 0.0), (164, -0.0026, 0.0),
                                      (2018, 0.0014, 0.0136)):
            p.observe(StepTime(Mode.DECODE, 16, t_decode(16) + stall, carries_next=True, bs=16))
            bs = 12 if batch_changes and stall else 16
            p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + excess, catch_up_tokens=tokens,
                               bs=bs))
            p.exchange(lambda v: v)
        return p

    assert catch_ups(batch_changes=False).catch_up_s_per_token() > 5e-6
    assert catch_ups(batch_changes=True).catch_up_s_per_token() < 1e-6


def test_a_catch_up_that_held_the_next_launch_is_no_sample_and_carries_nothing():
    """Under overlap a catch-up step may hold the next batch's launch (a prefill, a switch).
    Its excess was carried on and priced that prefill with the catch-up (the draft's prompt rate
    from 6 to 8 us a token here). Nor is it the catch-up's sample: right after a prefill its span
    starts late (on the GPU a 2048-token one read under a clean step)."""
    p = _first_prefills(_learned(controller(), 16))
    for tokens in (1024, 4096, 16384):
        p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 0.002 + tokens * 2e-6,
                           catch_up_tokens=tokens, carries_next=True, bs=16))
        p.observe(PrefillTime(tokens, tokens * 30e-6, draft=True))
        p.observe(PrefillTime(tokens, tokens * 24e-6, draft=False))
        p.exchange(lambda v: v)
    costs = p.estimates().batch_costs
    assert costs.draft_prefill_s_per_token == pytest.approx(6e-6, rel=0.01)
    assert costs.catch_up_s_per_token == costs.draft_prefill_s_per_token     # no line of its own
    assert costs.catch_up_fixed_s == 0.0 and costs.switch_s == 0.0


def test_a_switch_without_a_catch_up_is_measured_and_priced():
    """Spec -> decode has no catch-up, but its launch (held by the last spec step) costs: the
    controller learns it and charges it when it would enter decode, amortised."""
    p = _learned(controller(min_dwell_steps=0, margin=0.0, switch_horizon=4), 16)
    for _ in range(6):
        p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 0.006, carries_next=True))
        p.observe(StepTime(Mode.DECODE, 16, t_decode(16)))
        p.exchange(lambda v: v)
    assert p.estimates().batch_costs.switch_s == pytest.approx(0.006)
    assert p.step_time(Mode.SPEC, 16) == pytest.approx(t_spec(16))
    # Near a tie, the switch's price decides: spec at the accept where decode barely wins.
    a = t_spec(16) / t_decode(16) * 0.99
    for _ in range(8):
        p.observe(accepted(Mode.SPEC, np.full(16, a)))
    p.exchange(lambda v: v)
    p.commit(p.decide(PolicyInputs(16, 16, 16)))          # spec: dwell in it
    while p._dwell.mode is not Mode.SPEC:
        p.commit(Decision(Mode.SPEC, Reason.GOODPUT))
    assert p.decide(PolicyInputs(16, 16, 16)).mode is Mode.SPEC


def test_the_step_a_switch_launched_late_is_no_sample_and_its_shortfall_is_the_switchs():
    """As on the H200: the spec step before a switch holds the decode step's launch, so that
    decode step's span starts late (0.57-0.99x its size's median). Taken as a sample, one read
    bs 1's decode at 2.89 ms against 4.79 and priced decode in for the cells after it. The
    switch costs the two steps' excess together, as a catch-up does."""
    p = _learned(controller(), 16)
    for _ in range(6):
        p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 0.006, carries_next=True))
        p.observe(StepTime(Mode.DECODE, 16, t_decode(16) - 0.002))
        p.observe(StepTime(Mode.DECODE, 16, t_decode(16)))
        p.exchange(lambda v: v)
    assert p.estimates().batch_costs.switch_s == pytest.approx(0.004)
    assert p.step_time(Mode.DECODE, 16) == pytest.approx(t_decode(16))


def test_a_costly_draft_prefill_still_lets_speculation_be_re_measured():
    """Long prompts price spec's steps out through the draft's prefill, but its steps would win
    at this acceptance: spec is still re-measured while prompts price it out (only its runs'
    catch-ups re-measure the prefill rate, so a rate that went stale must not keep it out for
    good), once their share has fallen far enough for the re-measurement's price."""
    p = _first_prefills(_learned(controller(defers_prefill=True, stale_after=16,
                                            explore_budget=0.05), 16))
    for tokens in (2048, 8192, 32768):
        p.observe(PrefillTime(tokens, 0.005 + tokens * 60e-6, draft=True))
        p.observe(PrefillTime(tokens, 0.005 + tokens * 24e-6, draft=False))
    p.observe(Admitted(65536))
    p.observe(accepted(Mode.SPEC, np.full(16, 3.0)))
    p.exchange(lambda v: v)
    inputs = PolicyInputs(16, 16, 16)
    assert p.decide(inputs).mode is Mode.DECODE
    priced_out_explored = False
    for step in range(200):
        d = p.decide(inputs)
        spec, decode = p.state().spec_goodput, p.state().decode_goodput
        p.commit(d)
        if d.reason is Reason.EXPLORE and d.mode is Mode.SPEC:
            priced_out_explored = spec < decode
            break
        p.observe(StepTime(d.mode, 16, (t_spec if d.mode is Mode.SPEC else t_decode)(16)))
        p.observe(accepted(d.mode, np.full(16, 3.0 if d.mode is Mode.SPEC else 1.0)))
        if (step + 1) % p.sync_every == 0:
            p.exchange(lambda v: v)
    assert priced_out_explored


# ---------------------------------------------------------------- exploration


def test_exploration_stays_within_its_budget_and_heals_a_stale_estimate():
    budget = 0.02
    assert best_mode(48, 3.0) is Mode.DECODE and best_mode(48, 4.0) is Mode.SPEC
    for accept in (3.0, 2.0):
        sim = SimServer(controller(replay_prior(), explore_budget=budget, stale_after=64),
                        accept=lambda s: accept)
        sim.run(48, 200)
        sim.seconds = sim.tokens = 0.0
        sim.run(48, 3000)                # decode wins, spec would at the best acceptance
        if accept == 3.0:
            assert sum(r is Reason.EXPLORE for r in sim.reasons[200:]) > 0
        # The budget caps the time lost to re-measuring, not the number of steps: a spec
        # step 2-3x a decode step's length costs that much more of it.
        lost = 1.0 - sim.tokens / sim.seconds / (48 / t_decode(48))
        assert lost <= budget + 0.002, (accept, lost)
    # No exploration at all with a zero budget.
    quiet = SimServer(controller(replay_prior(), explore_budget=0.0), accept=lambda s: 3.0)
    quiet.run(48, 1000)
    assert all(r is not Reason.EXPLORE for r in quiet.reasons[50:])


def _windows(p: GoodputController, mode: Mode, seconds: float, windows: int) -> None:
    """`windows` exchanges of 8 steps of `mode` at bs 16, each taking `seconds`."""
    for _ in range(windows):
        for _ in range(8):
            p.commit(Decision(mode, Reason.GOODPUT))
            p.observe(StepTime(mode, 16, seconds))
        p.exchange(lambda v: v)


def test_a_slow_spell_that_ended_a_modes_run_fades_while_the_mode_is_not_run():
    """A host spell (steps 1.4x) at the end of speculation's run: its estimate reads the spell
    while it runs, then relaxes toward its typical level while decode runs. A spell as long as
    the windows that make that level is the level: it stays."""
    for spell_windows, after in ((3, 1.0), (16, 1.4)):
        p = controller()
        _windows(p, Mode.SPEC, t_spec(16), 12)
        _windows(p, Mode.SPEC, 1.4 * t_spec(16), spell_windows)
        assert p.step_time(Mode.SPEC, 16) > 1.3 * t_spec(16)
        _windows(p, Mode.DECODE, t_decode(16), 60)
        assert p.step_time(Mode.SPEC, 16) == pytest.approx(after * t_spec(16), rel=0.02)


def test_a_stall_seen_for_a_few_steps_fades_sooner_than_a_spell_seen_for_long():
    """A stall of 8 steps at 2x (on the H200, bs-4 spec steps at 13 ms for 7 steps, 6.7 ms
    steady) fades within ~2 exchanges of the other mode: at a fixed 128-step pace it still
    priced speculation ~65% dear 32 steps on, which kept decode for 52 steps. A spell seen for
    48 steps is expected to last about as long, and fades at that pace."""
    def after_decode(spell: float, windows: int) -> float:
        p = controller()
        _windows(p, Mode.SPEC, t_spec(16), 12)
        _windows(p, Mode.SPEC, spell * t_spec(16), windows)
        _windows(p, Mode.DECODE, t_decode(16), 4)
        return p.step_time(Mode.SPEC, 16) / t_spec(16)
    stall, spell = after_decode(2.0, 1), after_decode(1.4, 6)
    assert stall < 1.15
    assert spell > 1.15
    # A mode that left at its level (a spell that ended while it still ran): what is left over
    # it, the EMA's trace of the spell, fades at the slow pace, as a gap of context or noise.
    p = controller()
    _windows(p, Mode.SPEC, t_spec(16), 12)
    _windows(p, Mode.SPEC, 1.4 * t_spec(16), 6)
    _windows(p, Mode.SPEC, t_spec(16), 1)
    left = p.step_time(Mode.SPEC, 16) / t_spec(16) - 1.0
    _windows(p, Mode.DECODE, t_decode(16), 4)
    assert p.step_time(Mode.SPEC, 16) / t_spec(16) - 1.0 == pytest.approx(
        left * math.exp(-32 / 128), rel=0.05)


def test_a_short_re_measurement_in_a_spell_fades_too():
    """A re-measurement of 4 steps split 2 + 2 over two exchanges (windows too short to make
    a typical level) in a spell (1.5x), long after speculation's estimate settled: it moves the
    estimate, which then relaxes back while decode runs."""
    p = controller()
    _windows(p, Mode.SPEC, t_spec(16), 12)
    _windows(p, Mode.DECODE, t_decode(16), 60)
    for _ in range(2):
        for _ in range(2):
            p.commit(Decision(Mode.SPEC, Reason.EXPLORE))
            p.observe(StepTime(Mode.SPEC, 16, 1.5 * t_spec(16)))
        _windows(p, Mode.DECODE, t_decode(16), 1)
    assert p.step_time(Mode.SPEC, 16) > 1.15 * t_spec(16)
    _windows(p, Mode.DECODE, t_decode(16), 60)
    assert p.step_time(Mode.SPEC, 16) == pytest.approx(t_spec(16), rel=0.02)


@pytest.mark.parametrize("bs,low", [(16, 1.2), (24, 1.2), (32, 1.5)])
def test_a_rise_in_acceptance_is_found_where_speculation_looked_hopeless(bs, low):
    # Re-measuring spec here costs more than the bank holds (its steps 2-3x a decode step's,
    # far from winning): it waits for a full bank and leaves a debt, but is never ruled out,
    # else the rise goes unseen for good.
    rise = 1400
    sim = SimServer(controller(replay_prior(), stale_after=128),
                    accept=lambda s: low if s < rise else 3.5)
    assert best_mode(bs, low) is Mode.DECODE and best_mode(bs, 3.5) is Mode.SPEC
    sim.run(bs, rise + 2000)
    assert settled(sim.modes) is Mode.SPEC
    assert Mode.SPEC in sim.modes[rise:rise + 1200]


def test_spec_is_not_explored_where_it_could_not_win_at_any_acceptance():
    p = _learned(controller(stale_after=1, explore_budget=0.5), 16)
    for _ in range(8):
        p.observe(accepted(Mode.SPEC, np.full(16, 1.0)))
    p.exchange(lambda v: v)
    slow = SimServer(p, accept=lambda s: 1.0)
    slow.run(16, 50)
    # Measured: spec at bs 16 would not win even at accept K+1 = 4 if it cost 6x; make it so,
    # over as many windows as make its typical level (one alone could be a slow spell).
    for _ in range(16):
        for _ in range(4):
            p.observe(StepTime(Mode.SPEC, 16, 6 * t_spec(16)))
        p.exchange(lambda v: v)
    assert 4.0 * 16 / p.step_time(Mode.SPEC, 16) < 16 / p.step_time(Mode.DECODE, 16)
    slow.run(16, 300)
    assert all(m is Mode.DECODE for m in slow.modes[-280:])
    beyond = SimServer(controller(replay_prior(), stale_after=16), accept=lambda s: 4.0)
    beyond.run(128, 300)                                 # beyond the spec pool
    assert all(m is Mode.DECODE for m in beyond.modes)


def test_decode_is_re_measured_only_where_a_faster_decode_step_could_win():
    # bs 2: at accept 4 a spec step (18.4 ms) costs 2.3 ms a token against decode's 5.05:
    # decode would need steps 55% faster than measured to win, so its stale estimate is left
    # alone; at accept 2.3 (4.0 ms a token) 21% faster, beyond _DECODE_DRIFT (on the H200 the
    # accept-2 cells re-measured decode at every size up to C=32 where speculation led by
    # 15-47%); at accept 2 (4.6 ms a token) a decode step 10% faster would win: re-measured.
    for accept, explores in ((4.0, False), (2.3, False), (2.0, True)):
        sim = SimServer(controller(replay_prior(), stale_after=16, explore_budget=0.05),
                        accept=lambda s, a=accept: a)
        sim.run(2, 600)
        assert settled(sim.modes) is Mode.SPEC
        explored = any(r is Reason.EXPLORE and m is Mode.DECODE
                       for m, r in zip(sim.modes[100:], sim.reasons[100:]))
        assert explored is explores, accept


# ---------------------------------------------------------------- tensor-parallel ranks


class ThreadAllReduce:
    """An all-reduce (mean) between ranks running in threads, as gloo's would be."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list[Optional[list[float]]] = [None] * world

    def reducer(self, rank: int) -> Callable[[list[float]], list[float]]:
        def reduce(vec: list[float]) -> list[float]:
            self.slots[rank] = list(vec)
            self.barrier.wait()
            mean = [sum(sums) / self.world for sums in zip(*self.slots)]
            self.barrier.wait()
            return mean
        return reduce


def test_two_ranks_with_different_timings_decide_the_same():
    """Each rank measures its own step times (rank 1 runs 20% slower, with other noise); they
    meet only in the planner's exchange. Over a load that wanders and an acceptance that
    drops, both ranks make every decision alike."""
    allreduce = ThreadAllReduce(2)
    traces: list[list] = [[], []]

    def rank(r: int) -> None:
        policy = controller(replay_prior())
        planner = StepPlanner(DispatchTable.build(SPEC, DECODE), policy,
                              reduce=allreduce.reducer(r))
        noise, load = random.Random(10 + r), random.Random(7)
        bs, backlog = 8, 0
        for step in range(1500):
            bs = min(max(1, bs + load.randint(-2, 2)), 64)
            rows = np.arange(bs)
            plan = planner.plan(bs, rows=rows, catch_up_tokens=backlog)
            traces[r].append(plan)
            t = (t_spec if plan.mode is Mode.SPEC else t_decode)(plan.padded_bs)
            seconds = t * (1.2 if r else 1.0) * (1 + 0.2 * noise.uniform(-1, 1))
            caught = backlog if plan.mode is Mode.SPEC else 0
            policy.observe(StepTime(plan.mode, plan.padded_bs, seconds, caught))
            a = (3.0 if step < 700 else 1.4) if plan.mode is Mode.SPEC else 1.0
            policy.observe(accepted(plan.mode, np.full(bs, a), rows))
            backlog = 0 if plan.mode is Mode.SPEC else backlog + bs

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(traces[0]) == len(traces[1]) == 1500
    assert traces[0] == traces[1]
    assert {p.mode for p in traces[0]} == {Mode.SPEC, Mode.DECODE}


def test_a_local_timing_reaches_no_decision_before_the_exchange():
    p = controller(replay_prior(), min_dwell_steps=0)
    probe = PolicyInputs(24, 24, 24)
    before = p.decide(probe)
    for _ in range(50):                           # this rank alone saw spec steps as slow
        p.observe(StepTime(Mode.SPEC, 24, 2.0 * t_spec(24)))
    assert p.decide(probe) == before
    assert p.step_time(Mode.SPEC, 24) == pytest.approx(replay_prior().latency(Mode.SPEC, 24))
    p.exchange(lambda v: v)
    assert p.step_time(Mode.SPEC, 24) > replay_prior().latency(Mode.SPEC, 24)


def test_the_planner_exchanges_at_the_same_steps_on_every_rank():
    calls = []
    p = controller(sync_every=5)
    planner = StepPlanner(DispatchTable.build(SPEC, DECODE), p,
                          reduce=lambda v: calls.append(len(calls)) or v)
    for _ in range(21):
        planner.plan(4)
    assert len(calls) == 4                         # before steps 5, 10, 15, 20


# ---------------------------------------------------------------- estimates and config


def test_unmeasured_sizes_follow_the_prior_scaled_by_measured_neighbours():
    p = controller(replay_prior())
    for pb in (8, 32):
        p.observe(StepTime(Mode.SPEC, pb, t_spec(pb)))
    p.exchange(lambda v: v)
    # 16 and 24 lie between: the prior's shape times the measured/prior ratio (here 1/0.35).
    assert p.step_time(Mode.SPEC, 16) == pytest.approx(t_spec(16), rel=1e-6)
    assert p.step_time(Mode.SPEC, 48) == pytest.approx(t_spec(48), rel=1e-6)
    assert p.step_time(Mode.SPEC, 5) is None        # not a captured size


def test_a_size_measured_a_few_times_high_leans_on_its_neighbours_until_it_has_its_own():
    """As on the H200: spec bs 16 measured twice at start-up at 7.9 ms, between bs 8 and 32
    measured hundreds of times at ~6.7; decode ran on at bs 16 and never re-measured it. Its own
    samples weigh count/8; the rest is its neighbours' line, and only downwards."""
    p = controller(replay_prior())
    for pb, seconds, n in ((8, 0.0068, 300), (32, 0.0066, 100), (16, 0.0079, 2)):
        for _ in range(n):
            p.observe(StepTime(Mode.SPEC, pb, seconds))
        p.exchange(lambda v: v)
    # A quarter its own 7.9 ms, three quarters its neighbours' ~7 (their fixed parts scaled by
    # the prior's ratio between the sizes): where speculation at accept 1.5 beats decode again.
    assert 0.0069 < p.step_time(Mode.SPEC, 16) < 0.0073
    # Six more samples of it: its own, whole.
    for _ in range(6):
        p.observe(StepTime(Mode.SPEC, 16, 0.0079))
    p.exchange(lambda v: v)
    assert p.step_time(Mode.SPEC, 16) == pytest.approx(0.0079, rel=1e-6)
    # Priced below its neighbours, a few samples stand: a size priced low is measured as soon
    # as its mode runs. At the edge of the measured sizes (one neighbour) they stand too.
    q = controller(replay_prior())
    for pb, seconds, n in ((8, 0.0068, 300), (32, 0.0066, 100), (16, 0.0060, 2), (48, 0.0090, 2)):
        for _ in range(n):
            q.observe(StepTime(Mode.SPEC, pb, seconds))
        q.exchange(lambda v: v)
    assert q.step_time(Mode.SPEC, 16) == pytest.approx(0.0060, rel=1e-6)
    assert q.step_time(Mode.SPEC, 48) == pytest.approx(0.0090, rel=1e-6)


def test_a_catch_up_at_a_size_that_leans_on_its_neighbours_costs_what_its_step_was_priced_under():
    """A step is priced at the lower line; the catch-up it carries is what the step took beyond
    that price, or a switch back would look cheaper than it is."""
    p = controller(replay_prior())
    for pb, seconds, n in ((8, 0.0068, 300), (32, 0.0066, 100), (16, 0.0079, 2)):
        for _ in range(n):
            p.observe(StepTime(Mode.SPEC, pb, seconds))
        p.exchange(lambda v: v)
    priced = p.step_time(Mode.SPEC, 16)
    assert priced < 0.0075
    for _ in range(4):
        p.observe(StepTime(Mode.DECODE, 16, 0.0051))
    p.observe(StepTime(Mode.SPEC, 16, 0.0079 + 0.002, catch_up_tokens=100))
    p.exchange(lambda v: v)
    assert p.catch_up_seconds(100) == pytest.approx(0.0079 + 0.002 - priced, rel=0.02)


def test_leaning_on_neighbours_never_raises_a_price_nor_follows_a_barely_measured_one():
    """Neighbours whose context rate is steeper than the size's own would price it above its own
    line at long contexts: the lower of the two counts. A neighbour measured a few times is no
    better known than the size itself: it is not leant on."""
    p = controller(replay_prior())
    for pb, base, rate in ((1, 0.006, 0.0), (8, 0.0055, 6e-7), (32, 0.0055, 6e-7),
                           (48, 0.007, 0.0)):
        for kv in range(0, 4000, 40):
            p.observe(StepTime(Mode.SPEC, pb, base + rate * kv, kv_tokens=kv))
        p.exchange(lambda v: v)
    for _ in range(2):
        p.observe(StepTime(Mode.SPEC, 16, 0.0075, kv_tokens=2000))
    p.exchange(lambda v: v)
    i = p._times.at[Mode.SPEC][16]
    for kv in (0, 2000, 8000, 20000):
        assert p.step_time(Mode.SPEC, 16, kv) <= p._times.line_times(i, kv)[0] + 1e-12
    assert p.step_time(Mode.SPEC, 16, 2000) < p._times.line_times(i, 2000)[0]
    q = controller(replay_prior())
    for pb, seconds, n in ((8, 0.0068, 300), (32, 0.0066, 3), (16, 0.0079, 2)):
        for _ in range(n):
            q.observe(StepTime(Mode.SPEC, pb, seconds))
        q.exchange(lambda v: v)
    assert q.step_time(Mode.SPEC, 16) == pytest.approx(0.0079, rel=1e-6)


def test_step_times_follow_the_context_the_batch_attends_over():
    """A spec step over long prompts costs several times one over short ones (attention reads
    every context token, K+1 query tokens a request and again in each draft stage). Measured
    only at long contexts, it must not be taken for the step at a short one: the cost per
    context token, fitted within each size, moves the estimate to the batch's context."""
    beta = {Mode.SPEC: 0.55e-6, Mode.DECODE: 0.03e-6}
    truth = {Mode.SPEC: t_spec, Mode.DECODE: t_decode}
    p = controller(replay_prior(), min_dwell_steps=0)
    # Long prompts (2k tokens a request, growing while they decode) at bs 16 and 32.
    for pb in (16, 32):
        for kv in range(pb * 2048, pb * 2048 + pb * 512, pb * 8):
            for mode in (Mode.SPEC, Mode.DECODE):
                p.observe(StepTime(mode, pb, truth[mode](pb) + beta[mode] * kv, kv_tokens=kv))
        p.exchange(lambda v: v)
    got = p.estimates().step_times.context_s_per_token
    assert got["spec"] == pytest.approx(beta[Mode.SPEC], rel=0.01)
    assert got["decode"] == pytest.approx(beta[Mode.DECODE], rel=0.01)
    short = 16 * 300
    assert p.step_time(Mode.SPEC, 16, short) == pytest.approx(
        t_spec(16) + beta[Mode.SPEC] * short, rel=0.01)
    # Between measured sizes, too: bs 24 follows its neighbours' lines.
    assert p.step_time(Mode.SPEC, 24, short) == pytest.approx(
        t_spec(24) + beta[Mode.SPEC] * short, rel=0.02)
    # So a short-prompt batch at accept 3 speculates (it wins there), a long one decodes.
    for _ in range(8):
        p.observe(accepted(Mode.SPEC, np.full(16, 3.0)))
    p.exchange(lambda v: v)
    assert best_mode(16, 3.0) is Mode.SPEC
    assert p.decide(PolicyInputs(16, 16, 16, kv_tokens=short)).mode is Mode.SPEC
    assert p.decide(PolicyInputs(16, 16, 16, kv_tokens=16 * 2300)).mode is Mode.DECODE


def test_each_size_keeps_its_own_cost_per_context_token():
    """Attention's cost per context token differs with the batch (a single sequence is latency-
    bound): each size fits its own where its contexts spread; a size seen at one context only
    borrows its mode's pooled rate."""
    p = controller(replay_prior())
    rate = {1: 1.8e-6, 32: 0.34e-6}
    for _ in range(3):
        for pb, r in rate.items():
            for per_request in (128, 256, 512, 1024, 2048):
                kv = pb * per_request
                p.observe(StepTime(Mode.SPEC, pb, t_spec(pb) + r * kv, kv_tokens=kv))
        p.observe(StepTime(Mode.SPEC, 8, t_spec(8) + 0.5e-6 * 8 * 300, kv_tokens=8 * 300))
        p.exchange(lambda v: v)
    steps = p.estimates().step_times.step_s["spec"]
    assert steps[1][4] == pytest.approx(1.8e-6, rel=0.01)
    assert steps[32][4] == pytest.approx(0.34e-6, rel=0.01)
    pooled = p.estimates().step_times.context_s_per_token["spec"]
    assert 0.34e-6 < pooled < 1.8e-6 and steps[8][4] == pytest.approx(pooled)
    assert p.step_time(Mode.SPEC, 1, 4096) == pytest.approx(t_spec(1) + 1.8e-6 * 4096)


def _short_and_long_context_history(exchanges: int) -> GoodputController:
    """Spec at bs 16 over 4-8k context tokens (0.40 us a token), at bs 32 over 2-30k (0.55)."""
    p = controller(replay_prior())
    for _ in range(exchanges):
        for per_request in (256, 320, 384, 448, 512):
            kv = 16 * per_request
            p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 0.40e-6 * kv, kv_tokens=kv))
        for kv in range(2048, 30721, 2048):
            p.observe(StepTime(Mode.SPEC, 32, t_spec(32) + 0.55e-6 * kv, kv_tokens=kv))
        p.exchange(lambda v: v)
    return p


def test_far_beyond_the_contexts_a_size_has_seen_its_modes_steeper_rate_takes_over():
    """Spec's cost per context token grows with the context: bs 16 measured over 256-512-token
    prompts (0.40 us a token there) reaches 32k-token batches at the mode's rate, fitted where
    contexts were long (0.55 us: H200 run 7 estimated 21.8 ms against 25-28 ms measured)."""
    p = _short_and_long_context_history(exchanges=3)
    own = p.estimates().step_times.step_s["spec"][16][4]
    assert own == pytest.approx(0.40e-6, rel=0.01)
    assert p.estimates().step_times.context_s_per_token["spec"] > 0.5e-6
    # Within the contexts it has seen, its own line; far beyond, the steeper pooled rate.
    assert p.step_time(Mode.SPEC, 16, 16 * 400) == pytest.approx(
        t_spec(16) + 0.40e-6 * 16 * 400, rel=1e-3)
    far = p.step_time(Mode.SPEC, 16, 16 * 2048)
    assert far > t_spec(16) + 0.40e-6 * 16 * 2048 + 0.1e-6 * 16 * 1024
    # A shallower pooled rate never lowers a size's own beyond its reach: bs 32's 0.55 us holds
    # far beyond its 2-30k tokens though bs 16 pulls the pooled rate below it.
    assert p.estimates().step_times.context_s_per_token["spec"] < 0.55e-6
    assert p.step_time(Mode.SPEC, 32, 32 * 4096) == pytest.approx(
        t_spec(32) + 0.55e-6 * 32 * 4096, rel=0.01)


def test_a_rate_fitted_over_a_few_noisy_steps_is_not_carried_far_beyond_them():
    """H200 run 8, accept 1.5: nine decode steps at bs 32 over 2-3.2k context tokens, one of
    them short after a prefill, fitted 0.34 us a token (+- 0.19); bs 128 over 130-150k read
    0.031. bs 64 at 131k (9.4 ms measured in run 7) was priced 36.9 ms and the worker
    speculated over a 131k-token wave. Beyond its contexts a size's own rate holds only where it
    stands two standard errors above its mode's pooled one."""
    p = controller(replay_prior())
    for kv, ms in ((2048, 4.44), (2080, 5.42), (3040, 5.18), (3072, 5.32), (3104, 5.26),
                   (3136, 5.35), (3168, 5.28), (3200, 5.28), (3232, 5.32)):
        p.observe(StepTime(Mode.DECODE, 32, ms * 1e-3, kv_tokens=kv))
    for kv in range(130_000, 150_000, 128):
        p.observe(StepTime(Mode.DECODE, 128, 6.5e-3 + 0.031e-6 * kv, kv_tokens=kv))
    p.exchange(lambda v: v)
    steps = p.estimates().step_times.step_s["decode"]
    assert steps[32][4] == pytest.approx(0.34e-6, rel=0.05)         # within its contexts
    pooled = p.estimates().step_times.context_s_per_token["decode"]
    assert pooled == pytest.approx(0.031e-6, rel=0.01)
    assert p.step_time(Mode.DECODE, 32, 3100) == pytest.approx(5.25e-3, rel=0.02)
    assert p.step_time(Mode.DECODE, 64, 131_072) < 11e-3
    assert p.step_time(Mode.DECODE, 32, 65_536) < 8e-3


def test_a_line_holds_at_least_out_to_the_context_it_was_last_measured_at():
    """Contexts that grew: a long history at 4-8k tokens keeps the decayed spread low while the
    recent mean (the line's anchor) moves to 24k; the estimate there is what was measured
    there, not the pooled rate's extrapolation from an older reach."""
    p = _short_and_long_context_history(exchanges=30)
    for _ in range(8):
        p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + 0.40e-6 * 24_000, kv_tokens=24_000))
    p.exchange(lambda v: v)
    est, _, _, kv, _ = p.estimates().step_times.step_s["spec"][16]
    assert p._times._ctx.reach(p._times.spec_at[16]) < kv       # the decayed spread lags
    assert p.step_time(Mode.SPEC, 16, int(kv)) == pytest.approx(est, rel=2e-3)


def test_a_size_not_measured_scales_only_its_neighbours_fixed_part_by_the_prior():
    """Spec measured at bs 1 only: bs 32's fixed part is bs 1's times the prior's ratio, its
    seconds per context token bs 1's as measured (scaling that too priced bs 32 over 300-token
    prompts at 63 ms, and speculation at bs 32 looked hopeless)."""
    p = controller(replay_prior())
    for _ in range(3):
        for kv in range(64, 1089, 64):
            p.observe(StepTime(Mode.SPEC, 1, t_spec(1) + 1.8e-6 * kv, kv_tokens=kv))
        p.exchange(lambda v: v)
    assert p.estimates().step_times.step_s["spec"][1][4] == pytest.approx(1.8e-6, rel=0.01)
    assert p.step_time(Mode.SPEC, 32, 0) == pytest.approx(t_spec(32), rel=0.01)
    assert p.step_time(Mode.SPEC, 32, 32 * 300) == pytest.approx(
        t_spec(32) + 1.8e-6 * 32 * 300, rel=0.01)


def test_the_context_rate_waits_for_contexts_far_enough_apart():
    """Contexts within a few tokens of each other give no rate: noise would pass for one."""
    p = controller(replay_prior())
    for i in range(64):
        kv = 4096 + (i % 8)
        p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + (1e-4 if i % 2 else 0.0), kv_tokens=kv))
    p.exchange(lambda v: v)
    assert p.estimates().step_times.context_s_per_token["spec"] == 0.0
    assert p.step_time(Mode.SPEC, 16, 0) == pytest.approx(t_spec(16) + 0.5e-4)


def test_no_context_rate_is_steeper_than_the_line_through_the_origin_and_the_step():
    """As at bs 128 on the H200 over HTTP: a few speculative steps over 37-41k context tokens
    fitted 4.8 us a token, and at 55k a step of 18.6 ms read 106 ms (here at bs 16). No step has a negative
    fixed part: at 1.5x the context a step costs at most 1.5x."""
    p = controller(replay_prior())
    for i in range(16):
        kv = 37_000 + 256 * i
        p.observe(StepTime(Mode.SPEC, 16, 0.0186 + 4.8e-6 * (kv - 37_000), kv_tokens=kv))
    p.exchange(lambda v: v)
    est, _, _, est_kv, slope = p.estimates().step_times.step_s["spec"][16]
    assert slope == pytest.approx(est / est_kv)
    assert p.step_time(Mode.SPEC, 16, 55_000) == pytest.approx(est * 55_000 / est_kv)
    assert p.step_time(Mode.SPEC, 16, 55_000) < 0.04


def test_a_few_steps_of_a_large_batch_give_no_context_rate_of_their_own():
    """HTTP run 4 at bs 105: four spec steps over 39.6-40.5k context tokens (such a batch adds
    ~315 a step) fitted a rate nine times the mode's, and a step read 23 ms at 52k where they
    took 18-19. Contexts spread less than a tenth of their mean take the mode's rate."""
    p = controller(replay_prior())
    for i in range(64):              # the mode's rate, from bs 16 over 4-20k tokens: 50 ns
        kv = 4096 + 256 * i
        p.observe(StepTime(Mode.SPEC, 16, 0.008 + 5e-8 * kv, kv_tokens=kv))
    p.exchange(lambda v: v)
    for i, t in enumerate((0.0186, 0.0195, 0.0194, 0.0198)):
        p.observe(StepTime(Mode.SPEC, 32, t, kv_tokens=39_600 + 315 * i))
    p.exchange(lambda v: v)
    slope = p.estimates().step_times.step_s["spec"][32][4]
    assert slope == pytest.approx(p.estimates().step_times.context_s_per_token["spec"], rel=0.05)
    assert p.step_time(Mode.SPEC, 32, 52_000) < 0.0205


def test_a_lone_stall_is_no_step_sample_two_in_a_row_are():
    """A step 7x its size's line (a GC pause, finished requests' host work: 135 ms among 19 ms
    steps on the H200) is held back; the size's next step, if as slow, is its cost now."""
    p = controller(replay_prior())
    p.observe(StepTime(Mode.SPEC, 16, t_spec(16)))
    p.exchange(lambda v: v)
    p.observe(StepTime(Mode.SPEC, 16, 7 * t_spec(16)))
    p.observe(StepTime(Mode.SPEC, 16, t_spec(16)))
    p.exchange(lambda v: v)
    assert p.step_time(Mode.SPEC, 16) == pytest.approx(t_spec(16))
    for _ in range(2):
        p.observe(StepTime(Mode.SPEC, 16, 4 * t_spec(16)))
    p.exchange(lambda v: v)
    assert p.step_time(Mode.SPEC, 16) > 1.4 * t_spec(16)


def test_dwell_yields_when_the_other_mode_is_far_cheaper():
    """Dwell keeps a mode through a near tie; a new workload whose batch the other mode serves
    far cheaper (long prompts arriving during a speculative run) switches at once."""
    p = _learned(controller(min_dwell_steps=8, margin=0.03), 16)
    for _ in range(8):
        p.observe(accepted(Mode.SPEC, np.full(16, 3.0)))
    p.exchange(lambda v: v)
    first = p.decide(PolicyInputs(16, 16, 16))
    p.commit(first)
    assert first.mode is Mode.SPEC
    # One step into the dwell: acceptance collapses (decode now ~2.5x cheaper a token).
    for _ in range(40):
        p.observe(accepted(Mode.SPEC, np.full(16, 1.0)))
    p.exchange(lambda v: v)
    assert p.decide(PolicyInputs(16, 16, 16)) == Decision(Mode.DECODE, Reason.GOODPUT)
    # A small gap inside the dwell is kept.
    q = _learned(controller(min_dwell_steps=8, margin=0.0), 16)
    tie = t_spec(16) / t_decode(16)
    for _ in range(8):
        q.observe(accepted(Mode.SPEC, np.full(16, 3.0)))
    q.exchange(lambda v: v)
    q.commit(q.decide(PolicyInputs(16, 16, 16)))
    for _ in range(200):
        q.observe(accepted(Mode.SPEC, np.full(16, tie * 0.95)))
    q.exchange(lambda v: v)
    assert q.decide(PolicyInputs(16, 16, 16)).reason is Reason.DWELL


def test_idle_gaps_are_not_step_samples():
    p = controller(replay_prior())
    p.observe(StepTime(Mode.DECODE, 8, t_decode(8)))
    p.exchange(lambda v: v)
    p.observe(StepTime(Mode.DECODE, 8, 30.0))      # the server sat idle before this result
    p.exchange(lambda v: v)
    assert p.step_time(Mode.DECODE, 8) == pytest.approx(t_decode(8))


@pytest.mark.parametrize("kw", [dict(margin=-0.1), dict(min_dwell_steps=-1),
                                dict(explore_budget=0.9), dict(explore_steps=0),
                                dict(ema_alpha=0.0), dict(sync_every=0), dict(num_draft_tokens=0)])
def test_bad_parameters_are_config_errors(kw):
    with pytest.raises(ConfigError):
        controller(**kw)


def test_a_fitted_catch_up_never_prices_negative():
    # A line fitted through noisy catch-ups may slope down; a catch-up still costs >= 0 s, so
    # neither the switch's amortisation nor an exploration's price can turn into a credit.
    p = controller(replay_prior())
    p._batch_costs.catch_up_fit = (0.002, -3e-6)
    assert p.catch_up_seconds(8000) == 0.0 and p.catch_up_seconds(100) > 0


def test_a_controller_with_no_captured_sizes_still_builds():
    p = GoodputController(ControllerConfig(num_draft_tokens=K), {}, None)
    assert p.decide(PolicyInputs(4, None, 4)).mode is Mode.DECODE


def test_with_cuda_graphs_off_both_modes_are_keyed_at_every_size_and_measured():
    """Graphs off (SGLang's --disable-cuda-graph): no pool captured a size, every step runs
    eagerly at its own. Keyed at no size, speculation could never be measured and the
    controller explored it for ever; step_sizes keys both modes at every size."""
    table = DispatchTable.build((), ())
    sizes = table.step_sizes(64)
    assert sizes == {Mode.SPEC: tuple(range(1, 65)), Mode.DECODE: tuple(range(1, 65))}
    assert DispatchTable.build(SPEC, DECODE).step_sizes(64) == {Mode.SPEC: SPEC,
                                                               Mode.DECODE: DECODE}
    policy = GoodputController(ControllerConfig(num_draft_tokens=K, max_rows=64), sizes, None)
    planner = StepPlanner(table, policy, graphs_enabled=False)
    modes = []
    for _ in range(400):
        plan = planner.plan(8, rows=np.arange(8))
        policy.observe(StepTime(plan.mode, plan.padded_bs,
                                (t_spec if plan.mode is Mode.SPEC else t_decode)(8)))
        policy.observe(accepted(plan.mode, np.ones(8), np.arange(8)))
        modes.append(plan.mode)
    assert settled(modes) is Mode.DECODE and modes.count(Mode.SPEC) < 40


def test_explore_cap_rules_out_the_dearest_re_measurements():
    """DGW_EXPLORE_CAP trades the guarantee for smoother short workloads: a re-measurement
    dearer than cap x the bank is never made; cheaper costly ones still run into debt."""
    p = controller(explore_budget=0.01, explore_steps=4, explore_cap=3.0)
    p.commit(Decision(Mode.DECODE, Reason.GOODPUT))
    bank, budget = 4.0, p._explorer.budget
    assert budget.affordable(3 * bank) and not budget.affordable(3 * bank + 0.1)
    assert controller(explore_cap=0.0)._explorer.budget.affordable(100 * bank)      # 0: no cap
    # A cap under one bank bounds the cheap ones too.
    below = controller(explore_cap=0.5)._explorer.budget
    assert below.affordable(0.5 * bank) and not below.affordable(0.5 * bank + 0.1)
    # Where rising acceptance needs a dear re-measurement (bs 48 from accept 2: a catch-up of
    # the draft's backlog, which grows while decoding), it goes unseen.
    rise = 1400
    capped = SimServer(controller(replay_prior(), stale_after=128, explore_cap=1.0),
                       accept=lambda s: 2.0 if s < rise else 3.5)
    capped.run(48, rise + 2000)
    assert all(m is Mode.DECODE for m in capped.modes[rise:])
    uncapped = SimServer(controller(replay_prior(), stale_after=128),
                         accept=lambda s: 2.0 if s < rise else 3.5)
    uncapped.run(48, rise + 2000)
    assert Mode.SPEC in uncapped.modes[rise:]


def test_a_costly_re_measurement_runs_into_debt_without_starving_the_cheap_ones():
    p = controller(explore_budget=0.01, explore_steps=4)
    bank, budget = 4.0, p._explorer.budget
    p.commit(Decision(Mode.DECODE, Reason.GOODPUT))              # decoding
    assert budget.affordable(bank) and budget.affordable(3 * bank)      # a full bank, no debt
    for _ in range(4):                                           # one costly re-measurement
        p.commit(Decision(Mode.SPEC, Reason.EXPLORE, 3 * bank))
    # Its price went into debt; the bank is untouched: a cheap one is still affordable, the
    # next costly one only once the debt is repaid by what the full bank cannot hold.
    assert budget.allowance == pytest.approx(bank) and budget.debt == pytest.approx(3 * bank - 0.03)
    shown = p.estimates().to_json()                              # /get_server_info
    assert (shown["explore_allowance_steps"], shown["explore_debt_steps"]) == (budget.allowance,
                                                                                budget.debt)
    assert budget.affordable(bank) and not budget.affordable(bank + 0.1)
    steps = 0
    while not budget.affordable(bank + 0.1):
        p.commit(Decision(Mode.DECODE, Reason.GOODPUT))
        steps += 1
    assert steps == pytest.approx(1197, abs=1)                   # 11.97 at 0.01 a step
    # A cheap one is paid from the bank, which refills at the budget's rate.
    p.commit(Decision(Mode.SPEC, Reason.EXPLORE, 3.0))
    assert budget.allowance == pytest.approx(1.0) and not budget.affordable(2.0)


def test_a_dearer_re_measurement_is_never_more_affordable():
    """_explore prices a re-measurement of speculation at its fewest steps first and stops
    where that is unaffordable: sound only if affordability falls with price, in every state
    of the budget (bank filling or full, in debt or not, capped or not)."""
    prices = np.linspace(0.0, 20.0, 81)
    for cap, allowance, debt in itertools.product((0.0, 0.5, 2.0), np.linspace(0.0, 4.0, 17),
                                                  (0.0, 1.0)):
        budget = ExploreBudget(4.0, cap)
        budget.allowance, budget.debt = float(allowance), debt
        ok = [budget.affordable(float(x)) for x in prices]
        assert ok == sorted(ok, reverse=True), (cap, allowance, debt)


def test_context_sums_decayed_lazily_fit_what_eager_decay_fits_across_a_rescale():
    """The context sums apply their decay lazily and rescale long before a stored sum of
    squares could overflow (long contexts, ~35k exchanges: hours of serving); each key's slope,
    reach and each mode's pooled slope stay those of sums decayed at every exchange, and an
    exchange without samples changes no slope."""
    rng = np.random.default_rng(0)
    lazy, eager, squares = ContextSums(3), np.zeros((6, 3)), np.zeros(3)
    modes = (Mode.SPEC, Mode.SPEC, Mode.DECODE)
    for exchange in range(36_000):
        lazy.decay()
        eager *= 0.99
        squares *= 0.99 ** 2
        if exchange % 3000 == 0 or exchange in (34_360, 35_990):
            for i in range(3):
                x = rng.uniform(20_000, 200_000, 8)
                y = 0.01 + (i + 1) * 1e-7 * x + rng.normal(0, 1e-4, 8)
                window = [y.sum(), 8.0, x.sum(), (x * x).sum(), (x * y).sum(), (y * y).sum()]
                lazy.add(i, modes[i], window)
                eager[:, i] += window
                squares[i] += 8.0
    sy, n, sx, sxx, sxy, syy = eager
    var, cov = sxx - sx * sx / n, sxy - sx * sy / n
    effective = n * n / squares
    error = np.sqrt((syy - sy * sy / n - cov * cov / var) / ((effective - 2) * var))
    for i in range(3):
        assert lazy.own(i) == pytest.approx(cov[i] / var[i], rel=1e-9)
        assert lazy.own_error(i) == pytest.approx(error[i], rel=1e-6)
        assert lazy.reach(i) == pytest.approx(sx[i] / n[i] + 2 * np.sqrt(var[i] / n[i]), rel=1e-9)
    assert lazy.pooled(Mode.SPEC) == pytest.approx(cov[:2].sum() / var[:2].sum(), rel=1e-9)
    assert lazy.pooled(Mode.DECODE) == pytest.approx(cov[2] / var[2], rel=1e-9)
    assert 1.5e-7 < lazy.pooled(Mode.SPEC) < 2e-7     # between the two sizes' true rates
    # Decayed far below one step, a key's own slope would give way to the pooled one (its
    # spread is weighed against at least one step); only an exchange with samples says so.
    slopes = [lazy.own(i) for i in range(3)]
    for _ in range(800):
        lazy.decay()
    assert [lazy.own(i) for i in range(3)] == slopes
    lazy.add(0, Mode.SPEC, [0.01, 1.0, 1000.0, 1e6, 10.0, 1e-4])
    assert lazy.own(1) is None and lazy.own(2) is None



def test_a_noisy_prior_never_prices_a_size_out_of_line_with_its_measured_neighbours():
    """An unmeasured size is read from its measured neighbours scaled by the start-up replay's
    ratio between the sizes. Replays are noisy (on the H200, spec bs 112 replayed 1.2x bs 128):
    the ratio is held between the same cost and one in proportion to the batch."""
    def noisy_prior(noisy: int, measured: tuple[int, ...]) -> GoodputController:
        lat = {GraphKey(Mode.SPEC, b): 0.35 * t_spec(b) for b in SPEC}
        lat[GraphKey(Mode.SPEC, noisy)] = 1.2 * lat[GraphKey(Mode.SPEC, 32)]
        lat |= {GraphKey(Mode.DECODE, b): 0.8 * t_decode(b) for b in DECODE}
        p = controller(CalibrationTable(lat, K))
        for pb in measured:
            for _ in range(8):
                p.observe(StepTime(Mode.SPEC, pb, t_spec(pb)))
        p.exchange(lambda v: v)
        return p

    assert noisy_prior(24, (32,)).step_time(Mode.SPEC, 24) == pytest.approx(t_spec(32))
    assert noisy_prior(2, (1,)).step_time(Mode.SPEC, 2) == pytest.approx(2 * t_spec(1))
    # A prior in line with the sizes is followed as before: neither bound is reached.
    assert noisy_prior(48, (16,)).step_time(Mode.SPEC, 24) == pytest.approx(
        t_spec(16) * t_spec(24) / t_spec(16))


def _commit(p: GoodputController, mode: Mode, steps: int, reason: Reason = Reason.GOODPUT) -> None:
    for _ in range(steps):
        p.commit(Decision(mode, reason))


def test_an_estimate_long_unmeasured_yields_to_its_re_measurement():
    """On the H200 the first spec steps at bs 16 of a process took 8.2 ms; 650 steps later a
    re-measurement read 7.1 ms. Weighed as one EMA step, the re-measurement left the estimate at
    7.8 and speculation written off for 66 more steps; aged by the steps without a sample, the
    old one yields. A key measured every step keeps its smoothing."""
    p = controller()
    for s in (0.0082, 0.0082):
        p.observe(StepTime(Mode.SPEC, 16, s))
    _commit(p, Mode.SPEC, 2)
    p.exchange(lambda v: v)
    _commit(p, Mode.DECODE, 650)
    for s in (0.0071, 0.0071):
        p.observe(StepTime(Mode.SPEC, 16, s))
    _commit(p, Mode.SPEC, 2, Reason.EXPLORE)
    p.exchange(lambda v: v)
    assert p.step_time(Mode.SPEC, 16) == pytest.approx(0.0071, rel=0.01)
    q = controller()
    for s in (0.0082,) * 8 + (0.0071,) * 2:
        q.observe(StepTime(Mode.SPEC, 16, s))
        _commit(q, Mode.SPEC, 1)
        if q._step % 8 == 0:
            q.exchange(lambda v: v)
    q.exchange(lambda v: v)
    assert q.step_time(Mode.SPEC, 16) == pytest.approx(0.0082 - 0.36 * 0.0011, rel=0.01)


def test_a_modes_slow_first_steps_do_not_price_it_out_where_it_wins():
    """As on the H200: speculation's first ~100 steps in the process ran 1.25x, so at bs 2 and
    accept 2 (spec 10% ahead once warm) the worker that judged it by them decoded. While a
    mode has run fewer than 128 steps and the other more, it is priced down toward its prior, to
    no less than measured / 1.3: the worker speculates through the warm-up and stays where
    speculation wins."""
    assert best_mode(2, 2.0) is Mode.SPEC
    sim = SimServer(controller(replay_prior()), accept=lambda s: 2.0, noise=0.03,
                    warm_spec_steps=100, warm_spec_factor=1.25)
    sim.run(2, 1200)
    assert sim.modes[100:].count(Mode.SPEC) > 0.95 * 1100
    # Where speculation loses by more than warm-up could explain, it is not chosen for it.
    assert best_mode(32, 2.0) is Mode.DECODE and t_spec(32) / 2 > 1.3 * t_decode(32)
    far = SimServer(controller(replay_prior()), accept=lambda s: 2.0, noise=0.03,
                    warm_spec_steps=100, warm_spec_factor=1.25)
    far.run(32, 1200)
    assert far.modes[100:].count(Mode.SPEC) < 0.05 * 1100
    # Slow for good, not warming up: it speculates at most through the warm-up, then decodes.
    slow = SimServer(controller(replay_prior()), accept=lambda s: 2.0, noise=0.03,
                     warm_spec_steps=10**9, warm_spec_factor=1.25)
    slow.run(2, 1200)
    assert settled(slow.modes, 500) is Mode.DECODE
    assert slow.modes.count(Mode.SPEC) < 128 + 0.05 * 1200


def test_decode_is_priced_as_measured_while_speculation_has_served_the_process():
    """On an H100 (accept 1.5, 256x256 C=32) the worker had speculated ~600 steps, decode ~4:
    priced as a mode warming up, decode bs 32 read its 6.6-ms graph replay against 7.27 ms
    measured, and the worker decoded 100 steps of a cell speculation won by 7% (0.966 of
    EAGLE-3). Only speculation's first steps in a process run slow (decode's first 40 ran no
    slower than its later ones in every traced process), so decode is never priced below what
    it measured."""
    prior = CalibrationTable({GraphKey(Mode.SPEC, 32): 0.0086, GraphKey(Mode.DECODE, 32): 0.0066},
                             K, source="graph replays")
    p = controller(prior)
    rows = np.arange(32)
    for step in range(600):
        p.observe(StepTime(Mode.SPEC, 32, 0.01015))
        p.observe(accepted(Mode.SPEC, np.full(32, 1.0 + step % 2), rows))
        _commit(p, Mode.SPEC, 1)
        if step % 8 == 7:
            p.exchange(lambda v: v)
    for _ in range(8):
        p.observe(StepTime(Mode.DECODE, 32, 0.00727))
        _commit(p, Mode.DECODE, 1)
    p.exchange(lambda v: v)
    assert p.decide(PolicyInputs(32, 32, 32, rows=rows)) == Decision(Mode.SPEC, Reason.GOODPUT)
    assert p.state().decode_goodput == pytest.approx(32 / 0.00727, rel=0.01)


def test_a_window_back_at_its_level_after_a_host_spell_is_taken_whole():
    """On an H100 (accept 1.5, 2048x64 C=1) a spell of the host ran spec bs-1 steps at 10-21 ms
    among 8.8-ms ones; that window lifted the estimate to 11.6 ms and decode won. The next
    window read 8.74 again, but as one EMA step of two samples it moved the estimate only to
    10.6, and the worker decoded 66 steps of a cell speculation won by 10%. A window back
    within its key's typical level while the estimate stands over it is taken whole; one still
    high, or one under an estimate at its level, is smoothed as usual."""
    def after(spell: tuple, then: tuple) -> float:
        p = controller()
        for step in range(96):
            p.observe(StepTime(Mode.SPEC, 1, 0.0088))
            _commit(p, Mode.SPEC, 1)
            if step % 8 == 7:
                p.exchange(lambda v: v)
        for s in spell:
            p.observe(StepTime(Mode.SPEC, 1, s))
        _commit(p, Mode.SPEC, 8)
        p.exchange(lambda v: v)
        for s in then:
            p.observe(StepTime(Mode.SPEC, 1, s))
        _commit(p, Mode.SPEC, 8)
        p.exchange(lambda v: v)
        return p.step_time(Mode.SPEC, 1)

    spell = (0.01342, 0.01073, 0.00877, 0.00711, 0.0209, 0.01745, 0.00996, 0.0088)
    assert after(spell, (0.00877, 0.00871)) == pytest.approx(0.00874)
    assert after(spell, (0.0105, 0.0105)) > 0.0108             # still high: smoothed
    assert after(spell, (0.00874,)) > 0.0108                    # one sample is no window
    quiet = (0.0088,) * 8
    assert after(quiet, (0.0084, 0.0084)) > 0.0086             # no spell: smoothed


def _cold_spec_8(spec_steps_between: int, *windows: tuple) -> float:
    """Spec bs 8's estimate when it was measured three times in speculation's first steps of
    the process (8.9 ms, 1.3x steady), then `spec_steps_between` spec bs-1 steps ran, then
    `windows` of bs-8 samples came, an exchange after each."""
    p = controller(replay_prior())
    _commit(p, Mode.DECODE, 100)
    for _ in range(3):
        p.observe(StepTime(Mode.SPEC, 8, 0.0089))
        _commit(p, Mode.SPEC, 1)
    p.exchange(lambda v: v)
    for _ in range(spec_steps_between):
        p.observe(StepTime(Mode.SPEC, 1, 0.0064))
        _commit(p, Mode.SPEC, 1)
    p.exchange(lambda v: v)
    for w in windows:
        for s in w:
            p.observe(StepTime(Mode.SPEC, 8, s))
            _commit(p, Mode.SPEC, 1)
        p.exchange(lambda v: v)
    return p.step_time(Mode.SPEC, 8)


def test_a_re_measurement_split_by_an_exchange_is_taken_whole():
    """On the H200 (run 27, accept 1.5 2048x64 C=1) spec bs 1 was known only from the
    process's first steps, 8.5 ms against 6.8 steady. A re-measurement's clean steps read 6.75
    and 6.79, but an exchange fell between them: one sample is no window to take whole, so each
    moved the estimate one EMA step, to 7.9, and decode served 51 steps of a round speculation
    won by 10%. A lone sample that would replace the estimate waits one exchange and joins the
    next window; with none to join it, it is smoothed then."""
    assert _cold_spec_8(200, (0.00675,), (0.00679,)) == pytest.approx(0.00677)
    assert _cold_spec_8(200, (0.00675,)) == pytest.approx(0.0089)       # held, not yet folded
    assert _cold_spec_8(200, (0.00675,), ()) == pytest.approx(0.0089 - 0.2 * (0.0089 - 0.00675))


def test_a_key_measured_only_in_the_first_steps_takes_its_next_window_whole():
    """A process's first steps run slow (on the H200 bs-1 spec steps 7.2-8.5 ms for ~35 steps,
    6.6 steady; on the CPU demo 12-13 ms, 8.3): a key measured only then takes its first window
    of two samples or more after them whole. One measured later ages as usual."""
    def re_measured(start: int) -> float:
        p = controller()
        _commit(p, Mode.DECODE, start)
        for _ in range(4):
            p.observe(StepTime(Mode.SPEC, 1, 0.0080))
            _commit(p, Mode.SPEC, 1)
        p.exchange(lambda v: v)
        _commit(p, Mode.DECODE, 100)
        for _ in range(2):
            p.observe(StepTime(Mode.SPEC, 1, 0.0066))
        p.exchange(lambda v: v)
        return p.step_time(Mode.SPEC, 1)

    assert re_measured(0) == pytest.approx(0.0066)
    assert re_measured(70) > 0.0069


def test_a_key_measured_only_while_its_mode_warmed_up_takes_its_next_window_whole():
    """On the H200 (run 22, m54) spec bs 8 was measured three times in speculation's first
    steps of the process, at 8.7-9.2 ms, 1.3x its steady 6.7; 570 steps later its next window
    moved the estimate only to 7.9, and decode served a cell where speculation was 9% faster.
    Once its mode has run _MODE_WARM_STEPS, such a key takes its first window whole; one
    whose mode is still warming up ages as usual. (With a prior: without one nothing is
    counted.)"""
    steady = (0.0067,) * 3
    assert _cold_spec_8(200, steady) == pytest.approx(0.0067)
    # One sample alone is no window: it waits to join the next.
    assert _cold_spec_8(200, (0.0070,), steady) == pytest.approx((0.0070 + 3 * 0.0067) / 4)
    assert _cold_spec_8(50, steady) > 0.0075


def test_after_a_re_measurement_the_mode_holds_until_its_step_times_are_exchanged():
    """A re-measurement's acceptance reaches the controller at once, its step times only at the
    next exchange: a lucky draw of acceptance must not buy a switch on the old step time. One
    that makes speculation far cheaper does (as dwell yields): on the CPU demo a request
    drawing 3.0 at c=1 waited six decode steps for the exchange."""
    p = _learned(controller(min_dwell_steps=0), 16)       # spec wins from accept 2.3 up
    for _ in range(8):
        p.observe(accepted(Mode.SPEC, np.full(16, 2.0)))
    p.exchange(lambda v: v)
    probe = PolicyInputs(16, 16, 16)
    _commit(p, Mode.DECODE, 1)
    assert p.decide(probe).mode is Mode.DECODE
    _commit(p, Mode.SPEC, p.config.explore_steps, Reason.EXPLORE)
    for _ in range(p.config.explore_steps):
        p.observe(accepted(Mode.SPEC, np.full(16, 4.0)))
    assert p.decide(probe) == Decision(Mode.DECODE, Reason.DWELL)
    p.exchange(lambda v: v)
    assert p.decide(probe) == Decision(Mode.SPEC, Reason.GOODPUT)

    def after_re_measuring(accept: float) -> Decision:
        q = _learned(controller(min_dwell_steps=0), 16)
        rows = np.arange(16)
        for _ in range(8):
            q.observe(accepted(Mode.SPEC, np.full(16, 2.0), rows))
        q.exchange(lambda v: v)
        _commit(q, Mode.DECODE, 1)
        _commit(q, Mode.SPEC, q.config.explore_steps, Reason.EXPLORE)
        q.observe(Admitted(16 * 64, rows))                   # new requests, unmeasured
        for _ in range(q.config.explore_steps):
            q.observe(accepted(Mode.SPEC, np.full(16, accept), rows))
        return q.decide(PolicyInputs(16, 16, 16, rows=rows))

    assert after_re_measuring(2.6) == Decision(Mode.DECODE, Reason.DWELL)
    assert after_re_measuring(3.5) == Decision(Mode.SPEC, Reason.GOODPUT)


def _balance(p: GoodputController) -> float:
    shown = p.estimates()
    return shown.explore_allowance_steps - shown.explore_debt_steps


def _probing(bs: int, draws: tuple, decode_steps: int, **kw) -> tuple[GoodputController,
                                                                      Decision]:
    """A controller that learnt both step times at `bs` and requests drawing `draws` in turn,
    admitted one request in place of the last, then decoded `decode_steps`, and the
    re-measurement of speculation it now starts (the newcomer makes acceptance stale after a
    quarter of the window, the step times are not)."""
    p = controller(min_dwell_steps=0, stale_after=64, **kw)
    rows = np.arange(bs)
    for mode, t in ((Mode.SPEC, t_spec), (Mode.DECODE, t_decode)):
        for _ in range(4):
            p.observe(StepTime(mode, bs, t(bs)))
    for a in draws:
        p.observe(accepted(Mode.SPEC, np.full(bs, a), rows))
    p.observe(Admitted(64, rows[-1:]))
    p.exchange(lambda v: v)
    _commit(p, Mode.DECODE, decode_steps)
    d = p.decide(PolicyInputs(bs, bs, bs, rows=rows))
    assert (d.mode, d.reason) == (Mode.SPEC, Reason.EXPLORE)
    p.commit(d)
    return p, d


def test_a_re_measurement_of_speculation_ends_once_its_acceptance_shows_it_cannot_win():
    """Acceptance stale, step times not: the first step's acceptance is what the re-measurement
    checks. Too low for speculation to win even two standard errors up, it ends there; high, it
    runs on. Where the estimates say it will end so, it is priced as one step; where they do
    not (requests drew 2, 3, 2, 3 at bs 24: 3.65 two errors up, spec wins from 2.6) it is priced
    whole, and the steps it did not run go back. On the CPU accept-shift run a re-measurement
    at acceptance 1 cost ~6 decode steps whole, and the one before a rise in acceptance left
    too little budget to find it within the phase."""
    for bs, draws in ((16, (1.0,) * 4), (24, (2.0, 3.0) * 2)):
        inputs = PolicyInputs(bs, bs, bs, rows=np.arange(bs))
        for accept, ends in ((1.0, True), (4.0, False)):
            p, d = _probing(bs, draws, decode_steps=20)
            balance = _balance(p)
            p.observe(accepted(Mode.SPEC, np.full(bs, accept), inputs.rows))
            nxt = p.decide(inputs)
            assert (nxt == Decision(Mode.DECODE, Reason.GOODPUT)) is ends, (bs, accept)
            p.commit(nxt)
            if ends:
                refunded = _balance(p) - balance - p.config.explore_budget    # a step's income
                one = _probing(bs, draws, 20, explore_steps=1)[1].price
                if bs == 16:                                # priced as one step, as it ran
                    assert refunded == pytest.approx(0, abs=1e-9)
                    assert d.price == pytest.approx(one)
                else:                                       # 3 of its 4 steps go back
                    assert refunded == pytest.approx(d.price - one, rel=0.05)
                assert p.decide(inputs).mode is Mode.DECODE


def _run_probe(history: tuple, draws,
               priced: Optional[int] = None) -> tuple[GoodputController, int, list, list]:
    """A re-measurement of speculation at bs 24 (speculation wins from ~2.6) after requests drew
    `history`, its steps drawing draws(i) (`priced`: as priced for that many steps): the
    controller, the steps it ran, and the budget's charges and incomes on the way, each with
    the steps the probe had run (the incomes less each step's share of the budget)."""
    bs = 24
    inputs = PolicyInputs(bs, bs, bs, rows=np.arange(bs))
    p, _ = _probing(bs, history, decode_steps=20)
    if priced is not None:
        p._explorer.probe.priced = priced
    charges, incomes = [], []
    budget = p._explorer.budget
    charge, earn = budget.charge, budget.earn
    budget.charge = lambda price: (charges.append((p._explorer.probe.ran, price)), charge(price))
    budget.earn = lambda amount: (incomes.append(amount), earn(amount))
    steps = 1
    for i in range(20):
        p.observe(accepted(Mode.SPEC, np.full(bs, draws(i)), inputs.rows))
        nxt = p.decide(inputs)
        if nxt.reason is not Reason.EXPLORE:
            p.commit(nxt)
            break
        p.commit(nxt)
        steps += 1
    return p, steps, charges, [a for a in incomes if a != p.config.explore_budget]


def test_a_re_measurement_that_leaves_the_answer_open_runs_on_a_round_at_a_time():
    """Near break-even (bs 24: speculation wins from ~2.6) steps drawing 2 and 3 by turns leave
    the answer open (2.5, two standard errors either side of 2.6): the re-measurement runs on,
    four steps at a time, each round charged once at its price a step, to three rounds at most.
    One drawing 4 each step is sure after its four; one drawing 1 ends at its first (CPU demo:
    four steps read 1.75 where requests accepted 2.01, break-even ~1.82, and kept decode)."""
    history = (2.0, 3.0) * 2
    _, steps, charges, _ = _run_probe(history, lambda i: 2.0 + i % 2)
    assert steps == 12 and [ran for ran, _ in charges] == [4, 8]     # two rounds, once each
    assert _run_probe(history, lambda i: 4.0)[1] == 4
    assert _run_probe(history, lambda i: 1.0)[1] == 1
    # Priced as ending after one step, it pays for steps 2-4 one by one as they run; a round
    # after that is paid once, not again step by step.
    _, steps, charges, _ = _run_probe(history, lambda i: 2.0 + i % 2, priced=1)
    assert steps == 12 and [ran for ran, _ in charges] == [2, 3, 4, 4, 8]
    # One step of 3 with the draws' spread not yet learnt: two standard errors down is below
    # any acceptance (1 is the floor), not a free speculative token.
    p, _ = _probing(24, history, decode_steps=20)
    p._acceptance._spread.draw_var = None
    p.observe(accepted(Mode.SPEC, np.full(24, 3.0), np.arange(24)))
    assert p.decide(PolicyInputs(24, 24, 24, rows=np.arange(24))).reason is Reason.EXPLORE
    # Ended by its acceptance inside a round, the round's steps it did not run go back.
    p, steps, charges, refunds = _run_probe(history, lambda i: 2.0 + i % 2 if i < 4 else 1.0)
    assert 4 < steps < 8 and [ran for ran, _ in charges] == [4]
    assert refunds == [pytest.approx(charges[0][1] * (8 - steps) / 4)]


def test_a_steady_batchs_acceptance_goes_stale_over_the_whole_window_a_newcomers_sooner():
    """Requests whose acceptance was seen drift slowly: a batch of only them is re-measured
    once acceptance is DGW_STALE_AFTER steps old, one holding a request admitted since after a
    quarter of that (on the H200 a decode cell of 256 steps at accept 1.5, C=48-128, re-measured
    speculation every ~70 steps over the same requests, 1.4-2% of the cell)."""
    def first_re_measurement(newcomer: bool) -> int:
        p = controller(min_dwell_steps=0, stale_after=64)
        rows = np.arange(16)
        p.observe(Admitted(64, rows))
        for mode, t in ((Mode.SPEC, t_spec), (Mode.DECODE, t_decode)):
            for _ in range(4):
                p.observe(StepTime(mode, 16, t(16)))
        for _ in range(4):
            _commit(p, Mode.SPEC, 1)
            p.observe(accepted(Mode.SPEC, np.full(16, 1.0), rows))
        p.exchange(lambda v: v)
        if newcomer:
            p.observe(Admitted(64, rows[-1:]))
        for step in range(200):
            # Step times stay fresh: only acceptance can go stale.
            p.observe(StepTime(Mode.SPEC, 16, t_spec(16)))
            p.observe(StepTime(Mode.DECODE, 16, t_decode(16)))
            d = p.decide(PolicyInputs(16, 16, 16, rows=rows))
            if d.reason is Reason.EXPLORE:
                return step
            p.commit(d)
        return 200

    assert 16 <= first_re_measurement(newcomer=True) < 32
    assert 64 <= first_re_measurement(newcomer=False) < 96


def test_a_re_measurement_priced_as_ending_early_pays_for_the_steps_it_runs_on():
    """Priced as one step (all requests drew 1), it sees acceptance 4 and runs whole: each step
    beyond the one priced is charged as it runs, so the budget still bounds what it costs."""
    p, _ = _probing(16, (1.0,) * 4, decode_steps=20)
    step_price, balance = p._explorer.probe.step_price, _balance(p)
    inputs = PolicyInputs(16, 16, 16, rows=np.arange(16))
    for _ in range(p.config.explore_steps - 1):
        p.observe(accepted(Mode.SPEC, np.full(16, 4.0), inputs.rows))
        d = p.decide(inputs)
        assert (d.mode, d.reason) == (Mode.SPEC, Reason.EXPLORE)
        p.commit(d)
    income = (p.config.explore_steps - 1) * p.config.explore_budget
    assert balance + income - _balance(p) == pytest.approx(3 * step_price)


def test_the_steps_before_a_re_measurements_acceptance_is_seen_are_learnt():
    """Where a step's result is read after the next launch, a re-measurement's acceptance
    arrives after its second step: the next one expected to end early is priced as two."""
    p, d = _probing(16, (1.0,) * 4, decode_steps=20)
    inputs = PolicyInputs(16, 16, 16, rows=np.arange(16))
    p.commit(p.decide(inputs))                                   # its second step, launched
    p.observe(accepted(Mode.SPEC, np.full(16, 1.0), inputs.rows))      # the first's result
    p.commit(p.decide(inputs))                                   # ends it
    _commit(p, Mode.DECODE, 300)                                 # the bank refills
    again = p.decide(inputs)
    assert again.reason is Reason.EXPLORE
    assert again.price == pytest.approx(d.price + p._explorer.offer[1].step_price, rel=0.05)


def test_a_stale_step_time_is_judged_as_far_faster_as_it_may_have_drifted():
    """A step time not measured for DGW_STALE_AFTER steps may be what keeps speculation out
    (simulated, ended on acceptance alone one kept accept 3.5 at C=48 decoding at 0.83): it is
    judged 30% faster, as decode's is. At bs 16 acceptance 2.0 loses at the estimate (12.4 ms a
    token against 10.8) and wins at 0.7 of it (8.6): seen with a fresh step time it ends the
    re-measurement, with a stale one it runs whole; acceptance 1.0 ends either."""
    inputs = PolicyInputs(16, 16, 16, rows=np.arange(16))
    for decode_steps, accept, ends in ((20, 2.0, True), (80, 2.0, False), (80, 1.0, True)):
        p, _ = _probing(16, (accept,) * 4, decode_steps)
        for _ in range(p.config.explore_steps - 1):
            p.observe(accepted(Mode.SPEC, np.full(16, accept), inputs.rows))
            d = p.decide(inputs)
            p.commit(d)
            assert (d == Decision(Mode.DECODE, Reason.GOODPUT)) is ends, (decode_steps, accept)
            if ends:
                break


def test_one_low_step_ends_a_re_measurement_only_where_draws_are_seen_not_to_vary():
    """A step's draws count as one (SGLang's forced lengths give a whole batch one), its error
    that of a request's draws: requests drawing 1, 2, 1, 2 (SGLang's accept 1.5) leave a step
    of 1 two standard errors short of where speculation wins at bs 4 (1.95); requests that
    always draw 1 (the hard half of accept-shift) do not."""
    inputs = PolicyInputs(4, 4, 4, rows=np.arange(4))
    for draws, ends in (((1.0, 2.0) * 4, False), ((1.0,) * 8, True)):
        rows = np.arange(16)
        p = controller(min_dwell_steps=0, stale_after=64)
        for a in draws:                              # 16 requests' first draws: the spread
            p.observe(accepted(Mode.SPEC, np.full(16, a), rows))
        for mode, t in ((Mode.SPEC, t_spec), (Mode.DECODE, t_decode)):
            for _ in range(4):
                p.observe(StepTime(mode, 4, t(4)))
        p.observe(Admitted(4 * 64, inputs.rows))
        p.exchange(lambda v: v)
        _commit(p, Mode.DECODE, 20)
        d = p.decide(inputs)
        assert (d.mode, d.reason) == (Mode.SPEC, Reason.EXPLORE), draws
        p.commit(d)
        p.observe(accepted(Mode.SPEC, np.full(4, 1.0), inputs.rows))
        assert (p.decide(inputs).reason is Reason.GOODPUT) is ends, draws


def test_the_step_after_a_prefill_is_no_sample_unless_every_step_follows_one():
    """On the H200 the first step after a batch's prefill took 0.71x its size's median (its span
    began inside the prefill's; 1.07x mid-stream over HTTP), and at the lowest context of the
    batch it passed for a context rate. Every other one is taken, so a prefill before every
    step still leaves samples."""
    p = controller()
    p.observe(PrefillTime(4096, 0.08, draft=False))
    p.observe(StepTime(Mode.DECODE, 16, 0.0071))
    p.observe(StepTime(Mode.DECODE, 16, 0.010))
    p.exchange(lambda v: v)
    assert p.step_time(Mode.DECODE, 16) == pytest.approx(0.010)
    q = controller()
    for _ in range(8):
        q.observe(PrefillTime(256, 0.01, draft=False))
        q.observe(StepTime(Mode.DECODE, 16, 0.010))
    q.exchange(lambda v: v)
    assert q.estimates().step_times.step_s["decode"][16][1] == 4


def test_the_second_step_after_a_prefill_is_taken_back_when_the_next_reads_it_short():
    """Over the 19 GPU traces of H200 runs 20-24 and the H100 run, the second step after a
    prefill read under 0.9x its batch's later median in 31% of batches (steady steps: 4-7%). On
    the H100 one such (8.2 ms against 12.1) was one of spec bs 64's three samples and priced it
    10.8 ms. The next step of the key reading it 10% short takes it back; one that does not, or
    of another key, stays."""
    def after_prefill(*steps):
        p = controller()
        p.observe(PrefillTime(4096, 0.08, draft=False))
        for mode, t in steps:
            p.observe(StepTime(mode, 16, t))
        p.exchange(lambda v: v)
        return p

    held = (Mode.SPEC, 0.0062)                             # the first: held back as ever
    p = after_prefill(held, (Mode.SPEC, 0.0082), (Mode.SPEC, 0.0121), (Mode.SPEC, 0.0120))
    assert p.step_time(Mode.SPEC, 16) == pytest.approx(0.01205)
    assert p.estimates().step_times.step_s["spec"][16][1] == 2
    near = after_prefill(held, (Mode.SPEC, 0.0112), (Mode.SPEC, 0.0121))
    assert near.estimates().step_times.step_s["spec"][16][1] == 2      # within 10%: kept
    other = after_prefill(held, (Mode.SPEC, 0.0082), (Mode.DECODE, 0.0121))
    assert other.estimates().step_times.step_s["spec"][16][1] == 1     # not its key: kept


def test_after_a_prefill_the_step_is_held_as_the_prefills_not_as_a_carried_ones():
    """The step before a prefill holds the prefill's launch; the step after the prefill is held
    as the first after a prefill, so with a prefill before every step every other step is still
    a sample."""
    p = controller()
    p.observe(StepTime(Mode.DECODE, 16, 0.0101, carries_next=True))
    p.observe(PrefillTime(1024, 0.02, draft=False))
    p.observe(StepTime(Mode.DECODE, 16, 0.0070))          # held: the first after a prefill
    p.observe(PrefillTime(1024, 0.02, draft=False))
    p.observe(StepTime(Mode.DECODE, 16, 0.0104))          # taken: every other one is
    p.exchange(lambda v: v)
    assert p.step_time(Mode.DECODE, 16) == pytest.approx(0.0104)


def _switched_to_spec_with_a_catch_up(p: GoodputController, pb: int = 48) -> None:
    """Decode steps, the last holding the launch of a catch-up step into speculation."""
    for _ in range(4):
        p.observe(StepTime(Mode.DECODE, pb, 0.008))
    p.observe(StepTime(Mode.DECODE, pb, 0.030, carries_next=True))
    p.observe(StepTime(Mode.SPEC, pb, 0.009, catch_up_tokens=16448))


def test_the_step_after_a_catch_up_read_short_is_taken_back_by_the_next():
    """Under overlap the step after a catch-up often still starts inside its work: on the GPUs
    a quarter of them read over 10% short (H100 run 13: 9.0 ms, then 11.7 a step at spec bs 64).
    The next step of its key takes it back, so a re-measurement prices the mode as it runs."""
    p = controller()
    _switched_to_spec_with_a_catch_up(p)
    for s in (0.0090, 0.0117, 0.0117):
        p.observe(StepTime(Mode.SPEC, 48, s))
    p.exchange(lambda v: v)
    assert p.step_time(Mode.SPEC, 48) == pytest.approx(0.0117)


def test_the_step_after_a_catch_up_waits_through_an_exchange_for_the_next():
    """An exchange between the two steps does not fold the short one in: it waits in the next
    window for the next step of its key to say whether it stands."""
    p = controller()
    _switched_to_spec_with_a_catch_up(p)
    p.observe(StepTime(Mode.SPEC, 48, 0.0090))
    p.exchange(lambda v: v)
    assert p.step_time(Mode.SPEC, 48) is None
    for _ in range(2):
        p.observe(StepTime(Mode.SPEC, 48, 0.0117))
    p.exchange(lambda v: v)
    assert p.step_time(Mode.SPEC, 48) == pytest.approx(0.0117)


def test_without_overlap_the_step_after_a_catch_up_is_a_plain_sample():
    """An engine that runs each step to its end (the reference engine: no step holds the next
    one's launch) has no span to shift: there the step after a catch-up counts as it reads."""
    p = controller()
    for _ in range(4):
        p.observe(StepTime(Mode.DECODE, 48, 0.008))
    p.observe(StepTime(Mode.SPEC, 48, 0.040, catch_up_tokens=16448))
    for s in (0.0090, 0.0117):
        p.observe(StepTime(Mode.SPEC, 48, s))
    p.exchange(lambda v: v)
    assert p.estimates().step_times.step_s["spec"][48][1] == 2


def test_a_re_measurement_that_ended_folds_its_step_after_the_catch_up_at_once():
    """Its mode holds until the exchange after it: that exchange folds all it measured, the
    step after its catch-up too, rather than leave it for a next step of its key."""
    p = controller(explore_steps=2)
    for seconds in (0.008, 0.008, 0.008, 0.008, 0.030):
        p.commit(Decision(Mode.DECODE, Reason.GOODPUT))
        p.observe(StepTime(Mode.DECODE, 48, seconds, carries_next=seconds > 0.01))
    for seconds, caught_up in ((0.009, 16448), (0.0112, 0)):
        p.commit(Decision(Mode.SPEC, Reason.EXPLORE))
        p.observe(StepTime(Mode.SPEC, 48, seconds, catch_up_tokens=caught_up))
    p.exchange(lambda v: v)
    assert p.step_time(Mode.SPEC, 48) == pytest.approx(0.0112)


def test_the_step_after_a_catch_up_that_reads_as_the_next_is_a_sample():
    """One within 10% of the next stands, across an exchange too: the early steps are samples
    of their key wherever they are not short."""
    for exchange_between in (False, True):
        p = controller()
        _switched_to_spec_with_a_catch_up(p)
        p.observe(StepTime(Mode.SPEC, 48, 0.0112))
        if exchange_between:
            p.exchange(lambda v: v)
        p.observe(StepTime(Mode.SPEC, 48, 0.0118))
        p.exchange(lambda v: v)
        assert p.estimates().step_times.step_s["spec"][48][1] == 2, exchange_between


def test_a_batchs_last_step_cut_short_and_the_long_one_before_it_are_no_samples():
    """Under overlap a batch's last step is launched before its requests are seen finished: the
    step before it holds their work (1.45x its size's median on the H200), the last one is cut
    short (0.07-0.6x). Both are held back, and a short last step alone after a switch too."""
    p = controller()
    for _ in range(8):
        p.observe(StepTime(Mode.DECODE, 48, 0.006))
    p.exchange(lambda v: v)
    for s in (0.006, 0.006, 0.0115, 0.0004):
        p.observe(StepTime(Mode.DECODE, 48, s))
    p.observe(StepTime(Mode.SPEC, 48, 0.0147, carries_next=True))
    p.observe(StepTime(Mode.DECODE, 48, 0.0004))
    p.exchange(lambda v: v)
    assert p.step_time(Mode.DECODE, 48) == pytest.approx(0.006)
    assert p.estimates().step_times.step_s["decode"][48][1] == 10


def test_a_cut_short_step_is_no_first_sample_of_a_size_not_measured_yet():
    """H100 run 14's warm-up: the first decode steps at bs 64 came after a switch, the one the
    switch launched late (17.9 ms) and then one cut short (0.52 ms). Judged on its neighbours'
    line, the short one is held back; taken, it priced decode at bs 64 16x too cheap and every
    true step after it (8 ms) read as an idle gap, for 256 steps."""
    p = controller()
    for _ in range(8):
        p.observe(StepTime(Mode.DECODE, 2, 0.0064))
        p.observe(StepTime(Mode.SPEC, 64, 0.0120))
    p.exchange(lambda v: v)
    p.observe(StepTime(Mode.SPEC, 64, 0.0119, carries_next=True))
    p.observe(StepTime(Mode.DECODE, 64, 0.0179))
    p.observe(StepTime(Mode.DECODE, 64, 0.00052))
    p.exchange(lambda v: v)
    assert p.estimates().step_times.step_s["decode"].get(64, (None, 0))[1] == 0
    for _ in range(8):
        p.observe(StepTime(Mode.DECODE, 64, 0.0081))
    p.exchange(lambda v: v)
    assert p.step_time(Mode.DECODE, 64) == pytest.approx(0.0081)


def test_a_key_whose_line_reads_far_too_high_heals_from_its_short_steps():
    """A short step is held back only alone: where a size's line reads three times its steps
    (a step measured over a long context, the batch now over short ones), two short steps in a
    row are its cost, and the estimate comes down."""
    p = controller()
    for _ in range(4):
        p.observe(StepTime(Mode.SPEC, 48, 0.085))
    p.exchange(lambda v: v)
    for _ in range(50):
        for _ in range(8):
            p.observe(StepTime(Mode.SPEC, 48, 0.025))
        p.exchange(lambda v: v)
    assert p.step_time(Mode.SPEC, 48) == pytest.approx(0.025, rel=0.01)


def test_a_key_whose_line_reads_far_too_low_heals_from_its_long_steps():
    """A step 8x its size's line is an idle gap only alone: where the line reads far too low (two
    cut-short steps in a row taken as a new size's cost), two long steps in a row that its
    neighbours' line prices within 3x are its cost, and the estimate comes up (it read 0.5 ms
    for good before). Two idle gaps in a row at a size measured right stay gaps."""
    q = controller(replay_prior())
    for _ in range(4):
        for _ in range(8):
            q.observe(StepTime(Mode.DECODE, 8, t_decode(8)))
        q.exchange(lambda v: v)
    for _ in range(2):
        q.observe(StepTime(Mode.DECODE, 8, 30.0))
    q.exchange(lambda v: v)
    assert q.step_time(Mode.DECODE, 8) == pytest.approx(t_decode(8))
    p = controller()
    for _ in range(8):
        p.observe(StepTime(Mode.DECODE, 2, 0.0064))
    p.exchange(lambda v: v)
    for _ in range(2):
        p.observe(StepTime(Mode.DECODE, 64, 0.0005))
    p.exchange(lambda v: v)
    assert p.step_time(Mode.DECODE, 64) == pytest.approx(0.0005)
    for _ in range(4):
        for _ in range(8):
            p.observe(StepTime(Mode.DECODE, 64, 0.0081))
        p.exchange(lambda v: v)
    assert p.step_time(Mode.DECODE, 64) == pytest.approx(0.0081, rel=0.01)


def test_a_key_unmeasured_for_hours_has_no_standard_error_not_a_division_by_zero():
    """Its decayed squared weights underflow several rescales before its weights do."""
    sums = ContextSums(2)
    x = np.arange(64, 64 * 17, 64, dtype=float)
    y = 0.005 + 1e-7 * x
    sums.add(0, Mode.SPEC, [y.sum(), 16.0, x.sum(), (x * x).sum(), (x * y).sum(),
                            (y * y).sum()])
    assert sums.own_error(0) < 1e-9
    for _ in range(45_000):                       # ~6 rescales, ~360k steps
        sums.decay()
    sums.add(1, Mode.SPEC, [0.01, 1.0, 1000.0, 1e6, 10.0, 1e-4])
    assert sums.squares[0] == 0.0 and sums.sums[1][0] > 0
    assert sums.own_error(0) == float("inf")


def test_an_eager_step_ends_its_modes_run_for_the_next_catch_up():
    """A step no graph key holds (eager: a batch beyond the pools) still ends its mode's run:
    a catch-up after an eager decode step is a switch's, not one inside a speculative run."""
    from types import SimpleNamespace

    from dual_graph_worker.core.intake import SampleIntake

    times = SimpleNamespace(at={Mode.SPEC: {8: 0}, Mode.DECODE: {8: 1}},
                            line_times=lambda i, kv: (0.01, 0.01), samples=[1.0, 1.0],
                            add=lambda i, x, y: None)
    kinds = []
    costs = SimpleNamespace(add_catch_up=lambda at_switch, x, y: kinds.append(at_switch),
                            catch_up_ceiling=lambda tokens: None)
    intake = SampleIntake(times, costs)
    for mode, padded, catch_up in ((Mode.SPEC, 8, 0), (Mode.DECODE, 512, 0),
                                   (Mode.SPEC, 8, 100)):
        intake.step(StepTime(mode, padded, 0.015, catch_up_tokens=catch_up, bs=8))
    assert kinds == [True]


def test_catch_up_work_counts_pass_by_pass():
    """Full passes and a last pass of split_from and more are split; a shorter last pass runs
    the whole layer; a work description that cannot hold is refused."""
    work = CatchUpWork(2048, 0.25, 8192)
    assert work.tokens(1000) == 1000
    assert work.tokens(3000) == pytest.approx(750)
    assert work.tokens(8192 + 1000) == pytest.approx(2048 + 1000)
    assert work.tokens(2 * 8192 + 4096) == pytest.approx(4096 + 1024)
    assert not work.fills(2047) and work.fills(2048) and work.fills(20_000)
    for bad in ((2048, 0.0, 8192), (4096, 0.25, 2048), (2048, 0.25, 4095), (0, 0.25, 8192)):
        with pytest.raises(ValueError, match="split_from"):
            CatchUpWork(*bad)


def test_a_kv_filling_catch_up_is_a_spike_only_beyond_the_whole_layers_bound():
    """The intake holds back a lone catch-up dearer than the draft alone can be (here 2 us a
    token: twice the draft's share of a prefill token). A catch-up that fills K/V alone is
    never dearer than the whole layer over its tokens, so that is its bound too: catch-ups at
    switches of 20k-60k tokens at 1 us a token are their cost and fit their line; 300 ms for
    60k after them is a spike, held back once, and taken the second time."""
    work = CatchUpWork(2048, 0.25, 100_000)
    p = _learned(controller(defers_prefill=True, catch_up_work=work, draft_share=0.04), 16)
    for _ in range(6):
        p.observe(PrefillTime(8192, 8192 * 25e-6, draft=True))
        p.observe(PrefillTime(8192, 8192 * 24e-6, draft=False))
        p.exchange(lambda v: v)

    def catch_up(tokens: int, seconds: float) -> None:
        p.observe(StepTime(Mode.DECODE, 16, t_decode(16)))
        p.observe(StepTime(Mode.SPEC, 16, t_spec(16) + seconds, catch_up_tokens=tokens))
        p.exchange(lambda v: v)

    for tokens in (16, 1000, 16, 1000):
        catch_up(tokens, 2e-3 + tokens * 1e-6)
    whole = p.catch_up_s_per_token()
    for tokens in (20_000, 60_000, 40_000, 20_000):
        catch_up(tokens, 2e-3 + tokens * 1e-6)
    assert p.catch_up_seconds(60_000) == pytest.approx(0.062, rel=0.01)
    assert p.catch_up_s_per_token() == pytest.approx(whole)
    catch_up(60_000, 0.3)
    assert p.catch_up_seconds(60_000) == pytest.approx(0.062, rel=0.01)
    catch_up(60_000, 0.3)
    assert p.catch_up_seconds(60_000) > 0.08


def test_a_single_rank_skips_the_wire_and_decides_as_through_it():
    """The planner's default reducer (same_rank) folds a rank's records as they are; a
    reducer that hands back a copy sends them through the flat vector. Over switches,
    catch-ups and prefills both make every decision and every estimate alike."""
    def run(reduce) -> tuple[list, object]:
        policy = controller(replay_prior())
        planner = StepPlanner(DispatchTable.build(SPEC, DECODE), policy,
                              **({} if reduce is None else {"reduce": reduce}))
        noise, load = random.Random(3), random.Random(5)
        bs, backlog, plans = 8, 0, []
        for step in range(1200):
            bs = min(max(1, bs + load.randint(-3, 3)), 64)
            rows = np.arange(bs)
            if step % 97 == 0:
                policy.observe(PrefillTime(512 * (1 + step % 3), 0.01 * (1 + step % 3),
                                           draft=step % 2 == 0))
            plan = planner.plan(bs, rows=rows, catch_up_tokens=backlog, kv_tokens=300 * bs)
            plans.append(plan)
            t = (t_spec if plan.mode is Mode.SPEC else t_decode)(plan.padded_bs)
            caught = backlog if plan.mode is Mode.SPEC else 0
            policy.observe(StepTime(plan.mode, plan.padded_bs, t * (1 + 0.2 * noise.random())
                                    + 2e-6 * caught, caught, kv_tokens=300 * bs))
            a = (3.0 if step < 600 else 1.3) if plan.mode is Mode.SPEC else 1.0
            policy.observe(accepted(plan.mode, np.full(bs, a), rows))
            backlog = 0 if plan.mode is Mode.SPEC else backlog + bs
        return plans, policy.estimates()

    direct, wire = run(None), run(lambda vec: list(vec))
    assert direct == wire
    assert {p.mode for p in direct[0]} == {Mode.SPEC, Mode.DECODE}
