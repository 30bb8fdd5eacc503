"""Check a profile of the worker for a clean steady state, and write what was found.

    python -m profiling.check REPORT --out DIR [--warmup-steps N] [--max-eager-kernels N]
                              [--num-draft-tokens K] [--expect-sm SM90] [--source auto|nsys|torch]
                              [--engine auto|reference|sglang]

REPORT is an Nsight Systems report (.nsys-rep, exported with `nsys export`, which must be on
PATH), its SQLite export, or a torch.profiler Chrome trace (.json / .json.gz) when nsys is not
available. Profile with `nsys profile --trace=cuda,nvtx --cuda-graph-trace=graph` so each
replay is one cudaGraphLaunch. DIR receives report.md, timeline.png and check.json; the table
goes to stdout. Exit status: 0 all checks pass, 1 a check failed, 2 the input cannot be read.
"""

from __future__ import annotations

import argparse
import dataclasses
import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from profiling import engines, nsys_sqlite, torch_trace
from profiling.checks import (CheckConfig, CheckOutcome, DEFAULT_MAX_EAGER_KERNELS,
                              normalize_sm, run_checks)
from dual_graph_worker.core.argtypes import (OneLineParser, non_negative_int, output_dir,
                                             positive_int)
from dual_graph_worker.core.errors import DualGraphError
from dual_graph_worker.core.jsonio import write_json
from profiling.errors import ProfileInputError
from profiling.events import Trace
try:
    from profiling.plot import plot_timeline
except ImportError:  # no matplotlib (e.g. a bare GPU environment): verdict and report only
    plot_timeline = None
from profiling.report import ProfileSummary, format_table, render_markdown, summarize
from profiling.timeline import DEFAULT_WARMUP_STEPS, Timeline, build_timeline

SOURCES = ("auto", "nsys", "torch")
REPORT_MD = "report.md"
TIMELINE_PNG = "timeline.png"
CHECK_JSON = "check.json"


@dataclass(frozen=True)
class CheckResult:
    outcomes: list[CheckOutcome]
    summary: ProfileSummary
    report_md: Path
    timeline_png: Optional[Path]  # None without matplotlib
    check_json: Path

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outcomes)

    @property
    def failed(self) -> list[str]:
        return [o.name for o in self.outcomes if not o.passed]


def _looks_like_torch_trace(path: Path) -> bool:
    return path.name.endswith((".json", ".json.gz"))


def load_trace(path: Path, work_dir: Path, source: str = "auto") -> Trace:
    """Read any supported profile into the normalized model; work_dir holds an nsys export."""
    if source not in SOURCES:
        raise ProfileInputError(f"unknown source {source!r}; use one of {', '.join(SOURCES)}")
    if not path.exists():
        raise ProfileInputError(f"{path} does not exist; check the path (an .nsys-rep, its "
                                ".sqlite export or a torch trace .json)")
    if path.is_dir():
        raise ProfileInputError(f"{path} is a folder; pass the report file inside it "
                                "(.nsys-rep, .sqlite or a torch trace .json)")
    try:
        if source == "torch" or (source == "auto" and _looks_like_torch_trace(path)):
            try:
                return torch_trace.load_chrome_trace(path)
            except ProfileInputError as exc:
                raise ProfileInputError(
                    f"{exc}; pass the file torch.profiler's export_chrome_trace wrote (.json or "
                    ".json.gz), or name another format with --source") from None
        if path.name.endswith(nsys_sqlite.REPORT_SUFFIXES):
            return nsys_sqlite.load_sqlite(nsys_sqlite.export_sqlite(path, work_dir))
        if nsys_sqlite.is_sqlite(path):
            return nsys_sqlite.load_sqlite(path)
    except DualGraphError:
        raise
    except sqlite3.DatabaseError as exc:
        raise ProfileInputError(
            f"{path} is a damaged SQLite file ({exc}); export it again with `nsys export "
            "--type sqlite --force-overwrite true` or pass the .nsys-rep") from None
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise ProfileInputError(
            f"{path} holds malformed events ({type(exc).__name__}: {exc}); pass an unmodified "
            "profiler output (torch.profiler's export_chrome_trace, or nsys)") from None
    raise ProfileInputError(
        f"cannot tell what {path} is: pass an nsys report (.nsys-rep), its SQLite export, or a "
        "torch.profiler Chrome trace (.json), or name the format with --source")


