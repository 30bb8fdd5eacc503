"""How speculation's first steps after a switch read against the rest of a GPU run's steps at
the same size: per run of spec steps entered with a catch-up (a switch from decode, or a
re-measurement), its clean steps 1 and 2 (step 0 holds the catch-up) over the median of every
clean spec step of that size in the trace at contexts within 25% of the run's first. Whether a
switch's first steps cost more than the mode's later ones, the controller's question when a
short re-measurement reads high.

    python -m bench.sglang.switch_steps TRACE.json.gz ... [--out FILE.json] [--max-bs N]

Prints a table by batch range and position, writes FILE.json and a plot beside it (FILE.png).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np

from bench.plots import Panel, Series, line_chart
from bench.sglang.estimate_error import clean_step, read_each
from dual_graph_worker.core.argtypes import OneLineParser, int_range, output_file
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.provenance import checkout_commit, command_line

POSITIONS = (1, 2)
NEAR = 0.25
MIN_REFERENCE = 10
RANGES = ((1, 2), (3, 16), (17, 64), (65, 256))


def switch_ratios(costs: list, max_bs: int = 256) -> list[tuple[int, int, float]]:
    """(padded bs, position, ratio) of every clean step at POSITIONS of each spec run entered
    with a catch-up, against its size's clean spec steps at contexts within NEAR."""
    steps = [row for row in costs if row[0] != "p"]
    reference = defaultdict(list)
    for row in steps:
        if row[0] == "s" and clean_step(row):
            reference[row[1]].append((row[5], row[2]))
    out = []
    for (mode, bs), run in itertools.groupby(steps, key=lambda row: (row[0], row[1])):
        run = list(run)
        if mode != "s" or bs > max_bs or not run[0][3]:
            continue
        kv = run[0][5]
        near = [t for x, t in reference[bs] if abs(x - kv) <= NEAR * kv]
        if len(near) < MIN_REFERENCE:
            continue
        median = statistics.median(near)
        out += [(bs, k, run[k][2] / median) for k in POSITIONS
                if k < len(run) and clean_step(run[k])]
    return out


def by_range(ratios: list[tuple[int, int, float]]) -> list[dict]:
    rows = []
    for lo, hi in RANGES:
        for k in POSITIONS:
            mine = [r for bs, pos, r in ratios if lo <= bs <= hi and pos == k]
            if mine:
                p10, p50, p90 = np.percentile(mine, (10, 50, 90)).tolist()
                rows.append({"bs": [lo, hi], "position": k, "steps": len(mine), "median": p50,
                             "p10": p10, "p90": p90})
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(prog="python -m bench.sglang.switch_steps", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", help="replay traces (step_costs --trace)")
    ap.add_argument("--out", type=output_file, default="out/switch-steps.json")
    ap.add_argument("--max-bs", type=int_range(1, 4096), default=256,
                    help="the largest padded batch size read")
    args = ap.parse_args(argv)
    got = read_each(args.traces, lambda trace: switch_ratios(trace["costs"], args.max_bs))
    if got is None:
        return 2
    ratios = [r for each in got.values() for r in each]
    rows = by_range(ratios)
    print("| padded bs | step after the catch-up | steps | median / size's median | 10th-90th |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['bs'][0]}-{r['bs'][1]} | {r['position']} | {r['steps']} | {r['median']:.3f} "
              f"| {r['p10']:.2f}-{r['p90']:.2f} |")
    out = Path(args.out)
    write_json({"command": command_line("python -m bench.sglang.switch_steps", argv),
                "commit": checkout_commit(), "traces": args.traces, "rows": rows}, out)
    if rows:
        series = []
        for k in POSITIONS:
            mine = [r for r in rows if r["position"] == k]
            xs = [r["bs"][1] for r in mine]
            series += [Series(f"step {k}, median", xs, [r["median"] for r in mine]),
                       Series(f"step {k}, 10th", xs, [r["p10"] for r in mine], dashed=True),
                       Series(f"step {k}, 90th", xs, [r["p90"] for r in mine], dashed=True)]
        line_chart(out.with_suffix(".png"),
                   "Speculation's first steps after a catch-up, over its size's median",
                   "padded batch size (top of the range)",
                   [Panel("ratio", series)], log2_x=True)
    print(f"wrote {out}" + (f" and {out.with_suffix('.png')}" if rows else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
