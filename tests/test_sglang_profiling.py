"""Profiling the SGLang worker: the cycle policy, the NVTX step spans and profiling window, the
spec-stage hooks, and the scripted workload's command lines. Everything but the last part runs
without SGLang; the last part needs SGLang 0.5.17 importable (CPU is enough)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.engines.sglang import nvtx_spans
from dual_graph_worker.core.planner import StepPlan, StepPlanner
from dual_graph_worker.core.policies import PolicyContext, build_policy
from dual_graph_worker.core.simple_policies import CyclePolicy
from dual_graph_worker.core.settings import PolicyKind, Settings
from dual_graph_worker.engines.sglang.nvtx_spans import ProfileWindow, StepSpans
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import PolicyInputs, Reason
from dual_graph_worker.core import nvtx_names as names
from dual_graph_worker.core.nvtx import NULL_CONTEXT, Annotator
from bench.sglang.profile_workload import NSYS_FLAGS, WorkloadSpec, _parser, nsys_command

ROOT = Path(__file__).resolve().parents[1]
S, D = Mode.SPEC, Mode.DECODE


class Recorder:
    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def annotator(self) -> Annotator:
        from dual_graph_worker.core.nvtx import Backend

        return Annotator(Backend("recorder", lambda t: self.log.append(("start", t)) or t,
                                 lambda h: self.log.append(("end", h)),
                                 lambda t: self.log.append(("mark", t))))


class FakeCudaProfiler:
    def __init__(self, log: list) -> None:
        self.log = log

    def __call__(self) -> nvtx_spans.CudaProfilerRange:
        return nvtx_spans.CudaProfilerRange(lambda: self.log.append(("cuda", "start")),
                                            lambda: self.log.append(("cuda", "stop")))


# ------------------------------------------------------------------------------ cycle policy

def _inputs(spec_padded=8):
    return PolicyInputs(bs=8, spec_padded_bs=spec_padded, decode_padded_bs=8)


def test_cycle_policy_holds_each_mode_then_alternates():
    p = CyclePolicy(hold=2, num_draft_tokens=3)
    modes = []
    for _ in range(2 * p.period):
        d = p.decide(_inputs())
        assert d.reason is Reason.PINNED
        modes.append(d.mode)
        p.commit(d)
    assert modes == [S, S, D, D, S, D, S, D] * 2


def test_cycle_policy_advances_on_commit_only_and_respects_the_spec_pool():
    p = CyclePolicy(hold=3)
    assert [p.decide(_inputs()).mode for _ in range(3)] == [S, S, S]   # no commit: no progress
    assert p.decide(_inputs(spec_padded=None)).mode is D              # beyond the spec pool
    assert p.decide(_inputs(spec_padded=None)).reason is Reason.NO_SPEC_GRAPH
    with pytest.raises(ConfigError, match="DGW_MIN_DWELL"):
        CyclePolicy(hold=0)


def test_cycle_policy_from_the_worker_settings():
    cfg = Settings.from_env({"DGW_POLICY": "cycle", "DGW_MIN_DWELL": "4"})
    assert cfg.policy is PolicyKind.CYCLE
    policy = build_policy(cfg, PolicyContext(3, {Mode.SPEC: (1, 2, 4, 8)}))
    assert isinstance(policy, CyclePolicy) and policy.hold == 4 and policy.period == 16
    # Through the planner the worker uses: a fixed schedule at a constant batch size.
    sel = StepPlanner(DispatchTable.build((1, 2, 4, 8), (1, 2, 4, 8, 16)), policy)
    plans = [sel.plan(8) for _ in range(16)]
    assert [p.mode for p in plans] == [S] * 4 + [D] * 4 + [S, D] * 4
    assert {p.padded_bs for p in plans} == {8}


# --------------------------------------------------------------------------- profiling window

def _window(env):
    return ProfileWindow.from_settings(Settings.from_env(env))


def test_profile_window_from_settings():
    assert _window({}) is None
    w = _window({"DGW_PROFILE_STEADY_AFTER_STEPS": "48", "DGW_PROFILE_STEPS": "192"})
    assert (w.steady_after, w.steps, w.capture_start, w.capture_end) == (48, 192, 47, 240)
    mark_only = _window({"DGW_PROFILE_STEADY_AFTER_STEPS": "5"})
    assert mark_only.capture_start is None and mark_only.capture_end is None
    with pytest.raises(ConfigError, match="needs DGW_PROFILE_STEADY_AFTER_STEPS"):
        _window({"DGW_PROFILE_STEPS": "10"})
    with pytest.raises(ConfigError, match="DGW_PROFILE_STEADY_AFTER_STEPS"):
        _window({"DGW_PROFILE_STEADY_AFTER_STEPS": "ten"})
    with pytest.raises(ConfigError, match=">= 1"):
        Settings(profile_steady_after_steps=3, profile_steps=0)


def _plan(mode: Mode, bs: int = 8) -> StepPlan:
    return StepPlan(mode, bs, bs, True, Reason.PINNED)


WORKER = SimpleNamespace(server_args=SimpleNamespace(attention_backend="triton",
                                                     decode_attention_backend=None),
                         speculative_num_steps=3,
                         settings=Settings(policy=PolicyKind.CYCLE))


def _run(spans: StepSpans, modes) -> None:
    for mode in modes:
        with spans.step(_plan(mode), WORKER):
            pass


def test_step_spans_window_marks_and_ranges():
    rec = Recorder()
    spans = StepSpans(rec.annotator(), ProfileWindow(steady_after=3, steps=2),
                      FakeCudaProfiler(rec.log), spec_stage_hooks=lambda a: True)
    _run(spans, [S, S, D, D, S, D])
    marks = [t for kind, t in rec.log if kind == "mark"]
    config = [m for m in marks if m.startswith("config:")]
    # Config marks go out at the first step and again once the capture range is open.
    assert config[:5] == ["config:engine=sglang", "config:attention_backend=triton",
                          "config:num_draft_tokens=3", "config:continuity=lazy-catch-up",
                          "config:policy=cycle"]
    assert len(config) == 10
    events = [(k, t) for k, t in rec.log if not t.startswith("config:")]
    assert [t for k, t in events if k == "start"] == [
        f"step:{m.value}:bs8" for m in (S, S, D, D, S, D)]
    # capture opens before the 3rd step, steady mark before the 4th, capture closes before
    # the 6th: exactly the two steady steps inside the range.
    i_start = events.index(("cuda", "start"))
    i_steady = events.index(("mark", names.STEADY_STATE))
    i_stop = events.index(("cuda", "stop"))
    starts = [i for i, (k, t) in enumerate(events) if k == "start"]
    assert starts[1] < i_start < starts[2] < i_steady < starts[3] < starts[4] < i_stop < starts[5]
    assert [t for k, t in events if k == "mark" and t.startswith("switch:")] == [
        "switch:spec->decode", "switch:decode->spec", "switch:spec->decode"]
    assert all(names.parse(t) is not None for k, t in rec.log if k != "cuda")
    assert spans.steps_taken == 6


def test_step_spans_cost_nothing_without_a_listener_or_window():
    spans = StepSpans(Annotator(None), None, FakeCudaProfiler([]))
    assert spans.step(_plan(S), WORKER) is NULL_CONTEXT
    assert spans.steps_taken == 0


def test_window_without_a_listener_still_opens_and_closes_the_capture_range():
    log: list = []
    spans = StepSpans(Annotator(None), ProfileWindow(steady_after=1, steps=1),
                      FakeCudaProfiler(log))
    _run(spans, [S, D, S, D])
    assert log == [("cuda", "start"), ("cuda", "stop")]


def test_worker_config_marks_tolerate_a_bare_worker():
    marks = nvtx_spans.worker_config_marks(object())
    assert marks["engine"] == "sglang" and marks["attention_backend"] == "?"


# -------------------------------------------------------------------------------- workload

def test_nsys_command_records_only_the_window_and_round_trips_the_spec(tmp_path):
    spec = WorkloadSpec(bs=4, hold=2, warmup_steps=20, steps=64, output_len=512)
    cmd = nsys_command(tmp_path, spec, python="py")
    assert cmd[:2] == ["nsys", "profile"] and set(NSYS_FLAGS) <= set(cmd)
    assert "--capture-range=cudaProfilerApi" in cmd and "--capture-range-end=stop" in cmd
    i = cmd.index("-m")
    assert cmd[i - 1:i + 2] == ["py", "-m", "bench.sglang.profile_workload"]
    args = _parser().parse_args(cmd[i + 2:])
    assert not args.nsys
    assert WorkloadSpec(**{k: getattr(args, k) for k in spec.__dataclass_fields__}) == spec


def test_workload_spec_env_and_validation(tmp_path):
    spec = WorkloadSpec()
    env = spec.worker_env(tmp_path / "steps.jsonl")
    assert env["DGW_POLICY"] == "cycle" and env["DGW_MIN_DWELL"] == "8"
    assert (env["DGW_PROFILE_STEADY_AFTER_STEPS"], env["DGW_PROFILE_STEPS"]) == ("48", "192")
    assert Settings.from_env(env).policy is PolicyKind.CYCLE       # the worker accepts it
    assert _window(env).capture_end == 240
    # Even if every step accepted K+1 tokens, the profiled batch outlives the window.
    assert spec.profiled_tokens >= 4 * spec.needed_steps
    with pytest.raises(ValueError, match="graph in both pools"):
        WorkloadSpec(bs=32, max_graph_bs=16)
    with pytest.raises(ValueError, match="after the profiled batch's prefill"):
        WorkloadSpec(warmup_steps=10, warmup_tokens=16)


def test_make_nsys_profile_engine_sglang():
    out = subprocess.run(["make", "-n", "nsys-profile", "ENGINE=sglang", "EXPECT_SM=SM90"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "-m bench.sglang.profile_workload --nsys" in out and "--expect-sm SM90" in out
    ref = subprocess.run(["make", "-n", "nsys-profile"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert "dual_graph_worker.cli profile" in ref


# ============================================================ with SGLang 0.5.17 (CPU only)

@pytest.fixture
def eagle_module(supported_sglang):
    from sglang.srt.speculative import eagle_worker_v2 as ew

    yield ew
    nvtx_spans.uninstall_spec_stage_ranges()


def test_spec_stage_hooks_wrap_sglang_and_come_off_again(eagle_module, monkeypatch):
    ew = eagle_module
    monkeypatch.setattr(ew, "run_eagle_verify", lambda *a, **k: ("verified", a, k))
    sglang_span = ew.spec_stage_span
    rec = Recorder()
    a = rec.annotator()
    assert nvtx_spans.install_spec_stage_ranges(a)
    wrapped = ew.spec_stage_span
    assert nvtx_spans.install_spec_stage_ranges(a) and ew.spec_stage_span is wrapped  # idempotent
    with ew.spec_stage_span("draft"):
        rec.log.append(("body", "draft"))
    assert ew.run_eagle_verify(1, x=2) == ("verified", (1,), {"x": 2})
    with ew.spec_stage_span("not-a-stage"):                               # passed through
        pass
    assert rec.log == [("start", "stage:draft"), ("body", "draft"), ("end", "stage:draft"),
                       ("start", "stage:verify"), ("end", "stage:verify")]
    nvtx_spans.uninstall_spec_stage_ranges()
    assert ew.spec_stage_span is sglang_span


def test_worker_step_ranges_around_both_modes(eagle_module, monkeypatch, tmp_path,
                                              bare_sglang_worker):
    """forward_batch_generation puts a step range around each decode-family step; the spec
    step's stages come from EAGLE-3's own hooks, here called the way eagle_worker_v2 calls them."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from dual_graph_worker.engines.sglang.worker import DualGraphEagleWorker

    ew = eagle_module
    rec = Recorder()
    monkeypatch.setattr(ew, "run_eagle_verify", lambda *a, **k: None)

    def eagle_step(self, batch, on_publish=None, grammar_barrier=None):
        with ew.spec_stage_span("draft"):
            pass
        ew.run_eagle_verify(batch)
        with ew.spec_stage_span("draft_extend"):
            pass
        return SimpleNamespace(extra_keep_alive_refs=None)

    monkeypatch.setattr(ew.EAGLEWorkerV2, "forward_batch_generation", eagle_step)
    monkeypatch.setattr(DualGraphEagleWorker, "_decode_step",
                        lambda self, batch, rows, keep_alive, on_publish, gb: "decode-result")
    w = bare_sglang_worker(CyclePolicy(hold=1, num_draft_tokens=3))
    w._spans = StepSpans(rec.annotator())
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, is_extend_in_batch=False,
                            seq_lens=torch.zeros(3, dtype=torch.int64),
                            req_pool_indices_cpu=torch.arange(3))
    w.forward_batch_generation(batch)
    assert w.forward_batch_generation(batch) == "decode-result"
    spans = [(k, t) for k, t in rec.log if not t.startswith("config:")]
    assert spans == [
        ("start", "step:spec:bs3"), ("start", "stage:catch_up"), ("end", "stage:catch_up"),
        ("start", "stage:draft"), ("end", "stage:draft"),
        ("start", "stage:verify"), ("end", "stage:verify"),
        ("start", "stage:draft_extend"), ("end", "stage:draft_extend"), ("end", "step:spec:bs3"),
        ("mark", "switch:spec->decode"), ("start", "step:decode:bs4"),
        ("start", "stage:catch_up"), ("end", "stage:catch_up"), ("end", "step:decode:bs4"),
    ]


