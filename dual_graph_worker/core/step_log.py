"""The per-step log (JSONL) behind the load-ramp plot: mode, bs, padded bs, reason per step.

One line per completed decode step: ``StepRecord.to_json()`` plus ``"t"`` (wall-clock seconds
at launch, comparable with a client's ``time.time()``); between them event lines (``"event"``:
ready, each measured cost, lazy catch-up's events, the controller's cost terms every few steps).
Written by TP rank 0 only, off the serving thread (StepLogWriter).
"""

from __future__ import annotations

import atexit
import json
import queue
import threading
import time
from pathlib import Path
from typing import IO, Iterator, Optional

from dual_graph_worker.core.jsonl import json_lines
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import Reason
from dual_graph_worker.core.results import StepRecord


class StepLogWriter:
    """Lines are handed over as fresh dicts of plain values and serialized and written by a
    thread of their own, in the serving thread's waits on the GPU: neither the encoding nor a
    file write that stalls in the host's I/O lengthens a step.
    The writer flushes whenever it has caught up, so a reader can follow a live engine; every
    SLOW_EVERY lines it logs its own write times (a "log_writes" event)."""

    SLOW_S = 1e-3
    SLOW_EVERY = 4096

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: Optional[IO[str]] = open(self.path, "a")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, name="dgw-step-log", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def write(self, record: StepRecord, wall_time: float, **extra: object) -> None:
        self._put({**record.to_json(), "t": wall_time, **extra})

    def write_event(self, event: str, wall_time: float, **fields: object) -> None:
        """A non-step line (start-up summary, config): readers skip lines without "step"."""
        self._put({"event": event, "t": wall_time, **fields})

    def flush(self, timeout: float = 10.0) -> None:
        """Return once every line put so far is in the file."""
        if self._fh is not None:
            done = threading.Event()
            self._queue.put(done)
            done.wait(timeout)

    def close(self) -> None:
        if self._fh is None:
            return
        self._queue.put(None)
        self._thread.join(10.0)
        self._fh.close()
        self._fh = None
        atexit.unregister(self.close)

    def _put(self, line: dict) -> None:
        if self._fh is not None:
            self._queue.put(line)

    def _drain(self) -> None:
        lines, slow, worst = 0, 0, 0.0
        while True:
            item = self._queue.get()
            fh = self._fh
            if item is None:
                fh.flush()
                return
            if isinstance(item, threading.Event):
                fh.flush()
                item.set()
                continue
            try:
                line = json.dumps(item)
            except (TypeError, ValueError) as e:        # one bad line, not the log
                line = json.dumps({"event": "unwritable", "t": item.get("t"), "error": str(e)})
            t0 = time.perf_counter()
            fh.write(line + "\n")
            if self._queue.empty():
                fh.flush()
            took = time.perf_counter() - t0
            lines += 1
            slow += took > self.SLOW_S
            worst = max(worst, took)
            if lines % self.SLOW_EVERY == 0:
                fh.write(json.dumps({"event": "log_writes", "t": time.time(), "lines": lines,
                                     "slow": slow, "max_ms": round(worst * 1e3, 3)}) + "\n")
                slow, worst = 0, 0.0


def read_step_log(path: str | Path) -> Iterator[tuple[StepRecord, float]]:
    """(record, launch wall time) for every step line; event lines and torn tails are skipped."""
    for d in json_lines(path):
        if "step" not in d:
            continue
        yield StepRecord(step=int(d["step"]), mode=Mode(d["mode"]), bs=int(d["bs"]),
                         padded_bs=int(d["padded_bs"]), reason=Reason(d["reason"]),
                         graph=bool(d["graph"]), tokens=int(d["tokens"]),
                         mean_accept_len=float(d["mean_accept_len"])), float(d["t"])


def read_step_events(path: str | Path) -> list[dict]:
    return [d for d in json_lines(path) if "event" in d]
