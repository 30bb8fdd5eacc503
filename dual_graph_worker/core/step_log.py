"""The per-step log (JSONL) behind the load-ramp plot: mode, bs, padded bs, reason per step.

One line per completed decode step: ``StepRecord.to_json()`` plus ``"t"`` (wall-clock seconds
at launch, comparable with a client's ``time.time()``); between them event lines (``"event"``:
ready, each measured cost, prefill choices, lazy catch-up's events, the controller's cost terms
every few steps).
Written by TP rank 0 only, off the serving thread (StepLogWriter).
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Iterator, NamedTuple, Optional

from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.jsonl import json_lines
from dual_graph_worker.core.ledger import CompletedStep
from dual_graph_worker.core.policy import Observation, PolicyState
from dual_graph_worker.core.results import StepRecord


class StepLogWriter:
    """The serving thread hands each line over as the immutable objects it is made of (a tuple
    on a deque, no wake-up); a writer thread wakes every INTERVAL_S, builds, serializes, writes
    and flushes what has come, so neither the line's making nor a write stalled in the host's
    I/O lengthens a step."""

    INTERVAL_S = 0.05
    SLOW_S = 1e-3
    SLOW_EVERY = 4096
    # Lines waiting beyond this are dropped (and counted): a writer stuck in a hung disk must
    # not grow the server's memory by a line a step.
    MAX_PENDING = 100_000

    def __init__(self, path: str | Path, fh: Optional[IO[str]] = None) -> None:
        """`fh`: the file at `path`, opened to append (opened here where not given)."""
        if fh is None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(path, "a")
        self._fh: Optional[IO[str]] = fh
        self._lines: deque = deque()
        self._handed = self._done = 0       # lines handed over / taken by the writer
        self.dropped = 0                    # lines not handed over: the writer fell behind
        self.failed: Optional[str] = None   # the write error that stopped the log
        self._wake = threading.Event()
        self._drained = threading.Event()
        self._stopping = False
        self._slow, self._worst = 0, 0.0
        self._thread = threading.Thread(target=self._run, name="dgw-step-log", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def write(self, record: StepRecord, wall_time: float, **extra: object) -> None:
        self._put((_record_line, wall_time, record, extra))

    def write_step(self, done: CompletedStep, state: PolicyState, hook_s: float) -> None:
        """A completed step's line: its record, the policy's beliefs after it, and the worker's
        host time before its launch, in the engine's launch and in the verify hook."""
        self._put((_step_line, done.wall_time, done.record, done.host_s, done.launch_s, state,
                   hook_s))

    def write_event(self, event: str, wall_time: float, **fields: object) -> None:
        """A non-step line (ready, prefill_choice, lazy catch-up's, estimates): readers skip lines
        without "step"."""
        self._put((_event_line, wall_time, event, fields))

    def write_cost(self, observation: Observation, wall_time: float) -> None:
        """A measured cost as the policy saw it (a "cost" event with its fields)."""
        self._put((_cost_line, wall_time, observation))

    def flush(self, timeout: float = 10.0) -> None:
        """Return once every line handed over before this call is in the file, after `timeout`
        seconds, or once the writer has stopped."""
        target, deadline = self._handed, time.monotonic() + timeout
        while self._done < target and self._thread.is_alive() and time.monotonic() < deadline:
            self._drained.clear()
            self._wake.set()
            self._drained.wait(max(deadline - time.monotonic(), 0.0))

    def close(self) -> None:
        if self._fh is None:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(10.0)
        fh, self._fh = self._fh, None
        atexit.unregister(self.close)
        if not self._thread.is_alive():         # never close a file under a live writer
            try:
                fh.close()
            except OSError:
                pass

    def _put(self, line: tuple) -> None:
        if self._fh is None or self.failed is not None:
            return
        if len(self._lines) >= self.MAX_PENDING:
            self.dropped += 1
            if not self._thread.is_alive():
                self.failed = "the writer thread stopped"
            return
        self._lines.append(line)
        self._handed += 1

    def _run(self) -> None:
        while True:
            self._wake.wait(self.INTERVAL_S)
            self._wake.clear()
            stopping = self._stopping
            try:
                self._write_pending()
            except OSError as e:                # a full disk: stop logging, keep serving
                self.failed = f"{type(e).__name__}: {e}"
                self._done += len(self._lines)
                self._lines.clear()
            self._drained.set()
            if stopping or self.failed is not None:
                return

    def _write_pending(self) -> None:
        fh, lines = self._fh, self._lines
        if not lines:
            return
        while lines:
            make, wall_time, *parts = lines.popleft()
            try:
                line = json.dumps(make(wall_time, *parts))
            except Exception as e:          # one bad line, not the log (nor its thread)
                line = json.dumps({"event": "unwritable", "t": wall_time, "error": str(e)})
            t0 = time.perf_counter()
            fh.write(line + "\n")
            self._timed(time.perf_counter() - t0)
            self._done += 1
            if self._done % self.SLOW_EVERY == 0:
                fh.write(json.dumps({"event": "log_writes", "t": time.time(),
                                     "lines": self._done, "dropped": self.dropped,
                                     "slow": self._slow,
                                     "max_ms": round(self._worst * 1e3, 3)}) + "\n")
                self._slow, self._worst = 0, 0.0
        t0 = time.perf_counter()
        fh.flush()
        self._timed(time.perf_counter() - t0)

    def _timed(self, seconds: float) -> None:
        self._slow += seconds > self.SLOW_S
        self._worst = max(self._worst, seconds)


# What the writer thread makes of a handed-over tuple (make, wall time, parts...).
def _record_line(wall_time: float, record: StepRecord, extra: dict) -> dict:
    return {**record.to_json(), "t": wall_time, **extra}


def _step_line(wall_time: float, record: StepRecord, host_s: float, launch_s: float,
               state: PolicyState, hook_s: float) -> dict:
    return {**record.to_json(), "t": wall_time, "accept_ema": round(state.accept_len, 4),
            "goodput_spec": state.spec_goodput, "goodput_decode": state.decode_goodput,
            "plan_us": round(host_s * 1e6, 1), "launch_us": round(launch_s * 1e6, 1),
            "hook_us": round(hook_s * 1e6, 1)}


def _event_line(wall_time: float, event: str, fields: dict) -> dict:
    return {"event": event, "t": wall_time, **fields}


def _cost_line(wall_time: float, observation: Observation) -> dict:
    return {"event": "cost", "t": wall_time, "kind": type(observation).__name__,
            **observation._asdict()}


class LoggedStep(NamedTuple):
    """A step line read back: its record and its launch's wall-clock time."""

    record: StepRecord
    wall_time: float


def read_step_log(path: str | Path) -> Iterator[LoggedStep]:
    """Every step line; event lines and torn tails are skipped; a step line missing its fields is
    a ConfigError."""
    for d in json_lines(path):
        if "step" not in d:
            continue
        try:
            step = LoggedStep(StepRecord.from_json(d), float(d["t"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"step log {path} holds a malformed step line ({type(exc).__name__}"
                              f": {exc}); pass a log the worker wrote (DGW_STEP_LOG=PATH)") from None
        yield step


def read_step_events(path: str | Path) -> list[dict]:
    return [d for d in json_lines(path) if "event" in d]
