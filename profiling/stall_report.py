"""Where a server stood still: the step log's longest gaps and the stall watch's stacks.

    python -m profiling.stall_report RUN_DIR [--name dual-bench] [--top 5]

Reads RUN_DIR/steps-NAME.jsonl (DGW_STEP_LOG: one line per step and per worker event) and
RUN_DIR/stall-NAME.jsonl (DGW_STALL_TRACE, dual_graph_worker/core/stall_watch.py), prints the longest gaps
between consecutive lines after the worker's "ready" event and each stall episode (consecutive
samples of one gap) with the stack the serving thread spent it in, and writes
RUN_DIR/stall_report.json and RUN_DIR/stall_timeline.png (steps by mode, episodes shaded).
Times are seconds after "ready".
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.jsonl import json_lines
from dual_graph_worker.core.stall_watch import StallSample, read_stall_samples
from dual_graph_worker.core.argtypes import OneLineParser, positive_int

STDLIB_MARKERS = ("/lib/python3", "/usr/lib/python")


@dataclass(frozen=True)
class LogLine:
    t: float
    kind: str            # "spec" / "decode" for a step, the event's name otherwise
    bs: Optional[int]


@dataclass(frozen=True)
class Gap:
    t_from: float
    t_to: float
    gap_s: float
    before: str
    after: str


@dataclass(frozen=True)
class Episode:
    t_start: float       # when the serving thread last started a step before the stall
    duration_s: float    # the longest gap sampled: at least this long
    samples: int
    steps_before: int
    stack: tuple[str, ...]   # the most sampled stack, innermost first, stdlib frames dropped


def read_log(path: Path) -> tuple[Optional[float], list[LogLine]]:
    """(wall time of the "ready" event or None, every other line in file order)."""
    ready, lines = None, []
    for d in json_lines(path):
        if d.get("event") == "ready":
            ready = d["t"]
            continue
        kind = d.get("mode") if "step" in d else d.get("event", "?")
        lines.append(LogLine(d["t"], str(kind), d.get("bs")))
    return ready, lines


def longest_gaps(lines: Sequence[LogLine], top: int) -> list[Gap]:
    ordered = sorted(lines, key=lambda x: x.t)
    gaps = [Gap(a.t, b.t, b.t - a.t, a.kind, b.kind) for a, b in zip(ordered, ordered[1:])]
    return sorted(gaps, key=lambda g: g.gap_s, reverse=True)[:top]


def episodes(samples: Sequence[StallSample]) -> list[Episode]:
    """Samples of one gap (same step count, growing gap) form one episode."""
    groups: list[list[StallSample]] = []
    for s in samples:
        if groups and groups[-1][-1].steps == s.steps and s.gap_s >= groups[-1][-1].gap_s:
            groups[-1].append(s)
        else:
            groups.append([s])
    out = []
    for g in groups:
        stack, _ = Counter(g_s.stack for g_s in g).most_common(1)[0]
        longest = max(s.gap_s for s in g)
        out.append(Episode(t_start=g[0].t - g[0].gap_s, duration_s=longest, samples=len(g),
                           steps_before=g[0].steps,
                           stack=tuple(f for f in stack
                                       if not any(m in f for m in STDLIB_MARKERS))))
    return out


def plot(lines: Sequence[LogLine], eps: Sequence[Episode], t0: float, path: Path) -> Path:
    # matplotlib's object API on the Agg canvas: no pyplot, so no global backend or figure
    # state; imported here, so the readers above need no matplotlib (the SGLang suite uses them).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for mode, color in (("spec", "tab:orange"), ("decode", "tab:blue")):
        pts = [(x.t - t0, x.bs) for x in lines if x.kind == mode and x.bs]
        if pts:
            ax.scatter(*zip(*pts), s=4, c=color, label=f"{mode} step")
    for i, e in enumerate(eps):
        ax.axvspan(e.t_start - t0, e.t_start - t0 + e.duration_s, color="tab:red", alpha=0.2,
                   label="stall (stall watch)" if i == 0 else None)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("seconds after the worker was ready")
    ax.set_ylabel("running batch size")
    ax.legend(loc="upper right")
    fig.savefig(path, dpi=120)
    return path


def _log(run_dir: Path, name: str) -> Path:
    """A log as the worker wrote it, or gzipped as results/ keeps it."""
    plain = run_dir / name
    packed = plain.with_name(name + ".gz")
    return packed if packed.exists() and not plain.exists() else plain


def _run_dir(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text!r} {what}; pass the suite's run folder (the one "
                                         "holding steps-*.jsonl and stall-*.jsonl)")
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = OneLineParser(prog="python -m profiling.stall_report",
                      description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=_run_dir)
    p.add_argument("--name", default="dual-bench", help="the engine's log suffix")
    p.add_argument("--top", type=positive_int, default=5, help="longest gaps to list")
    a = p.parse_args(argv)
    steps_path = _log(a.run_dir, f"steps-{a.name}.jsonl")
    stall_path = _log(a.run_dir, f"stall-{a.name}.jsonl")
    missing = [str(x) for x in (steps_path, stall_path) if not x.is_file()]
    if missing:
        p.error(f"missing {', '.join(missing)} (or not a file): run the suite with "
                "--stall-trace-s (dual engines then write both), or pass --name for another "
                "engine")

    def read(reader, path: Path):
        try:
            return reader(path)
        except (KeyError, TypeError, ValueError) as exc:      # ConfigError is one
            p.error(f"a malformed line in {path} ({type(exc).__name__}: {exc}); pass the logs "
                    "the worker wrote (DGW_STEP_LOG, DGW_STALL_TRACE)")

    ready, lines = read(read_log, steps_path)
    if not lines:
        p.error(f"{steps_path} holds no step after the worker was ready: pass the log of a run "
                "that served")
    samples = read(read_stall_samples, stall_path)
    t0 = ready if ready is not None else min((x.t for x in lines), default=0.0)
    gaps = longest_gaps(lines, a.top)
    eps = episodes(samples)
    print(f"{len(lines)} step-log lines after ready; longest gaps between consecutive lines:")
    for g in gaps:
        print(f"  {g.gap_s:7.3f} s  at {g.t_from - t0:8.2f} s  ({g.before} -> {g.after})")
    print(f"{len(eps)} stall episode(s) (the serving thread started no step for >= the "
          "watch threshold):")
    for e in eps:
        print(f"  >= {e.duration_s:6.2f} s from {e.t_start - t0:8.2f} s, after {e.steps_before}"
              f" steps, {e.samples} samples, in:")
        for frame in e.stack[:12]:
            print(f"      {frame}")
    report = {"ready_t": ready, "gaps": [asdict(g) for g in gaps],
              "episodes": [asdict(e) for e in eps]}
    write_json(report, a.run_dir / "stall_report.json")
    png = plot(lines, eps, t0, a.run_dir / "stall_timeline.png")
    print(f"wrote {a.run_dir / 'stall_report.json'} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
