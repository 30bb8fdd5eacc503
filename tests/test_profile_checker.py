"""The nsys profile checker on synthetic SQLite exports (same tables/columns as nsys writes)."""

from __future__ import annotations

import os
import sqlite3
import stat
from collections import Counter
import subprocess
import sys
from pathlib import Path

import pytest

from dual_graph_worker.core import nvtx_names as names
from profiling import api_names, checks
from profiling.check import CHECK_JSON, REPORT_MD, TIMELINE_PNG, check_report, main
from profiling.checks import CheckConfig
from profiling.nsys_sqlite import load_sqlite, split_global_tid
from profiling.timeline import build_timeline

sys.path.insert(0, str(Path(__file__).parent))
from fixtures_profile import (GLOBAL_TID, PID, PLANTED_FAULTS, TID,  # noqa: E402
                              standard_profile)
from fixtures_profile import outcomes as _outcomes  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _sqlite(tmp_path: Path, violation=None, **kw) -> Path:
    return standard_profile(violation, **kw).write_sqlite(tmp_path / f"{violation}.sqlite")


def test_passing_profile_passes_every_check(tmp_path):
    result = check_report(_sqlite(tmp_path), tmp_path / "out")
    assert result.passed, [(o.name, o.detail) for o in result.outcomes]
    assert [o.name for o in result.outcomes] == list(checks.CHECK_NAMES)
    by_name = {o.name: o for o in result.outcomes}
    # 20 steady steps: 19 replay graphs, one ran eagerly and is reported, not failed.
    assert "19 graph steps checked (decode 7, spec 12)" in by_name[checks.GRAPH_LAUNCHES].detail
    assert "1 eager steps reported" in by_name[checks.GRAPH_LAUNCHES].detail
    assert "5 switch steps" in by_name[checks.SWITCH_COST].detail
    assert result.summary.gpus == ("NVIDIA H200 (SM90)",)
    assert (result.summary.engine, result.summary.attention_backend) == ("reference", "triton")
    assert result.summary.num_draft_tokens == 3
    assert (result.summary.steady_steps, result.summary.steady_eager_steps) == (20, 1)


@pytest.mark.parametrize("violation,check,phrase", PLANTED_FAULTS)
def test_each_violation_is_flagged_by_exactly_its_check(tmp_path, violation, check, phrase):
    result = check_report(_sqlite(tmp_path, violation), tmp_path / "out")
    assert result.failed == [check]
    failing = next(o for o in result.outcomes if o.name == check)
    assert len(failing.violations) == 1
    assert phrase in failing.violations[0]


def test_status_polls_at_a_switch_are_reported_not_counted(tmp_path):
    path = standard_profile(switch_polls=29).write_sqlite(tmp_path / "polls.sqlite")
    switch = _outcomes(path)[checks.SWITCH_COST]
    assert switch.passed, switch.violations
    assert any("29 in 5 switch steps" in n for n in switch.notes), switch.notes
    # A blocking call at the same place still fails (the planted switch fault).
    assert not _outcomes(_sqlite(tmp_path, "switch_extra_api"))[checks.SWITCH_COST].passed


def test_a_lone_event_pool_growth_at_a_switch_is_reported_not_counted(tmp_path):
    """An allocator creating one event, once, at one of many compared switches is its pool
    growing, not what a switch costs; at two switches, or among too few compared, it counts."""
    once = _outcomes(standard_profile(gap_events_at=(8,)).write_sqlite(tmp_path / "a.sqlite"))
    switch = once[checks.SWITCH_COST]
    assert switch.passed, switch.violations
    assert any("event-pool growth once" in n and "cudaEventCreateWithFlags +1" in n
               for n in switch.notes), switch.notes
    twice = _outcomes(standard_profile(gap_events_at=(8, 12)).write_sqlite(tmp_path / "b.sqlite"))
    assert len(twice[checks.SWITCH_COST].violations) == 2
    lone = [("x", Counter({"cudaEventCreate": 1}))]
    assert checks._lone_growth(lone, 10) == {0} and checks._lone_growth(lone, 9) == set()
    assert checks._lone_growth([("x", Counter({"cudaEventCreate": 1,
                                               "cudaStreamSynchronize": 1}))], 50) == set()
    # Growth at two places, even under two names, or many events at one: a switch's cost.
    assert checks._lone_growth(lone + [("y", Counter({"cuEventCreate": 1}))], 50) == set()
    assert checks._lone_growth([("x", Counter({"cuEventCreate": 40}))], 50) == set()


