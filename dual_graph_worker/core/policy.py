"""Mode policies: the contract, what they observe, and the simple ones.

A policy decides each step's mode from `PolicyInputs` (all rank-common) and from what it was
told through `observe`. Rank-common facts (accept lengths, token counts, rows: every TP rank
commits the same tokens) may be used at once; anything a rank measures on its own (timings) may
feed a decision only after `exchange` has made it common. So every rank, fed the same steps,
makes the same decisions and runs the same collectives.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Protocol, Sequence, Union

import numpy as np

from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import Mode


class Reason(str, enum.Enum):
    """Why a step ran in its mode (kept in each step record, exported as a metric label)."""

    PINNED = "pinned"                    # the user fixed the mode
    THRESHOLD = "threshold"              # threshold policy, outside the hysteresis band
    HYSTERESIS = "hysteresis"            # inside the band: kept the current mode
    GOODPUT = "goodput"                  # the controller picked the mode of higher goodput
    DWELL = "dwell"                      # minimum dwell not yet served: kept the current mode
    EXPLORE = "explore"                  # re-measuring the mode not chosen (bounded budget)
    NO_SPEC_GRAPH = "no_spec_graph"      # batch larger than the spec pool
    KV_PRESSURE = "kv_pressure"          # free KV slots cannot cover K+1 slots per request


# The per-step records (inputs, observations) are NamedTuples: immutable and typed as frozen
# dataclasses are, at a quarter of their cost to build (~0.4 us against ~1.7 us), which a decode
# step pays several times. Those holding arrays are never compared or hashed.


class PolicyInputs(NamedTuple):
    """One step's facts; every field is identical on every TP rank."""

    bs: int
    spec_padded_bs: Optional[int]   # None: no spec graph covers bs
    decode_padded_bs: int
    catch_up_tokens: int = 0        # draft tokens a SPEC step would catch up first
    rows: Optional[np.ndarray] = None   # request rows, if known
    kv_tokens: int = 0              # context tokens the batch attends over (sum of seq lens)
    prefill_tokens: int = 0         # prompt tokens joining in prefills: SPEC drafts them there


@dataclass(frozen=True)
class Decision:
    mode: Mode
    reason: Reason
    price: float = 0.0      # EXPLORE: the re-measurement's cost in steps, charged at commit


# ----------------------------------------------------------------------------- observations


class Accepted(NamedTuple):
    """A completed step's accepted tokens per request (rank-common). Decode steps accept 1."""

    mode: Mode
    accept_lens: list                     # [bs] tokens each request received, bonus included
    rows: Optional[np.ndarray] = None     # [bs] request rows, when the engine knows them


class Admitted(NamedTuple):
    """Requests whose prompts were prefilled (rank-common): `tokens` prompt tokens computed."""

    tokens: int
    rows: Optional[np.ndarray] = None


class StepTime(NamedTuple):
    """A decode step's end-to-end seconds (rank-local); `catch_up_tokens` > 0: the step also
    caught the draft up over that many tokens first; `carries_next`: its seconds also hold the
    host launch of a next batch of another kind (a prefill, a switch, a catch-up); `kv_tokens`:
    the context tokens the batch attended over (sum of its sequence lengths); `bs`: its
    requests (0: not known)."""

    mode: Mode
    padded_bs: int
    seconds: float
    catch_up_tokens: int = 0
    carries_next: bool = False
    kv_tokens: int = 0
    bs: int = 0


class PrefillTime(NamedTuple):
    """A prefill batch's seconds over `tokens` prompt tokens (rank-local); `draft`: the draft's
    prefill ran in it (False: it was deferred)."""

    tokens: int
    seconds: float
    draft: bool


Observation = Union[Accepted, Admitted, StepTime, PrefillTime]
# Makes a vector of rank-local sums common: every rank gets the mean over ranks. Python lists
# in and out: a single rank's exchange then touches no numpy (a cold call costs 5-45 us).
Reducer = Callable[[list[float]], list[float]]


def same_rank(vec: list[float]) -> list[float]:
    """The reducer of a single rank."""
    return vec


@dataclass(frozen=True)
class PolicyState:
    """What a policy believes now: for logs and metrics."""

    accept_len: float
    spec_goodput: Optional[float] = None     # expected tokens/s at the last decided batch
    decode_goodput: Optional[float] = None


class ModePolicy(Protocol):
    def decide(self, inputs: PolicyInputs) -> Decision: ...
    def commit(self, decision: Decision) -> None: ...
    def observe(self, event: Observation) -> None: ...
    def exchange(self, reduce: Reducer) -> None: ...
    def state(self) -> PolicyState: ...
    def estimates(self) -> Optional[dict]: ...


# ----------------------------------------------------------------------------- building blocks


@dataclass
class AcceptLengthEMA:
    """EMA of accepted tokens per request per spec step (1..K+1, bonus token included)."""

    num_draft_tokens: int
    alpha: float = 0.1
    value: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError(f"EMA alpha must be in (0, 1], got {self.alpha}")
        if self.value == 0.0:
            # Optimistic prior: assume speculation works until observed otherwise.
            self.value = float(self.num_draft_tokens + 1)

    def update(self, mean_accept_len: float) -> None:
        x = min(max(mean_accept_len, 1.0), self.num_draft_tokens + 1.0)
        self.value += self.alpha * (x - self.value)


