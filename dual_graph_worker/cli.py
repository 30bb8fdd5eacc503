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

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from dual_graph_worker import __version__
from dual_graph_worker.core.argtypes import OneLineParser, int_range
from dual_graph_worker.core.errors import report_user_errors


def _make_toy(argv: Sequence[str]) -> int:
    from dual_graph_worker.core.argtypes import output_dir, seed_int
    from dual_graph_worker.engines.reference.toy import TOY_MAX_HIDDEN
    ap = OneLineParser(prog="dgw make-toy-checkpoints",
                       description="Write DIR/target and DIR/draft-f100|f50|f0 (HF format).")
    ap.add_argument("dir", type=output_dir, help="folder to write (created if missing)")
    ap.add_argument("--hidden", type=int_range(8, TOY_MAX_HIDDEN), default=64,
                    help="hidden size = vocab size, a multiple of 8")
    ap.add_argument("--layers", type=int_range(4, 64), default=8, help="target layers, 4 to 64")
    ap.add_argument("--seed", type=seed_int, default=0)
    args = ap.parse_args(argv)
    from dual_graph_worker.engines.reference.toy import write_toy_checkpoints
    ck = write_toy_checkpoints(args.dir, hidden=args.hidden, layers=args.layers, seed=args.seed)
    print(f"target: {ck.target}")
    for name, path in ck.drafts.items():
        print(f"draft {name}: {path}")
    return 0


def _profile(argv: Sequence[str]) -> int:
    from dual_graph_worker.core.argtypes import output_dir
    from profiling.check import sm_name
    ap = OneLineParser(
        prog="dgw profile",
        description="Profile the scripted workload (warm-up, hold spec, hold decode, alternate) "
                    "under nsys when it is on PATH, else torch.profiler; then check the profile.")
    ap.add_argument("--model", choices=["tiny", "llama3-8b"], default="tiny")
    ap.add_argument("--bs", type=int_range(1, 512), default=8)
    ap.add_argument("--out", type=output_dir, default="out/profile")
    ap.add_argument("--backend", choices=["auto", "nsys", "torch"], default="auto")
    ap.add_argument("--expect-sm", type=sm_name,
                    help="fail unless the GPU is this one, e.g. SM90 or SM120")
    args = ap.parse_args(argv)
    use_nsys = args.backend == "nsys" or (args.backend == "auto" and shutil.which("nsys"))
    if use_nsys and not shutil.which("nsys"):
        ap.error("nsys is not on PATH; install Nsight Systems or use --backend torch")
    if args.model == "llama3-8b":
        import torch
        if not torch.cuda.is_available():
            ap.error("the Llama-3-8B-shaped workload needs a CUDA GPU; use --model tiny on CPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workload = [sys.executable, "-m", "profiling.workload", "--model", args.model, "--bs", str(args.bs)]
    if use_nsys:
        report = out / "workload.nsys-rep"
        cmd = ["nsys", "profile", "--trace=cuda,nvtx", "--cuda-graph-trace=graph",
               "--force-overwrite=true", "-o", str(report.with_suffix(""))] + workload
    else:
        report = out / "workload.trace.json"
        cmd = workload + ["--torch-profile", str(report)]
    print("+ " + " ".join(cmd))
    rc = subprocess.call(cmd)
    if rc != 0:
        print(f"error: the profiled workload exited with {rc} (its output is above)",
              file=sys.stderr)
        return rc
    from profiling.check import main as check_main
    extra = ["--expect-sm", args.expect_sm] if args.expect_sm else []
    return check_main([str(report), "--out", str(out)] + extra)


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


def _forward(module: str, fn: str = "main", prefix: Sequence[str] = ()) -> Callable[[Sequence[str]], int]:
    def run(argv: Sequence[str]) -> int:
        import importlib
        return getattr(importlib.import_module(module), fn)(list(prefix) + list(argv))
    return run


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "demo": (_forward("dual_graph_worker.engines.reference.runs.demo"), "load ramp on a toy model with real acceptance"),
    "accept-shift": (_forward("dual_graph_worker.engines.reference.runs.accept_shift"),
                     "acceptance that changes while serving, on a toy model"),
    "bench": (_forward("dual_graph_worker.engines.reference.runs.bench"), "concurrency sweep of every worker variant"),
    "make-toy-checkpoints": (_make_toy, "write toy HF checkpoints with known acceptance"),
    "profile": (_profile, "profile the scripted workload and check it"),
    "check-profile": (_forward("profiling.check"), "check an nsys report / torch trace"),
    "capture-measure": (_forward("capture.measure"), "GPU: measure every candidate graph"),
    "capture-tune": (_forward("capture.cli", prefix=("tune",)), "choose pool batch sizes"),
    "capture-report": (_forward("capture.cli", prefix=("report",)), "tables and plots of measurements"),
    "capture-flags": (_forward("capture.sglang_flags"),
                      "SGLang flags and env for a tuned capture config"),
    "settings": (_settings, "every DGW_* setting, or --check this environment"),
}


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
    return report_user_errors(COMMANDS[name][0], rest) or 0


if __name__ == "__main__":
    raise SystemExit(main())
