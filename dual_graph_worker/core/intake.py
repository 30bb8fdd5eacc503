"""Which estimate a measured time feeds: a step's seconds are a sample of its key's step time,
or the excess of a catch-up or a switch it carried, or nothing (an idle gap, a stall, a span
cut short or started late). Prefills' seconds feed the prefill fits. All of it rank-local."""

from __future__ import annotations

from typing import Optional

from dual_graph_worker.core.batch_costs import BatchCosts
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import PrefillTime, StepTime
from dual_graph_worker.core.step_times import StepTimeTable

# A sample this many times the current estimate is an idle gap, not a step.
_OUTLIER = 8.0
# One this many times it is a stall (a GC pause, finished requests' host work), unless the key's
# next step is one too: then it is the key's cost now.
_SPIKE = 3.0
_NO_ESTIMATE_MAX_S = 2.0
# The step after a prefill's held-back first, or after a catch-up, often still starts inside its
# work: it is taken back once the next step of its key reads it this much short.
_EARLY_SHORT = 0.9

# A step sample in this window's sums, or waiting for the next (a plain tuple: one is built every
# step, a NamedTuple costs ~0.3 us more): key, context tokens, seconds, above its line, early
# (the first taken after a prefill or a catch-up: the next step of its key may take it back),
# after a catch-up (it waits through an exchange for that step).
_Sample = tuple[int, float, float, bool, bool, bool]


