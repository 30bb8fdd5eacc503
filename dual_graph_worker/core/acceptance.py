"""Accept lengths: each request's, learnt from its speculative steps, and what a batch of
requests is expected to accept. Acceptance is the same on every rank (the engine counts the
accepted tokens), so it is applied at once, not at an exchange."""

from __future__ import annotations

from typing import Optional

import numpy as np

from dual_graph_worker.core.acceptance_spread import RequestSpread
from dual_graph_worker.core.estimates import AcceptanceEstimates
from dual_graph_worker.core.row_state import RowState, row_state
from dual_graph_worker.core.settings import RowLoops

# Each observation's weight halves every ~22 steps, whatever mode ran meanwhile, so the first
# speculative steps after a long decode period speak for the present.
_DECAY = 1.0 / 32.0
_ROW_ALPHA = 0.2
# The draws a request's EMA holds once past its first ones: its variance is one draw's times
# alpha / (2 - alpha).
_ROW_DRAWS = (2.0 - _ROW_ALPHA) / _ROW_ALPHA
_KEEP_SQ = (1.0 - _ROW_ALPHA) ** 2
# From this many rows a batch's expected acceptance weighs every measured request alike, as if
# its EMA were full: the batch's mean averages out what its requests' differing noise would
# change.
_POOLED_ROWS = 32
# A request's estimate starts as the mean of its first draws: one draw is too noisy to speak for
# a request (or, as a new request's expectation, for the next ones).
_FIRST_DRAWS = 4
# Once the spreads are trusted, requests' first estimates fold into them at most once every
# _FOLD_EVERY speculative steps, and at each exchange: a fold costs ~6 us whatever it holds, and
# a loaded server measures a few new requests every step.
_FOLD_EVERY = 4


class AcceptanceEstimate:
    """All requests' recent acceptance (decayed sums, an optimistic prior of K+1 of weight 1)
    and, per request-pool row, its request's own (row_state.RowState: NaN until _FIRST_DRAWS
    draws are in, then an EMA)."""

    def __init__(self, num_draft_tokens: int, max_rows: int,
                 loops: RowLoops = RowLoops.AUTO) -> None:
        k1 = num_draft_tokens + 1.0
        self._sum, self._weight = k1, 1.0
        self.seen_at = 0                          # the step acceptance was last seen at
        self._rows: Optional[RowState] = row_state(
            loops, max_rows, _FIRST_DRAWS, _ROW_ALPHA, _KEEP_SQ, _ROW_ALPHA * _ROW_ALPHA) \
            if max_rows else None
        # The latest step any request was admitted at: a batch holding one admitted since
        # acceptance was last seen has an acceptance nobody measured.
        self._last_admitted = -1
        # What requests' first estimates say: what a new one is expected to accept (per
        # request, so one long phase of many steps does not outweigh the requests that came
        # after it), how far requests surely differ (own_weight), one draw's variance.
        self._spread = RequestSpread(k1, _ROW_ALPHA, _FIRST_DRAWS, 1.0 / _ROW_DRAWS)
        # Requests' first estimates and their draws' variances, until the next fold.
        self._to_fold: tuple[list[float], list[float]] = ([], [])
        self._adds = self._folded_at = 0          # speculative steps seen; at the last fold

    @property
    def mean(self) -> float:
        """Every request's recent acceptance."""
        return self._sum / self._weight

    @property
    def fresh(self) -> float:
        """What a new request is expected to accept."""
        return self._spread.fresh

    @property
    def draw_var(self) -> Optional[float]:
        """One draw's variance within a request; None until the spread is trusted."""
        return self._spread.draw_var

    def expected(self, rows: Optional[np.ndarray] = None) -> float:
        """Accept length expected of a batch: each measured request's own estimate, pulled
        toward all requests' recent acceptance as far as requests are seen to differ against
        the noise of the draws it holds (a few unlucky draws must not write a request off);
        what the latest requests first measured for requests not measured yet."""
        every = self._sum / self._weight
        if rows is None or self._rows is None or not len(rows):
            return every
        spread, n = self._spread, len(rows)
        differ, draw = spread.differ, spread.draw_var
        # Where every differ or draw is 0 every row weighs alike (0 or 1): the pooled answer.
        if n < _POOLED_ROWS and draw and differ is not None:
            below, above = spread.sides_differ()
            if differ or below or above:
                return self._rows.weighted(rows, every, spread.fresh, spread.centre, below,
                                           above, draw) / n
        total, known = self._rows.pooled(rows)
        w = spread.full_weight
        if known == n:
            return every + w * (total / n - every)
        return ((1.0 - w) * every * known + w * total + (n - known) * spread.fresh) / n

    def admit(self, rows: list[int], step: int) -> None:
        """A new request holds each of `rows` from `step` on: nothing is known of it."""
        if self._rows is not None:
            self._rows.admit(rows, step)
            self._last_admitted = step

    def newcomers(self, rows: Optional[np.ndarray]) -> bool:
        """The batch holds a request admitted since acceptance was last seen (True without
        rows: nothing says otherwise)."""
        if rows is None or not len(rows) or self._rows is None:
            return True
        if self._last_admitted < self.seen_at:      # no request anywhere is that new
            return False
        return self._rows.newest(rows) >= self.seen_at

    def add(self, accepts: list[float], total: float, rows: Optional[np.ndarray],
            step: int) -> None:
        """One speculative step's accept lengths (1..K+1, their sum `total`) of request `rows`."""
        decay = (1.0 - _DECAY) ** (step - self.seen_at)
        self._sum = decay * self._sum + total
        self._weight = decay * self._weight + len(accepts)
        self.seen_at = step
        if rows is None or self._rows is None:
            return
        firsts, within = self._to_fold
        self._rows.add(rows, accepts, firsts, within)
        self._adds += 1
        if firsts and (self._spread.differ is None
                       or self._adds - self._folded_at >= _FOLD_EVERY):
            self.fold()

    def fold(self) -> None:
        """Folds the first estimates kept since the last fold into the spreads: add, at most
        once every _FOLD_EVERY speculative steps; the exchange, whatever the mode, what waits."""
        firsts, within = self._to_fold
        if firsts:
            self._spread.learn(firsts, within)
            self._to_fold, self._folded_at = ([], []), self._adds

    def rows_snapshot(self) -> tuple[list, list, list, list]:
        """Every row's estimate, noise, admission step and first draws (tests, tools)."""
        return self._rows.snapshot() if self._rows is not None else ([], [], [], [])

    def estimates(self) -> AcceptanceEstimates:
        spread, first = self._spread, 1.0 / _FIRST_DRAWS
        weight = spread.own_weight
        return AcceptanceEstimates(spread.fresh, spread.full_weight, weight(first),
                                   weight(first, True), weight(first, False))
