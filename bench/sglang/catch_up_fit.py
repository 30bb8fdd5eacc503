"""The controller's catch-up cost over a GPU run's own batch costs: a replay trace (`step_costs
--trace`) fed to a controller as `estimate_error` does (open loop: every step in the mode it
ran), the catch-up line (fixed seconds and seconds per draft token) read after every exchange.
A rate far above the draft's own (~0.6 us a token on the H200) prices re-measurements of
speculation that many times too dear.

    python -m bench.sglang.catch_up_fit TRACE.json.gz ... [--top 3] [--out FILE.json]

Prints the steepest fits; writes every fit as FILE.json and a plot beside it (FILE.png).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from bench.plots import Panel, Series, line_chart
from bench.sglang.estimate_error import read_each, replay
from dual_graph_worker.core.argtypes import OneLineParser, int_range, output_file
from dual_graph_worker.core.controller import GoodputController
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.provenance import command_line


def fit_history(trace: dict) -> list[dict]:
    """(step, fixed ms, us per token) after each exchange where the line moved."""
    out: list[dict] = []
    steps, p = 0, None
    for p, _, row in replay(trace):
        if row[0] != "p":
            if steps and steps % p.sync_every == 0:      # the exchange just made is in
                _read_fit(out, p, steps)
            steps += 1
    if p is not None:
        _read_fit(out, p, steps)                          # an exchange after the last row
    return out


def _read_fit(out: list[dict], p: GoodputController, step: int) -> None:
    costs = p.estimates().batch_costs
    now = {"step": step, "fixed_ms": round(costs.catch_up_fixed_s * 1e3, 3),
           "us_per_token": round(costs.catch_up_s_per_token * 1e6, 2)}
    if not out or (out[-1]["fixed_ms"], out[-1]["us_per_token"]) != \
            (now["fixed_ms"], now["us_per_token"]):
        out.append(now)


def _plot(histories: dict[str, list[dict]], path: Path) -> Path:
    def series(field: str) -> list[Series]:
        return [Series(Path(name).name.split(".")[0], [h["step"] for h in history],
                       [h[field] for h in history]) for name, history in histories.items()]

    return line_chart(path, "The controller's catch-up fit as each trace went on", "step",
                      [Panel("us per caught-up token", series("us_per_token")),
                       Panel("fixed ms a catch-up", series("fixed_ms"))])


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(prog="python -m bench.sglang.catch_up_fit", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", help="replay traces (step_costs --trace)")
    ap.add_argument("--top", type=int_range(1), default=3,
                    help="the steepest fits listed per trace")
    ap.add_argument("--out", type=output_file, default="out/catch-up-fit.json",
                    help="every trace's fit history as JSON (and a plot beside it, .png)")
    args = ap.parse_args(argv)
    histories = read_each(args.traces, fit_history)
    if histories is None:
        return 2
    print("| trace | fits | steepest us/token (step, fixed ms) |")
    print("|---|---|---|")
    for path, history in histories.items():
        steep = sorted(history, key=lambda h: -h["us_per_token"])[:args.top]
        print(f"| {Path(path).name} | {len(history)} | "
              + ", ".join(f"{h['us_per_token']:.2f} ({h['step']}, {h['fixed_ms']:.2f})"
                          for h in steep) + " |")
    out = Path(args.out)
    write_json({"command": command_line("python -m bench.sglang.catch_up_fit", argv),
                "histories": histories}, out)
    png = _plot(histories, out.with_suffix(".png"))
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