def test_lazy_catch_up_runs_inside_its_own_stage_range(eagle_module, monkeypatch,
                                                       bare_sglang_worker):
    """The spec step's catch-up (and a decode step's make_room) sit inside stage:catch_up,
    which the checker reports as stated eager work (profiling.engines SGLANG); without a
    profiler listening, neither the step nor its stages range anything."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    rec = Recorder()
    log = rec.log
    monkeypatch.setattr(eagle_module.EAGLEWorkerV2, "forward_batch_generation",
                        lambda self, batch, on_publish=None, grammar_barrier=None:
                        log.append(("body", "spec")) or SimpleNamespace(
                            extra_keep_alive_refs=None))
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, is_extend_in_batch=False,
                            seq_lens=torch.zeros(3, dtype=torch.int64),
                            req_pool_indices_cpu=torch.arange(3))

    def spec_step(annotator: Annotator) -> object:
        w = bare_sglang_worker(CyclePolicy(hold=1, num_draft_tokens=3),
                               continuity=SimpleNamespace(
                                   pending_tokens=lambda rows: 0,
                                   before_spec_step=lambda b, r: log.append(("body", "catch-up"))
                                   or ["kept"]))
        w._spans = StepSpans(annotator)
        return w.forward_batch_generation(batch)

    assert spec_step(rec.annotator()).extra_keep_alive_refs == ["kept"]
    assert [e for e in log if not e[1].startswith("config:")] == [
        ("start", "step:spec:bs3"), ("start", "stage:catch_up"), ("body", "catch-up"),
        ("end", "stage:catch_up"), ("body", "spec"), ("end", "step:spec:bs3")]
    log.clear()
    spec_step(Annotator(None))
    assert log == [("body", "catch-up"), ("body", "spec")]


def test_profile_workload_runs_from_the_repository_root():
    # Its __main__ puts REPO_ROOT first on sys.path; bench/ there would shadow sglang itself.
    from bench.sglang import profile_workload

    assert (profile_workload.REPO_ROOT / "pyproject.toml").exists()
    assert not (profile_workload.REPO_ROOT / "sglang").exists()
