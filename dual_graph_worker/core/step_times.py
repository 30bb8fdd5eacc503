"""Each (mode, padded batch size)'s step seconds, as measured while serving: per key a recent
mean at its recent mean context, moved along its seconds per context token; sizes not measured
lean on their measured neighbours, the start-up calibration is only the prior. Samples gather
rank-locally and reach the estimates only at an exchange (`fold`)."""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections import deque
from typing import Any, Mapping, Optional, Sequence

from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.estimates import KeyEstimate, StepTimeEstimates
from dual_graph_worker.core.exchange import KeyWindow, StepSums
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.regressions import FAR_ERRORS, KEY_SLOTS, ContextSums

# A measured step time predicts no less than this share of itself at a shorter context.
_CONTEXT_FLOOR = 0.25
# An unmeasured key's estimate above its typical level relaxes down toward it, so a host spell
# that ended its mode's last run does not price the mode out long after; only down, since an
# estimate too low gets its mode run and measured (docs/design.md: the windows and the pace).
_RELAX_STEPS = 128
_RELAX_MIN_STEPS = 16
_HIGH = 0.1
_TYPICAL_WINDOWS = 16
_TYPICAL_MIN_COUNT = 4
_TYPICAL_HORIZON = 4096
_SETTLED = 0.002
# A process's first steps run slow: a key measured only then takes its next window whole.
_WARM_STEPS = 64
# Speculation's first steps in a process can all run slow (decode's do not): until it has run
# this many, the choice prices its keys down toward the prior, by at most the factor (at most
# that many wrong steps, once), and a key measured only then takes its next window whole where
# that comes lower.
_MODE_WARM_STEPS = 128
_MODE_WARM_FACTOR = 1.3
# A key's own samples weigh in proportion to their count up to this many; short of it, where
# sizes measured that often on both sides price it lower, the rest is their line.
_TRUSTED_SAMPLES = 8
# A measured key's step line: intercept, seconds per context token, the context that rate
# reaches, the rate beyond. A key's step time is a weighted sum of such lines, held to a floor.
_Part = tuple[float, float, float, float]
_Line = tuple[float, tuple[tuple[float, float, _Part], ...]]
# A key's step seconds on its own line and as priced (None: unknown); a plain tuple, read every
# step.
KeyTimes = tuple[Optional[float], Optional[float]]
# A line not fitted since the last exchange.
_UNFIT: Any = object()
_UNREAD: Any = object()         # a key's context, not read since the fold


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


def _single(t: float, part: _Part) -> _Line:
    """A line of one part, held to _CONTEXT_FLOOR of `t`."""
    return _CONTEXT_FLOOR * t, ((1.0, 1.0, part),)


def _blend(a: _Line, b: _Line, w: float) -> _Line:
    """w of line a and 1 - w of line b."""
    (floor_a, parts_a), (floor_b, parts_b) = a, b
    return (w * floor_a + (1.0 - w) * floor_b,
            tuple((w * f, w * r, part) for f, r, part in parts_a)
            + tuple(((1.0 - w) * f, (1.0 - w) * r, part) for f, r, part in parts_b))


