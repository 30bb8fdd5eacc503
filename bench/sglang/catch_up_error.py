"""How far the controller's price of each catch-up lies from what it cost, on a GPU run's own
batch costs: each trace (`step_costs --trace`) is replayed as `estimate_error` replays it; at
each step that caught the draft up, the controller's price of a catch-up of its tokens (as of
the last exchange) is set against the step's excess over the controller's expected step of its
mode, size and context, plus the previous step's where that step held this one's launch (the
catch-up ran then), as the controller's intake counts it. Catch-ups that fill the
draft's K/V alone (the trace's `catch_up_work`) are summarised apart from the whole layer's.
Open loop, as estimate_error; run it from another tree to compare.

    python -m bench.sglang.catch_up_error TRACE.json.gz ... [--out FILE.json]

Writes FILE.json and a plot beside it (FILE.png): priced against measured, each catch-up.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Optional

from bench.plots import Panel, Series, line_chart
from bench.sglang.estimate_error import MODES, read_each, replay, trace_parser
from dual_graph_worker.core.batch_costs import CatchUpWork
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.provenance import command_line

BANDS = ("whole layer", "K/V only")


def catch_ups(trace: dict) -> list[dict]:
    """One record per step that caught the draft up, after the controller has a step time for
    its key."""
    work = trace.get("catch_up_work")
    work = work and CatchUpWork(**work)
    out, carry = [], 0.0
    for p, at, row in replay(trace):
        if row[0] == "p":
            carry = 0.0
            continue
        mode, pb, seconds, tokens, carries, kv, _ = row
        expected = p.step_time(MODES[mode], pb, kv)
        excess = seconds - expected if expected else None
        if tokens and excess is not None:
            kv_only = work is not None and work.split(tokens)[0] > 0
            out.append({"row": at, "tokens": tokens, "band": BANDS[kv_only],
                        "priced_s": p.catch_up_seconds(tokens), "measured_s": excess + carry,
                        "draft_prefill_s_per_token": p.draft_prefill_s_per_token()})
        carry = excess if carries and excess is not None else 0.0
    return out


def summary(records: list[dict]) -> dict:
    out = {}
    for band in BANDS:
        rs = [r for r in records if r["band"] == band and r["measured_s"] > 0]
        if rs:
            ratios = [r["priced_s"] / r["measured_s"] for r in rs]
            out[band] = {"catch_ups": len(rs), "tokens": sum(r["tokens"] for r in rs),
                         "median_priced_over_measured": statistics.median(ratios),
                         "sum_priced_over_sum_measured": sum(r["priced_s"] for r in rs)
                         / sum(r["measured_s"] for r in rs)}
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = trace_parser("catch_up_error", __doc__, "out/catch-up-error.json").parse_args(argv)
    got = read_each(args.traces, catch_ups)
    if got is None:
        return 2
    result = {"command": command_line("python -m bench.sglang.catch_up_error", argv),
              "traces": {}}
    print("| trace | catch-ups | n | tokens | priced / measured: median | sum over sum |")
    print("|---|---|---|---|---|---|")
    for path, records in got.items():
        stats = summary(records)
        result["traces"][path] = {"summary": stats, "catch_ups": records}
        for band, s in stats.items():
            print(f"| {Path(path).name} | {band} | {s['catch_ups']} | {s['tokens']} | "
                  f"{s['median_priced_over_measured']:.2f} | "
                  f"{s['sum_priced_over_sum_measured']:.2f} |")
    out = Path(args.out)
    write_json(result, out)
    png = _plot(result["traces"], out.with_suffix(".png"))
    print(f"wrote {out} and {png}")
    return 0


def _plot(traces: dict, path: Path) -> Path:
    series = []
    for name, t in traces.items():
        for band in BANDS:
            rs = [r for r in t["catch_ups"] if r["band"] == band and r["measured_s"] > 0]
            series.append(Series(f"{Path(name).name.split('.')[0]}, {band}",
                                 [r["tokens"] for r in rs],
                                 [r["priced_s"] / r["measured_s"] for r in rs], joined=False))
    return line_chart(path, "The controller's price of each catch-up against its measured cost",
                      "tokens caught up",
                      [Panel("priced / measured", [s for s in series if s.x],
                             lines=((1.0, ""),))], log2_x=True)


if __name__ == "__main__":
    sys.exit(main())