class SampleIntake:
    """Routes StepTime and PrefillTime observations into `times` and `costs`."""

    def __init__(self, times: StepTimeTable, costs: BatchCosts) -> None:
        self._times = times
        self._costs = costs
        self._last_mode: Optional[Mode] = None    # the last step's mode (switches)
        # The samples whose last one was held back as a lone outlier (_hold_lone): a step key,
        # or a catch-up kind (at a switch or not) and size (a power of two).
        self._held: set = set()
        # The kinds of prefill (with the draft or not) seen: the process's first of each is
        # held back.
        self._prefilled: set[bool] = set()
        # A prefill came since the last step; the last step was held back for one; the last
        # batch held the next one's launch; the last step caught the draft up; the last step's
        # sample while in this window's sums; the key of the last step if it was held back as
        # short.
        self._after_prefill = self._held_after_prefill = self._after_carry = False
        self._after_catch_up = False
        self._last_sample: Optional[_Sample] = None
        # A last sample taken after a catch-up, kept out of the exchange until the next step
        # says whether it stands (a quarter of them read over 10% short).
        self._waiting: Optional[_Sample] = None
        self._short: Optional[int] = None
        # The key of the last step if it was held back as an idle gap: a second in a row says
        # the key's line reads far too low instead.
        self._gap: Optional[int] = None
        # The excess of a step that carried the next batch's launch, which belongs to that
        # batch (a catch-up's, a prefill's or a switch's cost); None when none is held.
        self._carry: Optional[float] = None
        self._carry_bs = 0

    def exchanging(self, hold: bool = True) -> None:
        """The window's sums leave for the exchange: its last sample can no longer be dropped,
        unless it came after a catch-up and `hold`: that one waits for the next step in the next
        window."""
        last, self._last_sample = self._last_sample, None
        if hold and last is not None and last[5]:
            self._times.drop(*last[:3])
            self._waiting = last

    def prefill(self, event: PrefillTime) -> None:
        self._after_prefill = True
        self._after_carry = self._after_catch_up = False
        carry, self._carry = self._carry or 0.0, None
        if event.tokens <= 0:
            return
        # Judged on what every rank shares (its kind and tokens), not on its rank-local time.
        if event.draft not in self._prefilled:      # a first call pays one-off start-up work
            self._prefilled.add(event.draft)
            return
        if 0 < event.seconds < _NO_ESTIMATE_MAX_S * 8:
            self._costs.add_prefill(event.draft, float(event.tokens),
                                    float(event.seconds) + carry)

    def step(self, event: StepTime) -> None:
        after_prefill, self._after_prefill = self._after_prefill, False
        after_carry, self._after_carry = self._after_carry, event.carries_next
        # Only a catch-up whose launch the previous step held (overlap scheduling) shifts the
        # next step's span.
        after_catch_up, self._after_catch_up = \
            self._after_catch_up, event.catch_up_tokens > 0 and after_carry
        last, self._last_sample = self._last_sample, None
        if self._waiting is not None:
            last, self._waiting = self._waiting, None
            self._times.add(*last[:3])
        short, self._short = self._short, None
        gap, self._gap = self._gap, None
        carry, self._carry = self._carry, None
        # An eager step (no key) still ends its mode's run: the next catch-up is at a switch.
        switched = self._last_mode not in (None, event.mode)
        at_switch = self._last_mode is Mode.DECODE
        self._last_mode = event.mode
        times = self._times
        i = times.at[event.mode].get(event.padded_bs)
        if i is None or not event.seconds > 0:
            return
        # Samples are judged against the key's own line; costs beyond a step are what is left
        # over the step as priced (its own line, or lower where it leans on its neighbours).
        expected, priced = times.line_times(i, event.kv_tokens)
        if carry is not None and event.bs != self._carry_bs:
            # Requests left or joined in between: that excess also holds their host work
            # (finished results, the new batch), which no launch of this one costs.
            carry = None
        if carry is not None and switched and not event.catch_up_tokens:
            # The previous step held this switch's launch, so this one's span starts late: a
            # switch costs the two steps' excess (as a catch-up does).
            excess = None if event.carries_next else self._excess(i, event.seconds, priced)
            self._costs.add_switch(carry + (excess or 0.0))
        if event.catch_up_tokens > 0:
            # One that held the next launch (a switch's, a prefill's) is no sample of either:
            # its span mixes the two, and right after a prefill it starts late.
            if not event.carries_next:
                self._catch_up_sample(i, event, priced, carry, at_switch)
        elif event.carries_next:
            # Not a plain step's cost: its excess goes to the batch whose launch it holds.
            self._carry = self._excess(i, event.seconds, priced)
            self._carry_bs = event.bs
        elif not after_carry:         # one whose launch the previous step held starts late
            self._step_sample(i, event, expected, last, short, gap, after_prefill,
                              after_catch_up)

    def _catch_up_sample(self, i: int, event: StepTime, priced: float, carry: Optional[float],
                         at_switch: bool) -> None:
        """The catch-up's cost: this step's excess over a measured step of its size plus the
        previous step's (which held this one's launch); fixed cost and switch included, noise
        of either sign averages out in the regression."""
        excess = self._excess(i, event.seconds, priced)
        if excess is None:
            return
        x, y = float(event.catch_up_tokens), excess + (carry or 0.0)
        if not self._first_call_cost(at_switch, x, y, priced):
            self._costs.add_catch_up(at_switch, x, y)

    def _step_sample(self, i: int, event: StepTime, expected: Optional[float],
                     last: Optional[_Sample], short: Optional[int], gap: Optional[int],
                     after_prefill: bool, after_catch_up: bool) -> None:
        """Key i's sample from a plain step, unless it is none: the first after a prefill, an
        idle gap, a step cut short or a lone stall. `last`: the previous step's sample, `short`,
        `gap`: the key of the previous step if it was held back as short, as an idle gap."""
        times = self._times
        # The first step after a prefill is no clean sample: its span starts inside the prefill's.
        # Every other one is taken, so a prefill before every step still leaves samples.
        if after_prefill and not self._held_after_prefill:
            self._held_after_prefill = True
            return
        early, self._held_after_prefill = self._held_after_prefill or after_catch_up, False
        # An idle gap or a first-call warm-up is no step: more than _OUTLIER times the estimate
        # (measured, else the prior: start-up replays are off by a few times, not by eight).
        # But a second in a row within _SPIKE of what the key's neighbours or prior price it at is
        # its cost: its own line reads far too low (else nothing would ever raise it).
        outlier = expected is not None and event.seconds > _OUTLIER * expected
        if outlier and not (gap == i and self._in_line_with_others(i, event)):
            self._gap = i
            return
        if expected is None and event.seconds > _NO_ESTIMATE_MAX_S:
            return
        # Nor is a lone one under a third of the key's line (a batch's last step, cut short under
        # overlap), nor the step before it if of the same key and above its line: that one holds
        # the finished requests' work. Two in a row are the key's cost. A key not measured yet is
        # judged on its neighbours' or the prior's line: as its first sample such a step would
        # price its mode many times too cheap, and every true step after it as an idle gap.
        if expected is not None and event.seconds * _SPIKE < expected and short != i:
            if last is not None and last[0] == i and last[3]:
                times.drop(*last[:3])
            self._short = i
            return
        # A lone stall is no step either: as a size's first sample it would price its mode out
        # until the size is re-measured. Two in a row are the key's cost.
        stall = not outlier and expected is not None and event.seconds > _SPIKE * expected
        if self._hold_lone(i, stall):
            return
        x, y = float(event.kv_tokens), event.seconds
        if last is not None and last[4] and last[0] == i and last[2] < _EARLY_SHORT * y:
            times.drop(*last[:3])
        times.add(i, x, y)
        self._last_sample = (i, x, y, expected is not None and y > expected, early, after_catch_up)

    def _in_line_with_others(self, i: int, event: StepTime) -> bool:
        """The step reads under _SPIKE times key i's step as its neighbours or prior price it."""
        others = self._times.others_time(i, event.kv_tokens)
        return others is not None and event.seconds < _SPIKE * others

    def _first_call_cost(self, at_switch: bool, tokens: float, seconds: float,
                         step: float) -> bool:
        """Whether a catch-up is held back as a lone one-time cost (a first forward at its shape):
        a whole `step` over its line, at a rate beyond its fixed part that the draft alone does
        not reach (draft_rate_cap). Two in a row of a kind and size (a power of two) are the
        cost. The process's first catch-up is judged so too: its index path's first call is
        the dearest of all."""
        costs = self._costs
        ceiling = costs.catch_up_ceiling(tokens)
        spike = ceiling is not None and \
            seconds > costs.catch_up_seconds(int(tokens)) + step and seconds > ceiling
        return self._hold_lone(("catch-up", at_switch, int(tokens).bit_length()), spike)

    def _hold_lone(self, key: object, outlier: bool) -> bool:
        """Whether to hold back a sample of `key`: an outlier unless the last one of that key
        was too (two in a row are its cost)."""
        if not outlier and not self._held:          # the common case: nothing to hold or end
            return False
        if outlier and key not in self._held:
            self._held.add(key)
            return True
        self._held.discard(key)
        return False

    def _excess(self, i: int, seconds: float, expected: Optional[float]) -> Optional[float]:
        """Seconds beyond key i's expected step, if it is measured and this is no idle gap."""
        if self._times.samples[i] > 0 and seconds < _OUTLIER * expected + _NO_ESTIMATE_MAX_S:
            return seconds - expected
        return None
