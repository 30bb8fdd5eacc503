"""How each mode's first steps in a worker process read against its settled ones, in GPU runs'
batch costs: per trace (one process) and mode, the mode's clean steps (no catch-up, no carried
launch) numbered by how many steps of that mode the process had run, each over the median of
its key's clean steps from SETTLED on at contexts within 25%; per window of WINDOW such steps,
the median of those ratios. How long speculation runs slow after a process starts is what the
controller's warm-up pricing (step_times._MODE_WARM_STEPS) is read from; decode is the control.

    python -m bench.sglang.mode_warmup TRACE.json.gz ... [--out FILE.json]

Prints a table by window, writes FILE.json and a plot beside it (FILE.png).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np

from bench.plots import Panel, Series, line_chart
from bench.sglang.traces import MODES, clean_step, read_each, trace_parser
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.provenance import checkout_commit, command_line

WINDOW = 8
WINDOWS = 16                 # the first 128 steps of each mode
SETTLED = 256
NEAR = 0.25
MIN_REFERENCE = 10
SLOW = 1.10


def window_ratios(costs: list, mode: str) -> list[Optional[float]]:
    """Per window of the process's first WINDOWS x WINDOW steps of `mode`: the median of its
    clean steps' ratios to their key's settled median nearby (None: none had a reference)."""
    steps = list(enumerate(r for r in costs if r[0] == mode))
    settled = defaultdict(list)
    for n, row in steps:
        if n >= SETTLED and clean_step(row):
            settled[row[1]].append((row[5], row[2]))
    windows: list[list[float]] = [[] for _ in range(WINDOWS)]
    for n, row in steps[:WINDOW * WINDOWS]:
        if not clean_step(row):
            continue
        kv = row[5]
        ref = [s for x, s in settled[row[1]] if abs(x - kv) <= NEAR * max(kv, 1)]
        if len(ref) >= MIN_REFERENCE:
            windows[n // WINDOW].append(row[2] / statistics.median(ref))
    return [statistics.median(w) if w else None for w in windows]


def by_window(per_trace: dict[str, list[Optional[float]]]) -> list[dict]:
    out = []
    for k in range(WINDOWS):
        vals = [w[k] for w in per_trace.values() if w[k] is not None]
        if not vals:
            continue
        out.append({"steps": f"{k * WINDOW}-{(k + 1) * WINDOW - 1}", "first": k * WINDOW,
                    "traces": len(vals), "median": statistics.median(vals),
                    "p90": float(np.percentile(vals, 90)),
                    "share_slow": sum(v > SLOW for v in vals) / len(vals)})
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = trace_parser("mode_warmup", __doc__, "out/mode-warmup.json")
    args = ap.parse_args(argv)
    traces = read_each(args.traces,
                       lambda t: {m: window_ratios(t["costs"], m) for m in MODES})
    if traces is None:
        return 2
    result = {"command": command_line("python -m bench.sglang.mode_warmup", argv),
              "commit": checkout_commit(), "window": WINDOW,
              "settled_from": SETTLED, "slow": SLOW, "modes": {}}
    series = []
    for m, mode in MODES.items():
        per = {p: w[m] for p, w in traces.items()}
        per = {p: w for p, w in per.items() if any(v is not None for v in w)}
        rows = by_window(per)
        result["modes"][mode.value] = {"traces": per, "by_window": rows}
        print(f"{mode.value}: {len(per)} traces with settled steps; window = {WINDOW} steps of "
              f"the mode, ratio = step / its key's settled median nearby")
        print("| steps | traces | median | p90 | share > %.2f |" % SLOW)
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['steps']} | {r['traces']} | {r['median']:.3f} | {r['p90']:.3f} | "
                  f"{r['share_slow']:.0%} |")
        xs = [r["first"] for r in rows]
        series += [Series(f"{mode.value}, median", xs, [r["median"] for r in rows]),
                   Series(f"{mode.value}, p90", xs, [r["p90"] for r in rows], dashed=True)]
    out = Path(args.out)
    write_json(result, out)
    line_chart(out.with_suffix(".png"), "Each mode's first steps in a process over its settled "
               "steps (GPU traces)", "the mode's steps run in the process (window start)",
               [Panel("step / settled median", series)])
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
