"""Host cost of the goodput controller per decode step, as the SGLang worker drives it: one
plan (decide + commit; an exchange every sync_every steps), one StepTime and one Accepted
observation, at the batch sizes a server runs, over growing contexts. CPU only; prints a table, writes JSON.

    python -m bench.controller_cost [--out out/controller-cost.json] [--steps 20000]
                                    [--sync-every N]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.core.modes import GraphKey, Mode
from dual_graph_worker.core.planner import StepPlanner
from dual_graph_worker.core.policies import PolicyContext, build_policy
from dual_graph_worker.core.policy import StepTime, accepted
from dual_graph_worker.core.settings import Settings

SPEC = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 40, 44, 48)
DECODE = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136,
          144, 152, 160, 168, 176, 184, 192, 200, 208, 216, 224, 232, 240, 248, 256)


def planner(settings: Settings = Settings()) -> StepPlanner:
    prior = {GraphKey(Mode.SPEC, b): 0.01 + 1e-4 * b for b in SPEC}
    prior |= {GraphKey(Mode.DECODE, b): 0.008 + 2e-5 * b for b in DECODE}
    table = DispatchTable.build(SPEC, DECODE)
    policy = build_policy(settings, PolicyContext(3, {Mode.SPEC: SPEC, Mode.DECODE: DECODE},
                                                    CalibrationTable(prior, 3), True, 512))
    return StepPlanner(table, policy)


def per_step_us(bs: int, steps: int, settings: Settings = Settings()) -> list[float]:
    p = planner(settings)
    rows = np.arange(1, bs + 1)
    rows.flags.writeable = False          # the worker's: one read-only array per batch
    # Accept lengths as SGLang hands them over, a list (made by SGLang, not timed here).
    accept, ones = [3.0] * bs, [1.0] * bs
    samples = []
    for i in range(steps):
        t0 = time.perf_counter_ns()
        kv = bs * (256 + i % 256)         # contexts grow as a 256-in / 256-out batch's do
        plan = p.plan(bs, rows=rows, catch_up_tokens=0, kv_tokens=kv)
        p.policy.observe(StepTime(plan.mode, plan.padded_bs, 0.01, kv_tokens=kv))
        p.policy.observe(accepted(plan.mode, accept if plan.mode is Mode.SPEC else ones, rows))
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return samples[steps // 10:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.controller_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/controller-cost.json")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--sync-every", type=int, default=Settings().sync_every,
                    help="steps between exchanges (DGW_SYNC_EVERY; default %(default)s)")
    args = ap.parse_args(argv)
    if args.steps < 100:
        ap.error("--steps must be at least 100")
    if not 1 <= args.sync_every <= 1024:
        ap.error("--sync-every must be in 1..1024 (DGW_SYNC_EVERY's range)")
    settings = Settings(sync_every=args.sync_every)
    rows = []
    print(f"{'bs':>5} {'median us':>10} {'mean us':>8} {'p99 us':>8}  (plan + StepTime + Accepted, "
          f"one step; the mean includes the exchange every {args.sync_every} steps)")
    for bs in (1, 16, 64, 256):
        s = per_step_us(bs, args.steps, settings)
        med, mean, p99 = statistics.median(s), statistics.fmean(s), float(np.percentile(s, 99))
        rows.append({"bs": bs, "median_us": round(med, 2), "mean_us": round(mean, 2),
                     "p99_us": round(p99, 2)})
        print(f"{bs:5d} {med:10.2f} {mean:8.2f} {p99:8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python -m bench.controller_cost",
                               "sync_every": args.sync_every,
                               "machine": platform.processor() or platform.machine(),
                               "python": platform.python_version(), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
