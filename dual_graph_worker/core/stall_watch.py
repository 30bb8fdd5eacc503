"""Stall watch: where a serving thread is when it stops starting steps.

A diagnostic, off unless asked for (the SGLang worker: ``DGW_STALL_TRACE=path``). The serving
thread calls `beat()` at the start of every step; while no beat has come for ``threshold_s`` a
daemon thread appends the serving thread's Python stack as JSON lines:

    {"t": wall time, "gap_s": seconds since the last beat, "steps": beats so far,
     "stack": ["file:line function", ...]}   # innermost frame first

Why a sampler, and not faulthandler or a profiler: docs/design.md, "Seeing what the worker does".
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TextIO

from dual_graph_worker.core.jsonl import json_lines


@dataclass(frozen=True)
class StallSample:
    t: float
    gap_s: float
    steps: int
    stack: tuple[str, ...]      # innermost frame first

    def to_json(self) -> dict:
        return {"t": round(self.t, 4), "gap_s": round(self.gap_s, 3), "steps": self.steps,
                "stack": list(self.stack)}


def thread_stack(thread_id: int, depth: int) -> tuple[str, ...]:
    """The `depth` innermost frames of a live thread, innermost first (() once it has ended)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ()
    frames = traceback.extract_stack(frame)[::-1][:depth]
    return tuple(f"{f.filename}:{f.lineno} {f.name}" for f in frames)


class StallWatch:
    """Samples the thread that beats while it goes `threshold_s` without a `beat()`."""

    def __init__(self, out: TextIO, threshold_s: float = 1.0, period_s: float = 0.25,
                 depth: int = 24, max_samples: int = 4000,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if threshold_s <= 0 or period_s <= 0:
            raise ValueError(f"stall watch needs positive times, got threshold {threshold_s} s, "
                             f"period {period_s} s")
        self._out = out
        self.threshold_s = threshold_s
        self.period_s = period_s
        self._depth = depth
        self._max_samples = max_samples
        self._clock = clock
        self._wall_clock = wall_clock
        self._thread_id: Optional[int] = None     # the first beat's thread: the one watched
        self._last_beat: Optional[float] = None     # None: no step yet (start-up is not a stall)
        self.steps = 0
        self.samples = 0
        self._stop = threading.Event()
        self._sampler: Optional[threading.Thread] = None

    def beat(self) -> None:
        """The watched thread starts a step."""
        if self._thread_id is None:
            self._thread_id = threading.get_ident()
        self._last_beat = self._clock()
        self.steps += 1

    def check(self) -> Optional[StallSample]:
        """One sampler tick: a sample (also written) when the watched thread is stalled."""
        last = self._last_beat
        if last is None or self._thread_id is None or self.samples >= self._max_samples:
            return None
        gap = self._clock() - last
        if gap < self.threshold_s:
            return None
        sample = StallSample(self._wall_clock(), gap, self.steps,
                             thread_stack(self._thread_id, self._depth))
        self._out.write(json.dumps(sample.to_json()) + "\n")
        self._out.flush()
        self.samples += 1
        return sample

    def start(self) -> "StallWatch":
        self._sampler = threading.Thread(target=self._run, name="dgw-stall-watch", daemon=True)
        self._sampler.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.check()


def read_stall_samples(path: str | Path) -> list[StallSample]:
    """The samples a StallWatch wrote (a torn last line is skipped)."""
    return [StallSample(d["t"], d["gap_s"], d["steps"], tuple(d["stack"]))
            for d in json_lines(path)]
