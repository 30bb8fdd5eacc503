"""What speculation costs outside its steps: the draft's prefill of new prompts (the workload's
prompt share), a catch-up of the draft's backlog and a switch back to decode. Batches' seconds
gather rank-locally (`add_*`) and reach the fits only at an exchange (`fold`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

from dual_graph_worker.core.estimates import BatchCostEstimates
from dual_graph_worker.core.exchange import BatchSums
from dual_graph_worker.core.regressions import (CATCH_UP_MIN_SPREAD, MIN_EVENTS,
                                                PREFILL_MIN_SPREAD, Slope)

# Per exchange, how much of the prompt/output token history is kept (~20 exchanges).
_WORKLOAD_DECAY = 0.95
# Catch-ups are rarer than prefills: their regression keeps ~100 exchanges of history.
_CATCH_UP_DECAY = 0.99
# Below this many tokens per catch-up, a catch-up's fixed cost (one more draft forward) hides
# its per-token rate: the plain ratio is no rate then.
_RATIO_MIN_TOKENS = 512
# Beyond the catch-up sizes seen, a draft token costs at most 1/_RATE_CAP of a prefill token,
# and at most _SHARE_CAP times the draft's share of one where known (docs/design.md, catch-ups).
_RATE_CAP = 3.0
_SHARE_CAP = 2.0
_NOT_PER_TOKEN = ("lm_head", "wte", "shared_head")


def _line_sums(x: float, y: float) -> tuple[float, ...]:
    """One (x, y) point's share of a Slope's sums (regressions.LINE's layout)."""
    return 1.0, x, y, x * x, x * y


def _add(sums: list[float], values: tuple[float, ...]) -> None:
    """`values` added to `sums`, place by place."""
    for at, v in enumerate(values):
        sums[at] += v


def draft_share(target: Iterable[tuple[str, int]], draft: Iterable[tuple[str, int]]) -> float:
    """The draft's share of a prefill's weights, from each model's (parameter name, size):
    embeddings and LM heads left out (a lookup; a prefill's logits are its last token's).
    Sizes must count weights, not packed elements: an engine with quantized weights passes 0."""
    def per_token(params: Iterable[tuple[str, int]]) -> int:
        return sum(size for name, size in params
                   if not any("embed" in part or part in _NOT_PER_TOKEN
                              for part in name.split(".")))
    t, d = per_token(target), per_token(draft)
    return d / (t + d) if t + d > 0 else 0.0


def passes_too_short(pass_tokens: int, split_from: int) -> Optional[str]:
    """Why catch-up passes of `pass_tokens` cannot be split as CatchUpWork prices them (a pass
    of at least twice split_from), or None."""
    if pass_tokens < 2 * split_from:
        return (f"catch-up passes hold at most {pass_tokens} tokens, under twice the "
                f"{split_from} a pass needs to be split")
    return None


@dataclass(frozen=True)
class CatchUpWork:
    """An engine whose catch-up passes (of at most `pass_tokens`, at least twice `split_from`)
    compute only the draft's K/V from `split_from` tokens a pass (DGW_CATCH_UP_KV_ONLY): every
    catch-up of `split_from` tokens and more then splits a pass. Those are fitted on a line of
    their own, since their host work makes them no fixed share of the whole layer's; until
    that line is fitted, a token of theirs is priced at `kv_share` of a whole-layer token."""

    split_from: int
    kv_share: float
    pass_tokens: int

    def __post_init__(self) -> None:
        if self.split_from < 1 or passes_too_short(self.pass_tokens, self.split_from) \
                or not 0 < self.kv_share <= 1:
            raise ValueError(f"catch-up work: need 1 <= 2 * split_from <= pass_tokens and "
                             f"kv_share in (0, 1], got {self.split_from}, {self.pass_tokens}, "
                             f"{self.kv_share}")

    def fills(self, tokens: float) -> bool:
        """Whether a catch-up of `tokens` fills the draft's K/V alone in some pass: passes of
        at least twice split_from, packed greedily, leave none shorter unless all are."""
        return tokens >= self.split_from

    def split(self, tokens: float) -> tuple[int, float]:
        """The passes a catch-up of `tokens` splits and the tokens in them: its full passes, and
        a last one of split_from and more (a shorter one runs the whole layer)."""
        full, rest = divmod(tokens, self.pass_tokens)
        last = rest >= self.split_from
        return int(full) + last, full * self.pass_tokens + (rest if last else 0.0)

    def tokens(self, tokens: float) -> float:
        """`tokens` caught up, as whole-layer tokens: those of split passes at kv_share (each
        request's last row, run whole, is left out)."""
        split = self.split(tokens)[1]
        return tokens - split + self.kv_share * split


class BatchCosts:
    """The fits of prefills, catch-ups and switches, and the workload's prompt share.
    `draft_floor`, `draft_share`, `work`: ControllerConfig's (catch_up_work); `max_rows`:
    request rows tracked (0: none, and no turnover is counted)."""

    def __init__(self, draft_floor: bool, draft_share: float, max_rows: int,
                 work: Optional[CatchUpWork] = None) -> None:
        self._draft_floor_on = draft_floor
        self._draft_share = draft_share
        self._work = work
        self._prefill = {d: Slope(PREFILL_MIN_SPREAD, _WORKLOAD_DECAY) for d in (True, False)}
        # Catch-ups at a switch carry the switch; those inside a speculative run do not.
        self.catch_up = {at_switch: Slope(CATCH_UP_MIN_SPREAD, _CATCH_UP_DECAY)
                         for at_switch in (True, False)}
        self.kv_catch_up = Slope(CATCH_UP_MIN_SPREAD, _CATCH_UP_DECAY)
        # A switch without a catch-up (spec -> decode): decayed count and seconds.
        self._switches = self._switch_sum = 0.0
        # Decayed prompt and output tokens, and requests that joined the running batch and
        # those of them that took a finished request's place: the prompt share counts only
        # those (a batch filling up admits prompts no future step pays for again). A place left
        # waits one exchange for its taker, then counts as the batch shrinking.
        self._prompt = 0.0
        self._output = 0.0
        self._joined = 0.0
        self._took_place = 0.0
        self._vacant = 0
        self.prompt_window = 0.0
        self.output_window = 0.0
        self.batch_rows: Optional[np.ndarray] = None
        # Derived from the above at each exchange (they change nowhere else), read every step:
        # prompt tokens per output token, the draft's seconds per prompt token, a switch's
        # seconds, a catch-up's (fixed s, s per token), a K/V-only catch-up's (None: no line
        # yet), the tokens that rate holds out to and the seconds per token beyond them.
        self.prompt_per_output = 0.0
        self.delta = 0.0
        self.switch_s = 0.0
        self.catch_up_fit: tuple[float, float] = (0.0, 0.0)
        self.kv_catch_up_fit: Optional[tuple[float, float]] = None
        self.catch_up_reach = math.inf
        self._catch_up_far = 0.0
        # The rows admitted to since the running batch's rows were last taken (a reused row
        # holds a new request), those rows, and a scratch mark per row to compare them in C.
        self._admitted_since: Optional[set[int]] = set() if max_rows else None
        self._members: Optional[np.ndarray] = None
        self._mark = np.zeros(max_rows, dtype=bool)
        # Rank-local sums since the last exchange: never read by a decision.
        self._local = BatchSums.zeros()

    # ------------------------------------------------------------------------------ write

    def add_prefill(self, draft: bool, tokens: float, seconds: float) -> None:
        local = self._local
        _add(local.prefill_draft if draft else local.prefill_plain, _line_sums(tokens, seconds))

    def add_catch_up(self, at_switch: bool, tokens: float, seconds: float) -> None:
        local = self._local
        if not self.fills_kv(tokens):
            _add(local.catch_up_switch if at_switch else local.catch_up_run,
                 _line_sums(tokens, seconds))
        elif at_switch:
            # Inside a speculative run nothing is priced from them: the draft's prefill of a
            # prompt there runs the whole layer.
            _add(local.kv_catch_up, _line_sums(tokens, seconds))

    def fills_kv(self, tokens: float) -> bool:
        """Whether a catch-up of `tokens` fills the draft's K/V alone in some pass."""
        return self._work is not None and self._work.fills(tokens)

    def work_tokens(self, tokens: float) -> float:
        """A catch-up's tokens as the draft's whole-layer tokens (CatchUpWork)."""
        return tokens if self._work is None else self._work.tokens(tokens)

    def catch_up_ceiling(self, tokens: float) -> Optional[float]:
        """The dearest a catch-up of `tokens` can be from the draft's work alone: the whole
        layer's fixed part and draft_rate_cap a token (filling K/V alone is never dearer);
        None before the cap is known."""
        cap = self.draft_rate_cap()
        return None if cap is None else self.catch_up_fit[0] + tokens * cap

    def add_switch(self, seconds: float) -> None:
        _add(self._local.switches, (1.0, seconds))

    def admitted(self, tokens: int, rows: Optional[list[int]]) -> None:
        """A prefill of `tokens` prompt tokens; new requests hold `rows` (None: not known)."""
        self.prompt_window += tokens
        if rows is not None and self._admitted_since is not None:
            self._admitted_since.update(rows)

    def served(self, rows: Optional[np.ndarray], tokens: float) -> None:
        """A step gave `tokens` output tokens to the requests of `rows`."""
        self.batch_rows = rows
        self.output_window += tokens

    def take_local(self) -> BatchSums:
        """This rank's sums since the last exchange, and cleared."""
        local, self._local = self._local, BatchSums.zeros()
        return local

    def fold(self, sums: BatchSums) -> None:
        """Every rank's sums (take_local's, reduced), and the workload's prompt share; then the
        terms derived from them."""
        # Nothing new: every fit, a ratio of sums decayed alike, is unchanged.
        new = not sums.empty()
        for fit, window in ((self._prefill[True], sums.prefill_draft),
                            (self._prefill[False], sums.prefill_plain),
                            (self.catch_up[True], sums.catch_up_switch),
                            (self.catch_up[False], sums.catch_up_run),
                            (self.kv_catch_up, sums.kv_catch_up)):
            fit.fold(window if new else None)
        switches, seconds = sums.switches
        self._switches = _CATCH_UP_DECAY * self._switches + switches
        self._switch_sum = _CATCH_UP_DECAY * self._switch_sum + seconds
        self.switch_s = max(self._switch_sum / self._switches, 0.0) if self._switches > 0 \
            else 0.0
        self._prompt = _WORKLOAD_DECAY * self._prompt + self.prompt_window
        self._output = _WORKLOAD_DECAY * self._output + self.output_window
        self.prompt_window = self.output_window = 0.0
        joined, left = self._turnover()
        took = min(joined, left + self._vacant)
        self._vacant = min(left + self._vacant - took, left)
        self._joined = _WORKLOAD_DECAY * self._joined + joined
        self._took_place = _WORKLOAD_DECAY * self._took_place + took
        self.prompt_per_output = self.replaced() * self._prompt / self._output \
            if self._output > 0 else 0.0
        if new:
            rates = self._prefill_rates()
            floor, cap = self._draft_floor(rates), self._rate_cap(rates)
            self.delta = max(self._draft_prefill_rate(cap), floor)
            self.catch_up_fit = self._fit_catch_up()
            # From a line alone: a ratio would price a large one from a small one's fixed part.
            self.kv_catch_up_fit = self.kv_catch_up.fit()
            at_switch = self.catch_up[True]     # the sizes the line was fitted on
            self.catch_up_reach = (at_switch if at_switch.fit() is not None
                                   else self._both_catch_ups()).reach()
            rate = self.catch_up_fit[1]
            self._catch_up_far = max(rate if cap is None else min(rate, cap), floor)

    def _turnover(self) -> tuple[int, int]:
        """Requests that joined and left the running batch since the last exchange, from its
        rows then and now (a row re-admitted meanwhile holds a new request); none without rows.
        A request that joined and left in between is missed (fewer steps than sync_every)."""
        rows = self.batch_rows
        if rows is None or self._admitted_since is None:
            return 0, 0
        last, self._members = self._members, np.asarray(rows, dtype=np.intp).copy()
        since = list(self._admitted_since)
        self._admitted_since.clear()
        if last is None:
            return len(rows), 0
        # Those of the last rows that hold the same request now: in the batch still and not
        # admitted to since.
        mark = self._mark
        mark[last] = True
        mark[since] = False
        stayed = int(np.count_nonzero(mark[self._members]))
        mark[last] = False
        return len(rows) - stayed, len(last) - stayed

    # ------------------------------------------------------------------------------ read

    def replaced(self) -> float:
        """The share of joining requests that took a finished request's place (all, without
        the batch's rows)."""
        return self._took_place / self._joined if self._joined > 0 else 1.0

    def _draft_prefill_rate(self, cap: Optional[float]) -> float:
        """The draft's seconds per prompt token: the slope of catch-ups inside speculative runs
        (the same draft extend over deferred prompts, no switch in it), else of all catch-ups,
        else a ratio of large catch-ups (their fixed cost negligible), else the difference of
        the prefill slopes with and without the draft (no more than `cap`), else 0."""
        run, every = self.catch_up[False], self._both_catch_ups()
        for fit in (run.fit(), every.fit()):
            if fit is not None:
                return fit[1]
        for ups in (run, every):
            ratio = ups.ratio()
            if ratio is not None and ups.mean_tokens() >= _RATIO_MIN_TOKENS:
                return max(ratio, 0.0)
        with_draft, plain = self._prefill[True].value(), self._prefill[False].value()
        if with_draft is not None and plain is not None:
            # A difference of two noisy slopes, no catch-up's measurement: held to the cap.
            return min(max(with_draft - plain, 0.0), math.inf if cap is None else cap)
        return 0.0

    def _both_catch_ups(self) -> Slope:
        both = Slope(CATCH_UP_MIN_SPREAD, _CATCH_UP_DECAY)
        both.sums = self.catch_up[True].decayed() + self.catch_up[False].decayed()
        both.events = self.catch_up[True].events + self.catch_up[False].events
        return both

    def _fit_catch_up(self) -> tuple[float, float]:
        """A switch's catch-up, fixed part and rate: the line through the catch-ups at switches;
        where their sizes cannot give one, delta as the rate and their mean excess over it as
        the fixed part (or, with no delta, the ratio of large ones)."""
        at_switch = self.catch_up[True]
        fit = at_switch.fit()
        if fit is not None:
            return fit
        n, mean_tokens = at_switch.sums[0], at_switch.mean_tokens()
        if n <= 0:
            return 0.0, self.delta
        if self.delta == 0.0 and mean_tokens >= _RATIO_MIN_TOKENS:
            return 0.0, max(at_switch.ratio() or 0.0, 0.0)
        return max(at_switch.sums[2] / n - self.delta * mean_tokens, 0.0), self.delta

    def catch_up_seconds(self, tokens: int) -> float:
        """Expected seconds of one catch-up over `tokens` draft tokens: one that fills K/V
        alone, on its own line once it has one; else the whole layer's line (such a catch-up's
        tokens at kv_share: CatchUpWork.tokens) out to the sizes it has seen, beyond them no
        dearer a token than the draft can be (small catch-ups' scatter, a switch's costs
        riding on them, fits any rate)."""
        if tokens <= 0:
            return 0.0
        if self.kv_catch_up_fit is not None and self.fills_kv(tokens):
            fixed, rate = self.kv_catch_up_fit
            return fixed + rate * tokens
        work = self.work_tokens(tokens)
        fixed, rate = self.catch_up_fit
        beyond = max(work - self.catch_up_reach, 0.0)
        return max(fixed + rate * (work - beyond) + self._catch_up_far * beyond, 0.0)

    def _draft_floor(self, rates: tuple[Optional[float], Optional[float]]) -> float:
        """The least a draft token can cost: the draft's share of a prefill token with it (a
        catch-up fitted on a few hundred tokens can read 0 a token); `rates`: _prefill_rates."""
        if not self._draft_floor_on:
            return 0.0
        share = min(self._draft_share, 1.0 / _RATE_CAP)     # no dearer than draft_rate_cap
        # The lower reading: prefills with the draft are rare where they are deferred, so a
        # slow first call's would stand for minutes.
        with_draft, plain = rates
        readings = (with_draft, None if plain is None else plain / (1.0 - share))
        return share * min((r for r in readings if r is not None), default=0.0)

    def _prefill_rates(self) -> tuple[Optional[float], Optional[float]]:
        """A prefill's seconds per token with the draft and without it (_prefill_rate)."""
        return self._prefill_rate(True), self._prefill_rate(False)

    def _prefill_rate(self, draft: bool) -> Optional[float]:
        """A prefill's seconds per token (with the draft or not): its line's slope, else, where
        prefills were of one size (a wave of long prompts in equal chunks), their ratio if
        large enough for their fixed cost not to count. None where the line fell flat (a
        negative slope: noise) or too few prefills were seen: a process's first ones run at
        ~0.1 s whatever their size, which reads as no slope, or a ratio of 100-600 us a token."""
        prefills = self._prefill[draft]
        if prefills.fit() is not None:
            return prefills.value()
        one_size = prefills.events >= MIN_EVENTS
        return prefills.ratio() if one_size and prefills.mean_tokens() >= _RATIO_MIN_TOKENS \
            else None

    def draft_rate_cap(self) -> Optional[float]:
        """The most a draft token can cost beyond a catch-up's fixed part (_RATE_CAP,
        _SHARE_CAP); None before a prefill's per-token rate is known (_prefill_rate: the
        floor's reading too)."""
        return self._rate_cap(self._prefill_rates())

    def _rate_cap(self, rates: tuple[Optional[float], Optional[float]]) -> Optional[float]:
        prefill = next((v for v in rates if v is not None), None)
        if prefill is None:
            return None
        share = self._draft_share
        return prefill * (min(_SHARE_CAP * share, 1.0 / _RATE_CAP) if share > 0
                          else 1.0 / _RATE_CAP)

    def estimates(self) -> BatchCostEstimates:
        fixed, rate = self.catch_up_fit
        kv = self.kv_catch_up_fit or (None, None)
        return BatchCostEstimates(
            self.prompt_per_output, self.replaced(), self.delta, fixed, rate,
            None if math.isinf(self.catch_up_reach) else self.catch_up_reach,
            self._catch_up_far, self.switch_s, *kv)
