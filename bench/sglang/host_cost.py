"""The SGLang worker's own host time per step, on the CPU: its path before the launch, its verify
hook and its result processing, with SGLang's parent methods stubbed (no model, no GPU) and the
default goodput controller deciding. What the worker adds to every step of a server whose small
batches are host-bound (on the H200 the step log reads 110-210 us before launch and 80-260 us in
the hook); not SGLang's own host work.

    python -m bench.sglang.host_cost [--bs 1,16,64] [--steps 5000] [--step-log] [--opcodes N]

Prints the median microseconds of each part per batch size, and the total's mean and 99th
percentile (where stalls show); with --opcodes, the Python bytecodes each part executes (the
same on any host); writes out/host-cost.json and a plot beside it (.png). With --step-log the
steps run back to back, ~1000 in the writer thread's 50 ms where a GPU step takes ~6 ms: its
serializing then holds the interpreter for a share of their time a server's steps never see.
Needs SGLang 0.5.17 importable (`make setup-test` installs its CPU build).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import operator
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional
from unittest.mock import patch

import numpy as np
import torch

from bench.capture_lists import DECODE_BS, SPEC_BS
from bench.plots import Panel, Series, line_chart
from bench.sglang.bare_worker import bare_worker
from dual_graph_worker.core.argtypes import (OneLineParser, int_list, int_range,
                                             non_negative_float, output_file)
from dual_graph_worker.core.jsonio import write_json


K = 3


def _worker(step_log: Optional[Path]):
    from dual_graph_worker.core.modes import Mode
    from dual_graph_worker.core.policies import PolicyContext, build_policy
    from dual_graph_worker.core.settings import Settings

    ctx = PolicyContext(K, {Mode.SPEC: SPEC_BS, Mode.DECODE: DECODE_BS}, None,
                        defers_prefill=True, max_rows=512)
    return bare_worker(build_policy(Settings(), ctx), step_log=step_log,
                       sizes=(SPEC_BS, DECODE_BS))


def _parts(bs: int, steps: int, step_log: Optional[Path], gap_s: float,
           meter: Callable[[], float], clock: Optional[Callable[[], float]] = None
           ) -> np.ndarray:
    """Each step's three parts (before launch, verify hook, result processed) as differences of
    `meter`, at batch size `bs`; SGLang's own work (the parent class's methods, the decode pool's
    step) stubbed for the call. `clock`: what the worker times its steps by (default its own,
    the wall clock). The first tenth of the steps warms up and is left out."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    from dual_graph_worker.core.timing import ResultClock

    w = _worker(step_log)
    if clock is not None:
        w._clock = ResultClock(clock)
    done = SimpleNamespace(extra_keep_alive_refs=None)
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, is_extend_in_batch=False,
                            seq_lens=torch.zeros(bs, dtype=torch.int64),
                            req_pool_indices_cpu=torch.arange(bs), extend_num_tokens=bs)
    accepted = [2] * bs
    parts = np.zeros((steps, 3))
    with patch.object(EAGLEWorkerV2, "forward_batch_generation",
                      lambda self, batch, on_publish=None, grammar_barrier=None: done), \
            patch.object(EAGLEWorkerV2, "on_verify_complete_cpu",
                         lambda self, n, batch_size=0: None), \
            patch.object(type(w), "_decode_step",
                         lambda self, batch, rows, keep_alive, on_publish, gb: done):
        for i in range(steps + steps // 10):
            t0 = meter()
            w.forward_batch_generation(batch)
            t1 = meter()
            w.on_verify_complete_cpu(accepted, batch_size=bs)
            t2 = meter()
            w.dgw_result_processed()
            t3 = meter()
            if gap_s:
                time.sleep(gap_s)
            if i >= steps // 10:
                parts[i - steps // 10] = (t1 - t0, t2 - t1, t3 - t2)
    if w._step_log is not None:
        w._step_log.close()
    return parts


def measure(bs: int, steps: int, step_log: Optional[Path], gap_s: float = 0.0) -> dict:
    """Median microseconds of each part of a step at batch size `bs`."""
    parts = _parts(bs, steps, step_log, gap_s, time.perf_counter)
    med = np.median(parts, axis=0) * 1e6
    total = parts.sum(axis=1) * 1e6
    return {"bs": bs, "before_launch_us": round(float(med[0]), 1),
            "verify_hook_us": round(float(med[1]), 1),
            "result_processed_us": round(float(med[2]), 1),
            "total_us": round(float(np.median(total)), 1),
            # Stalls (the log writer holding the interpreter, collections) show here only.
            "total_mean_us": round(float(total.mean()), 1),
            "total_p99_us": round(float(np.percentile(total, 99)), 1)}


def count_opcodes(bs: int, steps: int) -> dict:
    """Median Python bytecodes each part of a step executes at batch size `bs`: the same path
    as `measure`, under a tracer that counts every opcode of every Python frame (C work, numpy's
    included, counts nothing). The worker's steps are timed by a clock that reads 3 ms a call,
    so its decisions (speculation, every step, at accept 3) never depend on the host: the count
    is the same on any machine, where the path's microseconds on a shared 2-core CPU move 2x
    from run to run."""
    count = [0]
    meter = functools.partial(operator.getitem, count, 0)     # C calls: no frame, no opcode
    clock = functools.partial(next, itertools.count(0.0, 0.003))

    def opcode(frame, event, arg):
        if event == "opcode":
            count[0] += 1
        return opcode

    def call(frame, event, arg):
        frame.f_trace_opcodes = True
        return opcode

    before = sys.gettrace()           # a coverage tool's or a debugger's: put back after
    sys.settrace(call)
    try:
        parts = _parts(bs, steps, None, 0.0, meter, clock)
    finally:
        sys.settrace(before)
    med = np.median(parts, axis=0)
    return {"bs": bs, "before_launch_ops": int(med[0]), "verify_hook_ops": int(med[1]),
            "result_processed_ops": int(med[2]), "total_ops": int(np.median(parts.sum(axis=1)))}


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(prog="python -m bench.sglang.host_cost", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", type=int_list, default=[1, 16, 64],
                    help="batch sizes, comma-separated (default 1,16,64)")
    ap.add_argument("--steps", type=int_range(10), default=5000)
    ap.add_argument("--step-log", action="store_true", help="with the step log on (a temp file)")
    ap.add_argument("--gap-ms", type=non_negative_float, default=0.0,
                    help="sleep this long after each step, as a GPU step's wait would: the "
                         "worker's code then meets cold caches, as it does in a server")
    ap.add_argument("--opcodes", type=int_range(0), default=0, metavar="STEPS",
                    help="also count the Python bytecodes each part executes over this many "
                         "steps (deterministic: compares two versions of the path on a noisy "
                         "host; ~100x slower than the path itself)")
    ap.add_argument("--out", type=output_file, default="out/host-cost.json")
    args = ap.parse_args(argv)
    sizes = args.bs
    try:
        importlib.import_module("sglang.srt.speculative.eagle_worker_v2")
    except ImportError:
        print("error: SGLang is not importable here; `make setup-test` installs its CPU build",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(b, args.steps, Path(tmp) / f"steps-{b}.jsonl" if args.step_log else None,
                        args.gap_ms / 1e3) for b in sizes]
    print(f"the SGLang worker's own host time per step (us, median of {args.steps}; SGLang's "
          f"parent methods stubbed, step log {'on' if args.step_log else 'off'}"
          + (f", {args.gap_ms:g} ms between steps" if args.gap_ms else "") + "):")
    print("   bs  before launch  verify hook  result processed  total  total mean  total p99")
    for r in rows:
        print(f"{r['bs']:5d}  {r['before_launch_us']:13.1f}  {r['verify_hook_us']:11.1f}  "
              f"{r['result_processed_us']:16.1f}  {r['total_us']:5.1f}  "
              f"{r['total_mean_us']:10.1f}  {r['total_p99_us']:9.1f}")
    ops = [count_opcodes(b, args.opcodes) for b in sizes] if args.opcodes > 0 else []
    if ops:
        print(f"Python bytecodes executed per step (median of {args.opcodes}, step log off):")
        print("   bs  before launch  verify hook  result processed  total")
        for r in ops:
            print(f"{r['bs']:5d}  {r['before_launch_ops']:13d}  {r['verify_hook_ops']:11d}  "
                  f"{r['result_processed_ops']:16d}  {r['total_ops']:5d}")
    out = Path(args.out)
    write_json({"step_log": args.step_log, "steps": args.steps, "gap_ms": args.gap_ms,
                "rows": rows, **({"opcodes": ops} if ops else {})}, out)
    png = _plot(rows, out.with_suffix(".png"), args.steps)
    print(f"wrote {out} and {png}")
    return 0


def _plot(rows: list[dict], path: Path, steps: int) -> Path:
    sizes = [r["bs"] for r in rows]
    parts = [Series(part.replace("_us", "").replace("_", " ") + ", median", sizes,
                    [r[part] for r in rows])
             for part in ("before_launch_us", "verify_hook_us", "result_processed_us",
                          "total_us")]
    parts.append(Series("total, p99", sizes, [r["total_p99_us"] for r in rows], dashed=True))
    return line_chart(path, f"The SGLang worker's own host time per step ({steps} steps, "
                      "SGLang's parent methods stubbed)", "batch size",
                      [Panel("us per step", parts, log_y=True)], log2_x=True)


if __name__ == "__main__":
    sys.exit(main())
