"""`dgw profile`: the scripted workload (profiling.workload) under nsys when it is on PATH, else
torch.profiler, in a child process; then the check (profiling.check) of the profile it wrote.

    python -m profiling.profile_and_check [--model tiny|llama3-8b] [--bs N] [--out DIR]
                                          [--backend auto|nsys|torch] [--expect-sm SM90]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from dual_graph_worker.core.argtypes import OneLineParser, int_range, output_dir
from dual_graph_worker.engines.reference.config import MODEL_SHAPES
from profiling.check import SOURCES, sm_name
from profiling.check import main as check_main


def _parser() -> OneLineParser:
    ap = OneLineParser(
        prog="dgw profile",
        description="Profile the scripted workload (warm-up, hold spec, hold decode, alternate) "
                    "under nsys when it is on PATH, else torch.profiler; then check the profile.")
    ap.add_argument("--model", choices=sorted(MODEL_SHAPES), default="tiny")
    ap.add_argument("--bs", type=int_range(1, 512), default=8)
    ap.add_argument("--out", type=output_dir, default="out/profile")
    ap.add_argument("--backend", choices=SOURCES, default="auto")
    ap.add_argument("--expect-sm", type=sm_name,
                    help="fail unless the GPU is this one, e.g. SM90 or SM120")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = _parser()
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
    extra = ["--expect-sm", args.expect_sm] if args.expect_sm else []
    status = check_main([str(report), "--out", str(out)] + extra)
    import torch
    if status and not torch.cuda.is_available():
        print("note: on CPU every step runs eagerly, so the graph checks cannot pass; this run "
              "shows the workload and its NVTX schedule: run it on a GPU for the verdict")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
