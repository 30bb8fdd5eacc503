"""The per-step log (JSONL) behind the load-ramp plot: mode, bs, padded bs, reason per step.

One line per completed decode step: ``StepRecord.to_json()`` plus ``"t"`` (wall-clock seconds
at launch, comparable with a client's ``time.time()``); between them event lines (``"event"``:
ready, each measured cost, lazy catch-up's events, the controller's cost terms every few steps).
Written by TP rank 0 only; lines are flushed as written so a reader can follow a live engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Iterator, Optional

from dual_graph_worker.core.jsonl import json_lines
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import Reason
from dual_graph_worker.core.results import StepRecord


class StepLogWriter:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: Optional[IO[str]] = open(self.path, "a", buffering=1)

    def write(self, record: StepRecord, wall_time: float, **extra: object) -> None:
        if self._fh is None:
            return
        self._fh.write(json.dumps({**record.to_json(), "t": wall_time, **extra}) + "\n")

    def write_event(self, event: str, wall_time: float, **fields: object) -> None:
        """A non-step line (start-up summary, config): readers skip lines without "step"."""
        if self._fh is None:
            return
        self._fh.write(json.dumps({"event": event, "t": wall_time, **fields}) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


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
