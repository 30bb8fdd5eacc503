"""The profile checker's SGLang expectation profile, on synthetic nsys SQLite exports shaped like
the SGLang worker's profile (tests/fixtures_profile.py: sglang_profile)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from profiling import checks, engines
from profiling.check import check_report, main
from profiling.checks import CheckConfig
from profiling.nsys_sqlite import load_sqlite

sys.path.insert(0, str(Path(__file__).parent))
from fixtures_profile import (GRAPH_LAUNCH, SGLANG_FAULTS, SGLANG_VIOLATIONS,  # noqa: E402
                              CatchUp, sglang_profile, standard_profile)
from fixtures_profile import outcomes as _outcomes  # noqa: E402


def _sqlite(tmp_path: Path, violation=None, **kw) -> Path:
    return sglang_profile(violation, **kw).write_sqlite(tmp_path / f"sglang-{violation}.sqlite")


def test_sglang_profile_passes_with_the_engine_taken_from_the_trace(tmp_path):
    result = check_report(_sqlite(tmp_path), tmp_path / "out", CheckConfig(expect_sm="SM90"))
    assert result.passed, [(o.name, o.detail) for o in result.outcomes]
    assert result.summary.engine == "sglang"
    assert result.summary.expectation.startswith("sglang (")
    by_name = {o.name: o for o in result.outcomes}
    assert "24 graph steps checked (decode 12, spec 12)" in by_name[checks.GRAPH_LAUNCHES].detail
    assert "5 distinct graphs" in " ".join(by_name[checks.GRAPH_LAUNCHES].notes)
    eager = by_name[checks.EAGER_KERNELS]
    assert "max 0 eager kernel launches outside the stated set" in eager.detail
    assert "launches from the stated set (sglang)" in eager.detail
    # The stated set is reported family by family, with counts, in the markdown.
    md = result.report_md.read_text()
    assert "Expectation profile: sglang" in md
    for label in ("aten", "sglang-spec", "sglang-metadata"):
        assert f"stated set `{label}`" in md
    assert "create_flashinfer_kv_indices_triton x36" in md
    assert "verify_tree_greedy_kernel_triton x12" in md


def test_the_same_trace_fails_the_reference_expectations(tmp_path):
    """The profile matters: under the reference rules SGLang's decode steps have a stage too
    many and every step too many eager kernels."""
    outcomes = _outcomes(_sqlite(tmp_path), CheckConfig(engine="reference"))
    assert not outcomes[checks.GRAPH_LAUNCHES].passed
    assert "stage draft_extend does not belong to mode decode" in \
        outcomes[checks.GRAPH_LAUNCHES].violations[0]
    assert not outcomes[checks.EAGER_KERNELS].passed
    assert "eager kernel launches > 4 allowed" in outcomes[checks.EAGER_KERNELS].violations[0]


@pytest.mark.parametrize("violation,check,phrase", SGLANG_FAULTS)
def test_each_sglang_violation_is_flagged_by_exactly_its_check(tmp_path, violation, check,
                                                              phrase):
    result = check_report(_sqlite(tmp_path, violation), tmp_path / "out")
    assert result.failed == [check]
    failing = next(o for o in result.outcomes if o.name == check)
    assert any(phrase in v for v in failing.violations), failing.violations


def test_a_decode_step_replaying_the_verify_graph_is_caught_inside_a_decode_range(tmp_path):
    """Its ranges look right (stage decode, one graph launch): only the graph id betrays it."""
    outcome = _outcomes(_sqlite(tmp_path, "decode_launches_verify_graph"))[checks.GRAPH_LAUNCHES]
    assert len(outcome.violations) == 1
    assert "stage decode launched graph" in outcome.violations[0]
    assert "decode-bs8" in outcome.violations[0]


def test_lazy_catch_up_decode_steps_have_no_draft_extend(tmp_path):
    lazy = _sqlite(tmp_path, continuity="lazy-catch-up")
    assert all(o.passed for o in _outcomes(lazy).values())
    # A keep-current trace whose decode steps lack the draft extend fails.
    assert not _outcomes(_sqlite(tmp_path, "missing_draft_extend"))[checks.GRAPH_LAUNCHES].passed


def _lazy(tmp_path: Path, catch_up: CatchUp, name: str) -> dict:
    path = sglang_profile(continuity="lazy-catch-up", catch_up=catch_up).write_sqlite(
        tmp_path / f"lazy-{name}.sqlite")
    return _outcomes(path)


def test_lazy_catch_up_is_stated_work_reported_apart(tmp_path):
    """The first spec step after decode steps runs the catch-up's eager draft extend: 24
    kernels and an upload, inside stage catch_up. They are the deferred draft work, not glue
    and not switch cost, and they are counted in the notes."""
    outcomes = _lazy(tmp_path, CatchUp(), "ok")
    assert all(o.passed for o in outcomes.values()), [
        (o.name, o.detail) for o in outcomes.values() if not o.passed]
    eager = outcomes[checks.EAGER_KERNELS]
    assert "max 0 eager kernel launches outside the stated set" in eager.detail
    note = next(n for n in eager.notes if n.startswith("stated stage `catch_up`"))
    # schedule (hold 3, 2 cycles of S S S D D D S D S D S D): 7 spec steps follow a decode step
    assert "168 launches in 7 of 24 graph steps, 24-24 per step" in note
    assert "nvjet_tst_128x64_64x4_1x2_h_bz_TNT x" in note
    switch = outcomes[checks.SWITCH_COST]
    assert any("stated eager stages (catch_up" in n and "in 7 switch steps and 0 other"
               in n for n in switch.notes), switch.notes


def test_catch_up_work_outside_its_stage_is_glue_and_switch_cost(tmp_path):
    outcomes = _lazy(tmp_path, CatchUp(in_stage=False), "outside")
    assert not outcomes[checks.EAGER_KERNELS].passed
    # 18 of the 24: the gathers and argmaxes are ATen, in the stated glue set anyway
    assert "18 eager kernel launches outside the stated set > 4 allowed" in \
        outcomes[checks.EAGER_KERNELS].violations[0]
    assert not outcomes[checks.SWITCH_COST].passed
    assert "cudaLaunchKernel +24" in outcomes[checks.SWITCH_COST].violations[0]


def test_an_allocation_inside_a_catch_up_still_fails_no_capture(tmp_path):
    outcomes = _lazy(tmp_path, CatchUp(malloc=True), "malloc")
    assert [n for n, o in outcomes.items() if not o.passed] == [checks.NO_CAPTURE]
    assert "allocation: cudaMalloc x7" in outcomes[checks.NO_CAPTURE].violations[0]


def test_unlisted_kernels_within_the_limit_pass_and_are_listed(tmp_path):
    path = _sqlite(tmp_path, "unlisted_eager_kernels")
    outcome = _outcomes(path, CheckConfig(max_eager_kernels=5))[checks.EAGER_KERNELS]
    assert outcome.passed
    assert "max 5 eager kernel launches outside the stated set" in outcome.detail
    assert any("mystery_kernel_0 x3" in n for n in outcome.notes)


def test_loader_keeps_demangled_names_and_graph_ids(tmp_path):
    trace = load_sqlite(_sqlite(tmp_path))
    launches = [e for e in trace.events if e.name == GRAPH_LAUNCH]
    assert launches and all(trace.graph_id(c) is not None for c in launches)
    argmax = next(e for e in trace.events if trace.kernel_name(e) == "reduce_kernel")
    assert trace.kernel_demangled_name(argmax).startswith("void at::native::reduce_kernel<")


def test_engine_resolution():
    assert engines.resolve(None, {"engine": "sglang"}) is engines.SGLANG
    assert engines.resolve("auto", {"engine": "reference"}) is engines.REFERENCE
    assert engines.resolve(None, {}) is engines.REFERENCE          # old traces: unchanged
    assert engines.resolve(None, {"engine": "vllm"}) is engines.REFERENCE
    assert engines.resolve("sglang", {"engine": "reference"}) is engines.SGLANG
    with pytest.raises(ValueError, match="unknown engine profile"):
        engines.resolve("trt", {})


@pytest.mark.parametrize("short,demangled,family", [
    ("vectorized_elementwise_kernel",
     "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>>(int)",
     "aten"),
    ("elementwise_kernel", "elementwise_kernel", "aten"),      # a source with short names only
    ("DeviceScanKernel", "void at_cuda_detail::cub::DeviceScanKernel<int*>(int*)", "aten"),
    ("create_flashinfer_kv_indices_triton", "create_flashinfer_kv_indices_triton",
     "sglang-metadata"),
    ("clamp_position_kernel", "void clamp_position_kernel<long>(long*, long const*, unsigned long)",
     "sglang-metadata"),
    ("VerifyTreeGreedy", "void VerifyTreeGreedy<int>(int*)", "sglang-spec"),
    ("build_tree_efficient", "void build_tree_efficient(long*)", "sglang-spec"),
    ("assign_extend_cache_locs", "assign_extend_cache_locs", "sglang-spec"),
    ("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", "nvjet_tst_128x64_64x8_1x1_v_bz_TNT", None),  # a GEMM
    ("_fwd_kernel_stage1", "_fwd_kernel_stage1", None),       # triton decode attention
    ("mystery_kernel", "void mystery_kernel<float>(float*)", None),
])
def test_stated_set_families(short, demangled, family):
    found = engines.SGLANG.eager_family(short, demangled)
    assert (found.label if found else None) == family
    assert engines.REFERENCE.eager_family(short, demangled) is None


def test_cli_engine_flag(tmp_path, capsys):
    good, bad = _sqlite(tmp_path), _sqlite(tmp_path, "capture_in_steady")
    assert main([str(good), "--out", str(tmp_path / "a"), "--engine", "sglang",
                 "--expect-sm", "SM90"]) == 0
    assert main([str(bad), "--out", str(tmp_path / "b")]) == 1
    assert main([str(good), "--out", str(tmp_path / "c"), "--engine", "reference"]) == 1
    assert "dgw profile check: FAIL" in capsys.readouterr().out


def test_reference_fixture_is_checked_unchanged_under_auto(tmp_path):
    path = standard_profile().write_sqlite(tmp_path / "ref.sqlite")
    result = check_report(path, tmp_path / "out")
    assert result.passed and result.summary.expectation.startswith("reference (")
    # Its graphs each serve one (mode, stage): the graph-identity rule holds there too.
    notes = {o.name: o.notes for o in result.outcomes}[checks.GRAPH_LAUNCHES]
    assert any("distinct graphs launched in steady state" in n for n in notes)


def test_fixture_rejects_unknown_fault():
    with pytest.raises(ValueError):
        sglang_profile("nope")
    assert len(SGLANG_VIOLATIONS) == len(set(SGLANG_VIOLATIONS)) == 5


def test_check_without_matplotlib_still_writes_the_verdict(tmp_path, monkeypatch):
    """A bare GPU environment may lack matplotlib: the report and check.json still come out."""
    import profiling.check as check_mod

    monkeypatch.setattr(check_mod, "plot_timeline", None)
    result = check_report(_sqlite(tmp_path), tmp_path / "out")
    assert result.passed and result.timeline_png is None
    assert result.report_md.exists() and result.check_json.exists()
    assert "![timeline]" not in result.report_md.read_text()


def test_report_times_what_steps_and_the_catch_up_launched_on_the_gpu(tmp_path):
    """Fixture kernels run 4 us, graph replays 30 us: a spec step is 3 graphs and 15 glue
    kernels (150 us); a catch-up adds its 24 kernels (96 us), reported on their own too."""
    path = sglang_profile(continuity="lazy-catch-up").write_sqlite(tmp_path / "lazy.sqlite")
    result = check_report(path, tmp_path / "out")
    rows = {(g.mode, g.stage, g.only_stage): (g.count, g.median_us)
            for g in result.summary.gpu_groups}
    assert rows[("spec", "", False)] == (5, 150.0)
    assert rows[("spec", "catch_up", False)] == (7, 246.0)
    assert rows[("spec", "catch_up", True)] == (7, 96.0)
    assert rows[("decode", "", False)][1] == 30.0 + 4 * 5      # graph + fill + 4 glue kernels
    md = result.report_md.read_text()
    assert "| spec | 8 | yes | catch_up | the stage alone | 7 | 96.0 |" in md


@pytest.mark.parametrize("continuity", ["keep-current", "lazy-catch-up"])
def test_on_fa3_the_draft_extend_sglang_runs_eagerly_is_stated_not_failed(tmp_path, continuity):
    # SGLang 0.5.17 captures no draft-extend graph for its spec steps on FA3 (EAGLE-3's own steps
    # run it eagerly): there the checker expects none and reports its kernels apart. The
    # worker's own width-1 draft-extend graph in keep-current decode steps is still expected.
    def check(name, **kw):
        path = sglang_profile(continuity=continuity, **kw).write_sqlite(
            tmp_path / f"{name}.sqlite")
        return check_report(path, tmp_path / name)

    fa3 = check("fa3", attention_backend="fa3", eager=("draft_extend",))
    assert fa3.passed, [(o.name, o.detail) for o in fa3.outcomes]
    assert "on fa3 eager (spec: draft_extend)" in fa3.summary.expectation
    by_name = {o.name: o for o in fa3.outcomes}
    assert "max 0 eager kernel launches outside the stated set" in \
        by_name[checks.EAGER_KERNELS].detail
    assert any(n.startswith("stated stage `draft_extend` (run eagerly by the engine here")
               for n in by_name[checks.EAGER_KERNELS].notes)
    # The same steps on triton, where SGLang captures the graph: both checks fail.
    triton = check("triton", eager=("draft_extend",))
    assert set(triton.failed) >= {checks.GRAPH_LAUNCHES, checks.EAGER_KERNELS}
    assert "stage draft_extend has 0 graph launches" in \
        {o.name: o for o in triton.outcomes}[checks.GRAPH_LAUNCHES].detail
    # A graph-capable stage run eagerly on FA3 is still a fault.
    assert checks.GRAPH_LAUNCHES in check("fa3-verify", attention_backend="fa3",
                                          eager=("verify",)).failed
