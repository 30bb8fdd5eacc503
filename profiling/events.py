"""The normalized event model both trace sources (nsys SQLite, torch.profiler JSON) produce.

Every check runs on a `Trace`; no check knows where the events came from.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Optional


class EventKind(str, enum.Enum):
    NVTX_RANGE = "nvtx_range"
    NVTX_MARK = "nvtx_mark"
    API_CALL = "api_call"  # a CUDA runtime or driver API call on a host thread


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One interval (a mark has end_ns == start_ns) on a host thread.

    `name` is the raw text: an NVTX message, or an API name as the source spells it
    (`cudaGraphLaunch_v10000` from nsys, `cudaGraphLaunch` from torch); see `api_names`.
    """

    kind: EventKind
    name: str
    start_ns: int
    end_ns: int
    pid: Optional[int] = None
    tid: Optional[int] = None
    correlation_id: Optional[int] = None  # API calls: links to the kernels they launched
    domain: Optional[str] = None  # NVTX domain name when the source records it


@dataclass(frozen=True)
class GpuInfo:
    name: str
    compute_major: Optional[int] = None
    compute_minor: Optional[int] = None

    @property
    def sm(self) -> Optional[str]:
        """SM90 (H100/H200), SM100 (B200), SM120 (RTX PRO 6000 Blackwell), ..."""
        if self.compute_major is None or self.compute_minor is None:
            return None
        return f"SM{self.compute_major}{self.compute_minor}"


KernelKey = tuple[Optional[int], int]  # (pid or None, correlation id)


@dataclass(frozen=True)
class Trace:
    """Everything the checks need from one profile."""

    events: tuple[TraceEvent, ...]
    # Name of the kernel an API call launched, keyed by the call's (pid, correlation id).
    kernel_names: Mapping[KernelKey, str] = field(default_factory=dict)
    gpus: tuple[GpuInfo, ...] = ()
    source: str = ""
    warnings: tuple[str, ...] = ()
    # The demangled name where the source keeps it apart from `kernel_names` (nsys: namespaces
    # such as at::native:: that an engine's stated set of eager kernels matches on).
    kernel_demangled: Mapping[KernelKey, str] = field(default_factory=dict)
    # The graph a graph launch replayed (nsys: graphExecId, else graphId), so a check can tell
    # which captured graph a stage ran, not only how many.
    graph_ids: Mapping[KernelKey, int] = field(default_factory=dict)
    # GPU time of what an API call launched (an eager kernel, or a whole graph replay), so a
    # report can say what a step or stage costs the device, not only the host.
    gpu_ns: Mapping[KernelKey, int] = field(default_factory=dict)

    @staticmethod
    def _lookup(table: Mapping[KernelKey, object], call: TraceEvent) -> object:
        if call.correlation_id is None:
            return None
        found = table.get((call.pid, call.correlation_id))
        return found if found is not None else table.get((None, call.correlation_id))

    def kernel_name(self, call: TraceEvent) -> str:
        return str(self._lookup(self.kernel_names, call) or "?")

    def kernel_demangled_name(self, call: TraceEvent) -> str:
        """The demangled name when recorded, else the same as `kernel_name`."""
        return str(self._lookup(self.kernel_demangled, call) or self.kernel_name(call))

    def gpu_time_ns(self, call: TraceEvent) -> int:
        """GPU time of the kernel or graph `call` launched; 0 when the source has none."""
        found = self._lookup(self.gpu_ns, call)
        return int(found) if found is not None else 0

    @property
    def has_gpu_times(self) -> bool:
        return bool(self.gpu_ns)

    def graph_id(self, call: TraceEvent) -> Optional[int]:
        found = self._lookup(self.graph_ids, call)
        return int(found) if found is not None else None
