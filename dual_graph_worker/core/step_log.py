"""The per-step log (JSONL) behind the load-ramp plot: mode, bs, padded bs, reason per step.

One line per completed decode step: ``StepRecord.to_json()`` plus ``"t"`` (wall-clock seconds
at launch, comparable with a client's ``time.time()``); between them event lines (``"event"``:
ready, each measured cost, lazy catch-up's events, the controller's cost terms every few steps).
Written by TP rank 0 only, off the serving thread (StepLogWriter).
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Iterator, Optional

from dual_graph_worker.core.jsonl import json_lines
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import Reason
from dual_graph_worker.core.results import StepRecord


class StepLogWriter:
    """Lines are handed over as fresh dicts of plain values and serialized and written by a
    thread of their own, which wakes every INTERVAL_S and takes what has come: neither the
    encoding nor a file write that stalls in the host's I/O lengthens a step, and the serving
    thread pays a deque append a line, not a thread wake-up. Every SLOW_EVERY lines the writer
    logs its own write times (a "log_writes" event)."""

    INTERVAL_S = 0.05
    SLOW_S = 1e-3
    SLOW_EVERY = 4096

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: Optional[IO[str]] = open(self.path, "a")
        self._lines: deque = deque()
        self._wake = threading.Event()
        self._drained = threading.Event()
        self._stopping = False
        self._written = self._slow = 0
        self._worst = 0.0
        self._thread = threading.Thread(target=self._run, name="dgw-step-log", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def write(self, record: StepRecord, wall_time: float, **extra: object) -> None:
        if self._fh is not None:
            self._lines.append({**record.to_json(), "t": wall_time, **extra})

    def write_event(self, event: str, wall_time: float, **fields: object) -> None:
        """A non-step line (start-up summary, config): readers skip lines without "step"."""
        if self._fh is not None:
            self._lines.append({"event": event, "t": wall_time, **fields})

    def flush(self, timeout: float = 10.0) -> None:
        """Return once every line handed over so far is in the file."""
        deadline = time.monotonic() + timeout
        while self._fh is not None and time.monotonic() < deadline:
            self._drained.clear()
            self._wake.set()
            self._drained.wait(max(deadline - time.monotonic(), 0.0))
            if not self._lines:          # a cycle that ended after this call took them all
                return

    def close(self) -> None:
        if self._fh is None:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(10.0)
        self._fh.close()
        self._fh = None
        atexit.unregister(self.close)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.INTERVAL_S)
            self._wake.clear()
            stopping = self._stopping
            self._write_pending()
            self._drained.set()
            if stopping:
                return

    def _write_pending(self) -> None:
        fh, lines = self._fh, self._lines
        if not lines:
            return
        while lines:
            item = lines.popleft()
            try:
                line = json.dumps(item)
            except (TypeError, ValueError) as e:        # one bad line, not the log
                line = json.dumps({"event": "unwritable", "t": item.get("t"), "error": str(e)})
            t0 = time.perf_counter()
            fh.write(line + "\n")
            took = time.perf_counter() - t0
            self._written += 1
            self._slow += took > self.SLOW_S
            self._worst = max(self._worst, took)
            if self._written % self.SLOW_EVERY == 0:
                fh.write(json.dumps({"event": "log_writes", "t": time.time(),
                                     "lines": self._written, "slow": self._slow,
                                     "max_ms": round(self._worst * 1e3, 3)}) + "\n")
                self._slow, self._worst = 0, 0.0
        t0 = time.perf_counter()
        fh.flush()
        took = time.perf_counter() - t0
        self._slow += took > self.SLOW_S
        self._worst = max(self._worst, took)


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