def test_warm_up_capture_and_allocation_are_outside_steady_state(tmp_path):
    trace = load_sqlite(_sqlite(tmp_path))
    early = {api_names.base_name(e.name) for e in trace.events if e.start_ns < _steady_mark(trace)}
    # The fixture really does capture, instantiate and allocate during warm-up ...
    assert {"cudaStreamBeginCapture", "cudaGraphInstantiateWithFlags", "cudaMalloc"} <= early
    # ... and the checker does not count it.
    assert _outcomes(tmp_path / "None.sqlite")[checks.NO_CAPTURE].passed


def _steady_mark(trace) -> int:
    return next(e.start_ns for e in trace.events if e.name == names.STEADY_STATE)


def test_without_steady_mark_the_first_n_steps_are_warm_up(tmp_path):
    path = _sqlite(tmp_path, steady_mark=False)
    # Two warm-up replays precede the steady schedule; skipping them gives a clean window.
    assert all(o.passed for o in _outcomes(path, CheckConfig(warmup_steps=2)).values())
    # Starting at the very first step puts the lazy warm-up allocations in the window; the
    # one right after the spec->decode warm-up switch also shows up as a switch cost.
    outcomes = _outcomes(path, CheckConfig(warmup_steps=0))
    assert [n for n, o in outcomes.items() if not o.passed] == [checks.NO_CAPTURE,
                                                                 checks.SWITCH_COST]
    assert "cudaMalloc x2" in outcomes[checks.NO_CAPTURE].violations[0]
    assert "cudaMalloc +1" in outcomes[checks.SWITCH_COST].violations[0]


def test_too_few_steps_without_mark_fails_loudly(tmp_path):
    outcomes = _outcomes(_sqlite(tmp_path, steady_mark=False), CheckConfig(warmup_steps=1000))
    assert not outcomes[checks.GRAPH_LAUNCHES].passed
    assert "no step in steady state" in outcomes[checks.GRAPH_LAUNCHES].detail


def test_k1_spec_steps_have_no_draft_stage(tmp_path):
    path = _sqlite(tmp_path, k=1)
    assert all(o.passed for o in _outcomes(path).values())
    # Told K=3 against a K=1 trace, every spec step misses its draft stage.
    outcome = _outcomes(path, CheckConfig(num_draft_tokens=3))[checks.GRAPH_LAUNCHES]
    assert not outcome.passed
    assert all("missing stage draft" in v for v in outcome.violations)


def test_unknown_k_accepts_spec_steps_with_or_without_draft(tmp_path):
    outcomes = _outcomes(_sqlite(tmp_path, with_config=False))
    assert all(o.passed for o in outcomes.values())
    assert "K=unknown" in outcomes[checks.GRAPH_LAUNCHES].detail
    assert any("num_draft_tokens unknown" in n for n in outcomes[checks.GRAPH_LAUNCHES].notes)
    assert "engine ?" in outcomes[checks.GPU_IDENTITY].detail


def test_eager_kernel_names_come_from_correlation_ids(tmp_path):
    notes = _outcomes(_sqlite(tmp_path))[checks.EAGER_KERNELS].notes
    assert any(n.startswith("accept: ") and "argmax_kernel x19" in n for n in notes)
    assert any(n.startswith("commit: ") and "commit_kernel x19" in n for n in notes)


def test_loader_reads_registered_strings_domains_and_thread_ids(tmp_path):
    trace = load_sqlite(_sqlite(tmp_path))
    texts = {e.name for e in trace.events}
    # Ranges are registered strings (NULL text, textId); marks carry text.
    assert {"stage:verify", "step:spec:bs4", "steady_state_begin"} <= texts
    verify = next(e for e in trace.events if e.name == "stage:verify")
    assert (verify.pid, verify.tid, verify.domain) == (PID, TID, names.DOMAIN)
    assert split_global_tid(GLOBAL_TID) == (PID, TID)
    # The look-alike step in the default domain is read but never becomes a step.
    assert any(e.name == "step:decode:bs999" and e.domain is None for e in trace.events)
    assert all(s.padded_bs != 999 for s in build_timeline(trace).steps)


