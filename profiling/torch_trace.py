"""torch.profiler Chrome trace (JSON) -> `Trace`: the fallback when nsys is not available.

Profile the worker with `torch.profiler.profile(activities=[CPU, CUDA])`; the worker's dgw
names arrive as `record_function` ranges (category "user_annotation", see
`dual_graph_worker.core.nvtx`), CUDA runtime calls as category "cuda_runtime"
(`cudaGraphLaunch`, `cudaLaunchKernel`, `cudaMalloc`, ...), driver calls as "cuda_driver", and
kernels as "kernel", linked to their launch through `args.correlation`. The same checks then run
on the result.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Iterable, Optional

from dual_graph_worker.core import nvtx_names as names
from profiling.errors import ProfileInputError
from profiling.events import EventKind, GpuInfo, KernelKey, Trace, TraceEvent

API_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
KERNEL_CATEGORIES = frozenset({"kernel"})
# The GPU-side shadow of a record_function range; the CPU-side one is the real annotation.
SKIPPED_CATEGORIES = frozenset({"gpu_user_annotation"})
_INSTANT_PHASES = frozenset({"i", "I", "R"})


def _ns(us: Any) -> int:
    return int(round(float(us) * 1000.0))


def _int_or_none(value: Any) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _read_json(path: Path) -> Any:
    if not path.exists():
        raise ProfileInputError(f"{path} does not exist")
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ProfileInputError(f"{path} is not a readable Chrome trace JSON: {e}") from e


def _gpus(props: Iterable[dict]) -> tuple[GpuInfo, ...]:
    seen: dict[GpuInfo, None] = {}
    for p in props:
        if isinstance(p, dict) and p.get("name"):
            seen.setdefault(GpuInfo(str(p["name"]), _int_or_none(p.get("computeMajor")),
                                    _int_or_none(p.get("computeMinor"))), None)
    return tuple(seen)


def load_chrome_trace(path: Path) -> Trace:
    data = _read_json(path)
    raw_events = data.get("traceEvents", []) if isinstance(data, dict) else data
    if not isinstance(raw_events, list):
        raise ProfileInputError(f"{path} has no traceEvents list; is it a Chrome trace?")
    if not any(isinstance(ev, dict) and "ts" in ev for ev in raw_events):
        raise ProfileInputError(f"{path} holds no timed events: not a trace of a run")
    events: list[TraceEvent] = []
    kernel_names: dict[KernelKey, str] = {}
    gpu_ns: dict[KernelKey, int] = {}
    for ev in raw_events:
        if not isinstance(ev, dict) or "ts" not in ev:
            continue
        phase = ev.get("ph")
        if phase != "X" and phase not in _INSTANT_PHASES:
            continue
        name = str(ev.get("name", ""))
        category = str(ev.get("cat", "")).lower()
        args = ev.get("args") or {}
        start = _ns(ev["ts"])
        end = start + _ns(ev.get("dur", 0)) if phase == "X" else start
        corr = _int_or_none(args.get("correlation"))
        pid, tid = _int_or_none(ev.get("pid")), _int_or_none(ev.get("tid"))
        if category in API_CATEGORIES:
            events.append(TraceEvent(EventKind.API_CALL, name, start, end, pid, tid, corr))
        elif category in KERNEL_CATEGORIES:
            if corr is not None:
                # Kernel rows carry the device as pid; correlation ids are unique per trace.
                kernel_names.setdefault((None, corr), name)
                gpu_ns[(None, corr)] = gpu_ns.get((None, corr), 0) + (end - start)
        elif category in SKIPPED_CATEGORIES:
            continue
        elif names.parse(name) is not None:
            kind = EventKind.NVTX_RANGE if phase == "X" else EventKind.NVTX_MARK
            events.append(TraceEvent(kind, name, start, end, pid, tid, None, names.DOMAIN))
    events.sort(key=lambda e: (e.start_ns, -e.end_ns))
    warnings = []
    if not any(e.kind is EventKind.API_CALL for e in events):
        warnings.append("no cuda_runtime events: profile with "
                        "activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] on a GPU")
    props = data.get("deviceProperties", []) if isinstance(data, dict) else []
    return Trace(tuple(events), kernel_names, _gpus(props or []),
                 source=f"torch.profiler trace {path}", warnings=tuple(warnings),
                 gpu_ns=gpu_ns)
