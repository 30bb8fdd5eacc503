"""Two versions of the worker's per-step host path, side by side: `host_cost` run in each of two
checkouts in turn, `--rounds` times, each run its own process (a version cannot be imported
beside another). On a shared host a run's figures drift 0.5-2x from one run to the next, so a
version is judged by the ratios of adjacent runs, not by one run. Prints each part's medians and
the B/A ratio per pair, writes JSON and a plot.

    python -m bench.sglang.host_cost_ab A_DIR B_DIR [--rounds 8] [--bs 1,16] [--steps 400]
                                        [--gap-ms 6] [--out out/host-cost-ab]

A_DIR, B_DIR: checkouts of the two versions (e.g. `git worktree add /tmp/a REF`). --gap-ms
sleeps before each step, as a GPU step's wait would: the path then meets cold caches. Each
checkout's `host_cost` uses its own graph lists: where an older one's spec pool ends below a
batch size, that row times the decode path and is no match for the other's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from dual_graph_worker.core.argtypes import (OneLineParser, int_list, int_range,
                                             non_negative_float, output_dir)
from dual_graph_worker.core.errors import DualGraphError, report_user_errors
from dual_graph_worker.core.provenance import command_line

PARTS = ("before_launch_us", "verify_hook_us", "result_processed_us", "total_us",
         "total_mean_us")


def _run(tree: Path, bs: str, steps: int, gap_ms: float) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "host-cost.json"
        done = subprocess.run([sys.executable, "-m", "bench.sglang.host_cost", "--bs", bs,
                               "--steps", str(steps), "--gap-ms", str(gap_ms), "--out", str(out)],
                              cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                              capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise DualGraphError(f"host_cost in {tree} exited with {done.returncode}: {last}; "
                                 "run it there alone to see why")
        return json.loads(out.read_text())["rows"]


def summary(runs: dict[str, list[list[dict]]]) -> list[dict]:
    """Per batch size and part: each version's median over its runs, and the median and range
    of B/A over adjacent pairs."""
    rows = []
    for k, row in enumerate(runs["a"][0]):
        for part in PARTS:
            a = [r[k][part] for r in runs["a"]]
            b = [r[k][part] for r in runs["b"]]
            ratios = [y / x for x, y in zip(a, b)]
            rows.append({"bs": row["bs"], "part": part, "a_median": statistics.median(a),
                         "b_median": statistics.median(b),
                         "ratio_median": statistics.median(ratios),
                         "ratio_min": min(ratios), "ratio_max": max(ratios)})
    return rows


def _plot(rows: list[dict], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    labels = [f"bs {r['bs']}\n{r['part'].removesuffix('_us')}" for r in rows]
    x = range(len(rows))
    ax.bar(x, [r["ratio_median"] for r in rows], color="tab:blue")
    ax.errorbar(x, [r["ratio_median"] for r in rows],
                yerr=[[r["ratio_median"] - r["ratio_min"] for r in rows],
                      [r["ratio_max"] - r["ratio_median"] for r in rows]],
                fmt="none", color="black", capsize=3)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(x), labels, fontsize=6)
    ax.set_ylabel("B / A (adjacent runs)")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[list[str]] = None) -> int:
    return report_user_errors(_main, argv)


def _main(argv: Optional[list[str]]) -> int:
    ap = OneLineParser(prog="python -m bench.sglang.host_cost_ab", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a_dir", type=Path)
    ap.add_argument("b_dir", type=Path)
    ap.add_argument("--rounds", type=int_range(2), default=8)
    ap.add_argument("--bs", type=int_list, default=[1, 16],
                    help="batch sizes, comma-separated (default 1,16)")
    ap.add_argument("--steps", type=int_range(10), default=400)
    ap.add_argument("--gap-ms", type=non_negative_float, default=6.0)
    ap.add_argument("--out", type=output_dir, default="out/host-cost-ab")
    args = ap.parse_args(argv)
    for d in (args.a_dir, args.b_dir):
        if not (d / "bench" / "sglang" / "host_cost.py").exists():
            print(f"error: {d} is no checkout of this project (no bench/sglang/host_cost.py); "
                  "make one with `git worktree add DIR REF`", file=sys.stderr)
            return 2
    out = Path(args.out)
    runs: dict[str, list[list[dict]]] = {"a": [], "b": []}
    for i in range(args.rounds):
        # Who goes first alternates, so a drift within a pair favours neither.
        order = ("a", "b") if i % 2 == 0 else ("b", "a")
        for v in order:
            runs[v].append(_run(args.a_dir if v == "a" else args.b_dir,
                                ",".join(map(str, args.bs)), args.steps, args.gap_ms))
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
    rows = summary(runs)
    print(f"host_cost, {args.steps} steps a run, {args.gap_ms:g} ms before each step, "
          f"{args.rounds} runs of each: A={args.a_dir} B={args.b_dir}")
    print("   bs  part                  A median  B median   B/A median  (range over pairs)")
    for r in rows:
        print(f"{r['bs']:5d}  {r['part']:20s} {r['a_median']:9.1f} {r['b_median']:9.1f} "
              f"{r['ratio_median']:11.3f}  ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})")
    out.mkdir(parents=True, exist_ok=True)
    command = command_line("python -m bench.sglang.host_cost_ab", argv)
    (out / "host-cost-ab.json").write_text(json.dumps(
        {"command": command, "a": str(args.a_dir), "b": str(args.b_dir), "steps": args.steps,
         "gap_ms": args.gap_ms, "runs": runs, "summary": rows}, indent=1))
    _plot(rows, out / "host-cost-ab.png", f"B/A, {args.gap_ms:g} ms gap: {command}")
    print(f"wrote {out}/host-cost-ab.json and host-cost-ab.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
