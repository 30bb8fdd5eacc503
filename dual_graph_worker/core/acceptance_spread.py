"""What requests' first estimates say of requests: what a new one is expected to accept (`fresh`),
one draw's variance within a request (`draw_var`), and how far requests surely differ, below and
above their centre. `learn` folds first estimates (each the mean of a request's first draws, with
those draws' variance) in; `own_weight` weighs a request's own estimate of a given noise against
all requests', `full_weight` at a full EMA's noise. Until _SPREAD_MIN_REQUESTS requests are in
nothing is trusted (`differ` None, every own estimate weighs whole). The acceptance estimate owns
one and holds no spread of its own; this holds no per-request state."""

from __future__ import annotations

import math
from typing import Optional

# Requests' spread of acceptance is learnt over the latest ~40 of them, and trusted from 8 on
# (until then each request's own estimate counts whole).
_SPREAD_ALPHA = 0.05
_SPREAD_MIN_REQUESTS = 8
# Each side of the centre is weighed on its own from this many requests on (until then, as both
# sides together): a population of alike requests with a few far above them (the CPU demo's
# toy) has first estimates below the centre that are the draws' noise alone, above it not.
_SIDE_MIN_REQUESTS = 4


def _sure_spread(variance: float, effective: float) -> float:
    """A variance over `effective` requests, unbiased, less one standard error of it (~22% over
    ~40 requests): where requests accept alike, its noise alone read as a spread gave their own
    noisy estimates a third of the weight or more."""
    return variance * effective / (effective - 1.0) * (1.0 - math.sqrt(2.0 / (effective - 1.0)))


class RequestSpread:
    """Requests' first estimates below and above their centre, decayed per request, and what
    they say: `fresh`, `differ` (None: untrusted), `draw_var`, `full_weight`."""

    def __init__(self, fresh: float, row_alpha: float, first_draws: int,
                 full_noise: float) -> None:
        # A request's EMA step (`row_alpha`), its first draws, and a full EMA's noise in draws:
        # the estimate's own rules, which the weights here are priced in.
        self._row_alpha, self._first_draws, self._full_noise = row_alpha, first_draws, full_noise
        # Optimistic until a request is measured.
        self.fresh = fresh
        # Per side: count, sum, sum of squares, squared weights (both sides together are their
        # sums).
        self._sides = {below: [0.0] * 4 for below in (True, False)}
        self._within = 0.0                        # decayed sum of each one's draws' variance
        self.differ: Optional[float] = None       # how far requests surely differ; None: untrusted
        self.centre = 0.0                         # the mean of the first estimates
        self._sides_cache: Optional[tuple[float, float]] = None   # sides_differ's, until a learn
        self.draw_var: Optional[float] = None     # one draw's variance within a request
        self.full_weight = 1.0                    # own_weight of a full EMA's noise

    def _first_weight(self, requests: int) -> float:
        """The weight of `requests` first estimates in what a new request is expected to accept
        (each moves it as one request's EMA step does)."""
        return 1.0 - (1.0 - self._row_alpha) ** requests

    def learn(self, firsts: list[float], within: list[float]) -> None:
        """Fold requests' first estimates into the new-request expectation and the spreads:
        how far requests surely differ (the first estimates' variance, less its standard error
        and their draws' noise), and one draw's variance."""
        n, added = len(firsts), sum(firsts)
        self.fresh += self._first_weight(n) * (added / n - self.fresh)
        keep = (1.0 - _SPREAD_ALPHA) ** n
        keep_sq = keep * keep
        sides = self._sides
        below, above = sides[True], sides[False]
        # Each request weighs 1 when folded: the squared weights decay twice as fast.
        for side in (below, above):
            side[:] = [keep * side[0], keep * side[1], keep * side[2], keep_sq * side[3]]
        self._within = keep * self._within + sum(within)
        centre = self.centre = (below[1] + above[1] + added) / (below[0] + above[0] + n)
        for m in firsts:
            side = sides[m < centre]
            side[0] += 1.0
            side[1] += m
            side[2] += m * m
            side[3] += 1.0
        count, s2, squares = below[0] + above[0], below[2] + above[2], below[3] + above[3]
        effective = count * count / squares
        if effective < _SPREAD_MIN_REQUESTS:
            return
        draw = self.draw_var = self._within / count
        noise = draw / self._first_draws
        self.differ = max(_sure_spread(max(s2 / count - centre * centre, 0.0), effective)
                          - noise, 0.0)
        self._sides_cache = None
        self.full_weight = self.own_weight(self._full_noise)

    def own_weight(self, noise: float, below: Optional[bool] = None) -> float:
        """The weight of a request's own estimate, of variance `noise` draws', over all
        requests': how far requests surely differ against that noise, on the side of the
        requests' centre the estimate lies (`below` it or not; None: both sides together)."""
        if self.differ is None:
            return 1.0
        differ, draw = self.differ, self.draw_var
        if below is not None:
            differ = self.sides_differ()[0 if below else 1]
        if differ > 0:
            return differ / (differ + draw * noise)
        return 0.0 if draw > 0 else 1.0

    def sides_differ(self) -> tuple[float, float]:
        """How far requests surely differ below the centre and above it (_side_spread). Read only
        where a batch is small, so made at the first read after a learn."""
        if self._sides_cache is None:
            noise = self.draw_var / self._first_draws
            below, above = (self._side_spread(self._sides[b], noise) for b in (True, False))
            self._sides_cache = (below, above)
        return self._sides_cache

    def _side_spread(self, side: list[float], noise: float) -> float:
        """A side's requests' mean squared distance from the centre of all, less its standard
        error and the draws' `noise`; both sides together's while it holds fewer than
        _SIDE_MIN_REQUESTS."""
        k, t1, t2, k2 = side
        effective = k * k / k2 if k2 > 0 else 0.0
        if effective < _SIDE_MIN_REQUESTS:
            return self.differ
        c = self.centre
        return max(_sure_spread(max(t2 - 2.0 * c * t1 + c * c * k, 0.0) / k, effective) - noise,
                   0.0)