def test_driver_calls_nested_in_runtime_calls_count_once(tmp_path):
    trace = load_sqlite(_sqlite(tmp_path))
    assert any(e.name == "cuGraphLaunch" for e in trace.events)
    steps = build_timeline(trace).steps
    assert all(not any(c.name == "cuGraphLaunch" for c in s.calls) for s in steps)


def test_missing_cuda_tables_are_tolerated_and_explained(tmp_path):
    path = _sqlite(tmp_path)
    conn = sqlite3.connect(path)
    for table in ("CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_KERNEL",
                  "CUPTI_ACTIVITY_KIND_GRAPH_TRACE", "TARGET_INFO_GPU"):
        conn.execute(f"DROP TABLE {table}")
    conn.commit()
    conn.close()
    result = check_report(path, tmp_path / "out")
    assert checks.GRAPH_LAUNCHES in result.failed
    assert any("--trace=cuda" in w for w in result.summary.warnings)
    assert (tmp_path / "out" / REPORT_MD).exists()


def test_empty_database_reports_no_steps(tmp_path):
    path = tmp_path / "empty.sqlite"
    sqlite3.connect(path).execute("CREATE TABLE StringIds(id INTEGER, value TEXT)").connection.close()
    outcome = _outcomes(path)[checks.GRAPH_LAUNCHES]
    assert not outcome.passed and "no dgw step ranges" in outcome.detail


def test_gpu_identity_falls_back_to_config_marks_and_checks_expected_sm(tmp_path):
    builder = standard_profile()
    builder.config("gpu_name", "NVIDIA RTX PRO 6000 Blackwell")
    builder.config("compute_capability", "12.0")
    path = builder.write_sqlite(tmp_path / "p.sqlite")
    conn = sqlite3.connect(path)  # an export without the compute capability columns
    conn.execute("DROP TABLE TARGET_INFO_GPU")
    conn.execute("CREATE TABLE TARGET_INFO_GPU(id INTEGER NOT NULL, name TEXT)")
    conn.execute("INSERT INTO TARGET_INFO_GPU VALUES (0, 'NVIDIA RTX PRO 6000 Blackwell')")
    conn.commit()
    conn.close()
    outcome = _outcomes(path)[checks.GPU_IDENTITY]
    assert outcome.passed and "NVIDIA RTX PRO 6000 Blackwell (SM120) from config marks" in outcome.detail
    outcomes = _outcomes(path, CheckConfig(expect_sm="SM90"))
    assert [n for n, o in outcomes.items() if not o.passed] == [checks.GPU_IDENTITY]
    assert "expected SM90, profile shows SM120" in outcomes[checks.GPU_IDENTITY].detail


@pytest.mark.parametrize("text,sm", [("SM90", "SM90"), ("9.0", "SM90"), ("sm_100", "SM100"),
                                     ("12.0", "SM120"), ("90", "SM90")])
def test_normalize_sm(text, sm):
    assert checks.normalize_sm(text) == sm


@pytest.mark.parametrize("text", ["9", "SM9", "sm_9"])
def test_a_one_digit_sm_is_refused_with_the_two_spellings(tmp_path, capsys, text):
    # No GPU reports SM9, so --expect-sm 9 could never pass: refuse it up front.
    with pytest.raises(ValueError, match="write 9.0 or 90"):
        checks.normalize_sm(text)
    assert main([str(_sqlite(tmp_path)), "--out", str(tmp_path / "o"), "--expect-sm", text]) == 2
    assert "write 9.0 or 90" in capsys.readouterr().err


@pytest.mark.parametrize("raw,base", [
    ("cudaGraphLaunch_v10000", "cudaGraphLaunch"),
    ("cudaLaunchKernel_ptsz_v7000", "cudaLaunchKernel"),
    ("cuMemAlloc_v2", "cuMemAlloc"),
    ("cudaGraphLaunch", "cudaGraphLaunch"),
    ("cuGraphInstantiateWithFlags", "cuGraphInstantiateWithFlags"),
])
def test_api_base_names(raw, base):
    assert api_names.base_name(raw) == base


