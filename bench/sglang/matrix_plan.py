"""How long a policy-matrix call would run, from a matrix's own records: each cell's run seconds
per engine (its rounds' mean), times the rounds asked, plus a fixed cost per run (prompts,
HTTP, the turn between engines) and the engines' start-up. GPU time is scarce: plan a session's
calls before making them, each under the device's per-call limit.

    python -m bench.sglang.matrix_plan MATRIX.json --accept 1.5,2 --workload 256x256@1,4 ...
        [--rounds 3] [--engines dual,eagle3,plain] [--startup-s 195] [--per-run-s 0.2]
        [--limit-s 555]

Plain runs each workload's cells once per call (acceptance does not touch it), EAGLE-3 and the
worker once per accept length, as policy_matrix serves them. Exits 1 where the estimate passes
--limit-s, 2 where a cell has no record to estimate from.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from bench.sglang.matrix_records import Workload
from bench.sglang.policy_matrix import ENGINES
from dual_graph_worker.core.argtypes import OneLineParser, int_range, name_list, positive_float
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.jsonio import read_json_object

# The turn a run costs beyond its own seconds (H200 run 26: each call's span over its records'
# seconds, 19-21 s over ~100 runs), and the engines' start-up together in a call that finds the
# machine cold (m70: 169-196 s; a warm one's, m71: 69-91 s).
PER_RUN_S = 0.2
COLD_STARTUP_S = 195.0


@dataclass(frozen=True)
class Plan:
    cells: list[tuple[str, float]]          # (cell, seconds over every engine and round)
    runs: int
    startup_s: float
    per_run_s: float

    @property
    def seconds(self) -> float:
        return self.startup_s + sum(s for _, s in self.cells) + self.runs * self.per_run_s


def run_seconds(records: list[dict]) -> dict[tuple, float]:
    """(engine, accept, input, output, concurrency) -> one run's seconds (the latest record's
    mean over its rounds)."""
    out = {}
    for r in records:
        runs = len(r.get("runs_tok_s") or ()) or 1
        total = r.get("seconds_total")
        out[(r["engine"], r["accept_len"], r["input_len"], r["output_len"], r["concurrency"])] = \
            total / runs if total else r["seconds"]
    return out


def plan(seconds: dict[tuple, float], accepts: Sequence[float], workloads: Sequence[Workload],
         engines: Sequence[str], rounds: int, startup_s: float, per_run_s: float) -> Plan:
    """The call's cells and seconds; KeyError naming the first cell no record estimates."""
    cells, runs = [], 0
    for w in workloads:
        for c in w.concurrency:
            for accept in accepts if any(e != "plain" for e in engines) else (None,):
                kinds = [e for e in engines if e != "plain"]
                if "plain" in engines and accept == accepts[0]:
                    kinds.append("plain")
                total = 0.0
                for e in kinds:
                    key = (e, None if e == "plain" else accept, w.input_len, w.output_len, c)
                    if key not in seconds:
                        raise KeyError(key)
                    total += seconds[key] * rounds
                runs += len(kinds) * rounds
                cells.append((f"a{accept:g} {w.name} C={c}", total))
    return Plan(cells, runs, startup_s, per_run_s)


def _accepts(text: str) -> list[float]:
    try:
        return [float(a) for a in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"accept lengths are numbers like 1.5,2; got {text!r}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(prog="python -m bench.sglang.matrix_plan", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("matrix", help="a policy-matrix.json (a call's or a composite)")
    ap.add_argument("--accept", type=_accepts, required=True, help="accept lengths, e.g. 1.5,2")
    ap.add_argument("--workload", action="append", required=True,
                    help="IN x OUT @ C,...; repeatable")
    ap.add_argument("--engines", type=name_list(ENGINES), default=list(ENGINES),
                    help="comma-separated, of " + ", ".join(ENGINES))
    ap.add_argument("--rounds", type=int_range(1, 20), default=3)
    ap.add_argument("--startup-s", type=positive_float, default=COLD_STARTUP_S,
                    help="the engines' start-up (default %(default)s: a cold machine)")
    ap.add_argument("--per-run-s", type=positive_float, default=PER_RUN_S,
                    help="each run's cost beyond its own seconds (default %(default)s)")
    ap.add_argument("--limit-s", type=positive_float, default=555.0,
                    help="the call's limit (default %(default)s: GPU_PACK_S)")
    args = ap.parse_args(argv)
    engines = args.engines
    try:
        matrix = read_json_object(args.matrix, "the matrix",
                                  "pass a policy-matrix.json that policy_matrix wrote")
        p = plan(run_seconds(matrix.get("records", [])), args.accept,
                 [Workload.parse(w) for w in args.workload], engines, args.rounds,
                 args.startup_s, args.per_run_s)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyError as err:
        engine, accept, i, o, c = err.args[0]
        print(f"error: {args.matrix} has no {engine} record at accept {accept} {i}x{o} C={c} "
              "to estimate it from; plan that cell from a matrix that ran it", file=sys.stderr)
        return 2
    print("| cell | seconds (every engine and round) |")
    print("|---|---|")
    for name, s in p.cells:
        print(f"| {name} | {s:.1f} |")
    cells = sum(s for _, s in p.cells)
    print(f"cells {cells:.0f} s + {p.runs} runs x {p.per_run_s:g} s + start-up "
          f"{p.startup_s:.0f} s = {p.seconds:.0f} s against the limit {args.limit_s:.0f} s "
          f"(the median cell {statistics.median(s for _, s in p.cells):.1f} s)")
    return 1 if p.seconds > args.limit_s else 0


if __name__ == "__main__":
    sys.exit(main())
