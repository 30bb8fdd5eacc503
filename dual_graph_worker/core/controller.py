"""The goodput controller: each step runs the mode the server measured to be faster.

Per step it compares the expected seconds per output token of each mode at this batch, from
step times measured while serving (step_times.py; the start-up calibration is only the prior),
each request's expected accept length (acceptance.py), the prompt share and the draft's prefill
and catch-up costs (batch_costs.py); it re-measures the mode not chosen where that could change
the answer, within a step-time budget (exploration.py: when, at what price, and the accounts).
Timings are rank-local (intake.py routes them) and reach the estimates only through `exchange`,
so decisions read only rank-common values. docs/design.md, "The controller", derives the cost
model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from dual_graph_worker.core.acceptance import AcceptanceEstimate
from dual_graph_worker.core.batch_costs import BatchCosts, CatchUpWork
from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.estimates import Estimates
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.exchange import ExchangeSums
from dual_graph_worker.core.exploration import ExploreConfig, Explorer, TimesHere
from dual_graph_worker.core.intake import SampleIntake
from dual_graph_worker.core.modes import OTHER, Mode
from dual_graph_worker.core.policy import (DECIDED, Accepted, Admitted, Decision, DraftPrefills,
                                           DwellState, Observation, PolicyInputs, PolicyState,
                                           PrefillTime, Reason, Reducer, StepTime, same_rank)
from dual_graph_worker.core.settings import BY_KEY, RowLoops, Settings
from dual_graph_worker.core.step_times import StepTimeTable

_RUN_ALPHA = 0.3
# Decode's steps hold steadier than speculation's (exploration._STEP_DRIFT): it is re-measured
# only where a step this much faster than estimated would win.
_DECODE_DRIFT = 0.15
# Dwell damps flapping near a tie; a batch the current mode serves at this multiple of the
# other's cost a token (the other 20% cheaper) is no tie.
_DWELL_BREAK = 1.25


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
    row_loops: RowLoops = _default("row_loops")
    # Decode-mode prefills skip the draft's prefill (lazy catch-up's deferral): only spec mode
    # pays the draft per prompt token.
    defers_prefill: bool = False
    max_rows: int = 0                 # request rows tracked for per-request acceptance
    draft_floor: bool = _default("draft_floor")
    # The draft's share of a prefill's weights (batch_costs.draft_share): with draft_floor, a draft
    # token costs no less than that share of a prefill token, whatever small catch-ups fit.
    draft_share: float = 0.0
    catch_up_work: Optional[CatchUpWork] = None     # None: every catch-up runs the whole layer

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
        """`engine`: what the engine knows (defers_prefill, max_rows, draft_share,
        catch_up_work)."""
        shared = {f.name: getattr(settings, f.name) for f in fields(cls) if f.name in BY_KEY}
        return cls(num_draft_tokens, **shared, **engine)


class GoodputController:
    """A ModePolicy; `sizes` are the captured batch sizes of each pool (the step-time table's
    keys), `prior` the start-up calibration or None."""

    def __init__(self, config: ControllerConfig, sizes: Mapping[Mode, Sequence[int]],
                 prior: Optional[CalibrationTable] = None) -> None:
        self.config = config
        self._times = StepTimeTable(sizes, prior, config.ema_alpha)
        self._acceptance = AcceptanceEstimate(config.num_draft_tokens, config.max_rows,
                                              config.row_loops)
        self._batch_costs = BatchCosts(config.draft_floor, config.draft_share, config.max_rows,
                                       config.catch_up_work)
        self._intake = SampleIntake(self._times, self._batch_costs)
        knobs = ExploreConfig(**{f.name: getattr(config, f.name) for f in fields(ExploreConfig)})
        self._explorer = Explorer(knobs, self._times, self._acceptance, self._batch_costs,
                                  self._spec_wins)
        self._dwell = DwellState()
        self._step = 0
        # A re-measurement's acceptance is seen at once, its step times at the next exchange:
        # until then the current mode stays unless the other is far cheaper (as dwell yields).
        self._unfolded = False
        # Steps a mode has recently run between switches: a switch's catch-up is spread over
        # this, not over a fixed horizon, so flipping near a tie pays what it really costs.
        self._run_len = float(config.switch_horizon)
        self._costs: tuple[Optional[float], Optional[float]] = (None, None)   # spec, decode
        self._defers_prefill = config.defers_prefill
        self._goodput = {m: DECIDED[m, Reason.GOODPUT] for m in Mode}

    # ------------------------------------------------------------------------------ decide

    def decide(self, inputs: PolicyInputs) -> Decision:
        decided = DECIDED
        spec_bs = inputs.spec_padded_bs
        if spec_bs is None:
            return decided[Mode.DECODE, Reason.NO_SPEC_GRAPH]
        cur = self._dwell.mode
        explorer = self._explorer
        if explorer.left:
            if explorer.judging() and \
                    explorer.probe_lost(self._times_here(inputs), inputs.bs, self._step):
                return self._goodput[cur]
            return decided[OTHER[cur], Reason.EXPLORE]
        from_decode = cur is Mode.DECODE
        # Each mode's step time here, looked up once: the re-measurement checks read them too.
        times = self._times
        spec_key, decode_key, measured, chosen_at = self._times_here(inputs)
        spec_t, decode_t = measured
        accept = self._acceptance.expected(inputs.rows)
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
            return explorer.explore(other, there_key, 1.0, there_t, here_t, inputs, accept,
                                    self._step) or stay
        if there * (1 + self.config.margin) < here:
            if (unfolded or self._dwell.must_dwell(self.config.min_dwell_steps)) and \
                    here < _DWELL_BREAK * there:
                return decided[cur, Reason.DWELL]
            return self._goodput[other]
        if unfolded:
            return decided[cur, Reason.DWELL]
        # Re-measure the other mode once this one is measured at this size (it is the
        # reference), when the other's estimate here is stale and could change the answer.
        if times.measured(here_key) and explorer.due(there_key, other, inputs.rows, self._step):
            if chosen_at != measured:
                # A re-measurement is judged and priced as measured: speculation only ever
                # re-measured stays warming up, and its warm-up price would re-measure it on
                # every chance.
                spec, decode = self._mode_costs(spec_t, decode_t, accept, inputs, from_decode)
                here, there = (decode, spec) if from_decode else (spec, decode)
            if self._plausible(other, there_t, here_t, inputs, (spec, decode)):
                return explorer.explore(other, there_key, 1.0 - here / there, there_t, here_t,
                                        inputs, accept, self._step) or stay
        return stay

    def commit(self, decision: Decision) -> None:
        self._step += 1
        mode, dwell = decision.mode, self._dwell
        if not self._times.warmed:
            self._times.ran(mode)
        if decision.reason is Reason.EXPLORE and mode is not dwell.mode:
            self._explorer.ran(decision, self._step)
            self._unfolded = not self._explorer.left
            return
        self._explorer.stayed()
        if mode is not dwell.mode and not dwell.dwell_waived:
            self._run_len += _RUN_ALPHA * (dwell.steps_in_mode - self._run_len)
        dwell.commit(mode)

    # ------------------------------------------------------------------------------ read

    def expected_accept(self, rows: Optional[np.ndarray] = None) -> float:
        """Accept length expected of a batch of request `rows` (AcceptanceEstimate.expected)."""
        return self._acceptance.expected(rows)

    def step_time(self, mode: Mode, padded_bs: int, kv_tokens: int = 0) -> Optional[float]:
        """Expected seconds of a step over `kv_tokens` context tokens (StepTimeTable.step_time)."""
        return self._times.step_time(mode, padded_bs, kv_tokens)

    def prompt_per_output(self) -> float:
        """Prompt tokens per output token of the requests that replace finished ones."""
        return self._batch_costs.prompt_per_output

    def draft_prefill_s_per_token(self) -> float:
        """delta: the draft's extra seconds per prompt token (as of the latest exchange)."""
        return self._batch_costs.delta

    def catch_up_s_per_token(self) -> float:
        """kappa: seconds per caught-up draft token beyond a catch-up's fixed cost, of the
        catch-ups that run the draft's whole layer."""
        return self._batch_costs.catch_up_fit[1]

    def catch_up_seconds(self, tokens: int) -> float:
        """Expected seconds of one catch-up over `tokens` draft tokens."""
        return self._batch_costs.catch_up_seconds(tokens)

    def state(self) -> PolicyState:
        return PolicyState(self._acceptance.mean,
                           *(None if c is None else 1.0 / c for c in self._costs))

    def estimates(self) -> Estimates:
        """For /get_server_info and the step log, not per step."""
        return Estimates(self._times.estimates(), self._batch_costs.estimates(),
                         self._acceptance.estimates(), self._run_len,
                         self._explorer.budget.allowance, self._explorer.budget.debt)

    # ------------------------------------------------------------------------------ observe

    def observe(self, event: Observation) -> None:
        # The two events of every step first.
        if isinstance(event, StepTime):
            self._intake.step(event)
        elif isinstance(event, Accepted):
            self._observe_accept(event)
        elif isinstance(event, Admitted):
            rows = None if event.rows is None else event.rows.tolist()
            self._batch_costs.admitted(event.tokens, rows)
            if rows is not None:
                self._acceptance.admit(rows, self._step)
        elif isinstance(event, PrefillTime):
            self._intake.prefill(event)
        elif isinstance(event, DraftPrefills):
            self._defers_prefill = event.deferred

    def _observe_accept(self, event: Accepted) -> None:
        accepts = event.accept_lens
        n = len(accepts)
        if not n:
            return
        total = event.total
        self._batch_costs.served(event.rows, total)
        if event.mode is not Mode.SPEC:
            return
        self._explorer.accepted(total, n, self._step)
        self._acceptance.add(accepts, total, event.rows, self._step)

    # ------------------------------------------------------------------------------ exchange

    @property
    def sync_every(self) -> int:
        return self.config.sync_every

    def exchange(self, reduce: Reducer) -> None:
        """Fold every rank's local measurements into the shared estimates: all ranks call this
        at the same step with the same `reduce` (the mean over ranks)."""
        # A re-measurement that ended waits for this exchange: it folds all it measured.
        self._intake.exchanging(hold=not self._unfolded)
        local = ExchangeSums(self._times.take_local(), self._batch_costs.take_local())
        # One rank's sums are every rank's: the wire's round trip would rebuild the same records.
        every = local if reduce is same_rank else \
            ExchangeSums.from_vector(reduce(local.to_vector()))
        self._unfolded = False
        self._times.fold(every.step_times, self._step)
        self._batch_costs.fold(every.batch_costs)
        self._acceptance.fold()

    # ------------------------------------------------------------------------------ model

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
        costs = self._batch_costs
        tokens = bs * accept if spec else float(bs)
        cost = t / tokens
        if prompt_share and (spec or not self._defers_prefill):
            cost += costs.prompt_per_output * costs.delta
        entering = (costs.catch_up_seconds(catch_up_tokens) if catch_up_tokens > 0 else 0.0) + \
            costs.delta * prefill_tokens + (costs.switch_s if switch else 0.0)
        if entering:
            horizon = min(max(self._run_len, self.config.min_dwell_steps, 1.0),
                          self.config.switch_horizon)
            cost += entering / (horizon * tokens)
        return cost

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

    # ------------------------------------------------------------------------------ times

    def _times_here(self, inputs: PolicyInputs) -> TimesHere:
        """Each mode's key here and step seconds (spec, decode): as measured, and as the choice
        of mode prices them (spec_warm_time while speculation warms up)."""
        times = self._times
        spec_key = times.spec_at.get(inputs.spec_padded_bs)
        decode_key = times.decode_at.get(inputs.decode_padded_bs)
        kv = inputs.kv_tokens
        measured = times.line_time(spec_key, kv), times.line_time(decode_key, kv)
        chosen = measured if not times.spec_cold else \
            (times.spec_warm_time(spec_key, measured[0], kv), measured[1])
        return spec_key, decode_key, measured, chosen
