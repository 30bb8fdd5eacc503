"""How far the controller's step time at each cell's first step lies from what the cell then
measured, on a GPU run's own batch costs: each trace (`step_costs --trace`: a worker's step log
in order) is fed to a controller with the run's start-up prior, each step committed in the mode
it ran, exchanging every sync_every steps (its default) as the worker does; at the first step
after each prefill, each mode's expected step at its padded size and context is set against
the median of the clean steps (no catch-up, no carried launch; the batch's first two and last
three left out) that mode ran at that size over the next 400 steps, where it ran at least 8;
and the expected step at those steps' median context, apart from it: a cell's context grows as
it runs (a 256-token output doubles a 256-token prompt's), so its steps run slower than its
first, which the first error counts and the second does not. Open loop: the costs are the run's,
whatever this controller would have chosen. Run it from another tree to compare.

    python -m bench.sglang.estimate_error TRACE.json.gz ... [--out FILE.json]

Writes FILE.json and a plot beside it (FILE.png): each cell's error by padded batch size.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Optional

from bench.plots import Panel, Series, line_chart
from bench.sglang.traces import MODES, clean_step, read_each, replay, trace_parser
from dual_graph_worker.core.controller import GoodputController
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.provenance import command_line

AHEAD = 400
MIN_STEPS = 8


def cell_errors(trace: dict) -> list[dict]:
    """One record per (batch start, mode) with at least MIN_STEPS clean steps ahead."""
    out, after_prefill = [], False
    for p, at, row in replay(trace):
        if row[0] == "p":
            after_prefill = True
            continue
        if after_prefill:
            out += _errors_here(p, trace["costs"], at, row[1], row[5], row[6])
        after_prefill = False
    return out


def _errors_here(p: GoodputController, costs: list, at: int, pb: int, kv: int,
                 bs: int) -> list[dict]:
    ahead = [r for r in costs[at:at + AHEAD] if r[0] != "p" and r[6] == bs][2:-3]
    out = []
    for m, mode in MODES.items():
        clean = [r for r in ahead if r[0] == m and r[1] == pb and clean_step(r)]
        expected = p.step_time(mode, pb, kv)
        if len(clean) >= MIN_STEPS and expected:
            measured = statistics.median(r[2] for r in clean)
            steps_kv = int(statistics.median(r[5] for r in clean))
            at_steps = p.step_time(mode, pb, steps_kv) or expected
            out.append({"row": at, "mode": mode.value, "padded_bs": pb, "kv_tokens": kv,
                        "expected_s": expected, "measured_s": measured,
                        "error": expected / measured - 1, "steps_kv_tokens": steps_kv,
                        "expected_at_steps_s": at_steps,
                        "error_at_steps": at_steps / measured - 1})
    return out


def summary(errors: list[dict]) -> dict:
    out = {}
    for mode in ("spec", "decode"):
        e = [r["error"] for r in errors if r["mode"] == mode]
        if e:
            a = [abs(x) for x in e]
            at = [r["error_at_steps"] for r in errors if r["mode"] == mode]
            out[mode] = {"cells": len(e), "mean_abs": statistics.fmean(a),
                         "median_abs": statistics.median(a), "max_abs": max(a),
                         "mean_signed": statistics.fmean(e),
                         "mean_abs_at_steps": statistics.fmean(abs(x) for x in at),
                         "mean_signed_at_steps": statistics.fmean(at)}
    return out


def _print_rows(name: str, stats: dict) -> None:
    for mode, s in stats.items():
        print(f"| {name} | {mode} | {s['cells']} | {s['mean_abs']:.3f} | "
              f"{s['median_abs']:.3f} | {s['max_abs']:.3f} | {s['mean_signed']:+.3f} | "
              f"{s['mean_abs_at_steps']:.3f} | {s['mean_signed_at_steps']:+.3f} |")


def main(argv: Optional[list[str]] = None) -> int:
    args = trace_parser("estimate_error", __doc__, "out/estimate-error.json").parse_args(argv)
    result = {"command": command_line("python -m bench.sglang.estimate_error", argv),
              "traces": {}}
    got = read_each(args.traces, lambda trace: (trace.get("source"), cell_errors(trace)))
    if got is None:
        return 2
    print("| trace | mode | cells | mean abs error | median | max | mean signed | at the steps' "
          "context: mean abs | mean signed |")
    print("|---|---|---|---|---|---|---|---|---|")
    every: list[dict] = []
    for path, (source, errors) in got.items():
        every += errors
        stats = summary(errors)
        result["traces"][path] = {"source": source, "summary": stats,
                                  "cells": errors}
        _print_rows(Path(path).name, stats)
    result["summary"] = summary(every)
    if len(args.traces) > 1:
        _print_rows(f"all {len(args.traces)} traces", result["summary"])
    out = Path(args.out)
    write_json(result, out)
    png = _plot(result["traces"], out.with_suffix(".png"))
    print(f"wrote {out} and {png}")
    return 0


def _plot(traces: dict, path: Path) -> Path:
    series = [Series(f"{Path(name).name.split('.')[0]}, {mode}",
                     [c["padded_bs"] for c in t["cells"] if c["mode"] == mode],
                     [100 * c["error"] for c in t["cells"] if c["mode"] == mode], joined=False)
              for name, t in traces.items() for mode in ("spec", "decode")]
    return line_chart(path, "The controller's step time at a cell's first step against what "
                      "the cell measured", "padded batch size",
                      [Panel("error, % (expected / measured - 1)", [s for s in series if s.x],
                             lines=((0.0, ""),))], log2_x=True)


if __name__ == "__main__":
    sys.exit(main())
