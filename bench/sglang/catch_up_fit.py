"""The controller's catch-up cost over a GPU run's own batch costs: a replay trace (`step_costs
--trace`) fed to a controller by `traces.replay`, as estimate_error's is (open loop: every step in
the mode it ran), the catch-up line (fixed seconds and seconds per draft token) read after every
exchange. A rate far above the draft's own (~0.6 us a token on the H200) prices re-measurements of
speculation that many times too dear. Each catch-up's price (`catch_up_seconds` just before it) is
also set against what it took: its step's seconds over its size's median clean step in the trace,
plus the excess of the step before it where that one held its launch. A trace whose worker filled
the draft's K/V alone (`catch_up_work`) has those catch-ups, and their own line, apart.

    python -m bench.sglang.catch_up_fit TRACE.json.gz ... [--top 3] [--out FILE.json]

Prints the steepest fits and the prices against what was taken; writes every fit and price as
FILE.json, a plot of the fits beside it (FILE.png) and one of the prices (FILE-prices.png). Run
it from another tree to compare.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Optional

from bench.plots import Panel, Series, line_chart
from bench.sglang.traces import (clean_step, exchanged_after, read_each, replay, trace_parser,
                                 trace_work)
from dual_graph_worker.core.argtypes import int_range
from dual_graph_worker.core.controller import GoodputController
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.provenance import checkout_commit, command_line

# A size's median step needs this many clean steps in the trace; catch-ups from this many tokens
# are tabled apart (a re-measurement's or a switch's at a large batch).
MIN_CLEAN = 5
LARGE = 8192


def fit_history(trace: dict) -> list[dict]:
    """(step, fixed ms, us per token) after each exchange where the line moved."""
    out: list[dict] = []
    steps, p = 0, None
    for p, _, row in replay(trace):
        if row[0] != "p":
            if steps and exchanged_after(steps, p.sync_every):   # the exchange just made is in
                _read_fit(out, p, steps)
            steps += 1
    if p is not None:
        _read_fit(out, p, steps)                          # an exchange after the last row
    return out


def _read_fit(out: list[dict], p: GoodputController, step: int) -> None:
    costs = p.estimates().batch_costs
    kv = costs.kv_catch_up_s_per_token
    now = {"step": step, "fixed_ms": round(costs.catch_up_fixed_s * 1e3, 3),
           "us_per_token": round(costs.catch_up_s_per_token * 1e6, 2),
           "kv_us_per_token": None if kv is None else round(kv * 1e6, 2)}
    if not out or {k: v for k, v in out[-1].items() if k != "step"} != \
            {k: v for k, v in now.items() if k != "step"}:
        out.append(now)


def price_errors(trace: dict) -> list[dict]:
    """Each catch-up with a measured size: its tokens, the controller's price just before it and
    the seconds it took (over its size's median clean step, plus a held launch's excess; at or
    under 0 for some small ones, whose noise outweighs them)."""
    medians = _clean_medians(trace["costs"])
    work = trace_work(trace)
    out, last = [], None
    for p, _, row in replay(trace):
        if row[0] != "p" and row[3] > 0:
            took = _taken(row, last, medians)
            if took is not None:             # its size (and a held launch's) measured
                out.append({"tokens": row[3], "priced_s": float(p.catch_up_seconds(row[3])),
                            "taken_s": took,
                            "kv_only": work is not None and work.fills(row[3])})
        last = row
    return out


def _clean_medians(rows: list) -> dict[tuple, float]:
    steps: dict[tuple, list[float]] = {}
    for row in rows:
        if row[0] != "p" and clean_step(row):
            steps.setdefault((row[0], row[1]), []).append(row[2])
    return {key: statistics.median(s) for key, s in steps.items() if len(s) >= MIN_CLEAN}


def _taken(row: list, last: Optional[list], medians: dict) -> Optional[float]:
    step = medians.get((row[0], row[1]))
    if step is None:
        return None
    took = row[2] - step
    if last is not None and last[0] != "p" and last[4]:          # it held this one's launch
        before = medians.get((last[0], last[1]))
        if before is None:
            return None
        took += last[2] - before
    return took


def price_summary(prices: list[dict]) -> dict:
    """Priced over taken, over the catch-ups that took more than 0 s: the median, the share
    under half and over twice, and their sums' ratio; with how many took 0 s or less (left
    out) and how many were priced at 0."""
    taken = [r for r in prices if r["taken_s"] > 0]
    ratios = [r["priced_s"] / r["taken_s"] for r in taken]
    counts = {"catch_ups": len(ratios), "took_nothing": len(prices) - len(taken),
              "priced_nothing": sum(r["priced_s"] <= 0 for r in prices)}
    if not ratios:
        return counts | dict.fromkeys(("median", "under_half", "over_twice", "sums"))
    n = len(ratios)
    return counts | {"median": round(statistics.median(ratios), 3),
                     "under_half": round(sum(x < 0.5 for x in ratios) / n, 3),
                     "over_twice": round(sum(x > 2 for x in ratios) / n, 3),
                     "sums": round(sum(r["priced_s"] for r in taken)
                                   / sum(r["taken_s"] for r in taken), 3)}


def _print_prices(prices: dict[str, list[dict]]) -> dict:
    every = [r for rows in prices.values() for r in rows]
    bands = [(f"< {LARGE} tokens", lambda r: r["tokens"] < LARGE and not r.get("kv_only")),
             (f">= {LARGE} tokens", lambda r: r["tokens"] >= LARGE and not r.get("kv_only"))]
    if any(r.get("kv_only") for r in every):
        bands.append(("K/V only", lambda r: r.get("kv_only")))
    table = {label: price_summary([r for r in every if keep(r)]) for label, keep in bands}
    print(f"\nEach catch-up's price against what it took, over {len(prices)} traces:")
    print("| catch-ups | n | median priced / taken | under half | over twice | "
          "sum priced / sum taken | took <= 0 s (left out) | priced 0 |")
    print("|---|---|---|---|---|---|---|---|")
    for label, s in table.items():
        print(f"| {label} | {s['catch_ups']} | {s['median']} | {s['under_half']} | "
              f"{s['over_twice']} | {s['sums']} | {s['took_nothing']} | {s['priced_nothing']} |")
    return table


def _plot(histories: dict[str, list[dict]], path: Path) -> Path:
    def series(field: str) -> list[Series]:
        return [Series(Path(name).name.split(".")[0], [h["step"] for h in history],
                       [h[field] for h in history]) for name, history in histories.items()]

    return line_chart(path, "The controller's catch-up fit as each trace went on", "step",
                      [Panel("us per caught-up token", series("us_per_token")),
                       Panel("fixed ms a catch-up", series("fixed_ms"))])


def _plot_prices(prices: dict[str, list[dict]], path: Path) -> Path:
    every = [r for rows in prices.values() for r in rows]
    shown = sorted((r for r in every if r["taken_s"] > 0 and r["priced_s"] > 0),
                   key=lambda r: r["tokens"])
    ratio = Series("a catch-up", [r["tokens"] for r in shown],
                   [r["priced_s"] / r["taken_s"] for r in shown], joined=False)
    return line_chart(path, f"Each catch-up's price against what it took ({len(prices)} traces, "
                      f"open loop; {len(every) - len(shown)} priced 0 or taking <= 0 s not shown)",
                      "catch-up tokens",
                      [Panel("priced / taken", [ratio], log_y=True, lines=((1.0, "exact"),))],
                      log2_x=True)


def main(argv: Optional[list[str]] = None) -> int:
    ap = trace_parser("catch_up_fit", __doc__, "out/catch-up-fit.json")
    ap.add_argument("--top", type=int_range(1), default=3,
                    help="the steepest fits listed per trace")
    args = ap.parse_args(argv)
    got = read_each(args.traces, lambda trace: (fit_history(trace), price_errors(trace)))
    if got is None:
        return 2
    histories = {path: history for path, (history, _) in got.items()}
    prices = {path: priced for path, (_, priced) in got.items()}
    print("| trace | fits | steepest us/token (step, fixed ms) | K/V-only line, last us/token |")
    print("|---|---|---|---|")
    for path, history in histories.items():
        steep = sorted(history, key=lambda h: -h["us_per_token"])[:args.top]
        kv = next((h["kv_us_per_token"] for h in reversed(history)
                   if h["kv_us_per_token"] is not None), None)
        print(f"| {Path(path).name} | {len(history)} | "
              + ", ".join(f"{h['us_per_token']:.2f} ({h['step']}, {h['fixed_ms']:.2f})"
                          for h in steep) + f" | {'-' if kv is None else f'{kv:.2f}'} |")
    summary = _print_prices(prices)
    out = Path(args.out)
    write_json({"command": command_line("python -m bench.sglang.catch_up_fit", argv),
                "commit": checkout_commit(), "histories": histories, "prices": prices,
                "price_summary": summary}, out)
    png = _plot(histories, out.with_suffix(".png"))
    priced = _plot_prices(prices, out.with_name(f"{out.stem}-prices.png"))
    print(f"wrote {out}, {png} and {priced}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
