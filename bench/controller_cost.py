"""Host cost of the goodput controller per decode step, as the SGLang worker drives it: one
plan (decide + commit; an exchange every sync_every steps), one StepTime and one Accepted
observation, and an Admitted one as requests replace finished ones, at the batch sizes a server
runs with SGLang's default graph lists, over growing contexts. CPU only; prints a table, writes
JSON and a plot beside it (.png). The step times fed in are SYNTHETIC (the controller's choices,
not its cost, depend on them). Each round measures every batch size in turn (with --both, each
with and without request turnover), so a host's slow spell or cold start falls on all of them
alike and shows as the spread of the rounds' medians.

    python -m bench.controller_cost [--out out/controller-cost.json] [--steps 20000]
                                    [--sync-every N] [--rounds 3] [--steady | --both] [--split]
                                    [--accept 3.0]

--split also times each part of a step apart (an Admitted and the plan; StepTime; Accepted),
each part's median printed and kept per row: two more clock reads a step, ~0.1 us each.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path
from typing import Optional

import numpy as np

from bench.capture_lists import DECODE_BS, SPEC_BS
from bench.plots import Panel, Series, line_chart
from dual_graph_worker.core.errors import report_user_errors
from dual_graph_worker.core.argtypes import OneLineParser, float_range, int_range, output_file
from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.modes import GraphKey, Mode
from dual_graph_worker.core.planner import StepPlanner
from dual_graph_worker.core.policies import PolicyContext, build_policy
from dual_graph_worker.core.policy import Admitted, StepTime, accepted
from dual_graph_worker.core.settings import Settings
from dual_graph_worker.core.provenance import checkout_commit, command_line


ROWS = 512                                # request rows (SGLang's max running requests here)
BATCHES = (1, 16, 64, 256)


def step_seconds(mode: Mode, bs: int) -> float:
    """The bench's SYNTHETIC step time: speculation wins at accept 3 at every batch, at 1.5
    only below bs ~28 (of BATCHES, at 1 and 16: so a loaded server decodes)."""
    return 0.01 + 1e-4 * bs if mode is Mode.SPEC else 0.008 + 2e-5 * bs


def planner(settings: Settings = Settings()) -> StepPlanner:
    prior = {GraphKey(Mode.SPEC, b): step_seconds(Mode.SPEC, b) for b in SPEC_BS}
    prior |= {GraphKey(Mode.DECODE, b): step_seconds(Mode.DECODE, b) for b in DECODE_BS}
    table = DispatchTable.build(SPEC_BS, DECODE_BS)
    policy = build_policy(settings, PolicyContext(3, {Mode.SPEC: SPEC_BS, Mode.DECODE: DECODE_BS},
                                                    CalibrationTable(prior, 3), True, ROWS))
    return StepPlanner(table, policy)


PARTS = ("plan", "step_time", "accepted")


def per_step_us(bs: int, steps: int, settings: Settings = Settings(), turnover: bool = True,
                parts: Optional[dict[str, list[float]]] = None,
                accept_len: float = 3.0) -> tuple[list[float], float]:
    """Each step's microseconds after the first tenth, and the share of those steps
    speculating. `turnover`: requests of 256 output tokens finish as the steps' tokens say
    (bs x `accept_len` / 256 a spec step, bs / 256 a decode step) and new ones take their rows
    in the order rows were freed, each admission timed as the controller sees it (an Admitted
    event and a new batch's rows); without it the batch never changes. `parts`: where given,
    each of PARTS' microseconds a step (after the first tenth) are added to its list."""
    p = planner(settings)
    ids = list(range(1, bs + 1))
    free = list(range(bs + 1, ROWS))
    rows = _frozen(ids)                   # the worker's: one read-only array per batch
    # Accept lengths as SGLang hands them over, a list (made by SGLang, not timed here), and
    # their sum as the worker's ledger passes it (it counts the step's tokens anyway).
    accept, ones = [accept_len] * bs, [1.0] * bs
    totals = {Mode.SPEC: float(sum(accept)), Mode.DECODE: float(bs)}
    samples, modes, owed = [], [], 0.0
    for i in range(steps):
        joined = None
        if turnover and owed >= 1.0:
            done = min(int(owed), bs)
            owed -= done
            free += ids[:done]
            ids = ids[done:] + free[:done]
            free = free[done:]
            rows, joined = _frozen(ids), _frozen(ids[-done:])
        t0 = time.perf_counter_ns()
        if joined is not None:
            p.policy.observe(Admitted(256 * len(joined), joined))
        kv = bs * (256 + i % 256)         # contexts grow as a 256-in / 256-out batch's do
        plan = p.plan(bs, rows=rows, catch_up_tokens=0, kv_tokens=kv)
        t1 = time.perf_counter_ns() if parts is not None else 0
        p.policy.observe(StepTime(plan.mode, plan.padded_bs,
                                  step_seconds(plan.mode, plan.padded_bs), kv_tokens=kv))
        t2 = time.perf_counter_ns() if parts is not None else 0
        p.policy.observe(accepted(plan.mode, accept if plan.mode is Mode.SPEC else ones, rows,
                                  total=totals[plan.mode]))
        t3 = time.perf_counter_ns()
        samples.append((t3 - t0) / 1e3)
        if parts is not None and i >= steps // 10:
            for name, a, b in zip(PARTS, (t0, t1, t2), (t1, t2, t3)):
                parts[name].append((b - a) / 1e3)
        modes.append(plan.mode is Mode.SPEC)
        owed += bs * (accept_len if plan.mode is Mode.SPEC else 1.0) / 256
    timed = modes[steps // 10:]
    return samples[steps // 10:], sum(timed) / len(timed)


def _frozen(ids: list[int]) -> np.ndarray:
    rows = np.array(ids)
    rows.flags.writeable = False
    return rows


def _plot(rows: list[dict], path: Path, what: str) -> Path:
    series = []
    for n, turnover in enumerate((True, False)):
        mine = sorted((r for r in rows if r["turnover"] is turnover), key=lambda r: r["bs"])
        if mine:
            name = "turnover" if turnover else "steady"
            xs = [r["bs"] for r in mine]
            series += [Series(f"{name}, median", xs, [r["median_us"] for r in mine],
                              color=f"C{n}"),
                       Series(f"{name}, mean (exchanges in)", xs, [r["mean_us"] for r in mine],
                              dashed=True, color=f"C{n}"),
                       Series(f"{name}, p99", xs, [r["p99_us"] for r in mine], joined=False,
                              color=f"C{n}")]
    return line_chart(path, f"The controller's host cost per decode step ({what})",
                      "batch size", [Panel("us per step", series, log_y=True,
                                           lines=((20.0, "20 us"),))], log2_x=True)


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m bench.controller_cost", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=output_file, default="out/controller-cost.json",
                    help="JSON to write (and the plot beside it, .png)")
    ap.add_argument("--steps", type=int_range(100), default=20000,
                    help="steps a batch size a round")
    ap.add_argument("--rounds", type=int_range(1, 20), default=3)
    batch = ap.add_mutually_exclusive_group()
    batch.add_argument("--steady", action="store_true",
                       help="no request turnover: the batch never changes (the lower bound)")
    batch.add_argument("--both", action="store_true",
                       help="with and without turnover, alternated in each round")
    ap.add_argument("--split", action="store_true",
                    help="also time each part of a step apart (the plan, StepTime, Accepted)")
    ap.add_argument("--accept", type=float_range(1.0, 4.0), default=3.0,
                    help="every request's accept length (K=3: 1-4); at 1.5 the bench's step "
                         "times make decode the faster mode, as a loaded server (default "
                         "%(default)s: speculation)")
    ap.add_argument("--sync-every", type=int_range(1, 1024), default=Settings().sync_every,
                    help="steps between exchanges (DGW_SYNC_EVERY's range; default %(default)s)")
    args = ap.parse_args(argv)
    settings = Settings(sync_every=args.sync_every)
    variants = (True, False) if args.both else (not args.steady,)
    samples = {(t, bs): [] for t in variants for bs in BATCHES}
    medians = {key: [] for key in samples}
    spec = {key: [] for key in samples}
    parts = {key: {name: [] for name in PARTS} for key in samples} if args.split else None
    for _ in range(args.rounds):
        for bs in BATCHES:
            for turnover in variants:
                s, share = per_step_us(bs, args.steps, settings, turnover,
                                       None if parts is None else parts[turnover, bs],
                                       args.accept)
                samples[turnover, bs] += s
                medians[turnover, bs].append(statistics.median(s))
                spec[turnover, bs].append(share)
    rounds = "1 round" if args.rounds == 1 else f"{args.rounds} rounds"
    print(f"{'bs':>5} {'batch':>9} {'median us':>10} {'round range':>12} {'mean us':>8} "
          f"{'p99 us':>8} {'spec':>5}" + ("".join(f" {n:>10}" for n in PARTS) if parts else ""))
    rows = []
    for (turnover, bs), s in samples.items():
        med, mean, p99 = statistics.median(s), statistics.fmean(s), float(np.percentile(s, 99))
        lo, hi = min(medians[turnover, bs]), max(medians[turnover, bs])
        share = statistics.fmean(spec[turnover, bs])
        rows.append({"bs": bs, "turnover": turnover, "median_us": round(med, 2),
                     "round_medians_us": [round(m, 2) for m in medians[turnover, bs]],
                     "mean_us": round(mean, 2), "p99_us": round(p99, 2),
                     "spec_share": round(share, 3)})
        split = {} if parts is None else \
            {n: round(statistics.median(v), 2) for n, v in parts[turnover, bs].items()}
        if split:
            rows[-1]["parts_median_us"] = split
        print(f"{bs:5d} {'turnover' if turnover else 'steady':>9} {med:10.2f} "
              f"{f'{lo:.1f}-{hi:.1f}':>12} {mean:8.2f} {p99:8.2f} {share:5.2f}"
              + "".join(f" {v:10.2f}" for v in split.values()))
    print(f"One step: plan + StepTime + Accepted, and with turnover an Admitted as requests "
          f"replace finished ones. Median over {rounds}; round range: the rounds' medians; the "
          f"mean includes the exchange every {args.sync_every} steps; spec: the share of steps "
          "speculating, under the bench's SYNTHETIC step times."
          + (" plan (with any Admitted), step_time, accepted: each part's median." if parts
             else ""))
    out = Path(args.out)
    write_json({"command": command_line("python -m bench.controller_cost", argv),
                "commit": checkout_commit(), "steps": args.steps, "rounds": args.rounds,
                "spec_bs": list(SPEC_BS), "decode_bs": list(DECODE_BS),
                "sync_every": args.sync_every, "step_times": "synthetic",
                "accept_len": args.accept,
                "machine": platform.processor() or platform.machine(),
                "python": platform.python_version(), "rows": rows}, out)
    png = _plot(rows, out.with_suffix(".png"), f"{rounds}, {args.steps} steps a batch size")
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(report_user_errors(main))
