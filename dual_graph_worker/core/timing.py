"""Each batch's cost from two timestamps the server already has: when the batch was launched and
when its result had been processed (the scheduler's own wait for that result is the only sync).

Results are processed in launch order. A batch's cost is the time from the later of its launch
and the previous batch's processing to its own processing: under overlap scheduling that is its
device time (or the host's step time when the host is the bottleneck); without overlap it is its
whole turn; after an idle gap it starts at its launch, so the gap never counts. Under overlap
the next batch is launched before this one's result is processed, so a batch's cost also holds
the host time of that launch: whoever reads a cost asks `peek` what was launched next.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Deque, Generic, NamedTuple, Optional, TypeVar

T = TypeVar("T")


class Processed(NamedTuple):
    """A batch whose result was processed: the tag it was launched with, and its cost."""

    tag: Any
    seconds: float


class ResultClock(Generic[T]):
    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 max_in_flight: int = 8, depth: Optional[int] = None) -> None:
        self._clock = clock
        # A result finds at most `depth` launches pending (its own, and under overlap the next
        # one): older ones never had theirs processed and are dropped (None: never).
        self._depth = depth
        # Bounded even if no result ever comes back.
        self._launched: Deque[tuple[T, float]] = deque(maxlen=max_in_flight)
        self._last_processed = -float("inf")

    def launched(self, tag: T) -> None:
        self._launched.append((tag, self._clock()))

    def processed(self) -> Optional[Processed]:
        """The oldest launched batch's result was processed: (its tag, its cost in seconds)."""
        now = self._clock()
        if not self._launched:
            self._last_processed = now
            return None
        while self._depth is not None and len(self._launched) > self._depth:
            self._launched.popleft()
        tag, t_launch = self._launched.popleft()
        cost = now - max(self._last_processed, t_launch)
        self._last_processed = now
        return Processed(tag, cost)

    @property
    def in_flight(self) -> int:
        return len(self._launched)

    def peek(self) -> Optional[T]:
        """The tag of the oldest batch launched and not processed yet (None if none)."""
        return self._launched[0][0] if self._launched else None