def test_api_classes():
    assert api_names.is_graph_launch("cuGraphLaunch")
    assert api_names.is_graph_launch("cudaGraphLaunch_ptsz_v10000")
    assert not api_names.is_graph_launch("cudaGraphLaunchHostNode")
    assert api_names.is_kernel_launch("cuLaunchKernelEx")
    assert not api_names.is_kernel_launch("cudaGraphLaunch_v10000")
    assert api_names.forbidden_category("cudaStreamBeginCapture_v10000") == "capture"
    assert api_names.forbidden_category("cuGraphInstantiate_v2") == "instantiate"
    assert api_names.forbidden_category("cudaGraphInstantiateWithFlags_v11040") == "instantiate"
    assert api_names.forbidden_category("cudaMallocAsync_v11020") == "allocation"
    assert api_names.forbidden_category("cudaHostAlloc_v3020") == "allocation"
    assert api_names.forbidden_category("cuMemAllocFromPoolAsync") == "allocation"
    assert api_names.forbidden_category("cudaMemcpyAsync_v3020") is None
    assert api_names.forbidden_category("cudaFree_v3020") is None


@pytest.mark.parametrize("text,parsed", [
    ("step:spec:bs8", names.StepName("spec", 8, True)),
    ("step:decode:eager-bs3", names.StepName("decode", 3, False)),
    ("stage:draft_extend", names.StageName("draft_extend")),
    ("switch:spec->decode", names.SwitchName("spec", "decode")),
    ("capture:spec-bs4", names.CaptureName("spec-bs4")),
    ("steady_state_begin", names.SteadyStateName()),
    ("config:num_draft_tokens=3", names.ConfigName("num_draft_tokens", "3")),
    ("forward", None),
    ("step:spec:bsX", None),
])
def test_name_parsing(text, parsed):
    assert names.parse(text) == parsed


# -- CLI -------------------------------------------------------------------------------------

def test_cli_passes_and_writes_markdown_png_and_json(tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(_sqlite(tmp_path)), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "dgw profile check: PASS" in printed and "gpu_identity" in printed
    assert (out / TIMELINE_PNG).read_bytes()[:8] == PNG_MAGIC
    md = (out / REPORT_MD).read_text()
    assert "# dgw profile check: PASS" in md and "NVIDIA H200 (SM90)" in md
    assert f"![timeline]({TIMELINE_PNG})" in md
    assert '"passed": true' in (out / CHECK_JSON).read_text()


def test_cli_exits_non_zero_on_failure_and_still_writes_outputs(tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(_sqlite(tmp_path, "malloc")), "--out", str(out)]) == 1
    assert "no_capture_instantiate_malloc  FAIL" in capsys.readouterr().out
    md = (out / REPORT_MD).read_text()
    assert "# dgw profile check: FAIL" in md and "cudaMalloc x1" in md
    assert (out / TIMELINE_PNG).read_bytes()[:8] == PNG_MAGIC


def test_cli_options_reach_the_checks(tmp_path):
    path = _sqlite(tmp_path, "eager_kernels")
    assert main([str(path), "--out", str(tmp_path / "a")]) == 1
    assert main([str(path), "--out", str(tmp_path / "b"), "--max-eager-kernels", "6"]) == 0
    assert main([str(path), "--out", str(tmp_path / "c"), "--max-eager-kernels", "6",
                 "--expect-sm", "SM100"]) == 1


def test_python_dash_m_entry_point(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "profiling.check", str(_sqlite(tmp_path, "double_launch")),
         "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert "graph_launches_per_stage       FAIL" in proc.stdout


def test_cli_input_errors_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "missing.sqlite"), "--out", str(tmp_path / "o")]) == 2
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a profile")
    assert main([str(junk), "--out", str(tmp_path / "o")]) == 2
    assert main([str(_sqlite(tmp_path)), "--out", str(tmp_path / "o"), "--expect-sm", "x"]) == 2
    assert "error:" in capsys.readouterr().err


