"""The stall watch (dual_graph_worker/core/stall_watch.py) and its worker settings."""

import io
import json
import time

import pytest

from dual_graph_worker.core.settings import Settings
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.stall_watch import StallWatch, read_stall_samples


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_no_sample_before_the_first_step_or_inside_the_threshold():
    clock, out = FakeClock(), io.StringIO()
    watch = StallWatch(out, threshold_s=1.0, clock=clock, wall_clock=lambda: 5.0)
    clock.now += 60                     # start-up, however long, is not a stall
    assert watch.check() is None
    watch.beat()
    clock.now += 0.9
    assert watch.check() is None
    assert out.getvalue() == ""


def test_a_stall_records_where_the_watched_thread_is(tmp_path):
    clock = FakeClock()
    path = tmp_path / "stall.jsonl"
    with open(path, "w") as out:
        watch = StallWatch(out, threshold_s=1.0, clock=clock, wall_clock=lambda: 5.0)
        watch.beat()
        watch.beat()
        clock.now += 2.5
        sample = watch.check()
    assert sample is not None and sample.gap_s == pytest.approx(2.5) and sample.steps == 2
    # Sampled from this very thread here, so this test function is on the stack.
    assert any("test_a_stall_records_where_the_watched_thread_is" in f for f in sample.stack)
    assert read_stall_samples(str(path)) == [
        type(sample)(5.0, 2.5, 2, sample.stack)]


def test_samples_stop_at_the_cap():
    clock, out = FakeClock(), io.StringIO()
    watch = StallWatch(out, threshold_s=1.0, max_samples=2, clock=clock)
    watch.beat()
    clock.now += 5
    assert [watch.check() is not None for _ in range(4)] == [True, True, False, False]
    assert len(out.getvalue().splitlines()) == 2


def _stalled_in_here(out: io.StringIO, deadline_s: float) -> None:
    # Stalls until the sampler has written (however late a loaded machine schedules it), so the
    # sample is taken while this frame is on the stack; the deadline only bounds a broken watch.
    end = time.monotonic() + deadline_s
    while not out.getvalue() and time.monotonic() < end:
        time.sleep(0.01)


def test_the_sampler_thread_catches_a_real_stall():
    out = io.StringIO()
    watch = StallWatch(out, threshold_s=0.05, period_s=0.01).start()
    try:
        watch.beat()
        _stalled_in_here(out, deadline_s=10.0)
    finally:
        watch.stop()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines, "a stall of up to 10 s past a 0.05 s threshold wrote no sample"
    assert any("_stalled_in_here" in frame for line in lines for frame in line["stack"])


@pytest.mark.parametrize("kwargs", [dict(threshold_s=0), dict(period_s=-1)])
def test_nonpositive_times_are_refused(kwargs):
    with pytest.raises(ValueError, match="positive"):
        StallWatch(io.StringIO(), **kwargs)


def test_worker_settings_for_the_stall_watch():
    cfg = Settings.from_env({"DGW_STALL_TRACE": "/tmp/s.jsonl", "DGW_STALL_TRACE_S": "2.5"})
    assert (cfg.stall_trace, cfg.stall_trace_s) == ("/tmp/s.jsonl", 2.5)
    assert Settings.from_env({}).stall_trace is None
    with pytest.raises(ConfigError, match="DGW_STALL_TRACE_S"):
        Settings.from_env({"DGW_STALL_TRACE_S": "0"})


def test_stall_report_finds_the_gap_and_the_stack(tmp_path, capsys):
    from profiling.stall_report import main

    steps = [{"event": "ready", "t": 100.0},
             {"step": 0, "mode": "spec", "bs": 1, "t": 101.0},
             {"event": "deferred_prefill", "t": 101.1, "requests": 64},
             {"step": 1, "mode": "decode", "bs": 128, "t": 109.6},
             {"step": 2, "mode": "decode", "bs": 128, "t": 109.7}]
    (tmp_path / "steps-dual-bench.jsonl").write_text(
        "".join(json.dumps(s) + "\n" for s in steps) + '{"torn')
    stack = ["/usr/lib/python3.12/subprocess.py:550 run", "/x/clamp_position.py:17 build",
             "/x/worker.py:336 _decode_step"]
    samples = [{"t": 102.2 + 0.25 * i, "gap_s": 1.1 + 0.25 * i, "steps": 7, "stack": stack}
               for i in range(4)]
    samples.append({"t": 120.0, "gap_s": 1.0, "steps": 9, "stack": ["/y/idle.py:1 recv"]})
    (tmp_path / "stall-dual-bench.jsonl").write_text(
        "".join(json.dumps(s) + "\n" for s in samples))
    assert main([str(tmp_path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "8.500 s  at     1.10 s  (deferred_prefill -> decode)" in out
    report = json.loads((tmp_path / "stall_report.json").read_text())
    first, second = report["episodes"]
    assert (first["samples"], first["steps_before"]) == (4, 7)
    assert first["duration_s"] == pytest.approx(1.85)
    assert first["stack"] == stack[1:]          # stdlib frames dropped
    assert second["stack"] == ["/y/idle.py:1 recv"]


def test_stall_report_names_missing_inputs(tmp_path, capsys):
    from profiling.stall_report import main

    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    assert "--stall-trace-s" in capsys.readouterr().err


def test_stall_report_names_a_malformed_line(tmp_path, capsys):
    from profiling.stall_report import main

    (tmp_path / "steps-dual-bench.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "stall-dual-bench.jsonl").write_text("")
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    err = capsys.readouterr().err
    assert "malformed line" in err and "KeyError" in err and "Traceback" not in err
