"""When to speculate: per-step mode decisions that every tensor-parallel rank makes identically.

A decision depends only on inputs all ranks share: the batch size, the accepted lengths of past
steps (every rank sees the same tokens), free KV slots (the allocator is replicated) and a
calibration table measured once and broadcast. Nothing reads a clock, so two ranks fed the same
inputs make the same decisions (tests/test_policy.py checks it).

Two policies:
- `ThresholdPolicy`: speculate while bs <= threshold, with a hysteresis band and a minimum dwell.
- `GoodputPolicy`: predicted tokens/s of each mode from the calibration table and an EMA of
  accepted length; picks the larger with a relative hysteresis margin and a minimum dwell, and
  probes speculation now and then while off so the EMA does not go stale.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Protocol

from dual_graph_worker.errors import ConfigError
from dual_graph_worker.modes import GraphKey, Mode


class Reason(str, enum.Enum):
    """Why a step ran in its mode (kept in each step record, exported as a metric label)."""

    PINNED = "pinned"                    # the user fixed the mode
    THRESHOLD = "threshold"              # threshold policy, outside the hysteresis band
    HYSTERESIS = "hysteresis"            # inside the band: kept the current mode
    GOODPUT = "goodput"                  # goodput policy picked the faster mode
    DWELL = "dwell"                      # minimum dwell not yet served: kept the current mode
    PROBE = "probe"                      # one spec step to refresh the acceptance estimate
    NO_SPEC_GRAPH = "no_spec_graph"      # batch larger than the spec pool
    KV_PRESSURE = "kv_pressure"          # free KV slots cannot cover K+1 slots per request


@dataclass(frozen=True)
class PolicyInputs:
    """Everything a decision may depend on. All fields are identical on every TP rank."""

    bs: int
    spec_padded_bs: Optional[int]   # None: no spec graph covers bs
    decode_padded_bs: int


@dataclass(frozen=True)
class Decision:
    mode: Mode
    reason: Reason


class ModePolicy(Protocol):
    def decide(self, inputs: PolicyInputs) -> Decision: ...
    def observe_accept(self, mean_accept_len: float) -> None: ...
    def commit(self, mode: Mode) -> None: ...
    @property
    def accept_len_ema(self) -> float: ...


@dataclass
class _DwellState:
    """Current mode and how many steps it has run; advanced only by `commit`."""

    mode: Mode = Mode.SPEC
    steps_in_mode: int = 0
    steps_since_probe: int = 0
    # No dwell is owed before the first committed step (the initial mode was never chosen),
    # nor right after a probe (a probe is one spec step, not a switch into speculation).
    dwell_waived: bool = True

    def commit(self, mode: Mode, probe: bool = False) -> None:
        if mode is self.mode:
            self.steps_in_mode += 1
        else:
            self.mode, self.steps_in_mode = mode, 1
        self.steps_since_probe = 0 if mode is Mode.SPEC else self.steps_since_probe + 1
        self.dwell_waived = probe and mode is Mode.SPEC

    def must_dwell(self, min_dwell_steps: int) -> bool:
        return not self.dwell_waived and self.steps_in_mode < min_dwell_steps


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
class PinnedPolicy:
    """Always the same mode: the static-spec and plain baselines."""

    mode: Mode
    num_draft_tokens: int = 1
    _ema: AcceptLengthEMA = field(init=False)

    def __post_init__(self) -> None:
        self._ema = AcceptLengthEMA(self.num_draft_tokens)

    def decide(self, inputs: PolicyInputs) -> Decision:
        if self.mode is Mode.SPEC and inputs.spec_padded_bs is None:
            return Decision(Mode.DECODE, Reason.NO_SPEC_GRAPH)
        return Decision(self.mode, Reason.PINNED)

    def observe_accept(self, mean_accept_len: float) -> None:
        self._ema.update(mean_accept_len)

    def commit(self, mode: Mode) -> None:
        pass

    @property
    def accept_len_ema(self) -> float:
        return self._ema.value


@dataclass
class ThresholdPolicy:
    """Speculate at bs <= `threshold`; leave spec above threshold + band, return below threshold - band."""

    threshold: int
    num_draft_tokens: int = 1
    band: int = 0
    min_dwell_steps: int = 0
    _state: _DwellState = field(default_factory=_DwellState, init=False)
    _ema: AcceptLengthEMA = field(init=False)

    def __post_init__(self) -> None:
        if self.threshold < 0 or self.band < 0 or self.min_dwell_steps < 0:
            raise ConfigError("threshold, band and min_dwell_steps must be >= 0, got "
                              f"{self.threshold}, {self.band}, {self.min_dwell_steps}")
        self._ema = AcceptLengthEMA(self.num_draft_tokens)

    def decide(self, inputs: PolicyInputs) -> Decision:
        if inputs.spec_padded_bs is None:
            return Decision(Mode.DECODE, Reason.NO_SPEC_GRAPH)
        cur = self._state.mode
        if cur is Mode.SPEC:
            want = Mode.DECODE if inputs.bs > self.threshold + self.band else Mode.SPEC
        else:
            want = Mode.SPEC if inputs.bs <= self.threshold - self.band else Mode.DECODE
        if want is not cur and self._state.must_dwell(self.min_dwell_steps):
            return Decision(cur, Reason.DWELL)
        in_band = abs(inputs.bs - self.threshold) <= self.band and want is cur
        return Decision(want, Reason.HYSTERESIS if in_band else Reason.THRESHOLD)

    def observe_accept(self, mean_accept_len: float) -> None:
        self._ema.update(mean_accept_len)

    def commit(self, mode: Mode) -> None:
        self._state.commit(mode)

    @property
    def accept_len_ema(self) -> float:
        return self._ema.value


@dataclass(frozen=True)
class CalibrationTable:
    """Measured step latency (seconds) per captured (mode, padded bs); broadcast to all ranks."""

    latency_s: Mapping[GraphKey, float]
    num_draft_tokens: int
    source: str = "measured"

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.latency_s.items() if not v > 0}
        if bad:
            raise ConfigError(f"calibration latencies must be > 0 seconds, got {bad}; "
                              "re-run the calibration (make capture-tune)")

    def latency(self, mode: Mode, padded_bs: int) -> Optional[float]:
        return self.latency_s.get(GraphKey(mode, padded_bs))

    def to_json(self) -> dict:
        return {"num_draft_tokens": self.num_draft_tokens, "source": self.source,
                "latency_s": [{"mode": k.mode.value, "bs": k.bs, "seconds": v}
                              for k, v in sorted(self.latency_s.items())]}

    @classmethod
    def from_json(cls, data: Mapping) -> "CalibrationTable":
        try:
            lat = {GraphKey(Mode(e["mode"]), int(e["bs"])): float(e["seconds"])
                   for e in data["latency_s"]}
            return cls(lat, int(data["num_draft_tokens"]), str(data.get("source", "measured")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"calibration table is malformed ({exc!r}); expected "
                              "{'num_draft_tokens': K, 'latency_s': [{'mode','bs','seconds'}]}; "
                              "regenerate it with `make capture-tune`") from exc

    @classmethod
    def load(cls, path: str | Path) -> "CalibrationTable":
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read calibration table {path}: {exc.strerror}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"calibration table {path} is not valid JSON ({exc}); "
                              "regenerate it with `make capture-tune`") from exc
        return cls.from_json(data)


@dataclass
class GoodputPolicy:
    """Pick the mode with the larger predicted tokens/s.

    decode tok/s = bs / t_decode(pad(bs));  spec tok/s = bs * E[accept_len] / t_spec(pad(bs)).
    Switch only when the other mode wins by more than `margin` (relative), and not before
    `min_dwell_steps` steps in the current mode. While off, every `probe_every` steps run one spec
    step if speculation could win at all (at the best possible acceptance), so a stale EMA heals.
    """

    calibration: CalibrationTable
    # 3%: above the calibration's run-to-run spread (~1%), below the 5% that a run near the
    # crossover lost on the H200 (bench_llama3-8b_acc2_run2.json, concurrency 128).
    margin: float = 0.03
    min_dwell_steps: int = 4
    # A probe under lazy continuity first catches the draft up over every token generated
    # since the last spec step (one eager draft extend of bs x backlog tokens): at 128 steps
    # that cost ~3% at bs 256 on the H200 (run2 above), so probe rarely.
    probe_every: int = 512
    ema_alpha: float = 0.1
    _state: _DwellState = field(default_factory=_DwellState, init=False)
    _ema: AcceptLengthEMA = field(init=False)
    _probe_pending: bool = field(default=False, init=False)   # last decision was a PROBE

    def __post_init__(self) -> None:
        if self.margin < 0 or self.min_dwell_steps < 0 or self.probe_every < 0:
            raise ConfigError("margin, min_dwell_steps and probe_every must be >= 0")
        self._ema = AcceptLengthEMA(self.calibration.num_draft_tokens, self.ema_alpha)

    def predicted_tok_s(self, mode: Mode, bs: int, padded_bs: int,
                        accept_len: float) -> Optional[float]:
        t = self.calibration.latency(mode, padded_bs)
        if t is None:
            return None
        return bs * (accept_len if mode is Mode.SPEC else 1.0) / t

    def decide(self, inputs: PolicyInputs) -> Decision:
        decision = self._decide(inputs)
        self._probe_pending = decision.reason is Reason.PROBE
        return decision

    def _decide(self, inputs: PolicyInputs) -> Decision:
        if inputs.spec_padded_bs is None:
            return Decision(Mode.DECODE, Reason.NO_SPEC_GRAPH)
        spec = self.predicted_tok_s(Mode.SPEC, inputs.bs, inputs.spec_padded_bs, self._ema.value)
        dec = self.predicted_tok_s(Mode.DECODE, inputs.bs, inputs.decode_padded_bs, 1.0)
        if spec is None or dec is None:
            # Uncalibrated sizes: fall back to the mode the calibration cannot rank against.
            return Decision(Mode.DECODE if spec is None else Mode.SPEC, Reason.GOODPUT)
        cur = self._state.mode
        if cur is Mode.SPEC:
            want = Mode.DECODE if dec > spec * (1 + self.margin) else Mode.SPEC
        else:
            want = Mode.SPEC if spec > dec * (1 + self.margin) else Mode.DECODE
        if want is not cur and self._state.must_dwell(self.min_dwell_steps):
            return Decision(cur, Reason.DWELL)
        if want is Mode.DECODE and cur is Mode.DECODE and self._probe_due(inputs, dec):
            return Decision(Mode.SPEC, Reason.PROBE)
        return Decision(want, Reason.GOODPUT)

    def _probe_due(self, inputs: PolicyInputs, dec_tok_s: float) -> bool:
        if not self.probe_every or self._state.steps_since_probe < self.probe_every:
            return False
        best = self.predicted_tok_s(Mode.SPEC, inputs.bs, inputs.spec_padded_bs or 0,
                                    self.calibration.num_draft_tokens + 1.0)
        return best is not None and best > dec_tok_s * (1 + self.margin)

    def observe_accept(self, mean_accept_len: float) -> None:
        self._ema.update(mean_accept_len)

    def commit(self, mode: Mode) -> None:
        self._state.commit(mode, probe=self._probe_pending)
        self._probe_pending = False

    @property
    def accept_len_ema(self) -> float:
        return self._ema.value
