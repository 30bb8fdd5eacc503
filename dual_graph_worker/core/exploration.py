"""Re-measurement of the mode not chosen: when the other mode's estimates here are stale, what
re-measuring it costs, and a running re-measurement of speculation that ends once its acceptance
shows speculation cannot win (or runs on where it leaves the answer open); paid from a budget in
steps of the current mode: every step earns a share of one, every re-measurement is charged its
price. The goodput controller asks; its cost model judges which mode wins (`SpecWins`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from dual_graph_worker.core.acceptance import AcceptanceEstimate
from dual_graph_worker.core.batch_costs import BatchCosts
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import Decision, PolicyInputs, Reason
from dual_graph_worker.core.step_times import StepTimeTable

# An exploration step costs at least this share of a step: nothing is free.
_MIN_LOSS = 0.05
# A re-measurement of speculation ends once its acceptance so far, this many standard errors
# above its mean, still leaves speculation behind: its acceptance was what it was checking.
_PROBE_ERRORS = 2.0
# One whose acceptance leaves the answer open runs on, explore_steps at a time, up to this many
# times explore_steps in all, where each of its steps is priced at most _EXTEND_PRICE of a
# current step: near break-even its steps cost little, a wrong answer a lot.
_PROBE_MAX_ROUNDS = 3
_EXTEND_PRICE = 0.25
# How far a step time may have drifted since it was measured: a stale speculative one is judged
# this much faster.
_STEP_DRIFT = 0.3

# Whether spec steps of the given seconds at an acceptance beat decode steps by the margin, the
# prompt cost left out (accept, spec_t, decode_t, bs; None: a step time is unknown).
SpecWins = Callable[[float, Optional[float], Optional[float], int], Optional[bool]]
# Each mode's step seconds at a batch, (spec, decode); None where unknown.
StepPair = tuple[Optional[float], Optional[float]]
# The controller's step times at a batch: the spec key, the decode key, each mode's seconds as
# measured, and as the choice prices them (spec warming up). A plain tuple: made every step.
TimesHere = tuple[Optional[int], Optional[int], StepPair, StepPair]


@dataclass
class Probe:
    """A running re-measurement of speculation: its price per step, the steps priced and run,
    its steps' batch-mean acceptance (count, sum, sum of squares), and, where what it has seen
    at a round's end leaves the answer open (speculation wins at the top of its error, not at
    the bottom), the price a step it would run on at (`open_price`; None: not open)."""

    step_price: float
    priced: int
    drift: float = 1.0       # the share of its step time estimate it is judged at
    ran: int = 0
    seen: int = 0
    total: float = 0.0
    squares: float = 0.0
    open_price: Optional[float] = None

    def add(self, mean: float) -> None:
        self.seen += 1
        self.total += mean
        self.squares += mean * mean


class ExploreBudget:
    """At most one full-price re-measurement banked (`bank` steps): spent in a burst, more would
    cost more than the budget's share of a short workload. The first one is paid for. One
    costing more than the bank is paid from a second account, in debt, repaid by what the full
    bank cannot hold: it never starves the cheap ones, and the next costly one waits until the
    debt is paid. `cap`: DGW_EXPLORE_CAP, the dearest one allowed in banks (0: no cap)."""

    def __init__(self, bank: float, cap: float) -> None:
        self.bank = bank
        self.cap = cap
        self.allowance = bank
        self.debt = 0.0

    def earn(self, income: float) -> None:
        """The bank fills first; what it cannot hold repays the debt."""
        room = self.bank - self.allowance
        if income <= room:
            self.allowance += income
        else:
            self.allowance = self.bank
            self.debt = max(self.debt - (income - room), 0.0)

    def charge(self, price: float) -> None:
        if price > self.bank:
            self.debt += price
        else:
            self.allowance -= price

    def affordable(self, price: float) -> bool:
        """One costing more than the bank waits for a full bank and no debt, then goes into
        debt: rare, never ruled out (else acceptance rising where speculation looked hopeless
        goes unseen for good) unless it costs more than the cap, which bounds every price
        (each costs 2-5% of a short workload; docs/design.md weighs the two)."""
        if self.cap and price > self.cap * self.bank:
            return False
        if price > self.bank:
            return self.allowance >= self.bank and self.debt < 1e-9
        return self.allowance >= price


@dataclass(frozen=True)
class ExploreConfig:
    """The controller's knobs re-measurement reads (ControllerConfig's of the same names)."""

    num_draft_tokens: int
    explore_budget: float
    explore_steps: int
    explore_cap: float
    stale_after: int


class Explorer:
    """The re-measurements of one controller: their budget, the steps the running one has
    `left`, its `probe` where it re-measures speculation, the `offer` of one (a decision and
    its probe, until the next commit), the step each mode was last re-measured at, and the
    steps a re-measurement of speculation runs before its acceptance is seen (`sight`: 2 where
    results are read after the next step's launch). It reads the estimates, never writes them."""

    def __init__(self, config: ExploreConfig, times: StepTimeTable,
                 acceptance: AcceptanceEstimate, batch_costs: BatchCosts,
                 spec_wins: SpecWins) -> None:
        self.config = config
        self._times = times
        self._acceptance = acceptance
        self._batch_costs = batch_costs
        self._spec_wins = spec_wins
        self.budget = ExploreBudget(float(config.explore_steps), config.explore_cap)
        self.left = 0
        self.probe: Optional[Probe] = None
        self.offer: Optional[tuple[Decision, Probe]] = None
        self.sight = 1
        self._sight_from: Optional[int] = None      # the step the last one started, until seen
        self.explored_at = {Mode.SPEC: -math.inf, Mode.DECODE: -math.inf}
        # A host-cost early-out: below this allowance no re-measurement is priced (infinite:
        # exploration is off). Most cost more; one cut to its fewest steps, or into a much
        # shorter step, may wait a little.
        self._min_price = config.explore_steps * _MIN_LOSS if config.explore_budget > 0 \
            else math.inf

    # ------------------------------------------------------------------------------ ask

    def due(self, i: Optional[int], mode: Mode, rows: Optional[np.ndarray], step: int) -> bool:
        """Whether a re-measurement of `mode` at key i is worth pricing at `step`: the
        allowance could pay for the cheapest one, `mode` was not re-measured within the last
        stale_after // 4 steps (its samples may be on the way), and the key is stale (not
        measured lately; for spec, or no acceptance seen lately)."""
        if i is None or not self.budget.allowance >= self._min_price:
            return False
        window = self.config.stale_after
        if self.explored_at[mode] >= step - window // 4:
            return False             # re-measured lately; its samples may still be on the way
        if self._time_stale(i, step):
            return True
        if mode is not Mode.SPEC:
            return False
        # Acceptance: stale after the window over the requests it was seen on (they drift
        # slowly), after a quarter of it once a request admitted since has joined.
        seen = step - self._acceptance.seen_at
        return seen > window or (seen > window // 4 and self._acceptance.newcomers(rows))

    def _time_stale(self, i: int, step: int) -> bool:
        """Key i's step time not measured within the last stale_after steps."""
        return self._times.measured_at(i) < step - self.config.stale_after

    def explore(self, mode: Mode, key: Optional[int], loss: float, explored: Optional[float],
                t: float, inputs: PolicyInputs, accept: float, step: int) -> Optional[Decision]:
        """A re-measurement of `mode` if the budget allows one now. Its price, in steps of the
        current mode (so the budget is a share of step time, whichever mode is explored): the share
        of each of its steps the estimates expect to lose (`loss`, held between _MIN_LOSS and 1:
        nothing is free) times that step's length, plus the round trip's switches (into spec: a
        catch-up of the backlog, back to decode: a switch; into decode: a switch, back: a catch-up
        of what the draft missed meanwhile). So cheap re-measurements come often and costly ones
        rarely. One of speculation that ends early gets back the steps it did not run (_end_probe).
        `key`, `explored`, `t`: the key and step time here of `mode`, the current mode's time;
        `accept`: the batch's expected acceptance, as the controller read it at `step`."""
        if self.config.explore_budget <= 0:
            return None
        step_price = max(min(loss, 1.0), _MIN_LOSS)
        if t and explored:
            step_price *= explored / t
        steps = self.config.explore_steps
        entering = 0.0
        if t:
            missed = inputs.bs * steps if mode is Mode.DECODE else inputs.catch_up_tokens
            entering = (self._batch_costs.catch_up_seconds(missed) + self._batch_costs.switch_s) / t
        probe = None
        if mode is Mode.SPEC and self._times.measured(key) and explored:
            # Priced at its fewest steps first (a dearer one is no more affordable): a loaded
            # server that decodes finds most long shots unaffordable, so most stop here.
            fewest = min(self.sight, steps)
            if not self.budget.affordable(fewest * step_price + entering):
                return None
            # The first steps whose acceptance is too low end it (probe_lost), as they will if
            # the estimate is right; a step time not measured lately is judged as far faster as
            # it may have drifted (a stale one may be what keeps speculation out).
            drift = 1.0 - _STEP_DRIFT if self._time_stale(key, step) else 1.0
            high = self._steps_high(accept, 0.0, 1)
            if self._spec_wins(high, explored * drift, t, inputs.bs) is False:
                steps = fewest
            probe = Probe(step_price, steps, drift)
        price = steps * step_price + entering
        if not self.budget.affordable(price):
            return None
        decision = Decision(mode, Reason.EXPLORE, price)
        self.offer = None if probe is None else (decision, probe)
        return decision

    def judging(self) -> bool:
        """A re-measurement of speculation runs and has seen acceptance (probe_lost reads it)."""
        return self.probe is not None and self.probe.seen > 0

    def probe_lost(self, here: TimesHere, bs: int, step: int) -> bool:
        """The running re-measurement of speculation (judging) has seen acceptance too low for
        it to win here even at the top of its error; on a round's last step, also what running
        on would cost a step where the answer is still open (Probe.open_price). `here`: the
        controller's step times at this batch of `bs`."""
        p = self.probe
        mean = p.total / p.seen
        variance = (p.squares - p.seen * mean * mean) / (p.seen - 1) if p.seen > 1 else 0.0
        # At the prices the choice uses (warm-up's included), not those it was priced at: it
        # ends where the choice would not take speculation, so speculation warming up gets its
        # steps.
        spec_key, _, measured, chosen = here
        spec_t, decode_t = chosen
        high = self._steps_high(mean, variance, p.seen)
        if self._spec_wins(high, spec_t and spec_t * p.drift, decode_t, bs) is False:
            return True
        if self.left == 1:
            p.open_price = self._open_price(mean, high, spec_key, measured, bs, step)
        return False

    def _steps_high(self, mean: float, variance: float, steps: int) -> float:
        """The mean acceptance of `steps` steps, _PROBE_ERRORS standard errors up. A step counts
        as one draw (its requests' draws may share a cause: SGLang's forced lengths give a whole
        batch one), of variance no less than a request's draws are seen to vary (before that
        is learnt, the widest a draw in 1..K+1 can)."""
        draw_var = self._acceptance.draw_var
        floor = draw_var if draw_var is not None else (self.config.num_draft_tokens / 2.0) ** 2
        return mean + _PROBE_ERRORS * math.sqrt(max(variance, floor) / steps)

    def _open_price(self, mean: float, high: float, spec_key: Optional[int],
                    measured: StepPair, bs: int, step: int) -> Optional[float]:
        """A re-measurement's price a step to run on where its acceptance (`mean`, `high`
        _PROBE_ERRORS errors up) leaves the answer open, at this batch's step times as measured
        lately (the batch may have grown since it began, and a size priced from its neighbours or
        warming up is optimistic); None where the answer is not open."""
        spec_t, decode_t = measured
        if not self._times.measured(spec_key) or self._time_stale(spec_key, step) or \
                self._spec_wins(high, spec_t, decode_t, bs) is not True or \
                self._spec_wins(max(2.0 * mean - high, 1.0), spec_t, decode_t, bs) is not False:
            return None
        return max(1.0 - decode_t * mean / spec_t, _MIN_LOSS) * spec_t / decode_t

    # ------------------------------------------------------------------------------ record

    def ran(self, decision: Decision, step: int) -> None:
        """`step` committed to a re-measurement (`decision`, of the mode not current): the
        first step of one charges its price, a probe's steps beyond those priced are charged
        as they run, and an open probe's last step may buy another round (_extend_probe)."""
        self.budget.earn(self.config.explore_budget)
        offer, self.offer = self.offer, None
        if not self.left:
            self.left = self.config.explore_steps
            self.budget.charge(decision.price)
            self.explored_at[decision.mode] = step
            if decision.mode is Mode.SPEC:
                self._sight_from = step
                if offer is not None and offer[0] is decision:
                    self.probe = offer[1]
        self.left -= 1
        probe = self.probe
        if probe is not None:
            probe.ran += 1
            if probe.ran > probe.priced:                    # priced as ending early
                self.budget.charge(probe.step_price)
            if not self.left and probe.open_price is not None:
                self._extend_probe(probe)
            if not self.left:
                self.probe = None

    def stayed(self) -> None:
        """A step committed to anything but a re-measurement: a running one ends."""
        self.budget.earn(self.config.explore_budget)
        self.offer = None
        if self.probe is not None:
            self._end_probe()
        self.left = 0

    def accepted(self, total: float, n: int, step: int) -> None:
        """A speculative step's acceptance, `total` tokens over `n` requests, seen at `step`."""
        if self._sight_from is not None:
            self.sight = max(step - self._sight_from + 1, 1)
            self._sight_from = None
        if self.probe is not None:
            self.probe.add(total / n)

    def _extend_probe(self, p: Probe) -> None:
        """An open re-measurement near break-even (its open_price at most _EXTEND_PRICE) runs
        explore_steps more where the budget allows them at that price and it has run fewer than
        _PROBE_MAX_ROUNDS rounds."""
        steps = self.config.explore_steps
        price = steps * p.open_price
        if p.open_price > _EXTEND_PRICE or p.ran + steps > _PROBE_MAX_ROUNDS * steps or \
                not self.budget.affordable(price):
            return
        self.budget.charge(price)
        p.step_price, p.open_price = p.open_price, None     # its steps from here on
        p.priced = p.ran + steps
        self.left = steps

    def _end_probe(self) -> None:
        """A re-measurement of speculation ended early: the steps it was priced for and did not
        run go back (to the bank, or to the debt it went into)."""
        p, self.probe = self.probe, None
        self.budget.earn(p.step_price * max(p.priced - p.ran, 0))
