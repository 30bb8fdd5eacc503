"""The interpreter's garbage-collection pauses, by generation: a diagnostic for the step log
and the benchmarks' cells (a process with many live objects can pause for hundreds of
milliseconds in a full collection)."""

from __future__ import annotations

import gc
import time


class GcPauses:
    def __init__(self) -> None:
        self._started = 0.0
        self._count = [0, 0, 0]
        self._seconds = [0.0, 0.0, 0.0]
        self._longest = [0.0, 0.0, 0.0]

    def start(self) -> "GcPauses":
        gc.callbacks.append(self._on_gc)
        return self

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def take(self) -> dict:
        """Per generation since the last take: [collections, their ms, the longest one's ms]."""
        count, seconds, longest = self._count, self._seconds, self._longest
        self._count, self._seconds, self._longest = [0, 0, 0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
        return {f"gen{g}": [count[g], round(seconds[g] * 1e3, 3), round(longest[g] * 1e3, 3)]
                for g in range(3)}

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        g = info.get("generation", 2)
        pause = time.perf_counter() - self._started
        self._count[g] += 1
        self._seconds[g] += pause
        self._longest[g] = max(self._longest[g], pause)
