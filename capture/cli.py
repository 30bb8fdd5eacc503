"""Command line: `python -m capture.cli tune ...` and `python -m capture.cli report ...`.

    tune    --measurements M.json --memory-budget 4GiB --time-budget 30
            --distribution uniform:1-256 --accept-len 3.0 --out out/capture/config.json
            [--no-exclude-compile-outlier]
    report  --measurements M.json [--config C.json] [--distribution D] [--accept-len A]
            --out-dir DIR

Bad input (missing or malformed files, unreadable sizes, infeasible budgets, a config from another
GPU or model) prints one `error: ...` line naming the problem and the fix, and exits with code 2;
no tracebacks for anything a user can fix.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from capture.config import build_capture_config, load_capture_config, save_capture_config
from capture.distribution import parse_distribution
from capture.measurements import load_measurements
from capture.report import Chosen, graph_table, write_report
from capture.result import COMPILE_OUTLIER_FACTOR
from capture.tuner import tune
from capture.units import parse_duration, parse_size
from dual_graph_worker.core.argtypes import OneLineParser, output_file, positive_int
from dual_graph_worker.core.errors import ConfigError, report_user_errors
from dual_graph_worker.core.modes import Mode


def _accept_len(text: str) -> float:
    """A finite number >= 1 (the measurements' K bounds it above: the tuner checks that)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 1.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected accepted tokens per request per spec step, a number in 1..K+1 such as "
            f"3.0, got {text!r}")
    return value


def _need_measurements(path: str) -> None:
    """A missing file or a folder, said with the fix (reading and parsing: load_measurements)."""
    p = Path(path)
    if not p.is_file():
        why = "it is a folder" if p.is_dir() else "no such file"
        raise ConfigError(f"cannot read measurements file {path}: {why}; pass the JSON that "
                          "`dgw capture-measure` wrote (e.g. results/capture/measurements_*.json)")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m capture.cli",
                      description="Choose and report CUDA graph pool batch sizes.")
    sub = p.add_subparsers(dest="command", required=True)

    # Each subcommand's usage names it as `dgw` runs it (dgw capture-tune / capture-report).
    t = sub.add_parser("tune", prog="dgw capture-tune",
                       help="choose spec/decode batch sizes and write a capture config")
    t.add_argument("--measurements", required=True, help="recorded measurements JSON")
    t.add_argument("--memory-budget", required=True,
                   help="graph pool memory budget, e.g. 4GiB or 512MiB")
    t.add_argument("--time-budget", required=True,
                   help="start-up capture time budget in seconds, e.g. 30 or 30s")
    t.add_argument("--distribution", default="uniform:1-256",
                   help="expected batch sizes: uniform:LO-HI, geometric[:P], fixed:N, "
                        "inline JSON {\"bs\": weight} or @file.json (default: %(default)s)")
    t.add_argument("--accept-len", required=True, type=_accept_len,
                   help="expected accepted tokens per request per spec step, 1..K+1")
    t.add_argument("--spec-max-bs", type=positive_int, default=None,
                   help="largest spec-pool batch size, below the replays' crossover: a served "
                        "spec step pays host work and draft prefills its replay does not "
                        "(the SGLang worker's DGW_SPEC_MAX_BS; default: the crossover)")
    # out/, as the Makefile's CAPTURE_CONFIG: a run's output stays out of the source package.
    t.add_argument("--out", type=output_file, default="out/capture/config.json",
                   help="capture config to write (default: %(default)s)")
    t.add_argument("--exclude-compile-outlier", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="per mode, replace a capture time above "
                        f"{COMPILE_OUTLIER_FACTOR:g}x the mode's median by that median: the first "
                        "capture of a mode pays one-time JIT compilation, not a per-graph cost "
                        "(the table lists what was replaced; default: on)")
    t.set_defaults(run=_run_tune)

    r = sub.add_parser("report", prog="dgw capture-report",
                       help="table and PNG plots of measurements (and a config)")
    r.add_argument("--measurements", required=True, help="recorded measurements JSON")
    r.add_argument("--config", help="a capture config tuned from these measurements")
    r.add_argument("--distribution",
                   help="batch-size distribution (default: the config's, else uniform over 1.."
                        "the largest measured decode bs)")
    r.add_argument("--accept-len", type=_accept_len,
                   help="accept length for the crossover (default: the config's)")
    r.add_argument("--out-dir", required=True, help="folder for report.txt and the PNGs")
    r.set_defaults(run=_run_report)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)   # usage errors: argparse prints and exits 2
    return report_user_errors(args.run, args)


def _run_tune(args: argparse.Namespace) -> int:
    _need_measurements(args.measurements)
    memory = parse_size(args.memory_budget)
    seconds = parse_duration(args.time_budget)
    m = load_measurements(args.measurements)
    dist = parse_distribution(args.distribution, max_bs=m.sizes(Mode.DECODE)[-1])
    result = tune(m, memory, seconds, dist, args.accept_len,
                  exclude_compile_outlier=args.exclude_compile_outlier,
                  spec_max_bs=args.spec_max_bs)
    save_capture_config(build_capture_config(m, result), args.out)
    print(result.table())
    print(f"\nwrote capture config {args.out}")
    if m.synthetic:
        print("warning: tuned on SYNTHETIC measurements; re-run on real ones before deploying",
              file=sys.stderr)
    return 0


def _run_report(args: argparse.Namespace) -> int:
    if Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
        raise ConfigError(f"--out-dir {args.out_dir} is a file; pass a folder for the report")
    _need_measurements(args.measurements)
    m = load_measurements(args.measurements)
    config = (load_capture_config(args.config, expected_gpu=m.gpu, expected_shape=m.model.shape)
              if args.config else None)
    if args.distribution:
        dist = parse_distribution(args.distribution, max_bs=m.sizes(Mode.DECODE)[-1])
    elif config is not None:
        dist = config.distribution
    else:
        dist = parse_distribution(f"uniform:1-{m.sizes(Mode.DECODE)[-1]}", 0)
    accept_len = args.accept_len if args.accept_len is not None else (
        config.accept_len if config is not None else None)
    if accept_len is None:
        raise ConfigError("report needs --accept-len (or --config, whose tuning accept length "
                          "is used) to place the crossover")
    chosen = Chosen(config.spec_bs, config.decode_bs) if config is not None else None
    # Capture times as the config was tuned (configs from before the option: the default).
    exclude = (config.exclude_compile_outlier if config is not None
               and config.exclude_compile_outlier is not None else True)
    files = write_report(m, args.out_dir, dist, accept_len, chosen, exclude)
    print(graph_table(m, chosen, exclude))
    print("\nwrote " + ", ".join(str(f) for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
