"""The goodput controller: each step runs the mode the server measured to be faster.

Per step it compares the expected seconds per output token of each mode at this batch, from
step times measured while serving (the start-up calibration is only the prior), each request's
expected accept length, the prompt share and the draft's prefill and catch-up costs; exploration
re-measures the mode not chosen within a step-time budget. Timings are rank-local and reach the
estimates only through `exchange`, so decisions read only rank-common values. docs/design.md,
"The controller", derives the cost model.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.settings import BY_KEY, Settings
from dual_graph_worker.core.modes import OTHER, Mode
from dual_graph_worker.core.regressions import (FAR_ERRORS, KEY_SLOTS, MIN_SPREAD, ContextSums,
                                                Slope)
from dual_graph_worker.core.policy import (Accepted, Admitted, Decision, DwellState,
                                           Observation, PolicyInputs, PolicyState, PrefillTime,
                                           Reason, Reducer, StepTime)

# A sample this many times the current estimate is an idle gap, not a step.
_OUTLIER = 8.0
# One this many times it is a stall (a GC pause, finished requests' host work), unless the key's
# next step is one too: then it is the key's cost now.
_SPIKE = 3.0
_NO_ESTIMATE_MAX_S = 2.0
# Per exchange, how much of the prompt/output token history is kept (~20 exchanges).
_WORKLOAD_DECAY = 0.95
# Acceptance: each observation's weight halves every ~22 steps, whatever mode ran meanwhile, so
# the first speculative steps after a long decode period speak for the present.
_ACCEPT_DECAY = 1.0 / 32.0
_ROW_ALPHA = 0.2
# The draws a request's EMA holds once past its first ones: its variance is one draw's times
# alpha / (2 - alpha).
_ROW_DRAWS = (2.0 - _ROW_ALPHA) / _ROW_ALPHA
_KEEP_SQ = (1.0 - _ROW_ALPHA) ** 2
# From this many rows a batch's expected acceptance weighs every measured request alike, as if
# its EMA were full: the batch's mean averages out what its requests' differing noise would
# change, and a per-row weight would cost a Python loop over the batch each step.
_POOLED_ROWS = 32
# Within 5% of a full EMA's noise (8 spec steps past the first draws) a row is weighed as full.
_FULL_NOISE = 1.05 / _ROW_DRAWS
_RUN_ALPHA = 0.3
# Catch-ups are rarer than prefills: their regression keeps ~100 exchanges of history.
_CATCH_UP_DECAY = 0.99
# Below this many tokens per catch-up, a catch-up's fixed cost (one more draft forward) hides
# its per-token rate: the plain ratio is no rate then.
_RATIO_MIN_TOKENS = 512
# A measured step time predicts no less than this share of itself at a shorter context.
_CONTEXT_FLOOR = 0.25
# An exploration step costs at least this share of a step: nothing is free.
_MIN_LOSS = 0.05
# A re-measurement of speculation ends once its acceptance so far, this many standard errors
# above its mean, still leaves speculation behind: its acceptance was what it was checking.
_PROBE_ERRORS = 2.0
# How far a size's step time may have drifted since it was measured (acceptance moves, step
# times barely do): a stale speculative step time is judged this much faster, and decode is
# re-measured only where a step _DECODE_DRIFT faster would win. Decode's steps hold steadier
# than speculation's (on the H200 a decode run's settling steps 0.999 of its later ones; spells
# slow speculation's host-bound steps far more): at 0.3 the accept-2 cells re-measured decode,
# 4 steps and a catch-up, at every size up to C=32, where speculation led by 15-47%.
_STEP_DRIFT = 0.3
_DECODE_DRIFT = 0.15
# While a key goes unmeasured an estimate above its typical level (the lower median of its last
# _TYPICAL_WINDOWS windows of _TYPICAL_MIN_COUNT samples or more) relaxes down toward it, by 1/e
# every _RELAX_STEPS steps; where its mode left in a spell (its latest windows ran _HIGH over
# that level), every as many steps as the spell was seen for (it is expected to last about as
# long), from _RELAX_MIN_STEPS on. A gap of a normal window (context, noise) keeps the slow pace.
# A host's slow spell (steps 1.2-1.5x for ~2 s on the H200) that ended a mode's last run no
# longer prices it out long after; a stall of 7 bs-4 spec steps at 2x priced it out for 52 steps
# at a fixed 128. A re-measurement's few settling steps fold into that level rather than replace
# it. Only down: an estimate too low makes its mode look cheap, so it runs and is measured.
# Windows older than _TYPICAL_HORIZON steps no longer count; within _SETTLED of its level a key
# is left alone until it is measured again.
_RELAX_STEPS = 128
_RELAX_MIN_STEPS = 16
_HIGH = 0.1
_TYPICAL_WINDOWS = 16
_TYPICAL_MIN_COUNT = 4
_TYPICAL_HORIZON = 4096
_SETTLED = 0.002
# A process's first steps run slow (on the H200 bs-1 spec steps 7.2-8.5 ms for ~35 steps, 6.6
# steady; on the CPU demo 12-13 ms, 8.3 steady): a key measured only then takes its first window
# of two samples or more after them whole.
_WARM_STEPS = 64
# A mode's first steps in a process can all run slow: on the H200 a process's first 40-120
# spec steps, whatever their size, 1.13-1.29x steady in 5 of 16 processes; where decode served,
# they came as sparse re-measurements that priced speculation out for minutes. Until a mode has
# run this many steps and the other has, the choice of mode prices its keys no higher than
# measured over the factor (nor lower than the prior): at most that many wrong steps, once.
# A key measured only while its mode had run fewer takes its first window after them whole
# where that comes lower (a bs-8 spec key's three cold samples, 1.3x steady, kept it priced out
# of a cell where it was 9% faster); a higher one, a batch's first steps or a spell, ages as usual.
_MODE_WARM_STEPS = 128
_MODE_WARM_FACTOR = 1.3
# A key's own samples weigh in proportion to their count up to this many; short of it, where
# sizes measured that often on both sides price it lower, the rest is their line.
_TRUSTED_SAMPLES = 8
# Dwell damps flapping near a tie; a batch the other mode serves this much cheaper is no tie.
_DWELL_BREAK = 1.25
# A measured key's step line: intercept, seconds per context token, the context that rate
# reaches, the rate beyond. A key's step time is a weighted sum of such lines, held to a floor.
_Part = tuple[float, float, float, float]
_Line = tuple[float, tuple[tuple[float, float, _Part], ...]]
# Local slots after the per-key ones: regressions (n, sum x, sum y, sum xx, sum xy
# with x = tokens, y = seconds) of prefills with and without the draft, of catch-ups at a
# switch back from decode, and of catch-ups inside a speculative run (after deferred prefills).
_PF = {True: 0, False: 5}
_CU = {True: 10, False: 15}
_SW = 20            # switches without a catch-up: count, sum of seconds
_TAIL = 22


# A request's estimate starts as the mean of its first draws: one draw is too noisy to speak for
# a request (or, as a new request's expectation, for the next ones).
_FIRST_DRAWS = 4
# Requests' spread of acceptance is learnt over the latest ~40 of them, and trusted from 8 on
# (until then each request's own estimate counts whole).
_SPREAD_ALPHA = 0.05
_SPREAD_MIN_REQUESTS = 8


def _moved(slope: float, t: float, x: float, kv: float) -> float:
    """A step of t seconds over x context tokens moved to kv along `slope`, no steeper than
    the line through the origin and that step."""
    return t + min(slope, t / max(x, 1.0)) * (kv - x)


def _time_on(line: _Line, kv_tokens: float) -> float:
    """A line's step seconds over `kv_tokens` context tokens."""
    floor, parts = line
    t = 0.0
    for fixed, rate, (a, b, reach, b_far) in parts:
        t += fixed * a + rate * b * kv_tokens
        if kv_tokens > reach:       # beyond the contexts its own rate has seen
            t += rate * (b_far - b) * (kv_tokens - reach)
    return max(t, floor)


def _blend(a: _Line, b: _Line, w: float) -> _Line:
    """w of line a and 1 - w of line b."""
    (floor_a, parts_a), (floor_b, parts_b) = a, b
    return (w * floor_a + (1.0 - w) * floor_b,
            tuple((w * f, w * r, part) for f, r, part in parts_a)
            + tuple(((1.0 - w) * f, (1.0 - w) * r, part) for f, r, part in parts_b))


def _total(v: np.ndarray) -> float:
    """A batch's sum (NaN if any is): below 32 values a Python sum of its list, since numpy's
    per-call cost (~1.5 us) outweighs the work there."""
    return sum(v.tolist()) if len(v) < 32 else float(np.add.reduce(v))


