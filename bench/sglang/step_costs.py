"""Measured step costs from a worker's step log (DGW_STEP_LOG "cost" events), grouped by mode,
padded batch size and the step's place in its run since the last switch, with the steps whose
cost also held the next batch's launch (a switch, a catch-up, a prefill: overlap scheduling)
apart: whether steps near a switch cost more than the steady ones, and by how much.

    python -m bench.sglang.step_costs STEP_LOG [--out FILE.md]
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional

from dual_graph_worker.core.step_log import read_step_events

PLACES = ("1st", "2nd-4th", "5th+", "carries next")


def _place(index_in_run: int) -> str:
    return PLACES[0] if index_in_run == 0 else PLACES[1] if index_in_run < 4 else PLACES[2]


def group_costs(events: Iterable[dict]) -> dict[tuple[str, int, str], list[float]]:
    """(mode, padded bs, place in run) -> step seconds, catch-up steps left out."""
    out: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    last_mode, run = None, 0
    for e in events:
        if e.get("event") != "cost" or e.get("kind") != "StepTime":
            continue
        mode = e["mode"]
        run = run + 1 if mode == last_mode else 0
        last_mode = mode
        if not e.get("catch_up_tokens"):
            place = PLACES[3] if e.get("carries_next") else _place(run)
            out[(mode, int(e["padded_bs"]), place)].append(float(e["seconds"]))
    return out


def report(groups: dict[tuple[str, int, str], list[float]]) -> str:
    lines = ["| mode | padded bs | " + " | ".join(f"{p}: median ms (n)" for p in PLACES) + " |",
             "|---|---|" + "---|" * len(PLACES)]
    for mode, bs in sorted({(m, b) for m, b, _ in groups}):
        cells = []
        for p in PLACES:
            xs = groups.get((mode, bs, p), [])
            cells.append(f"{1e3 * statistics.median(xs):.2f} ({len(xs)})" if xs else "-")
        lines.append(f"| {mode} | {bs} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sglang.step_costs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step_log")
    ap.add_argument("--out", help="also write the table here")
    args = ap.parse_args(argv)
    if not Path(args.step_log).is_file():
        ap.error(f"{args.step_log}: no such step log; run the worker with DGW_STEP_LOG=PATH")
    text = report(group_costs(read_step_events(args.step_log)))
    if args.out:
        Path(args.out).write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
