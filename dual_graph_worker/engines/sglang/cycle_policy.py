"""A profiling aid: a mode schedule fixed by step count (``DGW_POLICY=cycle``).

The SGLang scheduler, not the caller, sets the batch, so a profile cannot steer the threshold
policy step by step. This policy ignores load and repeats, for ``hold`` (= ``min_dwell_steps``)
steps each: speculate, decode, then alternate every step for ``2 * hold`` steps. One batch of
requests then gives held steps of both modes and a switch on every step, all at one padded
batch size, which is what ``profiling.check`` compares a switch step with. Beyond the spec pool it
decodes (NO_SPEC_GRAPH), like every policy. Never a serving policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dual_graph_worker.errors import ConfigError
from dual_graph_worker.modes import Mode
from dual_graph_worker.policy import AcceptLengthEMA, Decision, PolicyInputs, Reason


@dataclass
class CyclePolicy:
    hold: int
    num_draft_tokens: int = 1
    _step: int = field(default=0, init=False)   # committed steps; advanced by `commit` only
    _ema: AcceptLengthEMA = field(init=False)

    def __post_init__(self) -> None:
        if self.hold < 1:
            raise ConfigError(f"policy=cycle holds each mode for min_dwell_steps steps, which "
                              f"must be >= 1 (DGW_MIN_DWELL), got {self.hold}")
        self._ema = AcceptLengthEMA(self.num_draft_tokens)

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

    def observe_accept(self, mean_accept_len: float) -> None:
        self._ema.update(mean_accept_len)

    def commit(self, mode: Mode) -> None:
        self._step += 1

    @property
    def accept_len_ema(self) -> float:
        return self._ema.value
