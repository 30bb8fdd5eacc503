"""Running a step's stages: replaying captured CUDA graphs, or calling the stage functions.

`CudaGraphRunner` captures every (GraphKey, stage) of both pools into ONE graph memory pool
(`torch.cuda.graph_pool_handle()`), largest token count first so smaller graphs reuse the memory
of larger ones (as nano-vllm and vLLM do). Replay is a dict lookup and `graph.replay()` per stage.
`EagerRunner` calls the same stage functions at the same padded batch size: on CPU it exercises
exactly the padding and buffer logic the graphs use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Optional, Protocol

import torch

from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.core.modes import GraphKey, Mode, Stage
from dual_graph_worker.core.nvtx import Annotator
from dual_graph_worker.engines.reference.engine_api import StageFn

# Warm-up calls of a key's stages before its capture: lazy inits and autotuning stay off the graph.
_WARMUP_ITERS = 2


class StageRunner(Protocol):
    def run(self, mode: Mode, padded_bs: int, use_graph: bool) -> None: ...


def _stages(stage_fns: Mapping[Stage, StageFn], mode: Mode, k: int) -> tuple[Stage, ...]:
    return tuple(s for s in Stage.for_mode(mode, k) if s in stage_fns)


def _stages_by_mode(stage_fns: Mapping[Stage, StageFn], k: int) -> dict[Mode, tuple[Stage, ...]]:
    """Each mode's stages, worked out once so a step only indexes a dict."""
    return {mode: _stages(stage_fns, mode, k) for mode in Mode}


@dataclass
class EagerRunner:
    stage_fns: Mapping[Stage, StageFn]
    num_draft_tokens: int
    nvtx: Annotator

    def __post_init__(self) -> None:
        self._stages = _stages_by_mode(self.stage_fns, self.num_draft_tokens)

    def run(self, mode: Mode, padded_bs: int, use_graph: bool) -> None:
        for stage in self._stages[mode]:
            with self.nvtx.stage_range(stage.value):
                self.stage_fns[stage](padded_bs)


@dataclass(frozen=True)
class KeyCapture:
    key: GraphKey
    seconds: float          # wall time to capture all stages of this key
    pool_bytes: int         # growth of reserved memory while capturing it


@dataclass(frozen=True)
class CaptureReport:
    keys: tuple[KeyCapture, ...]
    total_seconds: float
    pool_bytes: int         # reserved-memory growth over the whole capture

    def per_mode(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for kc in self.keys:
            m = out.setdefault(kc.key.mode.value, {"graphs": 0, "seconds": 0.0, "pool_bytes": 0})
            m["graphs"] += 1
            m["seconds"] += kc.seconds
            m["pool_bytes"] += kc.pool_bytes
        return out


@dataclass
class CudaGraphRunner(EagerRunner):
    """Replays each key's captured stages; a step asked to run eagerly runs as EagerRunner's."""

    dispatch: DispatchTable
    graphs: dict[tuple[GraphKey, Stage], torch.cuda.CUDAGraph] = field(default_factory=dict,
                                                                       init=False)
    pool: Optional[tuple] = field(default=None, init=False)

    def capture(self, keys: Optional[tuple[GraphKey, ...]] = None,
                progress: bool = True) -> CaptureReport:
        from tqdm import tqdm

        keys = keys if keys is not None else self.dispatch.keys()
        width = lambda k: k.bs * k.mode.tokens_per_request(self.num_draft_tokens)
        order = sorted(keys, key=lambda k: (width(k), k.mode is Mode.SPEC), reverse=True)
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        captured: list[KeyCapture] = []
        total_bytes = 0
        t_all = time.perf_counter()
        bar = tqdm(order, desc="capturing CUDA graphs", unit="key", disable=not progress)
        with torch.inference_mode():
            for key in bar:
                bar.set_postfix_str(key.label())
                self.nvtx.mark_capture(key.label())
                t0 = time.perf_counter()
                stages = self._stages[key.mode]
                # Warm up on a side stream (lazy inits, autotuning) before capturing.
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(_WARMUP_ITERS):
                        for s in stages:
                            self.stage_fns[s](key.bs)
                torch.cuda.current_stream().wait_stream(stream)
                # Warm-up temporaries sit in the ordinary caching pool: release them so the
                # reserved-memory delta below is what the graph pool itself took.
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                r0 = torch.cuda.memory_reserved()
                for s in stages:
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool, stream=stream):
                        self.stage_fns[s](key.bs)
                    self.graphs[(key, s)] = g
                torch.cuda.synchronize()
                grew = torch.cuda.memory_reserved() - r0
                total_bytes += grew
                captured.append(KeyCapture(key, time.perf_counter() - t0, grew))
        return CaptureReport(tuple(captured), time.perf_counter() - t_all, total_bytes)

    def run(self, mode: Mode, padded_bs: int, use_graph: bool) -> None:
        if not use_graph:
            return super().run(mode, padded_bs, use_graph)
        key = GraphKey(mode, padded_bs)
        for stage in self._stages[mode]:
            with self.nvtx.stage_range(stage.value):
                self.graphs[(key, stage)].replay()
