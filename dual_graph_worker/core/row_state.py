"""Each request-pool row's acceptance state and the loops over a batch's rows: `RowState`, in C
(row_state.c) or in Python (`PyRowState`, the same loops: where no compiler is found, and the
reference the tests hold the C loops to). A row's estimate is NaN until its first draws are in,
then an EMA; its noise is that estimate's variance in draws'."""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path
from typing import Protocol, Sequence, Union

import numpy as np

from dual_graph_worker.core import native
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.settings import RowLoops

Rows = Union[np.ndarray, list]
_SOURCE = Path(__file__).with_suffix(".c")


class RowState(Protocol):
    """admit: new requests hold `rows` from `step` on. newest: the latest step any of `rows` was
    admitted at (-1: none). pooled: the sum of the measured rows' estimates and their count.
    weighted: the sum of each row's estimate pulled toward `every` by its side's spread
    (`below` or `above` `centre`) against its noise, `fresh` for a row not measured. add: a
    speculative step's accept lengths, into each measured row's EMA or an unmeasured one's first
    draws (first estimates and their draws' variance appended to `firsts` and `within`); whether
    every row was measured. snapshot: every row's estimate, noise, admission step, and the first
    draws of a row not measured yet."""

    def admit(self, rows: Rows, step: int) -> None: ...
    def newest(self, rows: Rows) -> int: ...
    def pooled(self, rows: Rows) -> tuple[float, int]: ...
    def weighted(self, rows: Rows, every: float, fresh: float, centre: float, below: float,
                 above: float, draw: float) -> float: ...
    def add(self, rows: Rows, accepts: list, firsts: list, within: list) -> bool: ...
    def snapshot(self) -> tuple[list, list, list, list]: ...


class PyRowState:
    """RowState's loops in Python, operation for operation as row_state.c's."""

    def __init__(self, max_rows: int, first_draws: int, alpha: float, keep_sq: float,
                 alpha_sq: float) -> None:
        if max_rows < 0 or first_draws < 2:
            raise ValueError("max_rows must be >= 0 and first_draws >= 2")
        self._k, self._alpha, self._keep_sq, self._alpha_sq = first_draws, alpha, keep_sq, alpha_sq
        self._est = [math.nan] * max_rows
        self._noise = [math.nan] * max_rows
        self._admitted_at = [-1] * max_rows
        self._draws: list[list[float]] = [[] for _ in range(max_rows)]

    def admit(self, rows: Rows, step: int) -> None:
        for row in self._ids(rows):
            self._est[row] = self._noise[row] = math.nan
            self._admitted_at[row] = step
            self._draws[row] = []

    def newest(self, rows: Rows) -> int:
        return max(map(self._admitted_at.__getitem__, self._ids(rows)), default=-1)

    def pooled(self, rows: Rows) -> tuple[float, int]:
        total, known = 0.0, 0
        for e in map(self._est.__getitem__, self._ids(rows)):
            if e == e:                  # a plain sum: sum() compensates from Python 3.12 on
                total += e
                known += 1
        return total, known

    def weighted(self, rows: Rows, every: float, fresh: float, centre: float, below: float,
                 above: float, draw: float) -> float:
        est, noise, total = self._est, self._noise, 0.0
        for row in self._ids(rows):
            e = est[row]
            if e != e:
                total += fresh
                continue
            d = below if e < centre else above
            total += every + d * (e - every) / (d + draw * noise[row])
        return total

    def add(self, rows: Rows, accepts: list, firsts: list, within: list) -> bool:
        est, noise, whole = self._est, self._noise, True
        alpha, keep_sq, alpha_sq = self._alpha, self._keep_sq, self._alpha_sq
        for row, accept in zip(self._ids(rows), map(float, accepts)):
            e = est[row]
            if e == e:
                est[row] = e + alpha * (accept - e)
                noise[row] = keep_sq * noise[row] + alpha_sq
            else:
                whole = False
                self._first_draw(row, accept, firsts, within)
        return whole

    def _first_draw(self, row: int, accept: float, firsts: list, within: list) -> None:
        draws, k = self._draws[row], self._k
        draws.append(accept)
        if len(draws) < k:
            return
        total = squares = 0.0
        for v in draws:
            total += v
            squares += v * v
        mean = total / k
        self._draws[row] = []
        self._est[row], self._noise[row] = mean, 1.0 / k
        firsts.append(mean)
        within.append((squares - k * mean * mean) / (k - 1))

    def snapshot(self) -> tuple[list, list, list, list]:
        return (list(self._est), list(self._noise), list(self._admitted_at),
                [list(d) for d in self._draws])

    def _ids(self, rows: Rows) -> Sequence[int]:
        """`rows` as a list, each checked against the pool (a negative one would wrap)."""
        ids = rows if type(rows) is list else rows.tolist()
        if ids and (min(ids) < 0 or max(ids) >= len(self._est)):
            bad = next(r for r in ids if not 0 <= r < len(self._est))
            raise IndexError(f"row {bad} outside the pool's {len(self._est)} rows")
        return ids




def row_state(loops: RowLoops, max_rows: int, first_draws: int, alpha: float, keep_sq: float,
              alpha_sq: float) -> RowState:
    """The RowState `loops` names (DGW_ROW_LOOPS): AUTO takes the C loops where they build."""
    return _kind(loops)(max_rows, first_draws, alpha, keep_sq, alpha_sq)


def loops_in_c(loops: RowLoops) -> bool:
    """Whether a controller built now runs its loops in C: builds them if need be (at launch,
    so DGW_ROW_LOOPS=c without a compiler is refused before any weights load)."""
    return _kind(loops) is not PyRowState


def _kind(loops: RowLoops) -> type:
    return PyRowState if loops is RowLoops.PYTHON else _c_loops(loops is RowLoops.C)


@functools.cache
def _c_loops(required: bool) -> type:
    """The C RowState type, built once a process; where it cannot be built, a ConfigError if
    `required`, else PyRowState and one warning naming why."""
    try:
        return native.load(_SOURCE, "dgw_row_state").RowState
    except native.NativeBuildError as e:
        if required:
            raise ConfigError(f"DGW_ROW_LOOPS=c: {e}") from None
        logging.getLogger(__name__).warning("the controller's loops run in Python (slower): %s",
                                            e)
        return PyRowState
