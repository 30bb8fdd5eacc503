"""DGW_CAPTURE_PROBE: every CUDA graph the server captures, sized and timed one by one, for
``make capture-measure ENGINE=sglang`` (capture/sglang_probe.py turns the file into the
tuner's measurements; docs/design.md, "Choosing the batch sizes").

Installed at plugin registration, before the target's graphs exist. Each graph is captured into
a pool of its own, so the pool's growth during the capture is that graph's isolated size (a
measuring server holds every graph's memory apart: start it with room). The worker replays every
graph once its own pools are captured and writes the file before the server takes requests.
"""

from __future__ import annotations

import statistics
import time
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterator, Optional, Sequence

from dual_graph_worker.core.jsonio import write_json

SCHEMA = "dgw-sglang-capture-probe/1"
_ATTR = "_dgw_capture_probe"      # on the patched backend class: the probe it reports to


@dataclass(frozen=True)
class GraphRecord:
    runner: str            # the graph runner's class: which stage of which pool
    draft: bool            # captured by the draft model's runner
    size: int              # the runner's capture size (bs for decode-family runners)
    capture_s: float       # warm-up forwards + capture, device synchronised
    pool_bytes: Optional[int]   # the graph's own pool: reserved growth during its capture
    replay_s: Optional[float] = None


class CaptureProbe:
    """Records each capture of `backend_cls` (SGLang's FullCudaGraphBackend) and replays them.
    `device` is torch.cuda (injected for tests)."""

    def __init__(self, path: str, device: Any, clock: Callable[[], float] = time.perf_counter,
                 use_pool: Callable[[Any], None] = lambda pool: None):
        self.path = path
        self.device = device
        self.clock = clock
        self.use_pool = use_pool       # tells the engine a capture's pool (SGLang's pool id)
        self.records: list[GraphRecord] = []
        self._graphs: list[tuple[Any, Any]] = []    # per record: (backend ref, shape key)
        self._grown: Optional[int] = None     # the capture in progress: its pool's growth

    def install(self, backend_cls: type) -> "CaptureProbe":
        """Patch `backend_cls` once; a second install in the process keeps the first probe."""
        installed = getattr(backend_cls, _ATTR, None)
        if installed is not None:
            return installed
        init, capture_one = backend_cls.__init__, backend_cls.capture_one
        probe = self

        def patched_init(backend, cuda_graph_runner, *args, **kwargs):
            init(backend, cuda_graph_runner, *args, **kwargs)
            backend._dgw_runner = (type(cuda_graph_runner).__name__, bool(getattr(
                getattr(cuda_graph_runner, "model_runner", None), "is_draft_worker", False)))
            backend._device_module = _SizedGraphs(backend._device_module, probe)

        def patched_capture_one(backend, shape_key, *args, **kwargs):
            return probe._capture(backend, shape_key, lambda: capture_one(
                backend, shape_key, *args, **kwargs))

        backend_cls.__init__, backend_cls.capture_one = patched_init, patched_capture_one
        setattr(backend_cls, _ATTR, self)
        return self

    def _capture(self, backend: Any, shape_key: Any, capture: Callable[[], Any]) -> Any:
        # A pool of its own: the growth measured is this graph's alone.
        backend._pool = self.device.graph_pool_handle()
        self.use_pool(backend._pool)
        self._grown = None
        self.device.synchronize()
        t0 = self.clock()
        out = capture()
        self.device.synchronize()
        runner, draft = getattr(backend, "_dgw_runner", ("unknown", False))
        self._graphs.append((weakref.ref(backend), shape_key))
        self.records.append(GraphRecord(runner, draft, int(getattr(shape_key, "size", -1)),
                                        self.clock() - t0, self._grown))
        return out

    @contextmanager
    def sized(self, graph_ctx: Any) -> Iterator[Any]:
        # Entering a capture empties the cache (torch.cuda.graph): what the warm-up forwards
        # left cached must leave "before" too, or it hides the pool's growth.
        self.device.synchronize()
        self.device.empty_cache()
        before = self.device.memory_reserved()
        with graph_ctx as g:
            yield g
        self._grown = max(int(self.device.memory_reserved() - before), 0)

    def replay_all(self, repeats: int = 20) -> None:
        """Each recorded graph's median replay, CUDA-event timed, on its capture-time inputs."""
        for i, (ref, key) in enumerate(self._graphs):
            backend = ref()
            graph = None if backend is None else backend._graphs.get(key)
            if graph is None:
                continue
            for _ in range(2):
                graph.replay()
            times = []
            for _ in range(repeats):
                start, end = self.device.Event(enable_timing=True), \
                    self.device.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            self.records[i] = replace(self.records[i], replay_s=statistics.median(times))

    def write(self, stamp: dict) -> None:
        write_json({"schema": SCHEMA, **stamp,
                    "graphs": [asdict(r) for r in self.records]}, self.path)


class _SizedGraphs:
    """A backend's device module whose ``graph(...)`` context measures the pool's growth."""

    def __init__(self, module: Any, probe: CaptureProbe) -> None:
        self._module, self._probe = module, probe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def graph(self, *args, **kwargs):
        return self._probe.sized(self._module.graph(*args, **kwargs))


def install_capture_probe(path: str) -> CaptureProbe:
    """On SGLang's full-graph backend: every decode-family runner's (prefill graphs use the
    breakable backend and are not probed)."""
    import torch
    from sglang.srt.model_executor.runner_backend import full_cuda_graph_backend as full

    # The pool id SGLang set for the session (symmetric memory reads it) follows each swap.
    return CaptureProbe(path, torch.cuda, use_pool=full.set_graph_pool_id).install(
        full.FullCudaGraphBackend)


def installed_capture_probe() -> Optional[CaptureProbe]:
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import (
        FullCudaGraphBackend,
    )

    return getattr(FullCudaGraphBackend, _ATTR, None)


def finish_capture_probe(probe: CaptureProbe, *, write: bool, model_shape: dict,
                         spec_bs: Sequence[int], decode_bs: Sequence[int]) -> None:
    """Replay every graph (on every rank: a graph may hold collectives) and, on `write`, write
    the file stamped with what a measurements file needs: GPU, model shape, SGLang version."""
    import torch

    from dual_graph_worker.core.capture_schema import GpuInfo
    from dual_graph_worker.engines.sglang.version import installed_sglang_version

    probe.replay_all()
    if write:
        probe.write({
            "gpu": GpuInfo.from_torch(torch.cuda.current_device()).to_json(),
            "model_shape": model_shape,
            "sglang": installed_sglang_version(), "torch": torch.__version__,
            "spec_bs": list(spec_bs), "decode_bs": list(decode_bs)})
