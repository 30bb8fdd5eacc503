"""The torch.profiler fallback: the same checks on a Chrome trace JSON."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dual_graph_worker.core.nvtx import Annotator
from dual_graph_worker.core.settings import read_setting
from profiling import checks
from profiling.check import check_report, check_trace, main
from profiling.checks import CheckConfig
from profiling.events import EventKind
from profiling.nsys_sqlite import load_sqlite
from profiling.timeline import build_timeline
from profiling.torch_trace import load_chrome_trace

sys.path.insert(0, str(Path(__file__).parent))
from fixtures_profile import PLANTED_FAULTS, standard_profile  # noqa: E402


def test_passing_trace_passes(tmp_path):
    result = check_report(standard_profile().write_chrome_trace(tmp_path / "t.json"),
                          tmp_path / "out")
    assert result.passed, [(o.name, o.detail) for o in result.outcomes]
    assert result.summary.gpus == ("NVIDIA H200 (SM90)",)
    assert result.summary.steady_steps == 20


@pytest.mark.parametrize("violation,check,phrase", PLANTED_FAULTS)
def test_violations_match_the_nsys_path(tmp_path, violation, check, phrase):
    builder = standard_profile(violation)
    _, from_json = check_trace(load_chrome_trace(builder.write_chrome_trace(tmp_path / "t.json")),
                               CheckConfig())
    _, from_sqlite = check_trace(load_sqlite(builder.write_sqlite(tmp_path / "t.sqlite")),
                                 CheckConfig())
    failed = [o for o in from_json if not o.passed]
    assert [o.name for o in failed] == [o.name for o in from_sqlite if not o.passed] == [check]
    assert phrase in failed[0].violations[0]


def test_both_sources_normalize_to_the_same_steps(tmp_path):
    builder = standard_profile()
    a = build_timeline(load_chrome_trace(builder.write_chrome_trace(tmp_path / "t.json")))
    b = build_timeline(load_sqlite(builder.write_sqlite(tmp_path / "t.sqlite")))

    def shape(tl):
        return [(s.label, s.steady, s.switch, tuple(st.name for st in s.stages),
                 len(s.calls)) for s in tl.steps]

    assert shape(a) == shape(b)
    # GPU time of the eager kernels, read from both sources (graph replays: nsys only here)
    kernels_a = [a.trace.gpu_time_ns(c) for s in a.steps for c in s.calls
                 if a.trace.kernel_name(c) != "?"]
    kernels_b = [b.trace.gpu_time_ns(c) for s in b.steps for c in s.calls
                 if b.trace.kernel_name(c) != "?" and b.trace.graph_id(c) is None]
    assert kernels_a and set(kernels_a) == set(kernels_b) == {4_000}


def test_gzipped_trace_and_cli(tmp_path, capsys):
    plain = standard_profile("malloc").write_chrome_trace(tmp_path / "t.json")
    gz = tmp_path / "t.json.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write(plain.read_text())
    assert main([str(gz), "--out", str(tmp_path / "out")]) == 1
    assert "no_capture_instantiate_malloc  FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("body", [{"traceEvents": 3}, [], {}, {"traceEvents": []},
                                  {"traceEvents": [{"name": "no timestamp"}]}])
def test_not_a_trace_is_an_input_error(body, tmp_path, capsys):
    """A file with nothing timed in it is no profile to judge: one line, not a FAIL report."""
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps(body))
    assert main([str(bad), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_real_torch_profiler_run_with_the_emitter(tmp_path):
    """The emitter under a live torch.profiler, read back by the fallback (CPU: no CUDA calls)."""
    nvtx = Annotator.switched(read_setting("nvtx"))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        nvtx.mark_config("engine", "reference")
        nvtx.mark_config("num_draft_tokens", 1)
        nvtx.mark_steady_state()
        for mode in ("spec", "spec", "decode"):
            if mode == "decode":
                nvtx.mark_switch("spec", "decode")
            with nvtx.step_range(mode, 4, graph=True):
                stages = ("verify", "draft_extend") if mode == "spec" else ("decode",)
                for stage in stages + ("accept", "commit"):
                    with nvtx.stage_range(stage):
                        torch.ones(8).sum()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))

    trace = load_chrome_trace(path)
    assert any(e.kind is EventKind.NVTX_RANGE and e.name == "step:spec:bs4" for e in trace.events)
    timeline, outcomes = check_trace(trace, CheckConfig())
    assert timeline.config == {"engine": "reference", "num_draft_tokens": "1"}
    (track,) = timeline.tracks
    assert track.steady_source == "steady_state_begin mark"
    assert [s.label for s in track.steady_steps] == ["spec-bs4", "spec-bs4", "decode-bs4"]
    assert [st.name for st in track.steps[0].stages] == ["verify", "draft_extend", "accept",
                                                         "commit"]
    assert [s.switch for s in track.steps] == [False, False, True]
    assert len(track.switch_marks) == 1
    # No GPU here: no graph launches, which the checker reports instead of passing silently.
    by_name = {o.name: o for o in outcomes}
    assert not by_name[checks.GRAPH_LAUNCHES].passed
    assert "stage verify has 0 graph launches" in by_name[checks.GRAPH_LAUNCHES].violations[0]
    assert by_name[checks.NO_CAPTURE].passed


def test_the_scripted_workload_runs_on_cpu_and_its_trace_has_both_modes(tmp_path, capsys):
    """`dgw profile`'s child process, in-process: the scripted policy drives the reference worker
    through both modes and the torch trace it writes parses into steps of each."""
    from profiling.workload import main as workload_main

    trace_path = tmp_path / "w.trace.json"
    assert workload_main(["--model", "tiny", "--bs", "2", "--hold", "3", "--alternate", "4",
                          "--warmup", "1", "--torch-profile", str(trace_path)]) == 0
    assert "switches: " in capsys.readouterr().out
    from profiling.check import load_trace

    timeline, _ = check_trace(load_trace(trace_path, tmp_path), CheckConfig())
    assert {"spec", "decode"} <= {s.mode for s in timeline.steps}
