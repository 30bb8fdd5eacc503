"""How long a policy-matrix call would run, from a matrix's own records: each cell's run seconds
per engine (its rounds' mean), times the rounds asked (at one round, a short cell's repeats),
plus a fixed cost per run (prompts, HTTP, the turn between engines) and the engines' start-up.
GPU time is scarce: plan a session's calls before making them.

    python -m bench.sglang.matrix_plan MATRIX.json --accept 1.5,2 --workload 256x256@1,4 ...
        [--rounds 3] [--engines dual,eagle3,plain] [--startup-s 195] [--per-run-s 0.2]
        [--budget-s 525] [--short-cell-s 2 --short-cell-runs 3]

Plain runs each workload's cells once per call (acceptance does not touch it), EAGLE-3 and the
worker once per accept length, as policy_matrix serves them. The estimate is set against the
call's --budget-s, which policy_matrix counts from before the engines start and past which it
starts no cell. Exits 1 where the estimate passes it, 2 where a cell has no record to estimate
from.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from bench.sglang.engine_child import MAX_RUNS
from bench.sglang.matrix_records import ENGINES, Repeats, Workload, workload_arg
from dual_graph_worker.core.argtypes import (OneLineParser, float_list, int_range, name_list,
                                             non_negative_float, positive_float)
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.jsonio import read_json_object

# The turn a run costs beyond its own seconds, and the engines' start-up together in a call that
# finds the machine cold: read from the matrix calls in results/README.md.
PER_RUN_S = 0.2
COLD_STARTUP_S = 195.0
RECORD_FIELDS = ("engine", "accept_len", "input_len", "output_len", "concurrency", "seconds")


class NoRecord(Exception):
    """No record estimates this (engine, accept, input, output, concurrency)."""


@dataclass(frozen=True)
class Plan:
    cells: tuple[tuple[str, float], ...]    # (engines at a cell, seconds over their runs)
    runs: int
    startup_s: float
    per_run_s: float

    @property
    def seconds(self) -> float:
        return self.startup_s + sum(s for _, s in self.cells) + self.runs * self.per_run_s


def run_seconds(records: Sequence) -> dict[tuple, float]:
    """(engine, accept, input, output, concurrency) -> one run's seconds (the latest record's
    mean over its rounds); ConfigError naming the first record that is no record."""
    out = {}
    for i, r in enumerate(records):
        if not isinstance(r, dict) or any(f not in r for f in RECORD_FIELDS) or \
                not isinstance(r["seconds"], (int, float)) or \
                not isinstance(r.get("runs_tok_s") or [], list) or \
                not isinstance(r.get("seconds_total") or 0, (int, float)):
            raise ConfigError(f"record {i} is no policy-matrix record (it needs "
                              f"{', '.join(RECORD_FIELDS)})")
        runs = len(r.get("runs_tok_s") or ()) or 1
        total = r.get("seconds_total")
        out[tuple(r[f] for f in RECORD_FIELDS[:-1])] = total / runs if total else r["seconds"]
    return out


def plan(seconds: dict[tuple, float], accepts: Sequence[float], workloads: Sequence[Workload],
         engines: Sequence[str], rounds: int, repeats: Repeats, startup_s: float,
         per_run_s: float) -> Plan:
    """The call's cells and seconds; NoRecord naming the first cell no record estimates."""
    cells, runs = [], 0

    def add(label: str, kinds: list[str], accept: Optional[float], w: Workload, c: int) -> None:
        nonlocal runs
        total = 0.0
        for e in kinds:
            key = (e, accept, w.input_len, w.output_len, c)
            if key not in seconds:
                raise NoRecord(key)
            # One round: a cell shorter than short_s runs `runs` times, as policy_matrix does.
            n = rounds if rounds > 1 or seconds[key] >= repeats.short_s else repeats.runs
            total += seconds[key] * n
            runs += n
        cells.append((label, total))

    others = [e for e in engines if e != "plain"]
    for w in workloads:
        for c in w.concurrency:
            if "plain" in engines:
                add(f"plain {w.name} C={c}", ["plain"], None, w, c)
            for accept in dict.fromkeys(accepts) if others else ():
                add(f"a{accept:g} {w.name} C={c}", others, accept, w, c)
    return Plan(tuple(cells), runs, startup_s, per_run_s)


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(prog="python -m bench.sglang.matrix_plan", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("matrix", help="a policy-matrix.json (a call's or a composite)")
    ap.add_argument("--accept", type=float_list, required=True, help="accept lengths, e.g. 1.5,2")
    ap.add_argument("--workload", type=workload_arg, action="append", required=True,
                    help="IN x OUT @ C,...; repeatable")
    ap.add_argument("--engines", type=name_list(ENGINES), default=list(ENGINES),
                    help="comma-separated, of " + ", ".join(ENGINES))
    ap.add_argument("--rounds", type=int_range(1, MAX_RUNS), default=1,
                    help="as policy_matrix's (default %(default)s)")
    ap.add_argument("--short-cell-s", type=non_negative_float, default=Repeats().short_s,
                    help="as policy_matrix's, at one round (default %(default)s)")
    ap.add_argument("--short-cell-runs", type=int_range(1, MAX_RUNS), default=Repeats().runs,
                    help="as policy_matrix's, at one round (default %(default)s)")
    ap.add_argument("--startup-s", type=positive_float, default=COLD_STARTUP_S,
                    help="the engines' start-up (default %(default)s: a cold machine)")
    ap.add_argument("--per-run-s", type=positive_float, default=PER_RUN_S,
                    help="each run's cost beyond its own seconds (default %(default)s)")
    ap.add_argument("--budget-s", type=positive_float, default=525.0,
                    help="the call's policy_matrix --budget-s (default %(default)s)")
    args = ap.parse_args(argv)
    try:
        matrix = read_json_object(args.matrix, "the matrix",
                                  "pass a policy-matrix.json that policy_matrix wrote")
        records = matrix.get("records")
        p = plan(run_seconds(records if isinstance(records, list) else [records]),
                 args.accept, args.workload, args.engines,
                 args.rounds, Repeats(args.short_cell_s, args.short_cell_runs),
                 args.startup_s, args.per_run_s)
    except ConfigError as err:
        print(f"error: {args.matrix}: {err}", file=sys.stderr)
        return 2
    except NoRecord as err:
        engine, accept, i, o, c = err.args[0]
        at = "" if accept is None else f" at accept {accept:g}"
        print(f"error: {args.matrix} has no {engine} record{at} {i}x{o} C={c} to estimate it "
              "from; plan that cell from a matrix that ran it", file=sys.stderr)
        return 2
    print("| engines at a cell | seconds (every run) |")
    print("|---|---|")
    for name, s in p.cells:
        print(f"| {name} | {s:.1f} |")
    cells = sum(s for _, s in p.cells)
    print(f"cells {cells:.0f} s + {p.runs} runs x {p.per_run_s:g} s + start-up "
          f"{p.startup_s:.0f} s = {p.seconds:.0f} s against --budget-s {args.budget_s:.0f} "
          f"(the median cell {statistics.median(s for _, s in p.cells):.1f} s)")
    return 1 if p.seconds > args.budget_s else 0


if __name__ == "__main__":
    sys.exit(main())
