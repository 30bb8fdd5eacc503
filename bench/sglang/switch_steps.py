"""How speculation's first steps after a switch read against the same size's settled steps in
a GPU run: per run of spec steps entered with a catch-up (a switch from decode, or a
re-measurement), its clean steps at positions 1..N (step 0 holds the catch-up) over the median
of the trace's clean spec steps of that size that ran SETTLED or more steps into their run, at
contexts within 25% of the run's first. Whether a re-measurement's few clean steps (positions
1-2 of a 4-step one) read speculation as it runs once chosen, the controller's question when a
short re-measurement reads high.

    python -m bench.sglang.switch_steps TRACE.json.gz ... [--out FILE.json] [--max-bs N]
                                        [--positions N]

Prints a table by batch range and position, writes FILE.json and a plot beside it (FILE.png).
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np

from bench.plots import Panel, Series, line_chart
from bench.sglang.traces import clean_step, read_each, trace_parser
from dual_graph_worker.core.argtypes import int_range
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.provenance import checkout_commit, command_line

NEAR = 0.25
SETTLED = 8
MIN_REFERENCE = 10
POSITIONS = 6
RANGES = ((1, 2), (3, 16), (17, 64), (65, 256))
HIGH = 1.05                   # a re-measurement reading speculation this much slow
Run = tuple[int, tuple[Optional[float], ...]]


def switch_runs(costs: list, max_bs: int = 256, positions: int = POSITIONS) -> list[Run]:
    """(padded bs, each of its steps 1..`positions` over the settled median, None where not
    clean or not run) of each spec run entered with a catch-up; the settled median: its size's
    clean spec steps SETTLED or more into their run, at contexts within NEAR."""
    steps = [row for row in costs if row[0] != "p"]
    runs = [(key, list(run)) for key, run in
            itertools.groupby(steps, key=lambda row: (row[0], row[1]))]
    reference = defaultdict(list)
    for (mode, bs), run in runs:
        if mode == "s":
            reference[bs] += [(row[5], row[2]) for row in run[SETTLED:] if clean_step(row)]
    out = []
    for (mode, bs), run in runs:
        if mode != "s" or bs > max_bs or not run[0][3]:
            continue
        kv = run[0][5]
        near = [t for x, t in reference[bs] if abs(x - kv) <= NEAR * kv]
        if len(near) < MIN_REFERENCE:
            continue
        median = statistics.median(near)
        out.append((bs, tuple(run[k][2] / median if k < len(run) and clean_step(run[k])
                              else None for k in range(1, positions + 1))))
    return out


def _ratios_in(lo: int, hi: int, runs: list[Run], positions: int) -> list[tuple]:
    """The ratios of the runs of padded bs lo..hi, each read at `positions` steps."""
    mine = [ratios for bs, ratios in runs if lo <= bs <= hi]
    if any(len(r) != positions for r in mine):
        raise ValueError(f"runs read at other than {positions} positions")
    return mine


def percentiles(values: list[float]) -> dict:
    """The median and the 10th and 90th percentiles of `values`."""
    p10, p50, p90 = np.percentile(values, (10, 50, 90)).tolist()
    return {"median": p50, "p10": p10, "p90": p90}


def by_position(runs: list[Run], positions: int = POSITIONS) -> list[dict]:
    """Per batch range and position: every run's step there (its 10th, 50th, 90th), and the
    median over the runs clean at every position alone. Short re-measurements reach only the
    first positions, so the two tell a mode settling from re-measurements reading apart."""
    rows = []
    for lo, hi in RANGES:
        mine = _ratios_in(lo, hi, runs, positions)
        whole = [r for r in mine if None not in r]
        for k in range(positions):
            got = [r[k] for r in mine if r[k] is not None]
            if got:
                rows.append({"bs": [lo, hi], "position": k + 1, "steps": len(got),
                             **percentiles(got), "whole_runs": len(whole),
                             "whole_median": statistics.median(r[k] for r in whole)
                             if whole else None})
    return rows


def by_length(runs: list[Run], positions: int = POSITIONS) -> list[dict]:
    """Per batch range, over the runs clean at every position read: the share whose first k
    steps' mean reads over HIGH, k = 1..positions (a re-measurement k clean steps long)."""
    rows = []
    for lo, hi in RANGES:
        whole = [r for r in _ratios_in(lo, hi, runs, positions) if None not in r]
        if whole:
            rows.append({"bs": [lo, hi], "runs": len(whole), "over": [
                sum(statistics.fmean(r[:k]) > HIGH for r in whole) / len(whole)
                for k in range(1, positions + 1)]})
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = trace_parser("switch_steps", __doc__, "out/switch-steps.json")
    ap.add_argument("--max-bs", type=int_range(1, 4096), default=256,
                    help="the largest padded batch size read")
    ap.add_argument("--positions", type=int_range(1, SETTLED - 1), default=POSITIONS,
                    help="the steps read after each catch-up (default %(default)s)")
    args = ap.parse_args(argv)
    got = read_each(args.traces,
                    lambda trace: switch_runs(trace["costs"], args.max_bs, args.positions))
    if got is None:
        return 2
    runs = [run for each in got.values() for run in each]
    rows, lengths = by_position(runs, args.positions), by_length(runs, args.positions)
    print(f"| padded bs | step after the catch-up | steps | median / size's settled median "
          f"| 10th-90th | median, runs clean at steps 1-{args.positions} (n) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        whole = "-" if r["whole_median"] is None else \
            f"{r['whole_median']:.3f} ({r['whole_runs']})"
        print(f"| {r['bs'][0]}-{r['bs'][1]} | {r['position']} | {r['steps']} | {r['median']:.3f} "
              f"| {r['p10']:.2f}-{r['p90']:.2f} | {whole} |")
    print(f"\nRuns clean at steps 1-{args.positions}: the share whose first k steps' mean reads "
          f"over {HIGH:.2f}x the settled median")
    print("| padded bs | runs | " + " | ".join(f"k={k}" for k in range(1, args.positions + 1))
          + " |")
    print("|---|---|" + "---|" * args.positions)
    for r in lengths:
        print(f"| {r['bs'][0]}-{r['bs'][1]} | {r['runs']} | "
              + " | ".join(f"{v:.2f}" for v in r["over"]) + " |")
    out = Path(args.out)
    write_json({"command": command_line("python -m bench.sglang.switch_steps", argv),
                "commit": checkout_commit(), "traces": args.traces, "settled_from": SETTLED,
                "rows": rows, "lengths": lengths}, out)
    if rows:
        series = []
        for n, (lo, hi) in enumerate(RANGES):
            mine = [r for r in rows if r["bs"] == [lo, hi]]
            if mine:
                xs = [r["position"] for r in mine]
                series.append(Series(f"bs {lo}-{hi}, every run", xs,
                                     [r["median"] for r in mine], color=f"C{n}"))
                if all(r["whole_median"] is not None for r in mine):
                    series.append(Series(f"bs {lo}-{hi}, runs clean at every step", xs,
                                         [r["whole_median"] for r in mine], dashed=True,
                                         color=f"C{n}"))
        line_chart(out.with_suffix(".png"),
                   "Speculation's steps after a catch-up over its size's settled median (medians)",
                   "step after the catch-up", [Panel("ratio", series, lines=((1.0, "settled"),))],
                   integer_x=True)
    print(f"wrote {out}" + (f" and {out.with_suffix('.png')}" if rows else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