class StepTimeTable:
    """Step-time estimates per key: an index, spec sizes ascending, then decode sizes ascending
    (`spec_at`, `decode_at`: padded bs -> key). `sizes`: each pool's captured batch sizes;
    `prior`: the start-up calibration or None; `ema_alpha`: a sample's weight in its key's mean."""

    def __init__(self, sizes: Mapping[Mode, Sequence[int]], prior: Optional[CalibrationTable],
                 ema_alpha: float) -> None:
        self._keys = [(m, int(b)) for m in (Mode.SPEC, Mode.DECODE)
                      for b in sorted(sizes.get(m, ()))]
        self.at = {m: {b: i for i, (km, b) in enumerate(self._keys) if km is m}
                   for m in (Mode.SPEC, Mode.DECODE)}
        self.spec_at, self.decode_at = self.at[Mode.SPEC], self.at[Mode.DECODE]
        self._mode_of = [m for m, _ in self._keys]
        self._keep = 1.0 - ema_alpha
        n = self.size = len(self._keys)
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
        self.samples = [0.0] * n                 # per key, folded so far
        self._seen = {m: [] for m in (Mode.SPEC, Mode.DECODE)}   # per mode, keys with samples
        self._last = [-math.inf] * n             # step of the last fold with samples
        self._mode_steps = {Mode.SPEC: 0, Mode.DECODE: 0}    # steps run in each, until spec warms
        # Speculation has run fewer than _MODE_WARM_STEPS and decode at least that many
        # (spec_warm_time); warmed once speculation has, for good, or from the start without a
        # prior to price against.
        self.spec_cold = False
        self.warmed = prior is None
        self._cold_keys = [False] * n           # spec keys measured only while it warmed up
        # Per key: its recent windows (mean seconds, mean context tokens, step, the slope of
        # the line through the origin and that step: _moved's bound) and their typical level
        # (seconds, context tokens).
        self._windows: dict[int, deque[tuple[float, float, int, float]]] = {}
        self._typical: dict[int, tuple[float, float]] = {}
        self._relaxing: set[int] = set()
        self._high_steps = [0.0] * n            # the latest samples over the typical level
        self._exchanged_at = 0
        # Per key, until the next fold: its line, and the line it may lean on (_lean_line).
        self._lines: list = [_UNFIT] * n
        # Per key, until the next fold: the context it was last read at and line_times' answer
        # there (a step reads its key twice at one context: the choice, then its sample).
        self._read_kv: list = [_UNREAD] * n
        self._read_times: list = [None] * n
        # Rank-local sums per key since the last exchange, in Python floats (a numpy slice
        # update costs ~1 us a step), a window in KeyWindow's field order: never read by a
        # decision.
        self._step_sums: dict[int, list[float]] = {}
        # Per key, a lone sample that with company would replace the estimate (_replaces): its
        # window waits one exchange for the next (a re-measurement split by an exchange).
        self._held: dict[int, KeyWindow] = {}

    # ------------------------------------------------------------------------------ read

    def step_time(self, mode: Mode, padded_bs: int, kv_tokens: int = 0) -> Optional[float]:
        """Expected seconds of a step over `kv_tokens` context tokens, as priced (line_time):
        this size's line where it is measured (or the lower line it leans on while its samples
        are few), else the nearest measured sizes' times at that context, interpolated by size,
        their fixed parts scaled by the prior's ratio between the sizes, else its prior; None
        where nothing prices it. Beyond the contexts a line has seen, its own rate counts only
        where it is surely steeper than its mode's pooled one."""
        return self.line_time(self.at[mode].get(padded_bs), kv_tokens)

    def line_time(self, i: Optional[int], kv_tokens: int) -> Optional[float]:
        """Key i's step seconds at `kv_tokens` as priced: the lower of its line and the line it
        leans on."""
        return self.line_times(i, kv_tokens)[1]

    def line_times(self, i: Optional[int], kv_tokens: int) -> KeyTimes:
        """Key i's step seconds at `kv_tokens` on its own line (what its samples are judged
        against) and as priced."""
        if i is None:
            return None, None
        if self._read_kv[i] == kv_tokens:
            return self._read_times[i]
        # Estimates change only at an exchange, so each key's lines are kept until the next one.
        lines = self._lines[i]
        if lines is _UNFIT:
            line = self._fit_line(i)
            lines = self._lines[i] = (line, self._lean_line(i, line))
        line, lean = lines
        if line is None:
            times = None, None
        else:
            t = _time_on(line, kv_tokens)
            times = t, (t if lean is None else min(t, _time_on(lean, kv_tokens)))
        self._read_kv[i], self._read_times[i] = kv_tokens, times
        return times

    def spec_warm_time(self, spec_key: Optional[int], spec_t: Optional[float],
                       kv_tokens: int) -> Optional[float]:
        """Spec key `spec_key`'s step seconds `spec_t` as the choice of mode prices them while
        speculation warms up (spec_cold): its prior, moved along the pooled slope, where that is
        lower, but never below spec_t / _MODE_WARM_FACTOR."""
        if spec_t is None or math.isnan(self._prior[spec_key]):
            return spec_t
        warm = self._prior[spec_key] + self._beta[Mode.SPEC] * kv_tokens
        return min(spec_t, max(spec_t / _MODE_WARM_FACTOR, warm))

    def measured(self, i: Optional[int]) -> bool:
        return i is not None and self.samples[i] > 0

    def measured_at(self, i: int) -> float:
        """The step key i was last folded with samples at (-inf: never)."""
        return self._last[i]

    def _lean_line(self, i: int, own: Optional[_Line]) -> Optional[_Line]:
        """A key measured fewer than _TRUSTED_SAMPLES times: its line at count/_TRUSTED_SAMPLES,
        the rest the line of trusted sizes on both sides of it. The mode not in use keeps its
        estimates until re-measured, so only a price that comes down counts (line_times takes
        the lower); one priced too low is measured as soon as its mode runs."""
        trust = self.samples[i] / _TRUSTED_SAMPLES
        if own is None or not 0.0 < trust < 1.0:
            return None
        near = self._neighbours_line(i, min_samples=_TRUSTED_SAMPLES)
        return None if near is None else _blend(own, near, trust)

    def others_time(self, i: int, kv_tokens: int) -> Optional[float]:
        """Key i's step seconds at `kv_tokens` as its measured neighbours or the prior price it,
        its own samples aside."""
        line = self._others_line(i)
        return None if line is None else _time_on(line, kv_tokens)

    def _fit_line(self, i: int) -> Optional[_Line]:
        if self.samples[i]:
            return _single(self._est[i], self._own_part(i))
        return self._others_line(i)

    def _others_line(self, i: int) -> Optional[_Line]:
        """Key i's line from its nearest measured sizes, else from its prior."""
        prior = self._prior[i]
        near = self._neighbours_line(i)
        if near is None and not math.isnan(prior):
            beta = self._beta[self._mode_of[i]]
            return _single(prior, (prior, 0.0, 0.0, beta))
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
        seen = self._seen[self._mode_of[i]]
        if min_samples:
            seen = [j for j in seen if self.samples[j] >= min_samples]
        if not seen:
            return None
        prior = self._prior[i]
        lo, hi = bisect_left(seen, i), bisect_right(seen, i)
        near = seen[max(lo - 1, 0):lo] + seen[hi:hi + 1]       # the nearest below and above
        if min_samples and len(near) < 2:
            return None
        weights = [1.0]
        if len(near) == 2:
            size = [self._keys[j][1] for j in (near[0], i, near[1])]
            w = (size[1] - size[0]) / (size[2] - size[0])
            weights = [1.0 - w, w]
        # The neighbours' fixed parts scaled by the prior's ratio between this size and them,
        # held between the same cost and one in proportion to the batch (start-up replays are
        # noisy); their seconds per context token interpolated, unscaled (a step's fixed part
        # grows with the batch, attention's cost per token read does not).
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

    def estimates(self) -> StepTimeEstimates:
        """Per measured (mode, padded bs) the step seconds, its sample count, prior, mean context
        tokens and seconds per context token; each mode's pooled seconds per context token."""
        steps = {m.value: {} for m in (Mode.SPEC, Mode.DECODE)}
        for i, (m, b) in enumerate(self._keys):
            if self.samples[i] > 0:
                prior = None if math.isnan(self._prior[i]) else self._prior[i]
                steps[m.value][b] = KeyEstimate(self._est[i], int(self.samples[i]), prior,
                                                self._est_kv[i], self._key_slope(i))
        return StepTimeEstimates(steps, {m.value: b for m, b in self._beta.items()})

    # ------------------------------------------------------------------------------ write

    def ran(self, mode: Mode) -> None:
        """A step of `mode` was committed, while speculation is warming up."""
        steps = self._mode_steps
        steps[mode] += 1
        if steps[mode] == _MODE_WARM_STEPS:
            if mode is Mode.SPEC:
                self.warmed, self.spec_cold = True, False
            else:
                self.spec_cold = True

    def add(self, i: int, x: float, y: float) -> None:
        """A step sample of key i: `y` seconds over `x` context tokens (rank-local)."""
        acc = self._step_sums.get(i)
        if acc is None:
            acc = self._step_sums[i] = [0.0] * KEY_SLOTS
        acc[0] += y
        acc[1] += 1.0
        acc[2] += x
        acc[3] += x * x
        acc[4] += x * y
        acc[5] += y * y

    def drop(self, i: int, x: float, y: float) -> None:
        """Take a sample of this window back out of key i's sums."""
        acc = self._step_sums[i]
        for slot, v in enumerate((y, 1.0, x, x * x, x * y, y * y)):   # as add added it
            acc[slot] -= v
        if acc[1] < 0.5:
            del self._step_sums[i]

    def take_local(self) -> StepSums:
        """This rank's sums since the last exchange (keys ascending, as on the wire), and
        cleared."""
        local = StepSums(self.size, {i: KeyWindow(*acc)
                                     for i, acc in sorted(self._step_sums.items())})
        self._step_sums.clear()
        return local

    def fold(self, sums: StepSums, step: int) -> None:
        """Every rank's sums (take_local's, reduced) at `step`: each key's EMA of step
        seconds and of context tokens, and the context regressions; the keys not measured since
        the last exchange relax down toward their typical level. The sums hold windows of a
        few keys: those are folded one by one. A window of two samples or more replaces the
        estimate whole where the one before it is known to be off: the process's first steps,
        speculation's warm-up, or a spell it is back from; a lone sample that would, waits one
        exchange for the next window (whose samples it joins) rather than be smoothed away."""
        n = self.size
        self._lines = [_UNFIT] * n
        self._read_kv = [_UNREAD] * n
        self._ctx.decay()
        held, self._held = self._held, {}
        if held:
            sums = sums.plus(held)
        got = list(sums.windows)
        self._relax_idle(set(got), step)
        if not got:                 # every sum decayed alike: the same slopes
            return
        keep = self._keep
        # Judged as the window is folded: samples taken cold and folded after count as warm.
        spec_cold = not self.warmed
        for i, window in sums.windows.items():
            count = window.steps
            mean, mean_kv = window.seconds / count, window.tokens / count
            cold = spec_cold and self._mode_of[i] is Mode.SPEC
            measured = self.samples[i] > 0
            if count < 2 and i not in held and measured:
                slope = self._key_slope(i)
                bound = self._high_bound(i, slope, mean_kv)
                if self._replaces(i, mean, mean_kv, slope, bound, cold, step):
                    self._held[i] = window
                    continue
            self._ctx.add(i, self._mode_of[i], window)
            slope = self._key_slope(i)
            if count >= _TYPICAL_MIN_COUNT:
                self._add_window(i, mean, mean_kv, step, slope)
            bound = self._high_bound(i, slope, mean_kv)
            high = bound is not None and mean > bound
            self._high_steps[i] = self._high_steps[i] + count if high else 0.0
            if not measured:
                insort(self._seen[self._mode_of[i]], i)
            else:
                whole = count >= 2 and self._replaces(i, mean, mean_kv, slope, bound, cold,
                                                      step)
                w = 1.0 if whole else 1.0 - keep ** count
                mean = self._est[i] + w * (mean - self._est[i])
                mean_kv = self._est_kv[i] + w * (mean_kv - self._est_kv[i])
            # A lone sample is no window to take whole: the key stays cold-only past it.
            self._cold_keys[i] = cold and (self._cold_keys[i] or not measured) or \
                self._cold_keys[i] and count < 2
            self._est[i], self._est_kv[i] = mean, mean_kv
            self.samples[i] += count
            self._last[i] = step
            if i in self._typical:      # a window too short to count still moves the estimate
                self._relaxing.add(i)
        self._beta = {m: self._ctx.pooled(m) for m in self._beta}

    def _replaces(self, i: int, mean: float, kv: float, slope: float, bound: Optional[float],
                  cold: bool, step: int) -> bool:
        """A window of `mean` seconds over `kv` context tokens replaces key i's estimate where
        the estimate is known to be off: the process's first steps, speculation's warm-up
        (`cold`: the window is), or a spell ended (the window back within `bound`, the key's
        typical level, while the estimate stands over it)."""
        back = bound is not None and mean <= bound < _moved(slope, self._est[i],
                                                             self._est_kv[i], kv)
        return self._last[i] < _WARM_STEPS <= step or \
            (self._cold_keys[i] and not cold and mean < self._est[i]) or back

    def _add_window(self, i: int, mean: float, kv: float, step: int, slope: float) -> None:
        """Key i's window of samples into its recent ones, and its typical level anew (its
        windows moved along `slope` to this one's context)."""
        windows = self._windows.get(i)
        if windows is None:
            windows = self._windows[i] = deque(maxlen=_TYPICAL_WINDOWS)
        windows.append((mean, kv, step, mean / max(kv, 1.0)))
        oldest = step - _TYPICAL_HORIZON
        # _moved over every window, inline (one call each cost ~twice the sum), its bound kept.
        levels = sorted([t + min(slope, steepest) * (kv - x)
                         for t, x, at, steepest in windows if at >= oldest])
        self._typical[i] = (levels[(len(levels) - 1) // 2], kv)

    def _high_bound(self, i: int, slope: float, kv: float) -> Optional[float]:
        """Key i's typical level moved along `slope` to `kv` context tokens, _HIGH over (None:
        no level yet)."""
        level = self._typical.get(i)
        if level is None:
            return None
        return (1.0 + _HIGH) * _moved(slope, level[0], level[1], kv)

    def _relax_idle(self, measured: set[int], step: int) -> None:
        """Move each unmeasured key's estimate down toward its typical level, for the steps
        since the last exchange; a key that reached it is left alone until measured again."""
        steps = step - self._exchanged_at
        self._exchanged_at = step
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
