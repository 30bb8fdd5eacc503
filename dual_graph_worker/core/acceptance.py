"""Accept lengths: each request's, learnt from its speculative steps, and what a batch of
requests is expected to accept. Acceptance is the same on every rank (the engine counts the
accepted tokens), so it is applied at once, not at an exchange."""

from __future__ import annotations

import math
import struct
from typing import Iterable, Optional, Union

import numpy as np

from dual_graph_worker.core.acceptance_spread import RequestSpread
from dual_graph_worker.core.estimates import AcceptanceEstimates

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
# change, and a per-row weight would cost a Python loop over the batch each step.
_POOLED_ROWS = 32
# Rows' estimates live in Python lists while batches are small: a step reads and updates at most a
# few dozen, where numpy's per-call cost outweighs the work. From _ARRAY_ROWS rows a batch they move
# to numpy arrays, read and updated at once (~2.5x cheaper over 256 rows), and back below
# _LIST_ROWS; in between they stay where they are, so a batch near one bound does not move them
# every step (a move converts every row of the pool: ~25 us at 512 rows). First draws stay in lists:
# a step adds to its few unmeasured rows only, where numpy's per-call cost would outweigh the work.
_ARRAY_ROWS = 96
_LIST_ROWS = 48
assert _POOLED_ROWS <= _LIST_ROWS <= _ARRAY_ROWS      # no batch in arrays weighs a row apart
_FEW_ROWS = 8                     # rows admitted at once that arrays still take one by one
Rows = Union[list, np.ndarray]
_ARRAY_FIELDS = ("_rows", "_noise", "_admitted_at")
# A request's estimate starts as the mean of its first draws: one draw is too noisy to speak for
# a request (or, as a new request's expectation, for the next ones).
_FIRST_DRAWS = 4
# Once the spreads are trusted, requests' first estimates fold into them at most once every
# _FOLD_EVERY speculative steps, and at each exchange: a fold costs ~6 us whatever it holds, and
# a loaded server measures a few new requests every step.
_FOLD_EVERY = 4


def _settling_updates() -> int:
    """EMA updates after which a row's noise no longer moves. A row's noise starts at exactly
    1 / _FIRST_DRAWS (_add_first_draws) and only ever takes add's keep_sq * noise + alpha^2, so
    after this many updates it sits at that recurrence's fixed point in floats."""
    noise, updates = 1.0 / _FIRST_DRAWS, 0
    while _KEEP_SQ * noise + _ROW_ALPHA * _ROW_ALPHA != noise:
        noise, updates = _KEEP_SQ * noise + _ROW_ALPHA * _ROW_ALPHA, updates + 1
    return updates


# A batch that this many adds in a row updated whole (every request measured) holds only rows
# whose noise is settled: add then leaves it. Only a batch that never changes gets there; one
# that does pays the update (~1.5 us over 256 rows).
_SETTLED_AFTER = _settling_updates()


def _frozen(rows: np.ndarray) -> bool:
    """Whether nobody can write `rows`: read-only and owning its memory (a read-only view may
    see its base written)."""
    return rows.base is None and not rows.flags.writeable