def check_trace(trace: Trace, config: CheckConfig) -> tuple[Timeline, tuple[CheckOutcome, ...]]:
    """The checks on an already-loaded trace (no files written)."""
    timeline = build_timeline(trace, config.warmup_steps)
    return timeline, run_checks(timeline, config)


def check_report(path: Path | str, out_dir: Path | str, config: Optional[CheckConfig] = None,
                 *, source: str = "auto") -> CheckResult:
    """Load, check, and write report.md, timeline.png and check.json into out_dir."""
    config = config or CheckConfig()
    path, out_dir = Path(path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    timeline, outcomes = check_trace(load_trace(path, out_dir, source), config)
    summary = summarize(timeline, config)
    verdict = "PASS" if all(o.passed for o in outcomes) else "FAIL"
    png = None
    if plot_timeline is not None:
        png = plot_timeline(timeline, out_dir / TIMELINE_PNG,
                            f"dgw steps: {verdict} ({', '.join(summary.gpus) or 'unknown GPU'})")
    md = out_dir / REPORT_MD
    md.write_text(render_markdown(outcomes, summary, png.name if png else None),
                  encoding="utf-8")
    js = out_dir / CHECK_JSON
    write_json({
        "passed": verdict == "PASS",
        "outcomes": [dataclasses.asdict(o) for o in outcomes],
        "summary": dataclasses.asdict(summary),
        "config": dataclasses.asdict(config),
    }, js)
    return CheckResult(list(outcomes), summary, md, png, js)


# ---------------------------------------------------------------- argument types
# sm_name: --expect-sm for this command and `dgw profile`, torch-free like the checker; the
# shared argparse types live in dual_graph_worker/core/argtypes.py (torch-free too; profiling
# may not import the `dgw` entry point).


def sm_name(text: str) -> str:
    """A GPU architecture as SM90, sm_90, 9.0 or 90."""
    try:
        normalize_sm(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="dgw check-profile",
        description="Check an nsys report (or torch.profiler trace) of the dual-graph worker: one "
                    "graph launch per stage, few eager kernels, no capture/instantiate/malloc "
                    "in steady state, switches that cost only a selection, and the GPU.")
    p.add_argument("report", type=Path, help=".nsys-rep, its .sqlite export, or a torch trace "
                                             ".json")
    p.add_argument("--out", type=output_dir, required=True, help="directory for report.md, "
                                                                "timeline.png, check.json")
    p.add_argument("--source", choices=SOURCES, default="auto")
    p.add_argument("--warmup-steps", type=non_negative_int, default=DEFAULT_WARMUP_STEPS,
                   help="steps skipped when the trace has no steady_state_begin mark "
                        f"(default {DEFAULT_WARMUP_STEPS})")
    p.add_argument("--max-eager-kernels", type=non_negative_int, default=DEFAULT_MAX_EAGER_KERNELS,
                   help="eager kernel launches allowed per graph step "
                        f"(default {DEFAULT_MAX_EAGER_KERNELS})")
    p.add_argument("--num-draft-tokens", type=positive_int, default=None,
                   help="K, when the trace lacks a config:num_draft_tokens mark")
    p.add_argument("--expect-sm", type=sm_name, default=None,
                   help="fail unless the GPU is this, e.g. SM90")
    p.add_argument("--engine", choices=engines.CHOICES, default=engines.AUTO,
                   help="what a step is expected to launch (profiling/engines.py); auto: the "
                        "trace's config:engine mark, reference when it has none")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        # Bad values (argparse printed usage and one error line) and --help: an exit status
        # returned, as for every other outcome, so in-process callers get 2 and not an exception.
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    config = CheckConfig(warmup_steps=args.warmup_steps,
                         max_eager_kernels=args.max_eager_kernels,
                         num_draft_tokens=args.num_draft_tokens, expect_sm=args.expect_sm,
                         engine=args.engine)
    try:
        result = check_report(args.report, args.out, config, source=args.source)
    except DualGraphError as e:
        # ProfileInputError and the like: one line naming the problem and the fix.
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result.outcomes, result.summary))
    print(f"report: {result.report_md}\ntimeline: {result.timeline_png}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
