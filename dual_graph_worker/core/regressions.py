"""The controller's decayed least-squares fits: seconds per token of batches (prefills,
catch-ups) and per key the step seconds against context tokens, with each mode's rate pooled
within every size."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from dual_graph_worker.core.modes import Mode

# A slope needs sizes this far apart (standard deviation, tokens): between nearby sizes the
# noise of a few hundred microseconds passes for a rate.
PREFILL_MIN_SPREAD = 64.0
CATCH_UP_MIN_SPREAD = 128.0
CONTEXT_MIN_SPREAD = 256.0
# A key's own context slope needs its contexts spread this share of their mean: a batch of 100
# grows ~300 tokens a step, so a few steps spread past CONTEXT_MIN_SPREAD and their noise fits
# any slope.
OWN_SPREAD = 0.1
# Step cost per context token: fitted over ~100 exchanges, as contexts change between workloads
# more slowly than step times drift.
CONTEXT_DECAY = 0.99
# A fitted slope holds out to this many standard deviations above the mean size it was fitted
# on (a key's context, a catch-up's tokens).
REACH = 2.0
# Beyond that, only where it stands this many standard errors above its mode's pooled slope.
FAR_ERRORS = 2.0
# A line needs this many batches (and so does a prefill ratio read in its place: a process's
# first prefills are slow whatever their size).
MIN_EVENTS = 3
# Per-key local slots: sum of seconds, count, and over context tokens x: sum x, xx, xy; sum yy
# (a key's window: exchange.KeyWindow).
KEY_SLOTS = 6
# A Slope's sums over its (x, y) points: n, sum x, sum y, sum xx, sum xy.
LINE = 5
_YY = 5     # the last key slot (sum yy): a line is fitted from the slots before it


class Slope:
    """Seconds per token of batches, as the slope of a decayed least-squares line: a batch's
    fixed cost (launches, metadata, one more forward) is the intercept, so small and large
    batches agree on the rate."""

    __slots__ = ("sums", "events", "decay", "min_spread", "idle")

    def __init__(self, min_spread: float, decay: float) -> None:
        self.sums = np.zeros(LINE)
        self.events = 0.0
        self.decay = decay
        self.min_spread = min_spread
        self.idle = 0               # exchanges since the last window: their decay is not applied

    def fold(self, window: Optional[Sequence[float]]) -> None:
        """None: an exchange with nothing new. Its decay waits for the next window, since every
        fit is a ratio of sums decayed alike."""
        if window is None:
            self.idle += 1
            return
        self.sums = self.decay ** (self.idle + 1) * self.sums + window
        self.idle = 0
        self.events += window[0]

    def decayed(self) -> np.ndarray:
        return self.decay ** self.idle * self.sums

    def fit(self) -> Optional[tuple[float, float]]:
        """(intercept, slope); None before MIN_EVENTS batches or while the sizes seen are too
        close to separate the two. A negative slope gives the flat line (mean, 0); a negative
        intercept (no fixed cost can be) refits the line through the origin."""
        n, sx, sy, sxx, sxy = self.sums
        if self.events < MIN_EVENTS or n <= 0:
            return None
        var = n * sxx - sx * sx                  # n^2 times the variance of the sizes
        if var < (self.min_spread * n) ** 2:
            return None
        slope = (n * sxy - sx * sy) / var
        if slope < 0:                  # no batch costs less for more tokens: noise, a flat line
            return sy / n, 0.0
        intercept = (sy - slope * sx) / n
        if intercept < 0:
            return 0.0, max(sxy / sxx, 0.0)
        return intercept, slope

    def value(self) -> Optional[float]:
        """The slope; None where the sizes cannot give one, or where it fell flat: a negative
        slope is noise, which a flat line still prices a batch by but which is no rate."""
        fit = self.fit()
        return None if fit is None or fit[1] <= 0 else fit[1]

    def ratio(self) -> Optional[float]:
        """Seconds per token over every batch seen (fixed costs included)."""
        sx, sy = self.sums[1:3]
        return sy / sx if sx > 0 else None

    def mean_tokens(self) -> float:
        n, sx = self.sums[:2]
        return sx / n if n > 0 else 0.0

    def reach(self) -> float:
        """The sizes its line was fitted on: their mean plus REACH standard deviations
        (infinite before any)."""
        n, sx, _, sxx, _ = self.sums
        if n <= 0:
            return math.inf
        mean = sx / n
        return mean + REACH * math.sqrt(max(sxx / n - mean * mean, 0.0))


class ContextSums:
    """Per key, decayed sums of its steps' seconds y and context tokens x (y, count, x, xx, xy,
    yy) and of the steps' squared weights, and each mode's seconds per context token pooled
    within every size. The decay is applied
    lazily: sums are kept in units of `scale`, the decay since they were last rescaled, so an
    exchange touches only the keys it measured. Slopes are read as of the last exchange with
    samples (`fit_scale`): an exchange without any changes none."""

    __slots__ = ("sums", "squares", "var", "cov", "scale", "fit_scale", "pools")

    def __init__(self, n: int) -> None:
        self.sums = [[0.0] * n for _ in range(KEY_SLOTS)]
        self.squares = [0.0] * n            # in units of scale squared
        # Per key, its count times the variance of its contexts and their covariance with y;
        # per mode, their totals and its steps.
        self.var = [0.0] * n
        self.cov = [0.0] * n
        self.pools = {m: [0.0, 0.0, 0.0] for m in Mode}
        self.scale = self.fit_scale = 1.0

    def decay(self) -> None:
        self.scale *= CONTEXT_DECAY
        # Rescale every ~6900 exchanges, long before a stored sum of squares could overflow.
        if self.scale < 1e-30:
            g, self.scale = self.scale, 1.0
            self.fit_scale /= g
            self.sums = [[g * v for v in slot] for slot in self.sums]
            self.squares = [g * g * v for v in self.squares]
            self.var = [g * v for v in self.var]
            self.cov = [g * v for v in self.cov]
            self.pools = {m: [g * v for v in pool] for m, pool in self.pools.items()}

    def add(self, i: int, mode: Mode, window: Sequence[float]) -> None:
        sums, g = self.sums, self.scale
        self.fit_scale = g
        for slot, v in zip(sums, window):
            slot[i] += v / g
        self.squares[i] += window[1] / (g * g)
        sy, n, sx, sxx, sxy = (slot[i] for slot in sums[:_YY])
        var, cov = sxx - sx * (sx / n), sxy - sx * (sy / n)
        pool = self.pools[mode]
        pool[0] += var - self.var[i]
        pool[1] += cov - self.cov[i]
        pool[2] += window[1] / g
        self.var[i], self.cov[i] = var, cov

    def pooled(self, mode: Mode) -> float:
        """The mode's slope within every size; 0 until its contexts have spread at all."""
        var, cov, count = self.pools[mode]
        if var >= CONTEXT_MIN_SPREAD ** 2 * count > 0:
            return max(cov / var, 0.0)
        return 0.0

    def own(self, i: int) -> Optional[float]:
        """Key i's own slope, if its contexts have spread far enough (at least CONTEXT_MIN_SPREAD
        and a OWN_SPREAD share of their mean)."""
        n = self.sums[1][i]
        if n <= 0:
            return None
        var, mean = self.var[i], self.sums[2][i] / n
        need = max(CONTEXT_MIN_SPREAD ** 2, (OWN_SPREAD * mean) ** 2)
        if self.fit_scale * var < need * max(self.fit_scale * n, 1.0):
            return None
        return max(self.cov[i] / var, 0.0)

    def own_error(self, i: int) -> float:
        """The standard error of key i's own slope, over its steps' effective count (a decay
        that weighs every step alike leaves it as it is); inf at an effective count of two or
        fewer, or with no spread."""
        n, var, squares = self.sums[1][i], self.var[i], self.squares[i]
        # Long unmeasured, the squared weights underflow before the weights do.
        count = n * n / squares if n > 0 and squares > 0 else 0.0
        if count <= 2.0 or var <= 0:
            return math.inf
        sy, syy = self.sums[0][i], self.sums[_YY][i]
        residual = syy - sy * (sy / n) - self.cov[i] ** 2 / var
        return math.sqrt(max(residual, 0.0) / ((count - 2.0) * var))

    def reach(self, i: int) -> float:
        """Key i's mean context plus REACH standard deviations."""
        n = self.sums[1][i]
        if n <= 0:
            return 0.0
        return self.sums[2][i] / n + REACH * math.sqrt(max(self.var[i], 0.0) / n)
