"""The step log's writer: lines land in order, a stalled file write never holds the caller,
and the writer reports its own slow writes."""

from __future__ import annotations

import io
import json
import threading
import time
from types import SimpleNamespace

from dual_graph_worker.core import step_log
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import Reason
from dual_graph_worker.core.results import StepRecord
from dual_graph_worker.core.step_log import StepLogWriter, read_step_events, read_step_log


class StalledFile(io.StringIO):
    """A file whose writes wait until `go` is set, as a write stuck in the host's I/O."""

    def __init__(self) -> None:
        super().__init__()
        self.go, self.entered = threading.Event(), threading.Event()

    def write(self, s: str) -> int:
        self.entered.set()
        self.go.wait()
        return super().write(s)

    def close(self) -> None:
        self.text = self.getvalue()
        super().close()


def test_lines_land_in_order_and_a_flush_makes_them_readable(tmp_path):
    log = StepLogWriter(tmp_path / "steps.jsonl")
    for i in range(100):
        log.write(StepRecord(i, Mode.SPEC, 4, 4, Reason.GOODPUT, True, 12, 3.0), float(i))
        log.write_event("cost", float(i), seconds=0.005)
    log.flush()
    assert [r.step for r, _ in read_step_log(tmp_path / "steps.jsonl")] == list(range(100))
    assert len(read_step_events(tmp_path / "steps.jsonl")) == 100
    log.close()
    log.write_event("late", 0.0)                   # after close: dropped, no error
    assert len(read_step_events(tmp_path / "steps.jsonl")) == 100


def test_a_stalled_file_write_never_holds_the_serving_thread(tmp_path):
    log = StepLogWriter(tmp_path / "steps.jsonl")
    log._fh.close()
    stalled = log._fh = StalledFile()
    for i in range(50):                            # every call returns while the writer waits
        log.write_event("cost", float(i), seconds=0.005)
    assert stalled.getvalue() == ""
    stalled.go.set()
    log.close()
    assert [json.loads(line)["t"] for line in stalled.text.splitlines()] == [float(i)
                                                                            for i in range(50)]


class SlowFirstWrite(io.StringIO):
    """A file whose first write takes 5 ms on the writer's (fake) clock."""

    def __init__(self, clock: list) -> None:
        super().__init__()
        self.clock = clock

    def write(self, s: str) -> int:
        if not self.getvalue():
            self.clock[0] += 0.005
        return super().write(s)

    def close(self) -> None:
        self.text = self.getvalue()
        super().close()


def test_the_writer_logs_its_own_slow_writes(tmp_path, monkeypatch):
    """Every SLOW_EVERY lines: how many writes took over a millisecond, and the slowest."""
    clock = [0.0]
    monkeypatch.setattr(step_log, "time", SimpleNamespace(
        perf_counter=lambda: clock[0], time=time.time, monotonic=time.monotonic))
    log = StepLogWriter(tmp_path / "steps.jsonl")
    log._fh.close()
    log._fh = slow = SlowFirstWrite(clock)
    log.SLOW_EVERY = 10
    for i in range(25):
        log.write_event("cost", float(i))
    log.close()
    reports = [json.loads(line) for line in slow.text.splitlines() if '"log_writes"' in line]
    assert [(r["lines"], r["slow"], r["max_ms"]) for r in reports] == [(10, 1, 5.0), (20, 0, 0.0)]


def test_a_line_that_cannot_be_serialized_is_named_and_the_log_goes_on(tmp_path):
    log = StepLogWriter(tmp_path / "steps.jsonl")
    class Torn:                 # a line whose making fails in the writer thread itself
        def to_json(self):
            raise RuntimeError("dictionary changed size during iteration")

    log.write_event("cost", 1.0, seconds=object())
    log.write(Torn(), 1.5)
    log.write_event("cost", 2.0, seconds=0.005)
    log.close()
    got = read_step_events(tmp_path / "steps.jsonl")
    assert [e["event"] for e in got] == ["unwritable", "unwritable", "cost"]
    assert got[0]["t"] == 1.0 and "object" in got[0]["error"]
    assert got[1]["t"] == 1.5 and "changed size" in got[1]["error"]


class FullDisk(io.StringIO):
    def write(self, s: str) -> int:
        raise OSError(28, "No space left on device")


def test_a_write_error_stops_the_log_not_the_server(tmp_path):
    log = StepLogWriter(tmp_path / "steps.jsonl")
    log._fh.close()
    log._fh = FullDisk()
    log.write_event("cost", 1.0)
    log.flush()
    assert log.failed is not None and "No space left" in log.failed
    for i in range(100):                          # dropped, not queued without bound
        log.write_event("cost", float(i))
    assert len(log._lines) == 0
    log.close()


def test_a_writer_that_falls_behind_drops_lines_rather_than_grow_without_end(tmp_path):
    """Stuck in a hung disk, the writer takes no lines: the serving thread keeps at most
    MAX_PENDING of them, counts the rest, and the count reaches the file once it writes."""
    log = StepLogWriter(tmp_path / "steps.jsonl")
    log.MAX_PENDING, log.SLOW_EVERY = 10, 16
    log._fh.close()
    stalled = log._fh = StalledFile()
    log.write_event("cost", 0.0)
    stalled.entered.wait(5.0)                      # the writer holds line 0 in its write
    for i in range(1, 31):
        log.write_event("cost", float(i))
    assert log.dropped == 20 and len(log._lines) == 10
    stalled.go.set()
    log.close()
    lines = [json.loads(line) for line in stalled.text.splitlines()]
    assert [d["t"] for d in lines if d["event"] == "cost"] == [float(i) for i in range(11)]
    log2 = StepLogWriter(tmp_path / "b.jsonl")
    log2.MAX_PENDING, log2.SLOW_EVERY = 2, 2
    log2._fh.close()
    stalled2 = log2._fh = StalledFile()
    log2.write_event("cost", 0.0)
    stalled2.entered.wait(5.0)
    for i in range(1, 6):
        log2.write_event("cost", float(i))
    stalled2.go.set()
    log2.close()
    written = [json.loads(line) for line in stalled2.text.splitlines()]
    assert [d["dropped"] for d in written if d["event"] == "log_writes"] == [3]
