"""How a batch's first steps after a prefill read against its later ones, in GPU runs' batch
costs: per batch (the steps between two prefills, at least 10 of one key), each of its first
10 steps over the median of its clean steps 4-10 (no catch-up, no carried launch). What the
controller's sample intake holds back at a batch's start is read from this.

    python -m bench.sglang.early_steps TRACE.json.gz ... [--out FILE.json]

Prints a table by position, writes FILE.json and a plot beside it (FILE.png).
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Optional

from bench.plots import Panel, Series, line_chart
from bench.sglang.traces import clean_step, read_each, trace_parser
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.provenance import checkout_commit, command_line

POSITIONS = 10
SHORT = 0.9


def batch_ratios(costs: list) -> list[list[float]]:
    """Per batch of POSITIONS or more steps of its first step's key after a prefill: each of
    its first POSITIONS steps of that key over the median of the clean ones from the fourth."""
    out = []
    runs = itertools.groupby(costs, key=lambda row: row[0] == "p")
    for n, (prefill, rows) in enumerate(runs):
        if prefill or not n:                    # steps before the first prefill: no batch start
            continue
        steps = list(rows)
        key = steps[0][:2]
        same = [s for s in steps if s[:2] == key][:POSITIONS]
        clean = [s[2] for s in same[3:] if clean_step(s)]
        if len(same) == POSITIONS and len(clean) >= 4:
            ref = statistics.median(clean)
            out.append([s[2] / ref for s in same])
    return out


def by_position(batches: list[list[float]]) -> list[dict]:
    return [{"position": k, "batches": len(batches),
             "median": statistics.median(b[k] for b in batches),
             "share_short": sum(b[k] < SHORT for b in batches) / len(batches)}
            for k in range(POSITIONS)] if batches else []


def main(argv: Optional[list[str]] = None) -> int:
    ap = trace_parser("early_steps", __doc__, "out/early-steps.json")
    args = ap.parse_args(argv)
    got = read_each(args.traces, lambda trace: batch_ratios(trace["costs"]))
    if got is None:
        return 2
    batches = [b for each in got.values() for b in each]
    rows = by_position(batches)
    print(f"| position after the prefill | batches | median / later median | share under {SHORT} |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['position']} | {r['batches']} | {r['median']:.3f} | {r['share_short']:.2f} |")
    out = Path(args.out)
    write_json({"command": command_line("python -m bench.sglang.early_steps", argv),
                "commit": checkout_commit(), "traces": args.traces, "positions": rows}, out)
    if rows:
        xs = [r["position"] for r in rows]
        line_chart(out.with_suffix(".png"), "A batch's steps after its prefill, over its later ones",
                   "step after the prefill (0: the first)",
                   [Panel("median ratio", [Series("median", xs, [r["median"] for r in rows])]),
                    Panel(f"share under {SHORT}",
                          [Series("share", xs, [r["share_short"] for r in rows])])],
                   integer_x=True)
    print(f"wrote {out}" + (f" and {out.with_suffix('.png')}" if rows else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