@dataclass
class DwellState:
    """Current mode and how many steps it has run; advanced only by `commit`."""

    mode: Mode = Mode.SPEC
    steps_in_mode: int = 0

    @property
    def dwell_waived(self) -> bool:
        """No dwell is owed before the first committed step (the initial mode was never
        chosen)."""
        return self.steps_in_mode == 0

    def commit(self, mode: Mode) -> None:
        if mode is self.mode:
            self.steps_in_mode += 1
        else:
            self.mode, self.steps_in_mode = mode, 1

    def must_dwell(self, min_dwell_steps: int) -> bool:
        return 0 < self.steps_in_mode < min_dwell_steps


@dataclass(kw_only=True)
class _Observing:
    """Accept-length bookkeeping every simple policy shares; they measure nothing else."""

    num_draft_tokens: int = 1
    _ema: AcceptLengthEMA = field(init=False)

    def __post_init__(self) -> None:
        self._ema = AcceptLengthEMA(self.num_draft_tokens)

    def observe(self, event: Observation) -> None:
        if isinstance(event, Accepted) and event.mode is Mode.SPEC and len(event.accept_lens):
            self._ema.update(float(np.mean(event.accept_lens)))

    def exchange(self, reduce: Reducer) -> None:
        pass

    def state(self) -> PolicyState:
        return PolicyState(self._ema.value)

    def estimates(self) -> Optional[dict]:
        return None          # no cost model behind these decisions


@dataclass(kw_only=True)
class PinnedPolicy(_Observing):
    """Always the same mode: the static-spec and plain baselines."""

    mode: Mode = Mode.SPEC

    def decide(self, inputs: PolicyInputs) -> Decision:
        if self.mode is Mode.SPEC and inputs.spec_padded_bs is None:
            return Decision(Mode.DECODE, Reason.NO_SPEC_GRAPH)
        return Decision(self.mode, Reason.PINNED)

    def commit(self, decision: Decision) -> None:
        pass


@dataclass(kw_only=True)
class ThresholdPolicy(_Observing):
    """Speculate at bs <= threshold; leave spec above threshold + band, return below
    threshold - band; never switch before `min_dwell_steps` steps in a mode."""

    threshold: int = 32
    band: int = 0
    min_dwell_steps: int = 0
    _dwell: DwellState = field(default_factory=DwellState, init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.threshold < 0 or self.band < 0 or self.min_dwell_steps < 0:
            raise ConfigError("threshold, band and min_dwell_steps must be >= 0, got "
                              f"{self.threshold}, {self.band}, {self.min_dwell_steps}")

    def decide(self, inputs: PolicyInputs) -> Decision:
        if inputs.spec_padded_bs is None:
            return Decision(Mode.DECODE, Reason.NO_SPEC_GRAPH)
        cur = self._dwell.mode
        if cur is Mode.SPEC:
            want = Mode.DECODE if inputs.bs > self.threshold + self.band else Mode.SPEC
        else:
            want = Mode.SPEC if inputs.bs <= self.threshold - self.band else Mode.DECODE
        if want is not cur and self._dwell.must_dwell(self.min_dwell_steps):
            return Decision(cur, Reason.DWELL)
        in_band = abs(inputs.bs - self.threshold) <= self.band and want is cur
        return Decision(want, Reason.HYSTERESIS if in_band else Reason.THRESHOLD)

    def commit(self, decision: Decision) -> None:
        self._dwell.commit(decision.mode)


@dataclass(kw_only=True)
class CyclePolicy(_Observing):
    """A profiling aid, never a serving policy: whatever the load, speculate for `hold` steps,
    decode as long, then alternate every step for twice that, and repeat, so one batch of
    requests yields held steps of both modes and switches at one batch size."""

    hold: int = 8
    _step: int = field(default=0, init=False)   # committed steps; advanced by `commit` only

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hold < 1:
            raise ConfigError(f"policy=cycle holds each mode for min_dwell_steps steps, which "
                              f"must be >= 1 (DGW_MIN_DWELL), got {self.hold}")

    @property
    def period(self) -> int:
        return 4 * self.hold

    def mode_at(self, step: int) -> Mode:
        """The scheduled mode of step `step` (0-based)."""
        i = step % self.period
        if i < self.hold:
            return Mode.SPEC
        if i < 2 * self.hold:
            return Mode.DECODE
        return Mode.SPEC if (i - 2 * self.hold) % 2 == 0 else Mode.DECODE

    def decide(self, inputs: PolicyInputs) -> Decision:
        mode = self.mode_at(self._step)
        if mode is Mode.SPEC and inputs.spec_padded_bs is None:
            return Decision(Mode.DECODE, Reason.NO_SPEC_GRAPH)
        return Decision(mode, Reason.PINNED)

    def commit(self, decision: Decision) -> None:
        self._step += 1


def accepted(mode: Mode, accept_lens: Sequence[float] | np.ndarray,
             rows: Optional[np.ndarray] = None) -> Accepted:
    """A list of numbers passes as it is, and is never written after (the SGLang worker's,
    every step: a cold numpy call costs more than the step's whole bookkeeping at a small
    batch); anything else becomes a list of floats."""
    lens = accept_lens if type(accept_lens) is list else \
        np.asarray(accept_lens, dtype=np.float64).tolist()
    return Accepted(mode, lens, rows if rows is None or type(rows) is np.ndarray
                    else np.asarray(rows))
