"""The scripted SGLang profiling workload: the dual-graph worker inside a real SGLang engine.

    python -m bench.sglang.profile_workload --out DIR --nsys [--expect-sm SM90]  # profile + check
    python -m bench.sglang.profile_workload --out DIR        # the workload alone (what nsys runs)

Needs a GPU, SGLang 0.5.17 importable and (with --nsys) nsys on PATH. The engine is the GPU
suite's (bench/sglang): Llama-3-8B-shaped target and EAGLE-3 draft with dummy weights, triton
attention, 3 draft steps, topk 1, 4 draft tokens, accept length forced by
SGLANG_SIMULATE_ACC_LEN, speculative algorithm DUAL_GRAPH_EAGLE3, one engine start
(--attention-backend default: the backend SGLang picks, FA3 on an H200).

The scheduler, not this script, sets the batch, so the modes come from the worker's profiling
policy (DGW_POLICY=cycle: spec for --hold steps, decode for --hold steps, then alternate every
step for 2 x --hold steps, repeat) on one batch of --bs requests admitted together: one prefill,
then decode-family steps only, all at one padded batch size. The worker owns the window
(dual_graph_worker/engines/sglang/nvtx_spans.py): after --warmup-steps decode-family steps (a
short warm-up generate, then the profiled batch's prefill and first steps) it opens an nsys
capture range, marks steady_state_begin, and closes the range after --steps steady steps, all in
the scheduler process where it runs. nsys therefore records only the steady window (a few MB).

Outputs in DIR: sglang.nsys-rep (with --nsys), steps.jsonl (the worker's step log),
workload.json (settings, step summary), check/ (report.md, timeline.png, check.json),
host-waits.md / .json (the CUDA API calls inside each catch-up, `profiling.host_waits`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from dual_graph_worker.core.argtypes import OneLineParser
from dual_graph_worker.core import nvtx_names as names
from dual_graph_worker.core.settings import settings_env

REPO_ROOT = Path(__file__).resolve().parents[2]
REPORT_STEM = "sglang"
STEP_LOG = "steps.jsonl"
SUMMARY = "workload.json"
CHECK_DIR = "check"
NUM_STEPS = 3            # EAGLE-3 draft steps (K); topk 1, so 4 draft tokens
MAX_TOP_UPS = 8

# Only the steady window is recorded (the worker opens and closes the capture range); each
# graph replay is one cudaGraphLaunch; child processes (the scheduler) are traced.
NSYS_FLAGS = ("--trace=cuda,nvtx", "--cuda-graph-trace=graph", "--trace-fork-before-exec=true",
              "--capture-range=cudaProfilerApi", "--capture-range-end=stop", "--sample=none",
              "--cpuctxsw=none", "--force-overwrite=true")


@dataclass(frozen=True)
class WorkloadSpec:
    bs: int = 8
    hold: int = 8                  # cycle policy: steps each mode is held
    warmup_steps: int = 48         # decode-family steps before steady state
    steps: int = 192               # steady steps recorded (6 cycles of 4 x hold)
    input_len: int = 128
    warmup_tokens: int = 16
    output_len: Optional[int] = None   # None: enough steps even if every step accepted K+1
    acc_len: float = 3.0
    max_graph_bs: int = 16         # both pools capture up to here: a short start-up
    log_level: str = "warning"
    attention_backend: str = "triton"   # "default": SGLang picks (fa3 on an H200)

    def __post_init__(self) -> None:
        for name in ("bs", "hold", "steps", "input_len", "warmup_tokens", "max_graph_bs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.bs > self.max_graph_bs:
            raise ValueError(f"--bs {self.bs} > --max-graph-bs {self.max_graph_bs}: the batch "
                             "must have a graph in both pools")
        if self.warmup_steps < self.warmup_tokens + 1:
            raise ValueError(f"--warmup-steps must exceed --warmup-tokens ({self.warmup_tokens}),"
                             " so steady state starts after the profiled batch's prefill")

    @property
    def forced(self) -> str:
        """What the figures are of: a line printed and stored with them."""
        return (f"DUMMY weights (Llama-3-8B shapes); accept length FORCED to {self.acc_len:g} "
                "(SGLANG_SIMULATE_ACC_LEN)")

    @property
    def needed_steps(self) -> int:
        """Decode-family steps the worker must begin for the capture range to close."""
        return self.warmup_steps + self.steps + 1

    @property
    def profiled_tokens(self) -> int:
        return self.output_len or (NUM_STEPS + 1) * (self.needed_steps + 8)

    def worker_env(self, step_log: Path) -> dict[str, str]:
        return settings_env(
            policy="cycle", min_dwell_steps=self.hold,
            profile_steady_after_steps=self.warmup_steps, profile_steps=self.steps,
            decode_max_bs=self.max_graph_bs, step_log=step_log,
        ) | {
            # Read when spec_utils is imported: set before SGLang is.
            "SGLANG_SIMULATE_ACC_LEN": str(self.acc_len),
        }

    def engine_kwargs(self, target: Path, draft: Path) -> dict:
        from bench.sglang.model_configs import engine_attention_backend, server_kwargs, spec_kwargs

        # The GPU suite's bench engine.
        return (server_kwargs(target, "dummy", self.max_graph_bs, log_level=self.log_level,
                              attention_backend=engine_attention_backend(self.attention_backend))
                | spec_kwargs("dual", draft))

    def workload_argv(self) -> list[str]:
        """The flags that reproduce this spec (what --nsys passes to the profiled child)."""
        out = []
        for key, value in asdict(self).items():
            if value is not None:
                out += [f"--{key.replace('_', '-')}", str(value)]
        return out


def nsys_command(out: Path, spec: WorkloadSpec, python: str = sys.executable) -> list[str]:
    return (["nsys", "profile", *NSYS_FLAGS, "-o", str(out / REPORT_STEM), python, "-m",
             "bench.sglang.profile_workload", "--out", str(out)] + spec.workload_argv())


def _steps_logged(step_log: Path) -> list:
    from dual_graph_worker.core.step_log import read_step_log

    return [r for r, _ in read_step_log(step_log)] if step_log.exists() else []


def run_workload(spec: WorkloadSpec, out: Path) -> dict:
    """Start the engine, warm up, run the profiled batch; returns the summary it writes."""
    from bench.sglang.model_configs import llama3_8b_shapes, write_dummy_pair
    from bench.sglang.workload import random_prompts, summarize_steps

    out.mkdir(parents=True, exist_ok=True)
    step_log = out / STEP_LOG
    if step_log.exists():
        step_log.unlink()
    shapes = llama3_8b_shapes()
    target, draft = write_dummy_pair(out / "models", shapes, "llama3-8b-shape",
                                     "llama3-8b-shape-eagle3")
    os.environ.update(spec.worker_env(step_log))
    from bench.sglang.engine_child import sampling
    from bench.sglang.plugin_shim import ensure_plugin_discoverable

    plugin = ensure_plugin_discoverable(out / "plugin_shim", REPO_ROOT)
    import sglang

    t0 = time.perf_counter()
    engine = sglang.Engine(**spec.engine_kwargs(target, draft))
    startup_s = time.perf_counter() - t0
    notes: list[str] = []
    try:
        # Warm-up: the profiled prompt shape once, short; then the profiled batch (one prefill).
        engine.generate(input_ids=random_prompts(spec.bs, spec.input_len, shapes.vocab_size, 1),
                        sampling_params=sampling(spec.warmup_tokens))
        t1 = time.perf_counter()
        engine.generate(input_ids=random_prompts(spec.bs, spec.input_len, shapes.vocab_size, 2),
                        sampling_params=sampling(spec.profiled_tokens))
        run_s = time.perf_counter() - t1
        for seed in range(3, 3 + MAX_TOP_UPS):
            short = spec.needed_steps - len(_steps_logged(step_log))
            if short <= 0:
                break
            # The window has not closed: more steps, at the price of prefills inside it.
            notes.append(f"top-up generate: {short} steps short of closing the capture range")
            engine.generate(input_ids=random_prompts(spec.bs, spec.input_len,
                                                     shapes.vocab_size, seed),
                            sampling_params=sampling((NUM_STEPS + 1) * short + 8))
    finally:
        engine.shutdown()
    records = _steps_logged(step_log)
    if len(records) < spec.needed_steps:
        notes.append(f"only {len(records)} of {spec.needed_steps} steps ran: the capture range "
                     "never closed; the report may be empty")
    summary = {"what": spec.forced, "spec": asdict(spec), "plugin": plugin,
               "startup_s": round(startup_s, 2),
               "profiled_generate_s": round(run_s, 2), "steps_logged": len(records),
               "window": {"steady_after_steps": spec.warmup_steps, "steps": spec.steps},
               "step_summary": summarize_steps(records).to_json() if records else None,
               "notes": notes}
    (out / SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary


def profile(spec: WorkloadSpec, out: Path, expect_sm: Optional[str]) -> int:
    """nsys around the workload, then the checker with the SGLang expectation profile."""
    if shutil.which("nsys") is None:
        print("error: nsys is not on PATH (install Nsight Systems)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    print(spec.forced, flush=True)
    cmd = nsys_command(out, spec)
    print("+ " + " ".join(cmd), flush=True)
    from bench.sglang.plugin_shim import pythonpath_env

    rc = subprocess.call(cmd, cwd=REPO_ROOT, env=pythonpath_env(REPO_ROOT))
    report = out / f"{REPORT_STEM}.nsys-rep"
    if rc != 0 or not report.exists():
        print(f"error: the profiled workload exited with {rc}; report {report} "
              f"{'exists' if report.exists() else 'missing'}", file=sys.stderr)
        return rc or 2
    from profiling.check import main as check_main

    extra = ["--expect-sm", expect_sm] if expect_sm else []
    exported = out / CHECK_DIR / f"{REPORT_STEM}.sqlite"     # the checker's export
    exported.unlink(missing_ok=True)                         # never an earlier run's
    rc = check_main([str(report), "--out", str(out / CHECK_DIR), "--engine", "sglang"] + extra)
    if exported.exists():
        from profiling.host_waits import format_waits, host_waits
        from profiling.nsys_sqlite import load_sqlite

        waits = host_waits(load_sqlite(exported), names.stage_name(names.CATCH_UP))
        text = format_waits(waits)
        (out / "host-waits.md").write_text(text + "\n")
        (out / "host-waits.json").write_text(json.dumps(waits.to_json(), indent=1))
        print(text)
    return rc


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m bench.sglang.profile_workload", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--nsys", action="store_true", help="run the workload under nsys, then check")
    ap.add_argument("--expect-sm", help="with --nsys: fail unless the GPU is this, e.g. SM90")
    d = WorkloadSpec()
    for key, value in asdict(d).items():
        kind = float if isinstance(value, float) else str if isinstance(value, str) else int
        ap.add_argument(f"--{key.replace('_', '-')}", type=kind, default=value)
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = WorkloadSpec(**{k: getattr(args, k) for k in asdict(WorkloadSpec())})
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = args.out.resolve()
    if args.nsys:
        return profile(spec, out, args.expect_sm)
    summary = run_workload(spec, out)
    print(json.dumps({k: summary[k] for k in ("what", "startup_s", "profiled_generate_s",
                                              "steps_logged", "notes")}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    raise SystemExit(main())