def _first_weight(requests: int) -> float:
    """The weight of `requests` first estimates in what a new request is expected to accept
    (each moves it as one request's EMA step does)."""
    return 1.0 - (1.0 - _ROW_ALPHA) ** requests


def _default(key: str):
    return BY_KEY[key].default


@dataclass(frozen=True)
class ControllerConfig:
    """The controller's knobs; those a server sets come from the DGW_* registry (settings.py),
    defaults included, through `from_settings`."""

    num_draft_tokens: int
    margin: float = _default("margin")
    min_dwell_steps: int = _default("min_dwell_steps")
    explore_budget: float = _default("explore_budget")
    explore_steps: int = _default("explore_steps")
    explore_cap: float = _default("explore_cap")
    stale_after: int = _default("stale_after")
    sync_every: int = _default("sync_every")
    ema_alpha: float = _default("ema_alpha")
    switch_horizon: int = _default("switch_horizon")
    # Decode-mode prefills skip the draft's prefill (lazy catch-up's deferral): only spec mode
    # pays the draft per prompt token.
    defers_prefill: bool = False
    max_rows: int = 0                 # request rows tracked for per-request acceptance
    draft_floor: bool = _default("draft_floor")
    # The draft's share of a prefill's weights (policies.draft_share): with draft_floor, a draft
    # token costs no less than that share of a prefill token, whatever small catch-ups fit.
    draft_share: float = 0.0

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if not (0 <= self.margin <= 1 and 0 <= self.explore_budget <= 0.5
                and 0 < self.ema_alpha <= 1):
            raise ConfigError("margin must be in [0, 1], explore_budget in [0, 0.5] and "
                              f"ema_alpha in (0, 1]; got {self.margin}, {self.explore_budget}, "
                              f"{self.ema_alpha}")
        if min(self.explore_steps, self.stale_after, self.sync_every, self.switch_horizon) < 1 \
                or self.min_dwell_steps < 0 or self.max_rows < 0:
            raise ConfigError("explore_steps, stale_after, sync_every and switch_horizon must be "
                              ">= 1, min_dwell_steps and max_rows >= 0")
        if not 0 <= self.draft_share < 1:
            raise ConfigError(f"draft_share must be in [0, 1), got {self.draft_share}")

    @classmethod
    def from_settings(cls, settings: Settings, num_draft_tokens: int, **engine: Any
                      ) -> "ControllerConfig":
        """`engine`: what the engine knows (defers_prefill, max_rows, draft_share)."""
        shared = {f.name: getattr(settings, f.name) for f in fields(cls) if f.name in BY_KEY}
        return cls(num_draft_tokens, **shared, **engine)


@dataclass
class _Probe:
    """A running re-measurement of speculation: its price per step, the steps priced, and its
    steps' batch-mean acceptance (count, sum, sum of squares)."""

    step_price: float
    priced: int
    drift: float = 1.0       # the share of its step time estimate it is judged at
    seen: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, mean: float) -> None:
        self.seen += 1
        self.total += mean
        self.squares += mean * mean


# A line not fitted since the last exchange.
_UNFIT: Any = object()


