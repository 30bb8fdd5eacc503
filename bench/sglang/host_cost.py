"""The SGLang worker's own host time per step, on the CPU: its path before the launch, its verify
hook and its result processing, with SGLang's parent methods stubbed (no model, no GPU) and the
default goodput controller deciding. What the worker adds to every step of a server whose small
batches are host-bound (on the H200 the step log reads 110-210 us before launch and 80-260 us in
the hook); not SGLang's own host work.

    python -m bench.sglang.host_cost [--bs 1,16,64] [--steps 5000] [--step-log]

Prints the median microseconds of each part per batch size; writes out/host-cost.json.
Needs SGLang 0.5.17 importable (`make setup-test` installs its CPU build).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch


class NoDraftWork:
    """A continuity strategy with nothing to do (the worker's glue is what is measured)."""

    defers_prefill = False

    def pending_tokens(self, rows):
        return 0

    def defers_prefill_of(self, batch, next_step_decodes):
        return False

    def on_prefill(self, batch):
        pass

    def before_spec_step(self, batch, rows):
        return []


def bare_worker(policy, continuity=None, step_log=None):
    """A DualGraphEagleWorker holding only its per-step state (no model, no graphs, no GPU)."""
    from dual_graph_worker.core.counters import WorkerCounters
    from dual_graph_worker.core.dispatch import DispatchTable
    from dual_graph_worker.core.planner import StepLedger, StepPlanner
    from dual_graph_worker.core.settings import Settings
    from dual_graph_worker.core.step_log import StepLogWriter
    from dual_graph_worker.core.timing import ResultClock
    from dual_graph_worker.engines.sglang.decode_pool import eager_decode_pool
    from dual_graph_worker.engines.sglang.draft_extend_graph import DraftSyncGraphs
    from dual_graph_worker.engines.sglang.layout import RowContext
    from dual_graph_worker.engines.sglang.nvtx_spans import StepSpans
    from dual_graph_worker.engines.sglang.worker import DualGraphEagleWorker

    w = object.__new__(DualGraphEagleWorker)
    w.adaptive_controller = None
    w.settings = Settings()
    w._ledger = StepLedger()
    w._clock = ResultClock()
    w.counters = WorkerCounters()
    w._metrics = None
    w._completed = 0
    w.planner = StepPlanner(DispatchTable.build(SPEC_BS, DECODE_BS), policy)
    w.continuity = continuity or NoDraftWork()
    w._stall_watch = None
    w._step_log = None if step_log is None else StepLogWriter(step_log)
    w._spans = StepSpans.from_settings(Settings())
    w._decode_pool = eager_decode_pool()
    w._draft_sync = DraftSyncGraphs(runner="width-1-graphs")
    w._context = RowContext(512)
    return w


SPEC_BS = (1, 2, 3, 4, 6, 8, 16, 32, 48)
DECODE_BS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)
K = 3


def _stubbed_worker(step_log: Optional[Path]):
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    from dual_graph_worker.core.modes import Mode
    from dual_graph_worker.core.policies import PolicyContext, build_policy
    from dual_graph_worker.core.settings import Settings

    done = SimpleNamespace(extra_keep_alive_refs=None)
    EAGLEWorkerV2.forward_batch_generation = \
        lambda self, batch, on_publish=None, grammar_barrier=None: done
    EAGLEWorkerV2.on_verify_complete_cpu = lambda self, n, batch_size=0: None
    ctx = PolicyContext(K, {Mode.SPEC: SPEC_BS, Mode.DECODE: DECODE_BS}, None,
                        defers_prefill=True, max_rows=512)
    w = bare_worker(build_policy(Settings(), ctx), step_log=step_log)
    type(w)._decode_step = lambda self, batch, rows, on_publish, gb: done
    return w


def measure(bs: int, steps: int, step_log: Optional[Path]) -> dict:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    w = _stubbed_worker(step_log)
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, is_extend_in_batch=False,
                            seq_lens=torch.zeros(bs, dtype=torch.int64),
                            req_pool_indices_cpu=torch.arange(bs), extend_num_tokens=bs)
    accepted = [2] * bs
    parts = np.zeros((steps, 3))
    for i in range(steps + steps // 10):                 # the first tenth warms up
        t0 = time.perf_counter()
        w.forward_batch_generation(batch)
        t1 = time.perf_counter()
        w.on_verify_complete_cpu(accepted, batch_size=bs)
        t2 = time.perf_counter()
        w.dgw_result_processed()
        t3 = time.perf_counter()
        if i >= steps // 10:
            parts[i - steps // 10] = (t1 - t0, t2 - t1, t3 - t2)
    if w._step_log is not None:
        w._step_log.close()
    med = np.median(parts, axis=0) * 1e6
    return {"bs": bs, "before_launch_us": round(float(med[0]), 1),
            "verify_hook_us": round(float(med[1]), 1),
            "result_processed_us": round(float(med[2]), 1),
            "total_us": round(float(np.median(parts.sum(axis=1)) * 1e6), 1)}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sglang.host_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", default="1,16,64")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--step-log", action="store_true", help="with the step log on (a temp file)")
    ap.add_argument("--out", default="out/host-cost.json")
    args = ap.parse_args(argv)
    try:
        sizes = [int(b) for b in args.bs.split(",") if b]
    except ValueError:
        print(f"error: --bs takes batch sizes like 1,16,64, not {args.bs!r}", file=sys.stderr)
        return 2
    try:
        import sglang.srt.speculative.eagle_worker_v2  # noqa: F401
    except ImportError:
        print("error: SGLang is not importable here; `make setup-test` installs its CPU build",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(b, args.steps, Path(tmp) / f"steps-{b}.jsonl" if args.step_log else None)
                for b in sizes]
    print(f"the SGLang worker's own host time per step (us, median of {args.steps}; SGLang's "
          f"parent methods stubbed, step log {'on' if args.step_log else 'off'}):")
    print("   bs  before launch  verify hook  result processed  total")
    for r in rows:
        print(f"{r['bs']:5d}  {r['before_launch_us']:13.1f}  {r['verify_hook_us']:11.1f}  "
              f"{r['result_processed_us']:16.1f}  {r['total_us']:5.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"step_log": args.step_log, "steps": args.steps, "rows": rows},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
