"""The worker-side NVTX emitter: free without a profiler, exact names with one."""

from __future__ import annotations

import pytest
from torch.profiler import ProfilerActivity, profile

from dual_graph_worker.core.modes import Mode, Stage
from dual_graph_worker.core import nvtx as nvtx_ranges, nvtx_names as names
from dual_graph_worker.core.nvtx import NULL_CONTEXT, Annotator, Backend
from dual_graph_worker.core.settings import nsys_injected, read_setting

attached = nsys_injected()


class Recorder:
    """A Backend that remembers what it was sent."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def backend(self) -> Backend:
        def start(text: str) -> str:
            self.log.append(("start", text))
            return text

        def end(handle: str) -> None:
            self.log.append(("end", handle))

        def mark(text: str) -> None:
            self.log.append(("mark", text))

        return Backend("recorder", start, end, mark)


@pytest.mark.skipif(attached, reason="an NVTX tool is attached to this process")
def test_without_a_profiler_everything_is_a_no_op():
    nvtx = Annotator.switched(read_setting("nvtx"))
    assert not nvtx.nvtx_listening and not nvtx.listening()
    assert nvtx.step_range("spec", 8, graph=True) is NULL_CONTEXT
    assert nvtx.stage_range("verify") is NULL_CONTEXT
    with nvtx.step_range(Mode.DECODE, 3, graph=False):
        with nvtx.stage_range(Stage.DECODE):
            pass
    assert nvtx.mark_switch("spec", "decode") is None
    assert nvtx.mark_capture("spec-bs8") is None
    assert nvtx.mark_steady_state() is None
    assert nvtx.mark_config("engine", "reference") is None
    with pytest.raises(KeyError):  # the body's exception passes through untouched
        with nvtx.step_range("spec", 1, graph=True):
            raise KeyError("boom")


@pytest.mark.skipif(attached, reason="an NVTX tool is attached to this process")
def test_no_name_is_built_when_nothing_listens():
    class Unprintable:
        @property
        def value(self):
            raise AssertionError("the name was formatted")

    nvtx = Annotator.switched(read_setting("nvtx"))
    with nvtx.step_range(Unprintable(), 8, graph=True):
        pass
    nvtx.mark_switch(Unprintable(), Unprintable())
    nvtx.mark_config("engine", Unprintable())


def test_names_sent_to_a_listener_follow_the_convention():
    rec = Recorder()
    a = Annotator(rec.backend())
    a.mark_config("num_draft_tokens", 3)
    a.mark_capture("spec-bs8")
    a.mark_steady_state()
    with a.step_range(Mode.SPEC, 8, graph=True):
        with a.stage_range(Stage.DRAFT_EXTEND):
            pass
    a.mark_switch(Mode.SPEC, Mode.DECODE)
    with a.step_range("decode", 3, graph=False):
        with a.stage_range("commit"):
            pass
    assert rec.log == [
        ("mark", "config:num_draft_tokens=3"),
        ("mark", "capture:spec-bs8"),
        ("mark", "steady_state_begin"),
        ("start", "step:spec:bs8"), ("start", "stage:draft_extend"),
        ("end", "stage:draft_extend"), ("end", "step:spec:bs8"),
        ("mark", "switch:spec->decode"),
        ("start", "step:decode:eager-bs3"), ("start", "stage:commit"),
        ("end", "stage:commit"), ("end", "step:decode:eager-bs3"),
    ]
    # What the worker emits is exactly what the checker parses.
    assert all(names.parse(text) is not None for _, text in rec.log)


def test_a_range_ends_even_when_its_body_raises():
    rec = Recorder()
    with pytest.raises(RuntimeError):
        with Annotator(rec.backend()).step_range("spec", 2, graph=True):
            raise RuntimeError
    assert rec.log == [("start", "step:spec:bs2"), ("end", "step:spec:bs2")]


def test_unknown_stage_is_rejected():
    with pytest.raises(ValueError, match="unknown stage"):
        Annotator.switched(read_setting("nvtx")).stage_range("prefill")


def test_nvtx_package_calls_are_valid_without_a_tool():
    found = nvtx_ranges._nvtx_package_backend()
    assert found is not None, "the nvtx package is a dependency"
    backend, listening = found
    assert listening is attached or not listening
    a = Annotator(backend)  # force emission through the real nvtx API (a dummy domain here)
    with a.step_range("spec", 4, graph=True):
        with a.stage_range("verify"):
            pass
    a.mark_steady_state()


def test_a_workers_settings_switch_its_ranges_on_or_off():
    """Settings.nvtx reaches the annotator a worker builds (a DGW_CONFIG file's too)."""
    with profile(activities=[ProfilerActivity.CPU]):
        assert Annotator.switched(True).listening()
        assert not Annotator.switched(False).listening()
        assert Annotator.switched(False).step_range("spec", 4, graph=True) is NULL_CONTEXT


def test_dgw_nvtx_0_switches_everything_off(monkeypatch):
    monkeypatch.setenv("DGW_NVTX", "0")
    a = Annotator.switched(read_setting("nvtx"))
    with profile(activities=[ProfilerActivity.CPU]):
        assert not a.listening()
        assert a.step_range("spec", 4, graph=True) is NULL_CONTEXT


def test_torch_profiler_is_a_listener_while_it_runs():
    a = Annotator(None, nvtx_ranges.torch_profiler_running)
    assert not a.listening()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert a.listening()
        with a.step_range("decode", 16, graph=True):
            a.mark_steady_state()
    assert not a.listening()
    seen = {e.name for e in prof.events()}
    assert {"step:decode:bs16", "steady_state_begin"} <= seen
