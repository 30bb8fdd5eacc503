"""GPU measurement for capture tuning: every candidate (mode, bs) captured ALONE into a fresh
graph pool (capture time, pool growth), its replayed step latency on synthetic requests of a
representative context, and the pool growth of capturing all candidates together.

Before the measured loop, a throwaway warm-up captures and replays the smallest key of each mode
once, then drops its pool: the one-time costs of the first capture (Triton JIT compilation,
library initialisation: seconds, where a later key's capture takes a tenth of one) land there,
not in any key's capture_s. Its wall time (the compilation, plus ~0.2 s for two ordinary
captures and replays) is recorded as meta.one_time_compile_s.

    python -m capture.measure --out results/capture/measurements_h200.json

Writes `dgw-capture-measurements/1` (capture/measurements.py), which `make capture-tune` reads.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from dual_graph_worker.engines.reference.capture_config import model_shape
from capture.measurements import GraphMeasurement, Measurements, save_measurements
from capture.report import plot_memory_and_capture
from dual_graph_worker.core.capture_schema import GpuInfo, ModelInfo
from dual_graph_worker.engines.reference.calibration import measure_step_latency
from dual_graph_worker.core.argtypes import OneLineParser, output_file, positive_int
from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.engines.reference.build import EngineSpec, engine_from_dummy
from dual_graph_worker.engines.reference.config import MODEL_SHAPES, named_shape
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.simple_policies import PinnedPolicy
from dual_graph_worker.engines.reference.worker import DualGraphWorker, WorkerConfig

CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160,
              176, 192, 208, 224, 240, 256)


def _reset(worker) -> None:
    worker.runner.graphs.clear()
    worker.runner.pool = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def warm_up(worker, context_len: int, log=print) -> float:
    """Capture and replay the smallest key of each mode once, then reset the pool: seconds taken.
    Throwaway: it only pays the one-time compilation before anything is measured."""
    keys = worker.dispatch.keys()
    t0 = time.perf_counter()
    for mode in (Mode.DECODE, Mode.SPEC):
        smallest = min((k for k in keys if k.mode is mode), key=lambda k: k.bs, default=None)
        if smallest is None:
            continue
        _reset(worker)
        worker.runner.capture(keys=(smallest,), progress=False)
        measure_step_latency(worker, smallest, context_len, repeats=1)   # replay it
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    _reset(worker)
    log(f"  warm-up (one-time compilation, not measured): {seconds:.2f} s")
    return seconds


def measure(engine, candidates=CANDIDATES, context_len: int = 384, repeats: int = 5,
            continuity: Continuity = Continuity.LAZY_CATCH_UP, log=print) -> Measurements:
    k = engine.limits.num_draft_tokens
    worker = DualGraphWorker(engine, WorkerConfig(candidates, candidates, True, continuity=continuity),
                             PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=k))
    compile_s = warm_up(worker, context_len, log)
    graphs = []
    for key in sorted(worker.dispatch.keys(), key=lambda g: (g.mode.value, g.bs)):
        _reset(worker)
        rep = worker.runner.capture(keys=(key,), progress=False)
        lat = measure_step_latency(worker, key, context_len, repeats)
        graphs.append(GraphMeasurement(key, rep.keys[0].seconds, max(rep.pool_bytes, 0), lat))
        log(f"  {key.label():>14s}: capture {rep.keys[0].seconds * 1e3:7.1f} ms, "
            f"pool {rep.pool_bytes / 2**20:7.1f} MiB, step {lat * 1e3:6.2f} ms")
    _reset(worker)
    t0 = time.perf_counter()
    total = worker.runner.capture(progress=False)
    log(f"  all {len(total.keys)} keys together: {total.pool_bytes / 2**20:.0f} MiB in "
        f"{time.perf_counter() - t0:.1f}s")
    _reset(worker)
    return Measurements(GpuInfo.from_torch(), ModelInfo.from_shape(model_shape(engine)), tuple(graphs),
                        total_pool_bytes=total.pool_bytes, synthetic=False,
                        notes=f"measured by capture.measure; step latency = median of {repeats} "
                              f"replays on synthetic requests of context {context_len}; "
                              f"acceptance irrelevant (timing only); continuity {continuity.value}; "
                              "one-time compilation paid by a warm-up before the measured keys",
                        meta={"torch": torch.__version__, "one_time_compile_s": compile_s})


def save_dummy_measured(m: Measurements, path: str | Path, shapes: str) -> Path:
    """Save `m`, measured on dummy weights of `shapes`, saying so (printed and in its notes),
    with its memory-and-capture plot beside it; returns the plot's path."""
    weights = f"DUMMY weights ({shapes} shapes: the shapes, not the values, set memory and time)"
    print(weights)
    m = replace(m, notes=f"{m.notes}; {weights}")
    save_measurements(m, path)
    png = Path(path).with_suffix(".png")
    plot_memory_and_capture(m, None, png)
    return png


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(prog="dgw capture-measure", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODEL_SHAPES), default="llama3-8b")
    ap.add_argument("--num-draft-tokens", type=positive_int, default=3)
    ap.add_argument("--context", type=positive_int, default=384)
    ap.add_argument("--max-bs", type=positive_int, default=256,
                    help="largest candidate batch size (candidates: "
                         f"{', '.join(map(str, CANDIDATES))})")
    ap.add_argument("--out", type=output_file, required=True, help="measurements JSON to write")
    args = ap.parse_args(argv)
    if args.max_bs < min(CANDIDATES):
        ap.error(f"--max-bs {args.max_bs} leaves no candidate batch size; pass at least "
                 f"{min(CANDIDATES)}")
    if not torch.cuda.is_available():
        ap.error("capture measurement needs a CUDA GPU (it captures CUDA graphs); run it on a GPU "
                 "machine, or tune on CPU from a recorded file (dgw capture-tune --measurements)")
    cands = tuple(b for b in CANDIDATES if b <= args.max_bs)
    pair = named_shape(args.model)
    engine = engine_from_dummy(pair, EngineSpec(num_draft_tokens=args.num_draft_tokens,
                                                max_requests=max(cands), max_context=args.context + 16,
                                                device="cuda", dtype="bfloat16", attention="triton"))
    png = save_dummy_measured(measure(engine, cands, args.context), args.out, args.model)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
