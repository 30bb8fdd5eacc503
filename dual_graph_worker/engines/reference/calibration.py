"""Step latency per captured (mode, padded bs): the goodput policy's calibration table.

Measured once at start-up, after capture, by replaying each key's stages on synthetic requests
whose context length is representative (attention cost grows with it). On a tensor-parallel
server rank 0's table is broadcast, so every rank decides from the same numbers.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from dual_graph_worker.core.calibration import CalibrationTable, wall_clock_timer
from dual_graph_worker.core.errors import DualGraphError
from dual_graph_worker.core.modes import GraphKey

if TYPE_CHECKING:
    from dual_graph_worker.engines.reference.worker import DualGraphWorker


def measure_step_latency(worker: DualGraphWorker, key: GraphKey, context_len: int,
                         repeats: int = 5) -> float:
    """Median seconds of one step of `key` over synthetic requests of `context_len` tokens."""
    if worker.num_running:
        raise DualGraphError("calibrate before admitting requests: it borrows request rows and slots")
    engine, alloc = worker.engine, worker.kv.allocator
    P, width = key.bs, key.mode.tokens_per_request(worker.k)
    rows = np.arange(1, P + 1, dtype=np.int64)
    ctx_slots = alloc.alloc(P * context_len)
    step_slots = alloc.alloc(P * width).reshape(P, width)
    try:
        engine.fill_synthetic_context(rows, context_len, ctx_slots)
        worker.bufs.stage(rows, np.full(P, context_len, dtype=np.int64), step_slots, P)
        worker.bufs.upload()
        graph = worker.dispatch.has_graph(key.mode, P)
        run = lambda: worker.runner.run(key.mode, P, graph and worker.config.use_cuda_graphs)
        sync = (lambda: torch.cuda.synchronize(engine.device)) if engine.device.type == "cuda" \
            else (lambda: None)
        return wall_clock_timer(time.perf_counter, sync)([run], warmup=1, iters=repeats)
    finally:
        alloc.free(ctx_slots)
        alloc.free(step_slots.reshape(-1))


def calibrate(worker: DualGraphWorker, context_len: int, repeats: int = 5) -> CalibrationTable:
    lat = {k: measure_step_latency(worker, k, context_len, repeats)
           for k in worker.dispatch.keys()}
    return CalibrationTable(lat, worker.k, source=f"measured at start-up, context {context_len}, "
                                                  f"median of {repeats} on {worker.engine.device}")