def test_nsys_rep_without_nsys_says_what_to_do(tmp_path, monkeypatch, capsys):
    rep = tmp_path / "run.nsys-rep"
    rep.write_bytes(b"\0" * 16)
    monkeypatch.setenv("PATH", str(tmp_path / "no-such-bin"))
    assert main([str(rep), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "nsys is not on PATH" in err and "torch.profiler" in err


def test_nsys_rep_is_exported_with_nsys(tmp_path, monkeypatch):
    """A stand-in `nsys` records its arguments and writes the export where -o says."""
    exported = _sqlite(tmp_path, "instantiate")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nsys"
    fake.write_text(
        "#!/bin/sh\n"
        f"echo \"$@\" > {tmp_path / 'args.txt'}\n"
        "while [ $# -gt 1 ]; do if [ \"$1\" = -o ]; then out=$2; fi; shift; done\n"
        f"cp {exported} \"$out\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    rep = tmp_path / "run.nsys-rep"
    rep.write_bytes(b"\0" * 16)
    result = check_report(rep, tmp_path / "out")
    args = (tmp_path / "args.txt").read_text().split()
    assert args[:5] == ["export", "--type", "sqlite", "--force-overwrite", "true"]
    assert args[5:] == ["-o", str(tmp_path / "out" / "run.sqlite"), str(rep)]
    assert result.failed == [checks.NO_CAPTURE]


def test_check_json_is_written_through_write_json(tmp_path, monkeypatch):
    # write_json writes a temporary file and renames it: a reader never sees half a verdict.
    import profiling.check as check_module
    from dual_graph_worker.core.jsonio import write_json

    written = []
    monkeypatch.setattr(check_module, "write_json",
                        lambda data, path: (written.append(Path(path)), write_json(data, path)))
    result = check_report(_sqlite(tmp_path), tmp_path / "out")
    assert written == [result.check_json] == [tmp_path / "out" / CHECK_JSON]


def _graph_rows_as_node_kernels(path: Path, *, drop_graph_rows: bool) -> dict[int, int]:
    """Two node kernels (graphNodeId set) per graph replay, as --cuda-graph-trace=node records
    them; without drop_graph_rows the graph rows stay, as --cuda-graph-trace=graph keeps them.
    Returns each replay's correlation id -> its node kernels' summed duration."""
    conn = sqlite3.connect(path)
    rows = conn.execute("SELECT start, correlationId, globalPid FROM "
                        "CUPTI_ACTIVITY_KIND_GRAPH_TRACE").fetchall()
    name = conn.execute("SELECT MAX(id) + 1 FROM StringIds").fetchone()[0]
    conn.execute("INSERT INTO StringIds VALUES (?, 'node_kernel')", (name,))
    sums = {}
    for start, corr, gpid in rows:
        for node, (t0, dur) in enumerate(((start, 10_000), (start + 15_000, 12_000)), 1):
            conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES "
                         "(?,?,0,1,NULL,7,?,?,?,?,?,?)",
                         (t0, t0 + dur, corr, gpid, name, name, node, 1))
        sums[corr] = 22_000
    if drop_graph_rows:
        conn.execute("DELETE FROM CUPTI_ACTIVITY_KIND_GRAPH_TRACE")
    conn.commit()
    conn.close()
    return sums


@pytest.mark.parametrize("node_mode", [True, False])
def test_graph_gpu_time_in_node_and_graph_trace_modes(tmp_path, node_mode):
    path = _sqlite(tmp_path)
    sums = _graph_rows_as_node_kernels(path, drop_graph_rows=node_mode)
    trace = load_sqlite(path)
    launches = [e for e in trace.events if e.correlation_id in sums]
    assert launches and all(api_names.is_graph_launch(e.name) for e in launches)
    # Node mode: no graph row, so a replay's GPU time is its node kernels' sum. Graph mode:
    # the graph row (30 us in the fixture) already spans its nodes, which are not added again.
    assert {trace.gpu_time_ns(e) for e in launches} == ({22_000} if node_mode else {30_000})
    assert all(trace.kernel_name(e) == "?" for e in launches)   # node kernels are not eager
    node_warning = [w for w in trace.warnings if "--cuda-graph-trace=node" in w]
    assert len(node_warning) == (1 if node_mode else 0)
