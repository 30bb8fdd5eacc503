"""NVTX for the SGLang worker: the dgw naming convention (core/nvtx_names.py) on its decode steps.

Step ranges and switch marks per decode-family step, EAGLE-3's own spec stages routed to dgw
stage ranges while a profiler listens, and the profiling window (steady-state mark, nsys capture
range). docs/sglang-0.5.17.md §13 says what is ranged and why the worker owns the window.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, NamedTuple, Optional

from dual_graph_worker.core.planner import StepPlan
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core import nvtx_names as names
from dual_graph_worker.core.nvtx import NULL_CONTEXT, Annotator
from dual_graph_worker.core.settings import Settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileWindow:
    """DGW_PROFILE_STEADY_AFTER_STEPS and DGW_PROFILE_STEPS, bounded and paired by Settings."""

    steady_after: int              # decode-family steps before the steady_state_begin mark
    steps: Optional[int] = None    # steady steps inside the capture range; None: no range

    @property
    def capture_start(self) -> Optional[int]:
        """Steps taken when cudaProfilerStart runs: one before the mark, so the mark itself
        cannot fall into the moment nsys starts collecting."""
        return None if self.steps is None else max(self.steady_after - 1, 0)

    @property
    def capture_end(self) -> Optional[int]:
        return None if self.steps is None else self.steady_after + self.steps

    @classmethod
    def from_settings(cls, settings: Settings) -> Optional["ProfileWindow"]:
        after = settings.profile_steady_after_steps
        return None if after is None else cls(after, settings.profile_steps)


class CudaProfilerRange(NamedTuple):
    """cudaProfilerStart / cudaProfilerStop: what nsys --capture-range=cudaProfilerApi follows."""

    start: Callable[[], None]
    stop: Callable[[], None]


def _cudart_range() -> CudaProfilerRange:
    import torch

    rt = torch.cuda.cudart()
    return CudaProfilerRange(rt.cudaProfilerStart, rt.cudaProfilerStop)


def worker_config_marks(worker: Any) -> dict[str, str]:
    """The config marks the checker reads, from a DualGraphEagleWorker (missing parts: "?")."""
    sa = getattr(worker, "server_args", None)
    cfg = getattr(worker, "settings", None)
    backend = (getattr(sa, "decode_attention_backend", None)
               or getattr(sa, "attention_backend", None) or "?")
    return {
        names.CONFIG_ENGINE: "sglang",
        names.CONFIG_ATTENTION_BACKEND: str(backend),
        # K as the checker means it: draft steps per spec step (no draft graph when K = 1).
        names.CONFIG_NUM_DRAFT_TOKENS: str(getattr(worker, "speculative_num_steps", "?")),
        names.CONFIG_CONTINUITY: str(getattr(getattr(cfg, "continuity", None), "value", "?")),
        names.CONFIG_POLICY: str(getattr(getattr(cfg, "policy", None), "value", "?")),
    }


class StepSpans:
    """Step ranges, switch marks and the profiling window of one scheduler process."""

    def __init__(self, annotator: Annotator, window: Optional[ProfileWindow] = None,
                 cuda_profiler: Optional[Callable[[], CudaProfilerRange]] = None,
                 spec_stage_hooks: Optional[Callable[[Annotator], bool]] = None) -> None:
        self._annotator = annotator
        self._window = window
        self._cuda_profiler = cuda_profiler or _cudart_range
        self._spec_stage_hooks = spec_stage_hooks or install_spec_stage_ranges
        self._taken = 0                     # decode-family steps begun so far
        self._last_mode: Optional[Mode] = None
        self._config_pending = True         # config marks go out once per capture
        self._hooks_tried = False           # install the spec-stage hooks once, when listened
        self._listening = False             # the current step's answer (stage)

    @classmethod
    def from_settings(cls, settings: Settings) -> "StepSpans":
        return cls(Annotator.switched(settings.nvtx), ProfileWindow.from_settings(settings))

    @property
    def steps_taken(self) -> int:
        return self._taken

    def step(self, plan: StepPlan, worker: Any) -> ContextManager[None]:
        """The range around one decode-family step, and the marks that precede it."""
        a = self._annotator
        window = self._window
        listening = self._listening = a.listening()
        if window is None and not listening:
            return NULL_CONTEXT               # no profiler, no window: nothing to do
        taken = self._taken
        self._taken += 1
        if window is not None and taken == window.capture_start:
            self._cuda_profiler().start()
            self._config_pending = True       # marks sent before the range are not recorded
            logger.info("dual-graph profiling: capture range opened before step %d", taken + 1)
            # nsys attaches its listener at cudaProfilerStart: ask again.
            listening = self._listening = a.listening()
        if listening:
            if self._config_pending:
                for key, value in worker_config_marks(worker).items():
                    a.mark_config(key, value)
                self._config_pending = False
            if not self._hooks_tried:
                self._hooks_tried = True
                self._spec_stage_hooks(a)
            if window is not None and taken == window.steady_after:
                a.mark_steady_state()
            if self._last_mode is not None and plan.mode is not self._last_mode:
                a.mark_switch(self._last_mode, plan.mode)
        if window is not None and taken == window.capture_end:
            self._cuda_profiler().stop()
            logger.info("dual-graph profiling: capture range closed after %d steady steps",
                        window.steps)
        self._last_mode = plan.mode
        return a.step_range(plan.mode, plan.padded_bs, plan.graph)

    def stage(self, stage: object) -> ContextManager[None]:
        """A stage range inside the current step's range (names.STAGES), where that step found a
        profiler listening: without one, no second check in the step (a cold one costs ~15 us)."""
        return self._annotator.stage_range(stage) if self._listening else NULL_CONTEXT


@contextlib.contextmanager
def _nested(outer: ContextManager[Any], inner: ContextManager[Any]) -> Iterator[None]:
    with outer, inner:
        yield


def install_spec_stage_ranges(annotator: Annotator) -> bool:
    """Route EAGLE-3's spec-step stages to dgw stage ranges (docs/sglang-0.5.17.md §13).
    Idempotent; False when SGLang is not importable (nothing installed)."""
    try:
        from sglang.srt.speculative import eagle_worker_v2 as ew
    except ImportError:
        return False
    if getattr(ew.spec_stage_span, "_dgw_stage_ranges", None) is annotator:
        return True
    uninstall_spec_stage_ranges()          # installed for another annotator (tests): replace
    sglang_span, sglang_verify = ew.spec_stage_span, ew.run_eagle_verify

    @functools.wraps(sglang_span)
    def spec_stage_span(name: str) -> ContextManager[Any]:
        ours = annotator.stage_range(name) if name in names.GRAPH_STAGES else NULL_CONTEXT
        theirs = sglang_span(name)
        return theirs if ours is NULL_CONTEXT else _nested(ours, theirs)

    @functools.wraps(sglang_verify)
    def run_eagle_verify(*args: Any, **kwargs: Any) -> Any:
        with annotator.stage_range("verify"):
            return sglang_verify(*args, **kwargs)

    for fn in (spec_stage_span, run_eagle_verify):
        fn._dgw_stage_ranges = annotator  # type: ignore[attr-defined]
    ew.spec_stage_span, ew.run_eagle_verify = spec_stage_span, run_eagle_verify
    logger.info("dual-graph profiling: EAGLE-3 spec stages emit dgw NVTX stage ranges")
    return True


def uninstall_spec_stage_ranges() -> None:
    """Put SGLang's own functions back (tests; a re-install for another annotator)."""
    from sglang.srt.speculative import eagle_worker_v2 as ew

    for attr in ("spec_stage_span", "run_eagle_verify"):
        fn = getattr(ew, attr)
        if getattr(fn, "_dgw_stage_ranges", None) is not None:
            setattr(ew, attr, fn.__wrapped__)

