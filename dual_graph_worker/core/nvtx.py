"""NVTX ranges and marks for the worker's hot path (domain "dgw"), free when nothing listens.

    nvtx = Annotator.switched(settings.nvtx)     # one per worker
    with nvtx.step_range("spec", padded_bs=8, graph=True):
        with nvtx.stage_range("draft"): ...
    nvtx.mark_switch("spec", "decode")

Listeners: the ``nvtx`` package, else ``torch.cuda.nvtx`` under Nsight, and a running
torch.profiler; ``DGW_NVTX=0`` switches emission off. Names come from ``nvtx_names``.
docs/design.md, "Seeing what the worker does", says how listening is decided.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, ContextManager, NamedTuple, Optional

from dual_graph_worker.core import nvtx_names as names
from dual_graph_worker.core.settings import nsys_injected

NULL_CONTEXT: ContextManager[None] = contextlib.nullcontext()
_STAGES = frozenset(names.STAGES)


class Backend(NamedTuple):
    """Where NVTX events go: start a range (-> handle), end it, drop a mark."""

    name: str
    start: Callable[[str], Any]
    end: Callable[[Any], None]
    mark: Callable[[str], None]


def _nvtx_package_backend() -> Optional[tuple[Backend, bool]]:
    try:
        import nvtx
    except ImportError:
        return None
    # A real nvtx.Domain only when a tool is attached; otherwise a no-op DummyDomain.
    domain = nvtx.get_domain(names.DOMAIN)

    def start(text: str) -> Any:
        return domain.start_range(message=text)

    def mark(text: str) -> None:
        domain.mark(message=text)

    backend = Backend("nvtx", start, domain.end_range, mark)
    return backend, isinstance(domain, nvtx.Domain)


def _torch_nvtx_backend() -> Optional[tuple[Backend, bool]]:
    try:
        import torch
        if not torch.cuda.is_available():  # the CPU build's nvtx is a stub that raises
            return None
        from torch.cuda import nvtx as tnvtx
    except Exception:
        return None
    backend = Backend("torch.cuda.nvtx", tnvtx.range_start, tnvtx.range_end, tnvtx.mark)
    return backend, nsys_injected()


def torch_profiler_running() -> bool:
    """True while a torch.profiler records. Never imports torch: without torch loaded, no
    torch profiler can be running, and this module stays cheap to import."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch._C._autograd._profiler_enabled())
    except AttributeError:
        return False


class _Range:
    """One range on every listener that was active when it was entered."""

    __slots__ = ("_text", "_backend", "_nvtx_handle", "_record")

    def __init__(self, text: str, backend: Optional[Backend], torch_on: bool) -> None:
        self._text = text
        self._backend = backend
        self._nvtx_handle: Any = None
        self._record: Any = None
        if torch_on:
            from torch.autograd.profiler import record_function
            self._record = record_function(text)

    def __enter__(self) -> None:
        if self._backend is not None:
            self._nvtx_handle = self._backend.start(self._text)
        if self._record is not None:
            self._record.__enter__()

    def __exit__(self, *exc: object) -> None:
        # Close in reverse order; never swallow the body's exception.
        if self._record is not None:
            self._record.__exit__(*exc)
        if self._backend is not None:
            self._backend.end(self._nvtx_handle)


class Annotator:
    """Emits the dgw convention to the listeners given at construction.

    Immutable: each worker builds one from its settings (`switched(settings.nvtx)`) and hands
    it to what emits for it; tests build their own with a recording backend.
    """

    __slots__ = ("_backend", "_torch_probe")

    def __init__(self, backend: Optional[Backend],
                 torch_probe: Optional[Callable[[], bool]] = None) -> None:
        self._backend = backend  # None: no NVTX listener
        self._torch_probe = torch_probe

    @classmethod
    def switched(cls, on: bool) -> "Annotator":
        """Emitting to whatever listens where `on` (Settings.nvtx), to nothing otherwise."""
        if not on:
            return cls(None, None)
        found = _nvtx_package_backend() or _torch_nvtx_backend()
        backend = found[0] if found is not None and found[1] else None
        return cls(backend, torch_profiler_running)

    @property
    def nvtx_listening(self) -> bool:
        return self._backend is not None

    def _torch_on(self) -> bool:
        return self._torch_probe is not None and self._torch_probe()

    def listening(self) -> bool:
        return self._backend is not None or self._torch_on()

    def _mark(self, make_text: Callable[[], str]) -> None:
        torch_on = self._torch_on()
        if self._backend is None and not torch_on:
            return
        text = make_text()
        if self._backend is not None:
            self._backend.mark(text)
        if torch_on:
            # torch.profiler has no instant events for user code; a zero-work range stands in.
            from torch.autograd.profiler import record_function
            with record_function(text):
                pass

    # The two range methods are the hot path: the listener test is inlined and the name is
    # built only after it.
    def step_range(self, mode: object, padded_bs: int, graph: bool) -> ContextManager[None]:
        """`step:{mode}:bs{padded_bs}`, or `step:{mode}:eager-bs{bs}` when no graph ran."""
        torch_on = self._torch_probe is not None and self._torch_probe()
        if self._backend is None and not torch_on:
            return NULL_CONTEXT
        return _Range(names.step_name(mode, padded_bs, graph), self._backend, torch_on)

    def stage_range(self, stage: object) -> ContextManager[None]:
        """`stage:{stage}`; stage is one of names.STAGES (draft, verify, draft_extend, decode,
        accept, commit, catch_up)."""
        text = getattr(stage, "value", stage)
        if text not in _STAGES:
            raise ValueError(f"unknown stage {stage!r}; use one of {', '.join(names.STAGES)}")
        torch_on = self._torch_probe is not None and self._torch_probe()
        if self._backend is None and not torch_on:
            return NULL_CONTEXT
        return _Range(names.stage_name(text), self._backend, torch_on)

    def mark_switch(self, old: object, new: object) -> None:
        self._mark(lambda: names.switch_name(old, new))

    def mark_capture(self, label: object) -> None:
        self._mark(lambda: names.capture_name(label))

    def mark_steady_state(self) -> None:
        """Once, when warm-up and capture are over: the checker starts here."""
        self._mark(lambda: names.STEADY_STATE)

    def mark_config(self, key: str, value: object) -> None:
        """`config:{key}={value}`, e.g. engine, attention_backend, num_draft_tokens."""
        self._mark(lambda: names.config_name(key, value))


__all__ = ["Annotator", "Backend", "NULL_CONTEXT", "torch_profiler_running"]