class AcceptanceEstimate:
    """All requests' recent acceptance (decayed sums, an optimistic prior of K+1 of weight 1)
    and, per request-pool row, its request's own: NaN until _FIRST_DRAWS draws are in, then an
    EMA. Estimates live in lists or in numpy arrays, by the batches' size (_ARRAY_ROWS); first
    draws in lists."""

    def __init__(self, num_draft_tokens: int, max_rows: int) -> None:
        k1 = num_draft_tokens + 1.0
        self._sum, self._weight = k1, 1.0
        self.seen_at = 0                          # the step acceptance was last seen at
        # Per row: its request's estimate (a list, or an array while batches are large:
        # _store_for), and its first draws (a list each: a draw is one append, its sums are taken
        # once, at the last).
        self._rows: Optional[Rows] = [math.nan] * max_rows if max_rows else None
        self._first_draws: list[list[float]] = [[] for _ in range(max_rows)]
        # Each row estimate's variance in units of one draw's: 1/_FIRST_DRAWS at first, toward
        # 1/_ROW_DRAWS as its EMA fills; NaN with the estimate (arrays update it with every
        # row's, unmasked). A request that decodes keeps its first, noisier one.
        self._noise: Rows = [math.nan] * max_rows
        # The step each row's request was admitted at, and the latest of any: a batch holding
        # one admitted since acceptance was last seen has an acceptance nobody measured.
        self._admitted_at: Rows = [-1] * max_rows
        self._last_admitted = -1
        # What requests' first estimates say: what a new one is expected to accept (per
        # request, so one long phase of many steps does not outweigh the requests that came
        # after it), how far requests surely differ (own_weight), one draw's variance.
        self._spread = RequestSpread(k1, _ROW_ALPHA, _FIRST_DRAWS, 1.0 / _ROW_DRAWS)
        # Requests' first estimates and their draws' variances, until the next fold.
        self._to_fold: tuple[list[float], list[float]] = ([], [])
        self._adds = self._folded_at = 0          # speculative steps seen; at the last fold
        # The latest rows array nobody can write and its list (one per batch, SGLang worker).
        self._rows_of: Optional[np.ndarray] = None
        self._ids: list[int] = []
        # The batch (an array nobody can write) the latest adds updated whole, and how many adds
        # in a row did; None from an add that found a row not measured, or an admission. Its
        # rows are all measured (only admit unmeasures a row), so add looks for none; from
        # _SETTLED_AFTER on it leaves their noise as it is.
        self._run_rows: Optional[np.ndarray] = None
        self._run_adds = 0
        self._arrays = False                      # the rows' state in numpy arrays
        # Whether the latest pooled batch held a request not measured yet: then the next one
        # likely does too (a loaded server decoding measures none), and one pass that drops
        # them is cheaper than a sum that finds a NaN first. Cost only; the answer is the same.
        self._unmeasured_in_batch = False
        self._packers: dict[int, struct.Struct] = {}    # _accept_array's, by batch size

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
        if (self._arrays or len(rows) >= _ARRAY_ROWS) and self._store_for(len(rows)):
            return self._expected_of_arrays(rows, every)
        est = self._rows
        ids = self._ids_of(rows)
        spread = self._spread
        n, fresh = len(ids), spread.fresh
        differ, draw, noise = spread.differ, spread.draw_var, self._noise
        # Where every differ or draw is 0 every row weighs alike (0 or 1): the pooled path's
        # answer. Otherwise each row's weight is own_weight(noise, side), inline: this runs
        # every step.
        if n < _POOLED_ROWS and draw and differ is not None:
            below, above = spread.sides_differ()
            if differ or below or above:
                centre, total = spread.centre, 0.0
                for i in ids:
                    e = est[i]
                    if e != e:
                        total += fresh
                        continue
                    d = below if e < centre else above
                    total += every + d * (e - every) / (d + draw * noise[i])
                return total / n
        if not self._unmeasured_in_batch:
            total = sum(map(est.__getitem__, ids))
            if total == total:                           # every request measured (no NaN)
                return self._pooled(every, total, n, n)
        known = [v for v in map(est.__getitem__, ids) if v == v]
        self._unmeasured_in_batch = len(known) < n
        return self._pooled(every, sum(known), len(known), n)

    def _expected_of_arrays(self, rows: np.ndarray, every: float) -> float:
        """expected's pooled answer: arrays hold batches of _LIST_ROWS and up, all pooled."""
        est = self._rows[rows]
        n = len(est)
        # np.add.reduce: ndarray.sum's own reduction, without its Python wrapper.
        if not self._unmeasured_in_batch:
            total = float(np.add.reduce(est))
            if total == total:                           # every request measured (no NaN)
                return self._pooled(every, total, n, n)
        known = est[est == est]
        self._unmeasured_in_batch = len(known) < n
        return self._pooled(every, float(np.add.reduce(known)), len(known), n)

    def _pooled(self, every: float, total: float, known: int, n: int) -> float:
        """A batch of `n` rows where each of the `known` measured ones (their estimates' sum
        `total`) weighs alike, pulled toward `every`; the rest at what a new request accepts."""
        spread = self._spread
        w = spread.full_weight
        if known == n:
            return every + w * (total / n - every)
        return ((1.0 - w) * every * known + w * total + (n - known) * spread.fresh) / n

    def _store_for(self, n: int) -> bool:
        """Moves the rows' state to arrays or back for a batch of `n` rows (_ARRAY_ROWS); whether
        it is in arrays."""
        arrays = n >= (_LIST_ROWS if self._arrays else _ARRAY_ROWS)
        if arrays != self._arrays:
            self._arrays = arrays
            for name in _ARRAY_FIELDS:
                v = getattr(self, name)
                setattr(self, name, np.array(v) if arrays else v.tolist())
        return arrays

    def _ids_of(self, rows: np.ndarray) -> list[int]:
        """`rows` as a list, kept for an array nobody can write: read-only and owning its memory
        (a read-only view may see its base written). A cold tolist costs ~7 us."""
        if rows is self._rows_of:
            return self._ids
        ids = rows.tolist()
        if _frozen(rows):
            self._rows_of, self._ids = rows, ids
        return ids

    def admit(self, rows: list[int], step: int) -> None:
        """A new request holds each of `rows` from `step` on: nothing is known of it."""
        if self._rows is None:
            return
        self._run_rows = None
        first_draws = self._first_draws
        if self._arrays and len(rows) > _FEW_ROWS:
            idx = np.asarray(rows)
            self._rows[idx] = self._noise[idx] = math.nan
            self._admitted_at[idx] = step
            for row in rows:
                first_draws[row] = []
        else:
            est, noise, admitted_at = self._rows, self._noise, self._admitted_at
            for row in rows:
                est[row] = noise[row] = math.nan
                admitted_at[row] = step
                first_draws[row] = []
        self._last_admitted = step

    def newcomers(self, rows: Optional[np.ndarray]) -> bool:
        """The batch holds a request admitted since acceptance was last seen (True without
        rows: nothing says otherwise)."""
        if rows is None or not len(rows) or self._rows is None:
            return True
        if self._last_admitted < self.seen_at:      # no request anywhere is that new
            return False
        if self._arrays:
            return int(self._admitted_at[rows].max()) >= self.seen_at
        return max(map(self._admitted_at.__getitem__, self._ids_of(rows))) >= self.seen_at

    def add(self, accepts: list[float], total: float, rows: Optional[np.ndarray],
            step: int) -> None:
        """One speculative step's accept lengths (1..K+1, their sum `total`) of request `rows`."""
        decay = (1.0 - _DECAY) ** (step - self.seen_at)
        self._sum = decay * self._sum + total
        self._weight = decay * self._weight + len(accepts)
        self.seen_at = step
        if rows is None or self._rows is None:
            return
        run = rows is self._run_rows
        settled = run and self._run_adds >= _SETTLED_AFTER
        drawn: Iterable[tuple[int, float]]
        if (self._arrays or len(accepts) >= _ARRAY_ROWS) and self._store_for(len(accepts)):
            drawn = self._add_to_arrays(accepts, rows, run, settled)
        elif settled:
            drawn = self._add_settled(accepts, rows)
        else:
            drawn = []
            est, noise = self._rows, self._noise
            alpha, keep_sq, alpha_sq = _ROW_ALPHA, _KEEP_SQ, _ROW_ALPHA * _ROW_ALPHA
            for row, accept in zip(self._ids_of(rows), accepts):
                r = est[row]
                if r == r:
                    est[row] = r + alpha * (accept - r)
                    noise[row] = keep_sq * noise[row] + alpha_sq
                else:
                    drawn.append((row, accept))
        self._count_run(rows, run, whole=not drawn)
        if drawn:
            self._add_first_draws(drawn)
        self._adds += 1
        if self._to_fold[0] and (self._spread.differ is None
                                  or self._adds - self._folded_at >= _FOLD_EVERY):
            self.fold()

    def fold(self) -> None:
        """Folds the first estimates kept since the last fold into the spreads: add, at most
        once every _FOLD_EVERY speculative steps; the exchange, whatever the mode, what waits."""
        firsts, within = self._to_fold
        if firsts:
            self._spread.learn(firsts, within)
            self._to_fold, self._folded_at = ([], []), self._adds

    def _count_run(self, rows: np.ndarray, run: bool, whole: bool) -> None:
        """Counts an add that updated every row of `rows` into their run, or ends it."""
        if not whole:
            self._run_rows = None
        elif run:
            self._run_adds += 1
        elif rows is self._rows_of or _frozen(rows):
            self._run_rows, self._run_adds = rows, 1

    def _add_settled(self, accepts: list[float], rows: np.ndarray) -> tuple:
        """add's loop over a settled batch (_SETTLED_AFTER) in lists: every row measured, its
        noise where it stays."""
        est, alpha = self._rows, _ROW_ALPHA
        for row, accept in zip(self._ids_of(rows), accepts):
            r = est[row]
            est[row] = r + alpha * (accept - r)
        return ()

    def _add_to_arrays(self, accepts: list[float], rows: np.ndarray, measured: bool,
                       settled: bool) -> Iterable[tuple[int, float]]:
        """add's estimate updates at once, element by element the arithmetic of its loop (a NaN
        row, not measured yet, stays NaN); the (row, accept) of each row not measured yet.
        `measured`: every row is (a run's batch); `settled`: their noise too (_SETTLED_AFTER)."""
        est, noise = self._rows, self._noise
        r = est[rows]
        moved = self._accept_array(accepts) - r            # in place from here: no temporaries
        moved *= _ROW_ALPHA
        moved += r
        est[rows] = moved
        if settled:
            return ()
        var = noise[rows]
        var *= _KEEP_SQ
        var += _ROW_ALPHA * _ROW_ALPHA
        noise[rows] = var
        if measured:
            return ()
        new = (r != r).nonzero()[0]
        if not len(new):
            return ()
        return zip(rows[new].tolist(), map(accepts.__getitem__, new.tolist()))

    def _accept_array(self, accepts: list[float]) -> np.ndarray:
        """`accepts` as a read-only array: packed, then read, ~2x cheaper than np.fromiter over
        256 floats (a format's Struct is made once)."""
        n = len(accepts)
        packer = self._packers.get(n)
        if packer is None:
            packer = self._packers[n] = struct.Struct(f"{n}d")
        return np.frombuffer(packer.pack(*accepts))

    def _add_first_draws(self, drawn: Iterable[tuple[int, float]]) -> None:
        """Each (row, accept) of a row not measured yet: into its first draws, and into its
        first estimate once _FIRST_DRAWS are in (kept for the next fold)."""
        est, noise, first_draws = self._rows, self._noise, self._first_draws
        firsts, within = self._to_fold
        for row, accept in drawn:
            draws = first_draws[row]
            draws.append(accept)
            if len(draws) >= _FIRST_DRAWS:
                total = squares = 0.0
                for v in draws:
                    total += v
                    squares += v * v
                mean = total / _FIRST_DRAWS
                est[row], noise[row] = mean, 1.0 / _FIRST_DRAWS
                firsts.append(mean)
                within.append((squares - _FIRST_DRAWS * mean * mean) / (_FIRST_DRAWS - 1))

    def estimates(self) -> AcceptanceEstimates:
        spread, first = self._spread, 1.0 / _FIRST_DRAWS
        weight = spread.own_weight
        return AcceptanceEstimates(spread.fresh, spread.full_weight, weight(first),
                                   weight(first, True), weight(first, False))