class GoodputController:
    """A ModePolicy; `sizes` are the captured batch sizes of each pool (the estimate table's
    keys), `prior` the start-up calibration or None."""

    def __init__(self, config: ControllerConfig, sizes: Mapping[Mode, Sequence[int]],
                 prior: Optional[CalibrationTable] = None) -> None:
        self.config = config
        # Keys are indices: spec sizes ascending, then decode sizes ascending.
        self._keys = [(m, int(b)) for m in (Mode.SPEC, Mode.DECODE) for b in sorted(sizes.get(m, ()))]
        self._at = {m: {b: i for i, (km, b) in enumerate(self._keys) if km is m}
                    for m in (Mode.SPEC, Mode.DECODE)}
        self._spec_at, self._decode_at = self._at[Mode.SPEC], self._at[Mode.DECODE]
        n_spec = len(self._spec_at)
        self._spans = {Mode.SPEC: range(0, n_spec), Mode.DECODE: range(n_spec, len(self._keys))}
        self._mode_of = [m for m, _ in self._keys]
        n = len(self._keys)
        self._prior = [math.nan] * n
        if prior is not None:
            for i, (m, b) in enumerate(self._keys):
                t = prior.latency(m, b)
                self._prior[i] = math.nan if t is None else float(t)
        # Shared estimates: read by decisions. A key's step time is its recent mean at its
        # recent mean context, moved along its seconds per context token (_key_slope).
        self._est = [math.nan] * n
        self._est_kv = [0.0] * n
        self._ctx = ContextSums(n)
        self._beta = {Mode.SPEC: 0.0, Mode.DECODE: 0.0}   # per mode, pooled over sizes
        self._samples = [0.0] * n
        self._last = [-math.inf] * n             # step of the last fold with samples
        self._mode_steps = {Mode.SPEC: 0, Mode.DECODE: 0}    # steps run in each, until both warm
        # The mode that has run fewer than _MODE_WARM_STEPS while the other has (_warm_times);
        # _warmed once both have, for good, or from the start without a prior to price against.
        self._cold: Optional[Mode] = None
        self._warmed = prior is None
        self._cold_keys = [False] * n           # measured only while its mode was warming up
        # Per key: its recent windows (mean seconds, mean context tokens, step) and their
        # typical level (seconds, context tokens).
        self._windows: dict[int, deque[tuple[float, float, int]]] = {}
        self._typical: dict[int, tuple[float, float]] = {}
        self._relaxing: set[int] = set()
        self._high_steps = [0.0] * n            # the latest samples over the typical level
        self._exchanged_at = 0
        self._prefill = {d: Slope(MIN_SPREAD["prefill"], _WORKLOAD_DECAY) for d in (True, False)}
        # Catch-ups at a switch carry the switch; those inside a speculative run do not.
        self._catch_up = {at_switch: Slope(MIN_SPREAD["catch_up"], _CATCH_UP_DECAY)
                          for at_switch in (True, False)}
        self._last_mode: Optional[Mode] = None    # rank-local: the last step's mode (switches)
        # Rank-local: the samples whose last one was held back as a lone outlier (_hold_lone):
        # a step key, or a catch-up kind (at a switch or not) and size (a power of two).
        self._held: set = set()
        # Rank-local: a prefill came since the last step; the last step was held back for one;
        # the last batch held the next one's launch; the last step's sample (key, context,
        # seconds, above its line) while in this window's sums; the key of the last step if it
        # was held back as short.
        self._after_prefill = self._held_after_prefill = self._after_carry = False
        self._last_sample: Optional[tuple[int, float, float, bool]] = None
        self._short: Optional[int] = None
        # Rank-local: the excess of a step that carried the next batch's launch, which belongs
        # to that batch (a catch-up's, a prefill's or a switch's cost); None when none is held.
        self._carry: Optional[float] = None
        self._carry_bs = 0
        # A switch without a catch-up (spec -> decode): decayed count and seconds.
        self._switches = self._switch_sum = self._switch_s = 0.0
        # Decayed prompt and output tokens, and requests that joined the running batch and
        # those of them that took a finished request's place: the prompt share counts only
        # those (a batch filling up admits prompts no future step pays for again). A place left
        # waits one exchange for its taker, then counts as the batch shrinking.
        self._prompt = 0.0
        self._output = 0.0
        self._joined = 0.0
        self._took_place = 0.0
        self._vacant = 0
        # Derived from the above at each exchange (they change nowhere else), read every step.
        self._prompt_per_output = 0.0
        self._delta = 0.0
        self._catch_up_fit: tuple[float, float] = (0.0, 0.0)    # (fixed s, s per token)
        self._catch_up_reach = math.inf     # tokens the fitted rate holds out to
        self._catch_up_far = 0.0            # s per token beyond them
        # Rank-local sums since the last exchange: never read by a decision. Step samples
        # gather in Python floats per key (a numpy slice update costs ~1 us a step).
        self._local = np.zeros(KEY_SLOTS * n + _TAIL)
        self._step_sums: dict[int, list[float]] = {}
        # Rank-common facts, applied at once.
        k1 = config.num_draft_tokens + 1.0
        # Decayed sums of accepted tokens and requests; an optimistic prior (K+1) of weight 1.
        self._accept_sum, self._accept_weight, self._accept_at = k1, 1.0, 0
        # Per request row: its estimate, NaN until _FIRST_DRAWS draws are in (their sum, sum of
        # squares and count meanwhile), in lists: a spec step reads and updates at most a few
        # dozen rows, where numpy's per-call cost outweighs the work. Its admissions (a reused
        # row holds a new request). The running batch's rows at the last exchange with theirs,
        # and the latest step's rows.
        rows = config.max_rows
        self._rows: Optional[list[float]] = [math.nan] * rows if rows else None
        self._draw_sum = [0.0] * rows
        self._draw_sq = [0.0] * rows
        self._draws = [0] * rows
        # Each row estimate's variance in units of one draw's: 1/_FIRST_DRAWS at first, toward
        # 1/_ROW_DRAWS as its EMA fills. A request that decodes keeps its first, noisier one.
        self._noise = [0.0] * rows
        self._admissions = np.zeros(rows, dtype=np.int64) if rows else None
        self._admitted_at = np.full(rows, -1, dtype=np.int64)     # _turnover's scratch
        # The step each row's request was admitted at: a batch holding one admitted since
        # acceptance was last seen has an acceptance nobody measured.
        self._admitted_step = np.full(rows, -1, dtype=np.int64)
        self._members: Optional[tuple[np.ndarray, np.ndarray]] = None
        self._batch_rows: Optional[np.ndarray] = None
        # What a request not measured yet is expected to accept: the first estimates of the
        # latest requests (per request, so one long phase of many steps does not outweigh the
        # requests that came after it). Optimistic until a request is measured.
        self._fresh = k1
        # Decayed sums over requests' first estimates (count, sum, sum of squares, the variance
        # of one draw within each, squared weights): how much requests surely differ beyond
        # their draws' noise (None until the spread is trusted: own estimates count whole), and
        # one draw's variance within a request. Together they weigh a request's own estimate
        # against all requests' (_own_weight).
        self._spread = [0.0] * 5
        self._differ: Optional[float] = None
        self._draw_var: Optional[float] = None
        self._full_weight = 1.0                  # _own_weight of a full EMA's noise
        self._prompt_window = 0.0
        self._output_window = 0.0
        # Decision state.
        self._dwell = DwellState()
        self._step = 0
        # At most one full-price re-measurement banked: spent in a burst, more would cost more
        # than the budget's share of a short workload.
        self._bank = float(config.explore_steps)
        self._allowance = self._bank           # the first re-measurement is paid for
        # A re-measurement costing more than the bank is paid from a second account, in debt,
        # repaid by what the full bank cannot hold: it never starves the cheap ones, and the
        # next costly one waits until the debt is paid.
        self._debt = 0.0
        self._explore_left = 0
        # The running re-measurement of speculation that may end early; the decision that would
        # start one and its state, until the next commit; the steps the last one ran before its
        # acceptance was seen (2 where results are read after the next step's launch), and the
        # step it started at until then.
        self._probe: Optional[_Probe] = None
        self._offer: Optional[tuple[Decision, _Probe]] = None
        self._sight = 1
        self._sight_from: Optional[int] = None
        # A re-measurement's acceptance is seen at once, its step times at the next exchange:
        # until then the current mode stays unless the other is far cheaper (as dwell yields).
        self._unfolded = False
        self._explored_at = {Mode.SPEC: -np.inf, Mode.DECODE: -np.inf}
        # Steps a mode has recently run between switches: a switch's catch-up is spread over
        # this, not over a fixed horizon, so flipping near a tie pays what it really costs.
        self._run_len = float(config.switch_horizon)
        self._costs: tuple[Optional[float], Optional[float]] = (None, None)   # spec, decode
        # Decisions are frozen values: the common ones are made once.
        self._decided = {(m, r): Decision(m, r) for m in Mode
                         for r in (Reason.GOODPUT, Reason.DWELL, Reason.EXPLORE,
                                   Reason.NO_SPEC_GRAPH)}
        self._goodput = {m: self._decided[m, Reason.GOODPUT] for m in Mode}
        # Per key, until the next exchange: its line, and the line it may lean on (_lean_line).
        self._lines: list = [_UNFIT] * n
        # A host-cost early-out: below this allowance no re-measurement is priced (infinite:
        # exploration is off). Most cost more; one into a much shorter step may wait a little.
        self._min_price = config.explore_steps * _MIN_LOSS if config.explore_budget > 0 \
            else math.inf

    # ------------------------------------------------------------------------------ decide

    def decide(self, inputs: PolicyInputs) -> Decision:
        decided = self._decided
        spec_bs = inputs.spec_padded_bs
        if spec_bs is None:
            return decided[Mode.DECODE, Reason.NO_SPEC_GRAPH]
        cur = self._dwell.mode
        if self._explore_left:
            if self._probe is not None and self._probe_lost(inputs):
                return self._goodput[cur]
            return decided[OTHER[cur], Reason.EXPLORE]
        from_decode = cur is Mode.DECODE
        # Each mode's step time here, looked up once: the re-measurement checks read them too.
        # _times_here, inline: a call and its tuples cost ~20 bytecodes on every step.
        spec_key = self._spec_at.get(spec_bs)
        decode_key = self._decode_at.get(inputs.decode_padded_bs)
        kv = inputs.kv_tokens
        measured = spec_t, decode_t = self._line_time(spec_key, kv), self._line_time(decode_key, kv)
        chosen_at = measured if self._cold is None else \
            self._warm_times(spec_key, decode_key, spec_t, decode_t, kv)
        accept = self.expected_accept(inputs.rows)
        spec, decode = self._costs = self._mode_costs(*chosen_at, accept, inputs, from_decode)
        if from_decode:
            here, there, here_t, there_t = decode, spec, decode_t, spec_t
            here_key, there_key = decode_key, spec_key
        else:
            here, there, here_t, there_t = spec, decode, spec_t, decode_t
            here_key, there_key = spec_key, decode_key
        other = OTHER[cur]
        stay = self._goodput[cur]
        # Until a re-measurement's step times are exchanged the mode holds, as it dwells, unless
        # the acceptance it saw at once already makes the other mode far cheaper.
        unfolded = self._unfolded
        if unfolded and (here is None or there is None):
            return decided[cur, Reason.DWELL]
        if here is None:
            # Nothing known of the current mode: measure it by staying.
            return decided[cur, Reason.EXPLORE]
        if there is None:
            return self._explore(other, there_key, 1.0, there_t, here_t, inputs) or stay
        if there * (1 + self.config.margin) < here:
            if (unfolded or self._dwell.must_dwell(self.config.min_dwell_steps)) and \
                    here < _DWELL_BREAK * there:
                return decided[cur, Reason.DWELL]
            return self._goodput[other]
        if unfolded:
            return decided[cur, Reason.DWELL]
        # Re-measure the other mode once this one is measured at this size (it is the
        # reference), when the other's estimate here is stale and could change the answer.
        if self._allowance >= self._min_price and self._measured(here_key) and \
                self._stale(there_key, other, inputs.rows):
            if chosen_at != measured:
                # A re-measurement is judged and priced as measured: a mode only ever
                # re-measured stays warming up, and its warm-up price would re-measure it on
                # every chance (on the H200 decode, 4 steps every accept-2 cell).
                spec, decode = self._mode_costs(spec_t, decode_t, accept, inputs, from_decode)
                here, there = (decode, spec) if from_decode else (spec, decode)
            if self._plausible(other, there_t, here_t, inputs, (spec, decode)):
                return self._explore(other, there_key, 1.0 - here / there, there_t, here_t,
                                     inputs) or stay
        return stay

    def commit(self, decision: Decision) -> None:
        self._step += 1
        if not self._warmed:
            steps = self._mode_steps
            steps[decision.mode] += 1
            if steps[decision.mode] == _MODE_WARM_STEPS:
                self._warmed = min(steps.values()) >= _MODE_WARM_STEPS
                self._cold = None if self._warmed else OTHER[decision.mode]
        self._earn(self.config.explore_budget)
        offer, self._offer = self._offer, None
        if decision.reason is Reason.EXPLORE and decision.mode is not self._dwell.mode:
            if not self._explore_left:
                self._explore_left = self.config.explore_steps
                self._charge(decision.price)
                self._explored_at[decision.mode] = self._step
                if decision.mode is Mode.SPEC:
                    self._sight_from = self._step
                    if offer is not None and offer[0] is decision:
                        self._probe = offer[1]
            self._explore_left -= 1
            self._unfolded = not self._explore_left
            probe = self._probe
            if probe is not None:
                if self._explore_steps_run() > probe.priced:    # priced as ending early
                    self._charge(probe.step_price)
                if self._unfolded:
                    self._probe = None
            return
        if self._probe is not None:
            self._end_probe()
        self._explore_left = 0
        if decision.mode is not self._dwell.mode and not self._dwell.dwell_waived:
            self._run_len += _RUN_ALPHA * (self._dwell.steps_in_mode - self._run_len)
        self._dwell.commit(decision.mode)

    @property
    def _accept(self) -> float:
        return self._accept_sum / self._accept_weight

    def expected_accept(self, rows: Optional[np.ndarray] = None) -> float:
        """Accept length expected of a batch: each measured request's own estimate, pulled
        toward all requests' recent acceptance as far as requests are seen to differ against
        the noise of the draws it holds (four draws of 1 at accept 1.88 wrote a request off for
        44 steps); what the latest requests first measured for requests not measured yet."""
        est = self._rows
        if rows is None or est is None or not len(rows):
            return self._accept
        ids = rows.tolist()
        n, every, fresh = len(ids), self._accept, self._fresh
        differ, draw, noise = self._differ, self._draw_var, self._noise
        # Where differ or draw is 0 every row weighs alike (0 or 1): the pooled path's answer.
        # Otherwise each row's weight is _own_weight(noise), inline: this runs every step.
        if n < _POOLED_ROWS and differ and draw and max(map(noise.__getitem__, ids)) > _FULL_NOISE:
            total = 0.0
            for i in ids:
                e = est[i]
                total += fresh if e != e else \
                    every + differ * (e - every) / (differ + draw * noise[i])
            return total / n
        w = self._full_weight
        total = sum(map(est.__getitem__, ids))
        if total == total:                               # every request measured (no NaN)
            return every + w * (total / n - every)
        known = [v for v in map(est.__getitem__, ids) if v == v]
        own = (1.0 - w) * every * len(known) + w * sum(known)
        return (own + (n - len(known)) * fresh) / n

    def _own_weight(self, noise: float) -> float:
        """The weight of a request's own estimate, of variance `noise` draws', over all
        requests': how far requests surely differ against that noise."""
        differ, draw = self._differ, self._draw_var
        if differ is None:
            return 1.0
        if differ > 0:
            return differ / (differ + draw * noise)
        return 0.0 if draw > 0 else 1.0

    def step_time(self, mode: Mode, padded_bs: int, kv_tokens: int = 0) -> Optional[float]:
        """Expected seconds of a step over `kv_tokens` context tokens: this size's line where it
        is measured, else the nearest measured sizes' times at that context, interpolated by
        size, their fixed parts scaled by the prior's ratio between the sizes; beyond the
        contexts a line has seen, its own rate only where it is surely steeper than its mode's
        pooled one."""
        return self._line_time(self._at[mode].get(padded_bs), kv_tokens)

    def _line_time(self, i: Optional[int], kv_tokens: int) -> Optional[float]:
        """Key i's step seconds at `kv_tokens` as priced: the lower of its line and the line it
        leans on."""
        return self._line_times(i, kv_tokens)[1]

    def _line_times(self, i: Optional[int],
                    kv_tokens: int) -> tuple[Optional[float], Optional[float]]:
        """Key i's step seconds at `kv_tokens` on its own line (what its samples are judged
        against) and as priced."""
        if i is None:
            return None, None
        # Estimates change only at an exchange, so each key's lines are kept until the next one.
        lines = self._lines[i]
        if lines is _UNFIT:
            line = self._fit_line(i)
            lines = self._lines[i] = (line, self._lean_line(i, line))
        line, lean = lines
        if line is None:
            return None, None
        t = _time_on(line, kv_tokens)
        return t, (t if lean is None else min(t, _time_on(lean, kv_tokens)))

    def _times_here(self, inputs: PolicyInputs) -> tuple:
        """Each mode's step seconds here (spec, decode) as the choice of mode prices them
        (_warm_times while one mode warms up); decide has its own copy, inline."""
        spec_key = self._spec_at.get(inputs.spec_padded_bs)
        decode_key = self._decode_at.get(inputs.decode_padded_bs)
        kv = inputs.kv_tokens
        measured = self._line_time(spec_key, kv), self._line_time(decode_key, kv)
        return measured if self._cold is None else \
            self._warm_times(spec_key, decode_key, *measured, kv)

    def _warm_times(self, spec_key: Optional[int], decode_key: Optional[int],
                    spec_t: Optional[float], decode_t: Optional[float], kv_tokens: int) -> tuple:
        """Each mode's step seconds (spec, decode) as the choice of mode prices them while one
        is warming up and the other is not (self._cold): the cold one's no higher than measured
        over _MODE_WARM_FACTOR where its prior is lower still. Two modes warming up are
        compared as measured."""
        if self._cold is Mode.SPEC:
            return self._warm_time(spec_key, spec_t, kv_tokens), decode_t
        return spec_t, self._warm_time(decode_key, decode_t, kv_tokens)

    def _warm_time(self, i: Optional[int], t: Optional[float], kv_tokens: int) -> Optional[float]:
        if t is None or math.isnan(self._prior[i]):
            return t
        return min(t, max(t / _MODE_WARM_FACTOR,
                          self._prior[i] + self._beta[self._mode_of[i]] * kv_tokens))

    def _lean_line(self, i: int, own: Optional[_Line]) -> Optional[_Line]:
        """A key measured fewer than _TRUSTED_SAMPLES times: its line at count/_TRUSTED_SAMPLES,
        the rest the line of trusted sizes on both sides of it. The mode not in use keeps its
        estimates until re-measured, so only a price that comes down counts (_line_time takes
        the lower); one priced too low is measured as soon as its mode runs."""
        trust = self._samples[i] / _TRUSTED_SAMPLES
        if own is None or not 0.0 < trust < 1.0:
            return None
        near = self._neighbours_line(i, min_samples=_TRUSTED_SAMPLES)
        return None if near is None else _blend(own, near, trust)

    def _fit_line(self, i: int) -> Optional[_Line]:
        if self._samples[i]:
            return _CONTEXT_FLOOR * self._est[i], ((1.0, 1.0, self._own_part(i)),)
        prior = self._prior[i]
        near = self._neighbours_line(i)
        if near is None and not math.isnan(prior):
            beta = self._beta[self._mode_of[i]]
            return _CONTEXT_FLOOR * prior, ((1.0, 1.0, (prior, 0.0, 0.0, beta)),)
        return near

    def _own_part(self, i: int) -> _Part:
        b = self._key_slope(i)
        return (self._est[i] - b * self._est_kv[i], b, self._reach(i),
                min(self._far_slope(b, i), self._steepest(i)))

    def _far_slope(self, b: float, i: int) -> float:
        """Beyond the contexts key i has seen: its own rate where it is surely steeper than its
        mode's pooled one (a few steps fit any rate), else the pooled one."""
        beta = self._beta[self._mode_of[i]]
        return b if b - beta > FAR_ERRORS * self._ctx.own_error(i) else beta

    def _neighbours_line(self, i: int, min_samples: float = 0.0) -> Optional[_Line]:
        """Key i's line from the nearest measured sizes of its mode below and above (a mode's
        keys ascend by size): their step times at the context, interpolated; None where none
        is measured (with `min_samples`: unless both sides hold a size measured that often)."""
        mode = self._mode_of[i]
        seen = [j for j in self._spans[mode]
                if self._samples[j] > 0 and self._samples[j] >= min_samples]
        if not seen:
            return None
        prior = self._prior[i]
        below, above = [j for j in seen if j < i], [j for j in seen if j > i]
        near = below[-1:] + above[:1]
        if min_samples and len(near) < 2:
            return None
        weights = [1.0]
        if len(near) == 2:
            size = [self._keys[j][1] for j in (near[0], i, near[1])]
            w = (size[1] - size[0]) / (size[2] - size[0])
            weights = [1.0 - w, w]
        # The neighbours' fixed parts scaled by the prior's ratio between this size and them,
        # held between the same cost and one in proportion to the batch (start-up replays are
        # noisy: on the H200 spec bs 112 replayed 1.2x bs 128); their seconds per context token
        # interpolated, unscaled (a step's fixed part grows with the batch, attention's cost
        # per token read does not).
        scaled = not math.isnan(prior) and all(not math.isnan(self._prior[j]) for j in near)
        floor, parts = 0.0, []
        for j, w in zip(near, weights):
            ratio = self._keys[i][1] / self._keys[j][1]
            scale = w * (min(max(prior / self._prior[j], min(ratio, 1.0)), max(ratio, 1.0))
                         if scaled else 1.0)
            floor += scale * _CONTEXT_FLOOR * self._est[j]
            parts.append((scale, w, self._own_part(j)))
        return floor, tuple(parts)

    def _key_slope(self, i: int) -> float:
        """Key i's seconds per context token: its own where its contexts have spread (attention's
        cost per token differs with the batch), else its mode's pooled one; no steeper than the
        line through the origin and its recent step (a step has no negative fixed part, and a
        few samples over a narrow range of contexts fit any slope)."""
        own = self._ctx.own(i)
        return min(self._beta[self._mode_of[i]] if own is None else own, self._steepest(i))

    def _steepest(self, i: int) -> float:
        """The slope of the line through the origin and key i's recent step."""
        est_kv = self._est_kv[i]
        return self._est[i] / max(est_kv, 1.0) if est_kv > 0 else math.inf

    def _reach(self, i: int) -> float:
        """The context key i's own rate holds out to: its spread above the decayed mean, and at
        least its recent context (the line's anchor, which moves faster than the decayed sums)."""
        return max(self._ctx.reach(i), self._est_kv[i])

    def state(self) -> PolicyState:
        return PolicyState(self._accept, *(None if c is None else 1.0 / c for c in self._costs))

    def estimates(self) -> dict:
        """For /get_server_info and the step log, not per step: per measured (mode, padded bs)
        the step seconds, its sample count, prior, mean context tokens and seconds per context
        token; each mode's pooled seconds per context token; the prompt and catch-up terms; the
        exploration accounts."""
        steps = {m.value: {} for m in (Mode.SPEC, Mode.DECODE)}
        for i, (m, b) in enumerate(self._keys):
            if self._samples[i] > 0:
                prior = None if math.isnan(self._prior[i]) else self._prior[i]
                steps[m.value][b] = [self._est[i], int(self._samples[i]), prior,
                                     self._est_kv[i], self._key_slope(i)]
        fixed, rate = self._catch_up_fit
        return {"step_s": steps,
                "context_s_per_token": {m.value: b for m, b in self._beta.items()},
                "prompt_per_output": self._prompt_per_output, "replaced": self._replaced(),
                "draft_prefill_s_per_token": self._delta, "catch_up_fixed_s": fixed,
                "catch_up_s_per_token": rate,
                "catch_up_reach_tokens": None if math.isinf(self._catch_up_reach)
                else self._catch_up_reach,
                "catch_up_far_s_per_token": self._catch_up_far, "switch_s": self._switch_s,
                "fresh_accept": self._fresh,
                "own_accept_weight": self._full_weight,
                "own_accept_weight_first": self._own_weight(1.0 / _FIRST_DRAWS),
                "run_len": self._run_len,
                "explore_allowance_steps": self._allowance, "explore_debt_steps": self._debt}

    # ------------------------------------------------------------------------------ observe

    def observe(self, event: Observation) -> None:
        # The two events of every step first.
        if isinstance(event, StepTime):
            self._observe_step(event)
        elif isinstance(event, Accepted):
            self._observe_accept(event)
        elif isinstance(event, Admitted):
            self._prompt_window += event.tokens
            if event.rows is not None and self._rows is not None:
                for row in event.rows.tolist():
                    self._rows[row], self._draws[row] = math.nan, 0
                    self._draw_sum[row] = self._draw_sq[row] = self._noise[row] = 0.0
                self._admissions[event.rows] += 1
                self._admitted_step[event.rows] = self._step
        elif isinstance(event, PrefillTime):
            self._after_prefill, self._after_carry = True, False
            carry, self._carry = self._carry or 0.0, None
            if event.tokens > 0 and 0 < event.seconds < _NO_ESTIMATE_MAX_S * 8:
                x, y = float(event.tokens), float(event.seconds) + carry
                self._add_local(_PF[event.draft], (1.0, x, y, x * x, x * y))

    def _observe_accept(self, event: Accepted) -> None:
        lens = event.accept_lens
        n = len(lens)
        if not n:
            return
        self._batch_rows = event.rows
        if event.mode is not Mode.SPEC:
            self._output_window += _total(lens)
            return
        accepts = lens.tolist()
        total = sum(accepts)
        self._output_window += total
        if self._sight_from is not None:
            self._sight = max(self._step - self._sight_from + 1, 1)
            self._sight_from = None
        if self._probe is not None:
            self._probe.add(total / n)
        # Accept lengths lie in 1..K+1 by construction (the engine counts accepted tokens).
        decay = (1.0 - _ACCEPT_DECAY) ** (self._step - self._accept_at)
        self._accept_sum = decay * self._accept_sum + total
        self._accept_weight = decay * self._accept_weight + n
        self._accept_at = self._step
        est, noise = self._rows, self._noise
        if event.rows is None or est is None:
            return
        firsts, within = [], []
        for row, accept in zip(event.rows.tolist(), accepts):
            r = est[row]
            if r == r:
                est[row] = r + _ROW_ALPHA * (accept - r)
                noise[row] = _KEEP_SQ * noise[row] + _ROW_ALPHA * _ROW_ALPHA
                continue
            self._draw_sum[row] += accept
            self._draw_sq[row] += accept * accept
            self._draws[row] += 1
            if self._draws[row] >= _FIRST_DRAWS:
                mean = est[row] = self._draw_sum[row] / _FIRST_DRAWS
                noise[row] = 1.0 / _FIRST_DRAWS
                firsts.append(mean)
                within.append((self._draw_sq[row] - _FIRST_DRAWS * mean * mean)
                              / (_FIRST_DRAWS - 1))
        if firsts:
            self._learn_spread(firsts, within)

    def _learn_spread(self, firsts: list[float], within: list[float]) -> None:
        """Fold requests' first estimates into the new-request expectation and the spreads:
        how far requests surely differ (the first estimates' variance, less its standard error
        and their four draws' noise), and one draw's variance."""
        n = len(firsts)
        self._fresh += _first_weight(n) * (sum(firsts) / n - self._fresh)
        keep = (1.0 - _SPREAD_ALPHA) ** n
        # Each request weighs 1 when folded: the squared weights decay twice as fast.
        decays = (keep, keep, keep, keep, keep * keep)
        window = (n, sum(firsts), sum(m * m for m in firsts), sum(within), n)
        self._spread = [d * s + v for d, s, v in zip(decays, self._spread, window)]
        count, s1, s2, sw, squares = self._spread
        effective = count * count / squares
        if effective < _SPREAD_MIN_REQUESTS:
            return
        between = max(s2 / count - (s1 / count) ** 2, 0.0) * effective / (effective - 1.0)
        draw = self._draw_var = sw / count
        # Less one standard error of that variance (~22% of it over ~40 requests): where
        # requests accept alike, its noise alone read as a spread gave their own noisy
        # estimates a third of the weight or more.
        sure = between * (1.0 - math.sqrt(2.0 / (effective - 1.0)))
        self._differ = max(sure - draw / _FIRST_DRAWS, 0.0)
        self._full_weight = self._own_weight(1.0 / _ROW_DRAWS)

    def _observe_step(self, event: StepTime) -> None:
        after_prefill, self._after_prefill = self._after_prefill, False
        after_carry, self._after_carry = self._after_carry, event.carries_next
        last, self._last_sample = self._last_sample, None
        short, self._short = self._short, None
        carry, self._carry = self._carry, None
        i = self._at[event.mode].get(event.padded_bs)
        if i is None or not event.seconds > 0:
            return
        # Samples are judged against the key's own line; costs beyond a step are what is left
        # over the step as priced (its own line, or lower where it leans on its neighbours).
        expected, priced = self._line_times(i, event.kv_tokens)
        if carry is not None and event.bs != self._carry_bs:
            # Requests left or joined in between: that excess also holds their host work
            # (finished results, the new batch), which no launch of this one costs.
            carry = None
        switched = self._last_mode not in (None, event.mode)
        at_switch = self._last_mode is Mode.DECODE
        self._last_mode = event.mode
        if carry is not None and switched and not event.catch_up_tokens:
            # The previous step held this switch's launch, so this one's span starts late: a
            # switch costs the two steps' excess (as a catch-up does).
            excess = None if event.carries_next else self._excess(i, event.seconds, priced)
            self._add_local(_SW, (1.0, carry + (excess or 0.0)))
        if event.carries_next:
            # Not a plain step's cost: its excess goes to the batch whose launch it holds.
            self._carry = self._excess(i, event.seconds, priced)
            self._carry_bs = event.bs
            return
        if event.catch_up_tokens > 0:
            # The catch-up's cost: this step's excess over a measured step of its size plus the
            # previous step's (which held this one's launch); fixed cost and switch included,
            # noise of either sign averages out in the regression.
            excess = self._excess(i, event.seconds, priced)
            if excess is not None:
                x, y = float(event.catch_up_tokens), excess + (carry or 0.0)
                if self._first_call_cost(at_switch, x, y, priced):
                    return
                self._add_local(_CU[at_switch], (1.0, x, y, x * x, x * y))
            return
        # Nor is one whose launch the previous step held: its span starts late (on the H200 a
        # decode step after a switch from spec ran 0.81-0.99x its size's median).
        if after_carry:
            return
        # The first step after a prefill is no clean sample: its span starts inside the prefill's
        # (on the H200 0.71x its size's median when the batch arrived at once, 1.07x over HTTP).
        # Every other one is taken, so a prefill before every step still leaves samples.
        if after_prefill and not self._held_after_prefill:
            self._held_after_prefill = True
            return
        self._held_after_prefill = False
        # An idle gap or a first-call warm-up is no step: more than _OUTLIER times the estimate
        # (measured, else the prior: start-up replays are off by a few times, not by eight).
        if expected is not None and event.seconds > _OUTLIER * expected:
            return
        if expected is None and event.seconds > _NO_ESTIMATE_MAX_S:
            return
        # Nor is a lone one under a third of a measured key's line: a batch's last step, its span
        # cut short under overlap (0.4 ms among 6 ms steps on the H200), nor the step before it
        # if of the same key and above its line: that one holds the finished requests' work
        # (their sum is two steps). Two in a row are the key's cost.
        if self._samples[i] > 0 and event.seconds * _SPIKE < expected and short != i:
            if last is not None and last[0] == i and last[3]:
                self._drop(last)
            self._short = i
            return
        # A lone stall is no step either: as a size's first sample it would price its mode out
        # until the size is re-measured. Two in a row are the key's cost.
        if self._hold_lone(i, expected is not None and event.seconds > _SPIKE * expected):
            return
        acc = self._step_sums.get(i)
        if acc is None:
            acc = self._step_sums[i] = [0.0] * KEY_SLOTS
        x, y = float(event.kv_tokens), event.seconds
        acc[0] += y
        acc[1] += 1.0
        acc[2] += x
        acc[3] += x * x
        acc[4] += x * y
        acc[5] += y * y
        self._last_sample = (i, x, y, expected is not None and y > expected)

    def _drop(self, sample: tuple[int, float, float, bool]) -> None:
        """Take a step sample of this window back out of its key's sums."""
        i, x, y, _ = sample
        acc = self._step_sums[i]
        for slot, v in enumerate((y, 1.0, x, x * x, x * y, y * y)):   # as _observe_step added it
            acc[slot] -= v
        if acc[1] < 0.5:
            del self._step_sums[i]

    def _first_call_cost(self, at_switch: bool, tokens: float, seconds: float,
                         step: float) -> bool:
        """Whether a catch-up is held back as a lone one-time cost: a whole `step` over its line,
        at a rate beyond its fixed part of 1/_SPIKE of a prefill's per-token slope (the target's,
        with the draft or not), which the draft alone does not reach. On the H200 a 528-token
        catch-up's first forward at its shape took 13-17 ms and the next one's (664 tokens) 2.8;
        taken, its 20-34 us a token priced speculation out for ~150 steps where it was 9%
        faster. Two in a row of a kind and size (a power of two) are the cost."""
        cap = self._draft_rate_cap()
        counted = self._catch_up[True].events + self._catch_up[False].events
        spike = cap is not None and counted > 0 and \
            seconds > self.catch_up_seconds(int(tokens)) + step and \
            seconds > self._catch_up_fit[0] + tokens * cap
        return self._hold_lone(("catch-up", at_switch, int(tokens).bit_length()), spike)

    def _hold_lone(self, key: object, outlier: bool) -> bool:
        """Whether to hold back a sample of `key`: an outlier unless the last one of that key
        was too (two in a row are its cost)."""
        if outlier and key not in self._held:
            self._held.add(key)
            return True
        self._held.discard(key)
        return False

    def _excess(self, i: int, seconds: float, expected: Optional[float]) -> Optional[float]:
        """Seconds beyond key i's expected step, if it is measured and this is no idle gap."""
        if self._samples[i] > 0 and seconds < _OUTLIER * expected + _NO_ESTIMATE_MAX_S:
            return seconds - expected
        return None

    def _add_local(self, slot: int, values: tuple) -> None:
        """Add to the local slots after the per-key sums (the _PF/_CU/_SW layout)."""
        at = len(self._local) - _TAIL + slot
        self._local[at:at + len(values)] += values

    # ------------------------------------------------------------------------------ exchange

    @property
    def sync_every(self) -> int:
        return self.config.sync_every

    def exchange(self, reduce: Reducer) -> None:
        """Fold every rank's local measurements into the shared estimates: all ranks call this
        at the same step with the same `reduce` (the mean over ranks)."""
        n = len(self._keys)
        for i, acc in self._step_sums.items():
            self._local[i:KEY_SLOTS * n:n] += acc
        self._step_sums.clear()
        self._last_sample = None
        vec = np.asarray(reduce(self._local.copy()), dtype=np.float64)
        self._local[:] = 0.0
        self._lines = [_UNFIT] * n
        self._unfolded = False
        self._fold_step_times(vec[:KEY_SLOTS * n].reshape(KEY_SLOTS, n))
        self._fold_batch_costs(vec[KEY_SLOTS * n:])

    def _fold_step_times(self, keys: np.ndarray) -> None:
        """Each key's EMA of step seconds and of context tokens, and the context regressions;
        the keys not measured since the last exchange relax down toward their typical level.
        A window holds samples of a few sizes: those are folded one by one."""
        self._ctx.decay()
        got = keys[1].nonzero()[0].tolist()
        self._relax_idle(set(got))
        if not got:                 # every sum decayed alike: the same slopes
            return
        keep = 1.0 - self.config.ema_alpha
        # Judged as the window is folded: samples taken cold and folded after count as warm.
        cold_mode = {m: not self._warmed and self._mode_steps[m] < _MODE_WARM_STEPS
                     for m in self._mode_steps}
        for i in got:
            window = keys[:, i].tolist()
            self._ctx.add(i, self._mode_of[i], window)
            sums, count, kv = window[:3]
            mean, mean_kv = sums / count, kv / count
            if count >= _TYPICAL_MIN_COUNT:
                self._add_window(i, mean, mean_kv)
            self._count_high(i, mean, mean_kv, count)
            cold = cold_mode[self._mode_of[i]]
            measured = self._samples[i] > 0
            if measured:
                warm_only = count >= 2 and (self._last[i] < _WARM_STEPS <= self._step or
                                            self._cold_keys[i] and not cold and
                                            mean < self._est[i])
                w = 1.0 if warm_only else 1.0 - keep ** count
                mean = self._est[i] + w * (mean - self._est[i])
                mean_kv = self._est_kv[i] + w * (mean_kv - self._est_kv[i])
            # A lone sample is no window to take whole: the key stays cold-only past it.
            self._cold_keys[i] = cold and (self._cold_keys[i] or not measured) or \
                self._cold_keys[i] and count < 2
            self._est[i], self._est_kv[i] = mean, mean_kv
            self._samples[i] += count
            self._last[i] = self._step
            if i in self._typical:      # a window too short to count still moves the estimate
                self._relaxing.add(i)
        self._beta = {m: self._ctx.pooled(m) for m in self._beta}

    def _add_window(self, i: int, mean: float, kv: float) -> None:
        """Key i's window of samples into its recent ones, and its typical level anew."""
        windows = self._windows.get(i)
        if windows is None:
            windows = self._windows[i] = deque(maxlen=_TYPICAL_WINDOWS)
        windows.append((mean, kv, self._step))
        oldest, b = self._step - _TYPICAL_HORIZON, self._key_slope(i)
        levels = sorted(_moved(b, t, x, kv) for t, x, at in windows if at >= oldest)
        self._typical[i] = (levels[(len(levels) - 1) // 2], kv)

    def _count_high(self, i: int, mean: float, kv: float, count: float) -> None:
        """Key i's samples in a row over its typical level (a window's mean decides)."""
        level = self._typical.get(i)
        high = level is not None and mean > (1.0 + _HIGH) * _moved(
            self._key_slope(i), level[0], level[1], kv)
        self._high_steps[i] = self._high_steps[i] + count if high else 0.0

    def _relax_idle(self, measured: set) -> None:
        """Move each unmeasured key's estimate down toward its typical level, for the steps
        since the last exchange; a key that reached it is left alone until measured again."""
        steps = self._step - self._exchanged_at
        self._exchanged_at = self._step
        for i in [i for i in self._relaxing if i not in measured]:
            t, x = self._typical[i]
            typical = _moved(self._key_slope(i), t, x, self._est_kv[i])
            gap = self._est[i] - typical
            if gap < _SETTLED * typical:
                self._relaxing.discard(i)
            else:
                high = self._high_steps[i]
                spell = min(max(high, _RELAX_MIN_STEPS), _RELAX_STEPS) if high else _RELAX_STEPS
                self._est[i] = typical + math.exp(-steps / spell) * gap

    def _fold_batch_costs(self, tail: np.ndarray) -> None:
        """Prefills, catch-ups and switches (the slots after the per-key ones), and the
        workload's prompt share; then the terms derived from them."""
        new = np.count_nonzero(tail) > 0      # else every fit, a ratio of sums decayed alike, is unchanged
        for draft, at in _PF.items():
            self._prefill[draft].fold(tail[at:at + 5] if new else None)
        for at_switch, at in _CU.items():
            self._catch_up[at_switch].fold(tail[at:at + 5] if new else None)
        switches, seconds = tail[_SW:_SW + 2].tolist()
        self._switches = _CATCH_UP_DECAY * self._switches + switches
        self._switch_sum = _CATCH_UP_DECAY * self._switch_sum + seconds
        self._switch_s = max(self._switch_sum / self._switches, 0.0) if self._switches > 0 \
            else 0.0
        self._prompt = _WORKLOAD_DECAY * self._prompt + self._prompt_window
        self._output = _WORKLOAD_DECAY * self._output + self._output_window
        self._prompt_window = self._output_window = 0.0
        joined, left = self._turnover()
        took = min(joined, left + self._vacant)
        self._vacant = min(left + self._vacant - took, left)
        self._joined = _WORKLOAD_DECAY * self._joined + joined
        self._took_place = _WORKLOAD_DECAY * self._took_place + took
        self._prompt_per_output = self._replaced() * self._prompt / self._output \
            if self._output > 0 else 0.0
        if new:
            floor = self._draft_floor()
            self._delta = max(self._draft_prefill_rate(), floor)
            self._catch_up_fit = self._fit_catch_up()
            at_switch = self._catch_up[True]     # the sizes the line was fitted on
            self._catch_up_reach = (at_switch if at_switch.fit() is not None
                                    else self._both_catch_ups()).reach()
            cap = self._draft_rate_cap()
            rate = self._catch_up_fit[1]
            self._catch_up_far = max(rate if cap is None else min(rate, cap), floor)

    # ------------------------------------------------------------------------------ model

    def _turnover(self) -> tuple[int, int]:
        """Requests that joined and left the running batch since the last exchange, from its
        rows then and now (a row re-admitted meanwhile holds a new request); none without rows.
        A request that joined and left in between is missed (fewer steps than sync_every)."""
        rows = self._batch_rows
        if rows is None or self._admissions is None:
            return 0, 0
        rows = np.array(rows, dtype=np.int64)
        admissions = self._admissions[rows]
        last, self._members = self._members, (rows, admissions)
        if last is None:
            return len(rows), 0
        last_rows, last_admissions = last
        here = self._admitted_at
        here[rows] = admissions
        stayed = int(np.count_nonzero(here[last_rows] == last_admissions))
        here[rows] = -1
        return len(rows) - stayed, len(last_rows) - stayed

    def _replaced(self) -> float:
        """The share of joining requests that took a finished request's place (all, without
        the batch's rows)."""
        return self._took_place / self._joined if self._joined > 0 else 1.0

    def prompt_per_output(self) -> float:
        """Prompt tokens per output token of the requests that replace finished ones."""
        return self._prompt_per_output

    def draft_prefill_s_per_token(self) -> float:
        """delta: the draft's extra seconds per prompt token (as of the latest exchange)."""
        return self._delta

    def _draft_prefill_rate(self) -> float:
        """The draft's seconds per prompt token: the slope of catch-ups inside speculative runs
        (the same draft extend over deferred prompts, no switch in it), else of all catch-ups,
        else a ratio of large catch-ups (their fixed cost negligible), else the difference of
        the prefill slopes with and without the draft, else 0."""
        run, every = self._catch_up[False], self._both_catch_ups()
        for fit in (run.fit(), every.fit()):
            if fit is not None:
                return fit[1]
        for ups in (run, every):
            ratio = ups.ratio()
            if ratio is not None and ups.mean_tokens() >= _RATIO_MIN_TOKENS:
                return max(ratio, 0.0)
        with_draft, plain = self._prefill[True].value(), self._prefill[False].value()
        if with_draft is not None and plain is not None:
            return max(with_draft - plain, 0.0)
        return 0.0

    def _both_catch_ups(self) -> Slope:
        both = Slope(MIN_SPREAD["catch_up"], _CATCH_UP_DECAY)
        both.sums = self._catch_up[True].decayed() + self._catch_up[False].decayed()
        both.events = self._catch_up[True].events + self._catch_up[False].events
        return both

    def _fit_catch_up(self) -> tuple[float, float]:
        """A switch's catch-up, fixed part and rate: the line through the catch-ups at switches;
        where their sizes cannot give one, delta as the rate and their mean excess over it as
        the fixed part (or, with no delta, the ratio of large ones)."""
        at_switch = self._catch_up[True]
        fit = at_switch.fit()
        if fit is not None:
            return fit
        n, mean_tokens = at_switch.sums[0], at_switch.mean_tokens()
        if n <= 0:
            return 0.0, self._delta
        if self._delta == 0.0 and mean_tokens >= _RATIO_MIN_TOKENS:
            return 0.0, max(at_switch.ratio() or 0.0, 0.0)
        return max(at_switch.sums[2] / n - self._delta * mean_tokens, 0.0), self._delta

    def catch_up_s_per_token(self) -> float:
        """kappa: seconds per caught-up draft token beyond a catch-up's fixed cost."""
        return self._catch_up_fit[1]

    def catch_up_seconds(self, tokens: int) -> float:
        """Expected seconds of one catch-up over `tokens` draft tokens: the fitted line out to
        the sizes it has seen, beyond them no dearer a token than the draft can be. Small
        catch-ups' scatter (a switch's costs ride on them) fitted 8-23 us a token on the H200,
        which priced a 12k-token one at ~300 ms where one of 10k took 27."""
        if tokens <= 0:
            return 0.0
        fixed, rate = self._catch_up_fit
        beyond = max(tokens - self._catch_up_reach, 0.0)
        return max(fixed + rate * (tokens - beyond) + self._catch_up_far * beyond, 0.0)

    def _draft_floor(self) -> float:
        """The least a draft token can cost: the draft's share of a prefill token with it (a
        catch-up fitted on a few hundred tokens read 0 a token; on the H200 a prefill of 8192
        tokens took 16-25 ms more with the draft, where its share of the weights gives ~8)."""
        if not self.config.draft_floor:
            return 0.0
        share = min(self.config.draft_share, 1.0 / _SPIKE)     # no dearer than _draft_rate_cap
        # The lower reading: prefills with the draft are rare where they are deferred, so a
        # slow first call's would stand for minutes.
        plain = self._prefill_rate(False)
        rates = (self._prefill_rate(True), None if plain is None else plain / (1.0 - share))
        return share * min((r for r in rates if r is not None), default=0.0)

    def _prefill_rate(self, draft: bool) -> Optional[float]:
        """A prefill's seconds per token (with the draft or not): its line's slope, else, where
        prefills were of one size (a wave of long prompts in equal chunks), their ratio if
        large enough for their fixed cost not to count."""
        prefills = self._prefill[draft]
        rate = prefills.value()
        if rate is None and prefills.mean_tokens() >= _RATIO_MIN_TOKENS:
            rate = prefills.ratio()
        return rate

    def _draft_rate_cap(self) -> Optional[float]:
        """The most a draft token can cost beyond a catch-up's fixed part: 1/_SPIKE of a
        prefill's per-token slope (the target's, with the draft or not); None before one."""
        slopes = (self._prefill[True].value(), self._prefill[False].value())
        prefill = next((v for v in slopes if v is not None), None)
        return None if prefill is None else prefill / _SPIKE

    def _mode_costs(self, spec_t: Optional[float], decode_t: Optional[float], accept: float,
                    inputs: PolicyInputs, from_decode: bool) -> tuple:
        """Each mode's seconds per output token here, from its step time (_cost)."""
        spec = self._cost(True, spec_t, inputs.bs, accept, inputs.catch_up_tokens,
                          prefill_tokens=inputs.prefill_tokens)
        return spec, self._cost(False, decode_t, inputs.bs, 1.0, 0, switch=not from_decode)

    def _cost(self, spec: bool, t: Optional[float], bs: int, accept: float,
              catch_up_tokens: int, prompt_share: bool = True, switch: bool = False,
              prefill_tokens: int = 0) -> Optional[float]:
        """Seconds per output token of spec (or decode) mode here, from its step time `t` (None:
        unknown), with what entering it costs amortised. Spec: a catch-up of the draft's backlog,
        `catch_up_tokens` (what decode steps left, or prompts a prefill deferred), and the draft's
        prefill of `prefill_tokens` joining now, at its rate (no catch-up of its own). Decode: a
        `switch`. A prefill's preview and the next step's plan so price a batch alike."""
        if t is None:
            return None
        tokens = bs * accept if spec else float(bs)
        cost = t / tokens
        if prompt_share and (spec or not self.config.defers_prefill):
            cost += self._prompt_per_output * self._delta
        entering = (self.catch_up_seconds(catch_up_tokens) if catch_up_tokens > 0 else 0.0) + \
            self._delta * prefill_tokens + (self._switch_s if switch else 0.0)
        if entering:
            horizon = min(max(self._run_len, self.config.min_dwell_steps, 1.0),
                          self.config.switch_horizon)
            cost += entering / (horizon * tokens)
        return cost

    def _measured(self, i: Optional[int]) -> bool:
        return i is not None and self._samples[i] > 0

    def _stale(self, i: Optional[int], mode: Mode, rows: Optional[np.ndarray] = None) -> bool:
        """Key i (of `mode`) not measured lately; for spec, or no acceptance seen lately."""
        if i is None:
            return False
        window = self.config.stale_after
        if self._explored_at[mode] >= self._step - window // 4:
            return False             # re-measured lately; its samples may still be on the way
        if self._time_stale(i):
            return True
        if mode is not Mode.SPEC:
            return False
        # Acceptance: stale after the window over the requests it was seen on (they drift
        # slowly), after a quarter of it once a request admitted since has joined.
        seen = self._step - self._accept_at
        return seen > window or (seen > window // 4 and self._newcomers(rows))

    def _newcomers(self, rows: Optional[np.ndarray]) -> bool:
        """The batch holds a request admitted since acceptance was last seen (True without
        rows: nothing says otherwise)."""
        if rows is None or not len(rows) or self._admissions is None:
            return True
        return int(self._admitted_step[rows].max()) >= self._accept_at

    def _time_stale(self, i: int) -> bool:
        """Key i's step time not measured within the last stale_after steps."""
        return self._last[i] < self._step - self.config.stale_after

    def _plausible(self, mode: Mode, t: Optional[float], current_t: float,
                   inputs: PolicyInputs, costs: tuple) -> bool:
        """Worth re-measuring: decode if it would win with its steps _DECODE_DRIFT faster than
        estimated (its time is all it has to refresh); spec if its steps would win at the best
        possible acceptance (a new request's acceptance is unknown). The draft's
        prompt cost is left out here: only a spec run's catch-ups re-measure it, so an
        overestimate of it must not keep spec from ever being tried. `t`: its step time here,
        `current_t`: the current mode's, `costs`: each mode's (spec, decode) as measured."""
        if mode is Mode.DECODE:
            spec, decode = costs
            if spec is None or decode is None or not t:
                return True
            return (decode - _DECODE_DRIFT * t / inputs.bs) * (1 + self.config.margin) < spec
        return self._spec_wins(self.config.num_draft_tokens + 1.0, t, current_t, inputs.bs) is True

    def _spec_wins(self, accept: float, spec_t: Optional[float], decode_t: Optional[float],
                   bs: int) -> Optional[bool]:
        """Whether spec steps of `spec_t` at `accept` beat decode steps of `decode_t` by the
        margin, the prompt cost left out (None: a step time is unknown)."""
        spec = self._cost(True, spec_t, bs, accept, 0, prompt_share=False)
        decode = self._cost(False, decode_t, bs, 1.0, 0, prompt_share=False)
        if spec is None or decode is None:
            return None
        return spec * (1 + self.config.margin) < decode

    def _steps_high(self, mean: float, variance: float, steps: int) -> float:
        """The mean acceptance of `steps` steps, _PROBE_ERRORS standard errors up. A step counts
        as one draw (its requests' draws may share a cause: SGLang's forced lengths give a whole
        batch one), of variance no less than a request's draws are seen to vary (before that
        is learnt, the widest a draw in 1..K+1 can)."""
        floor = self._draw_var if self._draw_var is not None else \
            (self.config.num_draft_tokens / 2.0) ** 2
        return mean + _PROBE_ERRORS * math.sqrt(max(variance, floor) / steps)

    def _probe_lost(self, inputs: PolicyInputs) -> bool:
        """The running re-measurement of speculation has seen acceptance too low for it to win
        here even at the top of its error."""
        p = self._probe
        if not p.seen:
            return False
        mean = p.total / p.seen
        variance = (p.squares - p.seen * mean * mean) / (p.seen - 1) if p.seen > 1 else 0.0
        spec_t, decode_t = self._times_here(inputs)
        return self._spec_wins(self._steps_high(mean, variance, p.seen),
                               spec_t and spec_t * p.drift, decode_t, inputs.bs) is False

    def _end_probe(self) -> None:
        """A re-measurement of speculation ended early: the steps it was priced for and did not
        run go back (to the bank, or to the debt it went into)."""
        p, self._probe = self._probe, None
        self._earn(p.step_price * max(p.priced - self._explore_steps_run(), 0))

    def _explore_steps_run(self) -> int:
        return self.config.explore_steps - self._explore_left

    def _explore(self, mode: Mode, key: Optional[int], loss: float, explored: Optional[float],
                 t: float, inputs: PolicyInputs) -> Optional[Decision]:
        """A re-measurement of `mode` if the budget allows one now. Its price, in steps of the
        current mode (so the budget is a share of step time, whichever mode is explored): the
        share of each of its steps the estimates expect to lose (`loss`, at least 5%: nothing is
        free) times that step's length, plus the round trip's switches (into spec: a catch-up of
        the backlog, back to decode: a switch; into decode: a switch, back: a catch-up of what
        the draft missed meanwhile). So cheap re-measurements come often and costly ones rarely.
        One of speculation that ends early gets back the steps it did not run (_end_probe).
        `key`, `explored`, `t`: the key and step time here of `mode`, the current mode's time."""
        if self.config.explore_budget <= 0:
            return None
        step_price = max(min(loss, 1.0), _MIN_LOSS)
        if t and explored:
            step_price *= explored / t
        steps = self.config.explore_steps
        probe = None
        if mode is Mode.SPEC and self._measured(key) and explored:
            # The first steps whose acceptance is too low end it (_probe_lost), as they will if
            # the estimate is right; a step time not measured lately is judged as far faster as
            # it may have drifted (a stale one may be what keeps speculation out).
            drift = 1.0 - _STEP_DRIFT if self._time_stale(key) else 1.0
            high = self._steps_high(self.expected_accept(inputs.rows), 0.0, 1)
            if self._spec_wins(high, explored * drift, t, inputs.bs) is False:
                steps = min(self._sight, steps)
            probe = _Probe(step_price, steps, drift)
        price = steps * step_price
        if t:
            missed = inputs.bs * self.config.explore_steps if mode is Mode.DECODE else \
                inputs.catch_up_tokens
            price += (self.catch_up_seconds(missed) + self._switch_s) / t
        if not self._affordable(price):
            return None
        decision = Decision(mode, Reason.EXPLORE, price)
        self._offer = None if probe is None else (decision, probe)
        return decision

    def _earn(self, income: float) -> None:
        """The bank fills first; what it cannot hold repays the debt."""
        room = self._bank - self._allowance
        if income <= room:
            self._allowance += income
        else:
            self._allowance = self._bank
            self._debt = max(self._debt - (income - room), 0.0)

    def _charge(self, price: float) -> None:
        if price > self._bank:
            self._debt += price
        else:
            self._allowance -= price

    def _affordable(self, price: float) -> bool:
        """One costing more than the bank waits for a full bank and no debt, then goes into
        debt: rare, never ruled out (else acceptance rising where speculation looked hopeless
        goes unseen for good) unless DGW_EXPLORE_CAP caps its price (each costs 2-5% of a short
        workload; docs/design.md weighs the two)."""
        if price > self._bank:
            cap = self.config.explore_cap
            return (not cap or price <= cap * self._bank) and self._allowance >= self._bank \
                and self._debt < 1e-9
        return self._allowance >= price
