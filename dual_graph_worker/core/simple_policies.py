"""The simple mode policies: pinned (the static baselines), threshold, and cycle (a profiling
aid). Each tracks the mean accept length for logs and measures nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.estimates import Estimates
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import (DECIDED, Accepted, Decision, DwellState, Observation,
                                           PolicyInputs, PolicyState, Reason, Reducer)


@dataclass
class AcceptLengthEMA:
    """EMA of accepted tokens per request per spec step (1..K+1, bonus token included)."""

    num_draft_tokens: int
    alpha: float = 0.1
    value: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError(f"EMA alpha must be in (0, 1], got {self.alpha}")
        # Optimistic prior: assume speculation works until observed otherwise.
        self.value = float(self.num_draft_tokens + 1)

    def update(self, mean_accept_len: float) -> None:
        x = min(max(mean_accept_len, 1.0), self.num_draft_tokens + 1.0)
        self.value += self.alpha * (x - self.value)


@dataclass(kw_only=True)
class _Observing:
    """Accept-length bookkeeping every simple policy shares; they measure nothing else."""

    num_draft_tokens: int = 1
    _ema: AcceptLengthEMA = field(init=False)
    sync_every: ClassVar[int] = 0              # nothing measured to exchange

    def __post_init__(self) -> None:
        self._ema = AcceptLengthEMA(self.num_draft_tokens)

    def observe(self, event: Observation) -> None:
        if isinstance(event, Accepted) and event.mode is Mode.SPEC and len(event.accept_lens):
            self._ema.update(event.total / len(event.accept_lens))

    def exchange(self, reduce: Reducer) -> None:
        pass

    def state(self) -> PolicyState:
        return PolicyState(self._ema.value)

    def estimates(self) -> Optional[Estimates]:
        return None          # no cost model behind these decisions


@dataclass(kw_only=True)
class PinnedPolicy(_Observing):
    """Always the same mode: the static-spec and plain baselines."""

    mode: Mode = Mode.SPEC

    def decide(self, inputs: PolicyInputs) -> Decision:
        if self.mode is Mode.SPEC and inputs.spec_padded_bs is None:
            return DECIDED[Mode.DECODE, Reason.NO_SPEC_GRAPH]
        return DECIDED[self.mode, Reason.PINNED]

    def commit(self, decision: Decision) -> None:
        pass


@dataclass(kw_only=True)
class ThresholdPolicy(_Observing):
    """Speculate at bs <= threshold; leave spec above threshold + band, return at or below
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
            return DECIDED[Mode.DECODE, Reason.NO_SPEC_GRAPH]
        cur = self._dwell.mode
        if cur is Mode.SPEC:
            want = Mode.DECODE if inputs.bs > self.threshold + self.band else Mode.SPEC
        else:
            want = Mode.SPEC if inputs.bs <= self.threshold - self.band else Mode.DECODE
        if want is not cur and self._dwell.must_dwell(self.min_dwell_steps):
            return DECIDED[cur, Reason.DWELL]
        in_band = abs(inputs.bs - self.threshold) <= self.band and want is cur
        return DECIDED[want, Reason.HYSTERESIS if in_band else Reason.THRESHOLD]

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
            return DECIDED[Mode.DECODE, Reason.NO_SPEC_GRAPH]
        return DECIDED[mode, Reason.PINNED]

    def commit(self, decision: Decision) -> None:
        self._step += 1
