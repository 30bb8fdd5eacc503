"""How far the controller's spec step time reads after each re-measurement of speculation in a
GPU run, against what speculation then measured there once chosen. A re-measurement is a run of
at most MAX_STEPS spec steps at one size between decode steps; the controller replays the trace
open loop (traces.replay) and its spec step time at that size is read SETTLE step rows
after the re-measurement (an exchange has folded it by then), or before the first spec step at
that size if one comes sooner (the estimate that chose it), at the context of the steps it is set
against: the median of clean spec steps 3-10 at that size in the next MIN_STEPS clean ones
within AHEAD rows. Under 1: it read speculation cheaper than it ran (a switch it then undoes).

    python -m bench.sglang.re_measure_error TRACE.json.gz ... [--out FILE.json]

Prints the ratios' spread per trace and over all, writes FILE.json and a plot beside it (FILE.png).
"""

from __future__ import annotations

import itertools
import statistics
import sys
from pathlib import Path
from typing import Optional

from bench.plots import Panel, Series, line_chart
from bench.sglang.traces import clean_step, read_each, replay, trace_parser
from bench.sglang.switch_steps import percentiles
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.provenance import checkout_commit, command_line

MAX_STEPS = 5
SETTLE = 8
AHEAD = 600
MIN_STEPS = 10


def re_measurements(costs: list) -> dict[int, tuple[int, float, int]]:
    """Row to read the estimate at -> (padded bs, the measured median seconds, its context)."""
    runs = [(kind, size, [at for at, _ in rows]) for (kind, size), rows in
            itertools.groupby(enumerate(costs), key=lambda r: (r[1][0], r[1][1]))]
    out = {}
    for (before, _, _), (kind, pb, rows), (after, _, _) in zip(runs, runs[1:], runs[2:]):
        if kind != "s" or before != "d" or after != "d" or len(rows) > MAX_STEPS:
            continue
        end = rows[-1] + 1
        later = [r for r in costs[end:end + AHEAD] if r[0] == "s" and r[1] == pb
                 and clean_step(r)][2:MIN_STEPS]
        read_at = _read_at(costs, end, pb)
        if len(later) == MIN_STEPS - 2 and read_at is not None:
            out[read_at] = (pb, statistics.median(r[2] for r in later),
                            int(statistics.median(r[5] for r in later)))
    return out


def _read_at(costs: list, end: int, pb: int) -> Optional[int]:
    """The row SETTLE step rows after `end`, or the first spec row at `pb` before it."""
    steps = 0
    for k in range(end, len(costs)):
        if costs[k][0] == "s" and costs[k][1] == pb:
            return k
        if costs[k][0] != "p":
            steps += 1
            if steps > SETTLE:
                return k
    return None


def ratios(trace: dict) -> list[dict]:
    """One record per re-measurement: padded bs, estimate and measured seconds, their ratio."""
    wanted, out = re_measurements(trace["costs"]), []
    for p, at, _ in replay(trace):
        if at in wanted:
            pb, measured, kv = wanted[at]
            expected = p.step_time(Mode.SPEC, pb, kv)
            if expected:
                out.append({"row": at, "padded_bs": pb, "expected_s": expected,
                            "measured_s": measured, "ratio": expected / measured})
    return out


def spread(records: list[dict]) -> dict:
    r = [x["ratio"] for x in records]
    if not r:
        return {"n": 0}
    return {"n": len(r), **percentiles(r), "mean": statistics.fmean(r),
            "under_0_95": sum(x < 0.95 for x in r) / len(r)}


def _row(name: str, s: dict) -> str:
    if not s["n"]:
        return f"| {name} | 0 | | | | | |"
    return (f"| {name} | {s['n']} | {s['median']:.3f} | {s['mean']:.3f} | {s['p10']:.3f} | "
            f"{s['p90']:.3f} | {s['under_0_95']:.2f} |")


def main(argv: Optional[list[str]] = None) -> int:
    args = trace_parser("re_measure_error", __doc__, "out/re-measure-error.json").parse_args(argv)
    got = read_each(args.traces, ratios)
    if got is None:
        return 2
    print("| trace | re-measurements | median estimate / measured | mean | 10th | 90th | "
          "share under 0.95 |")
    print("|---|---|---|---|---|---|---|")
    every = [r for records in got.values() for r in records]
    for path, records in got.items():
        print(_row(Path(path).name, spread(records)))
    if len(got) > 1:
        print(_row(f"all {len(got)} traces", spread(every)))
    out = Path(args.out)
    write_json({"command": command_line("python -m bench.sglang.re_measure_error", argv),
                "commit": checkout_commit(), "summary": spread(every),
                "traces": {path: records for path, records in got.items()}}, out)
    if not every:
        print(f"wrote {out}; no plot: no re-measurement of speculation was followed by "
              f"{MIN_STEPS} spec steps at its size")
        return 0
    png = line_chart(out.with_suffix(".png"), "Speculation's step time after a re-measurement "
                     "against its steps once chosen", "padded batch size",
                     [Panel("estimate / measured",
                            [Series("re-measurements", [r["padded_bs"] for r in every],
                                    [r["ratio"] for r in every], joined=False)],
                            lines=((1.0, ""), (0.95, "0.95")))], log2_x=True)
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
