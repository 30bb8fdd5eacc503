"""`dgw`: the command line.

    dgw demo                      load ramp on a toy model (CPU default): plain vs static spec vs dynamic
    dgw accept-shift              acceptance that changes while serving (real, toy two-cycle chain)
    dgw bench                     GPU sweep: tok/s and TPOT per concurrency for every worker variant
    dgw make-toy-checkpoints DIR  HF-format toy target + EAGLE-3 drafts with known acceptance
    dgw profile                   nsys (or torch.profiler) run of a scripted workload, then the check
    dgw check-profile REPORT      verdict on a profile: graph launches, no capture/malloc, switches
    dgw capture-measure           GPU: capture time, pool memory and step latency of every candidate
    dgw capture-tune / capture-report   choose the pools' batch sizes under budgets; plots
    dgw capture-flags CONFIG      SGLang server flags + DGW_* env that run a tuned capture config
    dgw settings [--check]        every DGW_* setting (the docs table), or validate this environment
    dgw --version                 the package version

`dgw CMD --help` describes a command's options. A bad argument stops the command with one line
naming the problem and the fix, and exit status 2.
"""

from __future__ import annotations

import sys
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence

from dual_graph_worker import __version__
from dual_graph_worker.core.argtypes import OneLineParser, int_range
from dual_graph_worker.core.errors import report_user_errors
from dual_graph_worker.engines.reference.config import MIN_LAYERS


def _make_toy(argv: Sequence[str]) -> int:
    from dual_graph_worker.core.argtypes import output_dir, seed_int
    from dual_graph_worker.engines.reference.config import TOY_MAX_HIDDEN
    ap = OneLineParser(prog="dgw make-toy-checkpoints",
                       description="Write DIR/target and DIR/draft-f100|f50|f0 (HF format).")
    ap.add_argument("dir", type=output_dir, help="folder to write (created if missing)")
    ap.add_argument("--hidden", type=int_range(8, TOY_MAX_HIDDEN), default=64,
                    help="hidden size = vocab size, a multiple of 8")
    ap.add_argument("--layers", type=int_range(MIN_LAYERS, 64), default=8,
                    help=f"target layers, {MIN_LAYERS} to 64")
    ap.add_argument("--seed", type=seed_int, default=0)
    args = ap.parse_args(argv)
    from dual_graph_worker.engines.reference.toy import write_toy_checkpoints
    ck = write_toy_checkpoints(args.dir, hidden=args.hidden, layers=args.layers, seed=args.seed)
    print(f"target: {ck.target}")
    for name, path in ck.drafts.items():
        print(f"draft {name}: {path}")
    return 0


def _settings(argv: Sequence[str]) -> int:
    """`dgw settings`: every DGW_* variable (the docs table), or `--check`: validate this
    environment's DGW_* variables and DGW_CONFIG file as a server would at launch."""
    import json
    import os

    from dual_graph_worker.core.settings import Settings, docs_table
    from dual_graph_worker.engines.sglang.capture_config import check_setting_files

    ap = OneLineParser(prog="dgw settings", description=_settings.__doc__)
    ap.add_argument("--check", action="store_true",
                    help="validate the DGW_* environment and print the effective settings")
    args = ap.parse_args(argv)
    if not args.check:
        print(docs_table(), end="")
        return 0
    settings = Settings.from_env(os.environ)
    check_setting_files(settings)
    print(json.dumps(settings.to_json(), indent=1))
    return 0


def _forward(module: str, prefix: Sequence[str] = ()) -> Callable[[Sequence[str]], int]:
    """A command run by a tool's `main`, found by module name only when the command runs:
    `dgw` imports no tool package (bench, capture, profiling) itself."""
    def run(argv: Sequence[str]) -> int:
        import importlib
        return importlib.import_module(module).main(list(prefix) + list(argv))
    return run


# What each command does is in the module docstring (`dgw --help`).
COMMANDS: Mapping[str, Callable[[Sequence[str]], int]] = MappingProxyType({
    "demo": _forward("bench.reference.demo"),
    "accept-shift": _forward("bench.reference.accept_shift"),
    "bench": _forward("bench.reference.bench"),
    "make-toy-checkpoints": _make_toy,
    "profile": _forward("profiling.profile_and_check"),
    "check-profile": _forward("profiling.check"),
    "capture-measure": _forward("capture.measure"),
    "capture-tune": _forward("capture.cli", prefix=("tune",)),
    "capture-report": _forward("capture.cli", prefix=("report",)),
    "capture-flags": _forward("capture.sglang_flags"),
    "settings": _settings,
})


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"dgw {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        what = "option" if name.startswith("-") else "command"
        print(f"error: unknown {what} '{name}'; commands: {', '.join(COMMANDS)} "
              "(or --help, --version)", file=sys.stderr)
        return 2
    return report_user_errors(COMMANDS[name], rest) or 0


if __name__ == "__main__":
    raise SystemExit(main())
