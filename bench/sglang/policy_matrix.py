"""The policy matrix: plain SGLang, EAGLE-3 and the dual-graph worker at its defaults, over
accept lengths x workloads x concurrency, on a Llama-3-8B-shaped dummy target.

    python -m bench.sglang.policy_matrix --out DIR [--accept 1.5,2,3,3.5] [--engines ...]

One engine process per kind serves every cell (engine_child.py): plain once (acceptance does not
touch it), EAGLE-3 and the worker once each, with the forced accept length switched between
phases inside the running engine (acc_control.py; SGLANG_SIMULATE_ACC_LEN FORCES acceptance,
dummy weights accept nothing). A cell is one batch of C requests sent at once (T=0, ignore_eos);
tok/s = output tokens / wall time, prefill included; a cell shorter than --short-cell-s (2 s) runs
--short-cell-runs (3) times in all, fresh prompts each, and reads the median (every run kept in
`runs_tok_s`): one slow spell of the host moves a cell of a few hundred steps by percents. Each
engine's first phase runs every batch shape once with short answers before timing it (one-time
costs a server pays once). The worker keeps what it learned from one phase to the next, as a
server whose acceptance changes would. Writes DIR/policy-matrix.json (one record per cell, the
worker's with its controller's cost model), DIR/heatmap.png (worker / max(plain, EAGLE-3)),
DIR/report.md; with --step-log also the worker's step log and its
per-step costs by place in a run (DIR/step-costs.md). With --processes N every engine runs in N
processes, taken in turn (plain, EAGLE-3, worker, plain, ...): a cell's tok/s is the median of
its processes (each process's record kept, with its `process`), since one process's
low-concurrency cells move by a few percent from the next one's. The step log is the first
worker process's. A side process samples the host's speed all along (host_speed.py,
DIR/host-speed.jsonl): every cell and run carries it, and the report sets each engine's runs on
a slow host apart; --host-load N spins N processes while each cell runs (what that does and does
not slow: the option's help). With --interleave every engine is up at once and each cell runs on
one engine after another (interleave.py), so a slow spell of seconds meets them alike; with
--rounds N each accept length's cells run N times over, one run of each a round, and a
cell reads its median round, so such a spell moves one round of one engine. --pin-cpus LIST
puts every engine's processes on the same CPUs: taking turns, each then serves on the same
cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from bench.sglang import host_speed, interleave, placement, step_costs
from bench.sglang.acc_control import ENV as ACC_ENV
from bench.sglang.acc_control import SAMPLING_ENV, SAMPLINGS
from bench.sglang.engine_child import (MAX_RUNS, REPEAT_SEED_STRIDE, gpu_name, gpu_total_mib,
                                       run_child)
from bench.sglang.matrix_records import (ENGINES, LAUNCHED_TOGETHER, Repeats, Workload,
                                         fill_from, merged_workloads, other_readings,
                                         other_settings, per_cell_median, ratios, records,
                                         short_pools, stored_settings, with_rounds_asked,
                                         workload_arg)
from bench.sglang.matrix_report import heatmap, matrix_report
from bench.sglang.model_configs import (
    accept_problem,
    engine_attention_backend,
    engine_kwargs,
    llama3_8b_shapes,
    write_dummy_pair,
)
from dual_graph_worker.core.argtypes import OneLineParser, float_list, name_list
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.jsonio import read_json_object, write_json
from dual_graph_worker.core.jsonl import json_lines
from dual_graph_worker.core.settings import assignments, settings_env

HOST_SPEED_FILE = "host-speed.jsonl"

DEFAULT_WORKLOADS = ("256x256@1,4,8,16,32,48,64,128,256", "64x1024@1,32,128",
                     "2048x64@1,16,64")


def sweep_task(w: Workload, name: str, vocab: int, *, warm_shapes: bool, seed: int,
               repeats: Repeats = Repeats(0.0, 1), host_load: int = 0) -> dict:
    """engine_child's sweep: one batch of C requests per concurrency, after a warm-up; with
    `host_load` that many spinning processes while each cell runs (host_speed.Hogs)."""
    return {"name": name, "kind": "sweep", "concurrency": list(w.concurrency),
            "input_len": w.input_len, "output_len": w.output_len, "vocab": vocab,
            "warmup": True, "warm_shapes": warm_shapes, "seed": seed,
            "short_cell_s": repeats.short_s, "short_cell_runs": repeats.runs,
            "host_load": host_load}


def tasks_for(kind: str, accepts: list[float], workloads: list[Workload], vocab: int,
              repeats: Repeats = Repeats(), host_load: int = 0) -> list:
    def sweep(w: Workload, name: str, phase: int) -> dict:
        # The first phase warms every shape first, alike for every engine.
        return sweep_task(w, name, vocab, warm_shapes=phase == 0,
                          seed=_seed(phase, workloads.index(w)), repeats=repeats,
                          host_load=host_load)

    if kind == "plain":
        return [sweep(w, w.name, 0) for w in workloads]
    tasks = []
    for phase, a in enumerate(accepts):
        tasks.append(_accept_task(a))
        tasks += [sweep(w, _task_name(kind, a, w), phase) for w in workloads]
    return tasks


def _seed(phase: int, workload: int) -> int:
    """Prompts unique to each (phase, workload): the radix cache must serve none of them."""
    return 1000 + 100_000 * phase + 10_000 * workload


def _accept_task(accept: float) -> dict:
    return {"name": f"set-a{accept}", "kind": "set_accept", "accept_len": accept}


def _task_name(kind: str, accept: float, w: Workload) -> str:
    return w.name if kind == "plain" else f"a{accept}-{w.name}"


def _round_name(name: str, r: int, rounds: int) -> str:
    return f"{name}#r{r}" if rounds > 1 else name


def interleave_plan(run: "Run", kinds: list[str]) -> interleave.Plan:
    """The matrix as interleave.py runs it: every engine warms every shape first; then per
    accept phase each cell is one task per engine (plain in the first phase only), with the
    prompts tasks_for gives that phase and workload; with rounds, the phase's cells that many
    times over, one run each (the prompts of the short-cell repeats), each round of a cell in its
    own engine order: a spell of a few seconds then meets one round of a cell, not two in a
    row."""
    warm = {k: [sweep_task(w, f"warm-{w.name}", run.vocab, warm_shapes=True,
                           seed=_seed(0, i)) | {"timed": False}
                for i, w in enumerate(run.workloads)] for k in kinds}
    phases = []
    for phase, a in enumerate(run.accepts):
        # After the switch, the 2-prompt warm-up every sequential sweep opens with (the worker's
        # acceptance estimate settles on it), untimed.
        settle = sweep_task(Workload(8, 8, ()), f"warm-a{a}", run.vocab, warm_shapes=False,
                            seed=_seed(phase, 0)) | {"timed": False}
        setup = {k: [_accept_task(a), settle] for k in kinds if k != "plain"}
        sizes = [(i, w, c) for i, w in enumerate(run.workloads) for c in w.concurrency]
        cells = [{k: sweep_task(Workload(w.input_len, w.output_len, (c,)),
                                _round_name(_task_name(k, a, w), r, run.rounds), run.vocab,
                                warm_shapes=False, seed=_seed(phase, i),
                                repeats=run.repeats,
                                host_load=run.host_load) | {"warmup": False, "first_run": r}
                  for k in kinds if k != "plain" or phase == 0}
                 for r in range(run.rounds) for i, w, c in sizes]
        turns = tuple(j + r for r in range(run.rounds) for j in range(len(sizes)))
        phases.append(interleave.Phase(setup, cells, turns))
    return interleave.Plan(warm, phases)


def run_engine(name: str, spec: dict, out: Path, deadline: float) -> dict:
    """One engine process; `name` (its kind, then kind.p2, kind.p3, ...) names its files."""
    print(f"[matrix] start {name} ({deadline - time.time():.0f} s left)", flush=True)
    res = run_child(out, spec | {"name": name}, shim_dir=out / "shim",
                    timeout=max(10.0, deadline - time.time()))
    print(f"[matrix] done {name}: rc={res['returncode']} startup={res.get('startup_s')}",
          flush=True)
    return res


def failure(res: dict, measured: bool) -> Optional[str]:
    """Why an engine's run failed, or None: its error (the engine's or a task's), a non-zero
    exit, or no cell measured (`measured`: its records are not empty)."""
    tasks = [t for t in (res.get("tasks") or {}).values() if isinstance(t, dict)]
    errors = [res.get("error")] + [t.get("error") for t in tasks]
    if why := next((e for e in errors if e), None):
        return str(why)
    if res.get("returncode", 0) != 0:
        return f"exited with {res['returncode']}"
    return None if measured else "measured no cell"


def with_host_speed(rec: dict, samples: Sequence[host_speed.HostSample],
                    placed: Sequence[dict] = (), engine_pid: Optional[int] = None) -> dict:
    """`rec` with the host's speed while it ran (host_speed.during): the cell's in its machine
    record (`host_ms`), each run's in `runs_host_ms`; and with the sampler's placement samples
    and the engine's pid, where each run's scheduler ran (`runs_placement`)."""
    if not samples or "t_start" not in rec:
        return rec
    out = dict(rec)
    # Over its runs where it has them: rounds spread over a phase, whose span holds other cells.
    runs = [host_speed.during(samples, a, b) for a, b in rec.get("runs_t") or []]
    seen = [ms for ms in runs if ms is not None]
    host_ms = round(statistics.median(seen), 2) if seen else \
        host_speed.during(samples, rec["t_start"], rec["t_end"])
    out["machine"] = (rec.get("machine") or {}) | {"host_ms": host_ms}
    if runs:
        out["runs_host_ms"] = runs
        if placed and engine_pid is not None:
            out["runs_placement"] = [placement.placement_during(placed, engine_pid, a, b)
                                     for a, b in rec["runs_t"]]
    return out


def with_host_record(recs: list[dict], results: dict[str, dict], out: Path) -> list[dict]:
    """Each engine's records `with_host_speed`, read from the sampler's file in `out`."""
    samples = host_speed.read(out / HOST_SPEED_FILE)
    placed = placement.read_placement(out / HOST_SPEED_FILE)
    return [with_host_speed(r, samples, placed, results[r["engine"]].get("pid"))
            for r in recs]


@dataclass(frozen=True)
class Run:
    """One matrix call's inputs to every engine process it starts."""

    out: Path
    accepts: list[float]
    workloads: list[Workload]
    repeats: Repeats
    host_load: int
    vocab: int
    target: Path
    draft: Path
    radix: bool
    log_level: str
    backend: Optional[str]
    acc_sampling: str
    dual_env: dict
    step_log: bool
    rounds: int = 1
    cpus: Optional[list[int]] = None     # every engine process pinned to these (all alike)
    freeze_gc: bool = False


def engine_spec(run: Run, kind: str, process: int, extra_kwargs: Optional[dict] = None,
                dual_env: Optional[dict] = None) -> dict:
    """engine_child's spec of one engine process: its server arguments, environment (forced
    acceptance, the worker's settings and step log; `dual_env` under the run's) and tasks."""
    env = {}
    if kind != "plain":
        acc_file = run.out / f"acc-{kind}"
        acc_file.write_text(str(run.accepts[0]))
        for ack in run.out.glob(f"acc-{kind}.ack-*"):      # an earlier run's schedulers
            ack.unlink()
        env = {"SGLANG_SIMULATE_ACC_LEN": str(run.accepts[0]), ACC_ENV: str(acc_file),
               SAMPLING_ENV: run.acc_sampling}
    if kind == "dual":
        if not process:
            # The worker is measured again: an earlier call's log and its costs would pass for
            # this one's (and the log appends).
            for stale in ("dual.steps.jsonl", "step-costs.md"):
                (run.out / stale).unlink(missing_ok=True)
            if run.step_log:
                env |= settings_env(step_log=run.out / "dual.steps.jsonl")
        env |= (dual_env or {}) | run.dual_env
    kwargs = engine_kwargs(kind, run.target, run.draft, run.radix, run.log_level, run.backend)
    optional = {"cpus": run.cpus, "freeze_gc": run.freeze_gc}
    return {"engine_kwargs": kwargs | (extra_kwargs or {}), "env": env,
            "tasks": tasks_for(kind, run.accepts, run.workloads, run.vocab, run.repeats,
                               run.host_load)} | {k: v for k, v in optional.items() if v}


def _spans(cpus: list[int]) -> str:
    """[2, 3, 4, 7] -> '2-4,7'."""
    spans: list[list[int]] = []
    for c in cpus:
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def cpu_list(text: str) -> list[int]:
    """'4-7,9' -> [4, 5, 6, 7, 9]; ValueError naming what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"{part.strip()!r} is no CPU or range like 4 or 4-7")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


class MatrixWriter:
    """DIR/policy-matrix.json, report.md and heatmap.png, rewritten as engines finish."""

    def __init__(self, out: Path, note: str, accepts: list[float], columns: list[Workload],
                 settings: dict, earlier: list[dict], fill_source: str,
                 startup_s: dict, kv_pools: dict, kv_asked: Optional[int]) -> None:
        self.out, self.note, self.accepts, self.columns = out, note, accepts, columns
        self.settings, self.earlier, self.fill_source = settings, earlier, fill_source
        self.startup_s, self.kv_pools, self.kv_asked = dict(startup_s), dict(kv_pools), kv_asked

    def started(self, name: str, res: dict) -> None:
        self.startup_s[name] = res.get("startup_s")
        self.kv_pools[name] = interleave.kv_tokens(res)

    def short_pools(self) -> str:
        return short_pools(self.kv_pools, self.kv_asked)

    def write(self, recs: list[dict]) -> None:
        filled = fill_from(with_rounds_asked(recs, self.settings), self.earlier,
                           self.fill_source)
        cells = ratios(per_cell_median(filled))
        other = other_readings(filled)
        short = self.short_pools()
        note = f"{short}. {self.note}" if short else self.note
        matrix = {"note": note, "accepts": self.accepts,
                  "workloads": [w.to_json() for w in self.columns],
                  "records": filled, "cells": cells, **other,
                  "settings": self.settings, "startup_s": self.startup_s,
                  "kv_pools": self.kv_pools, "kv_asked": self.kv_asked}
        write_json(matrix, self.out / "policy-matrix.json")      # a killed run leaves it whole
        (self.out / "report.md").write_text(
            matrix_report(cells, other, filled, self.accepts, self.columns,
                          f"**{short}.** {self.note}" if short else note))
        if cells:
            heatmap(cells, self.accepts, self.columns, self.out / "heatmap.png", note)


def kept_worker_env(previous: dict, engines: Sequence[str], dual_env: dict) -> dict:
    """The worker settings a matrix in DIR goes on with: this call's, or, in a call that runs
    no worker and names none, those of the worker records it keeps (baselines added after
    the worker's call need not repeat its --dual-env)."""
    if previous and "dual" not in engines and not dual_env:
        return stored_settings(previous)["dual_env"]
    return dual_env


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(prog="python -m bench.sglang.policy_matrix",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--accept", type=float_list, default="1.5,2.0,3.0,3.5")
    ap.add_argument("--engines", type=name_list(ENGINES), default=list(ENGINES),
                    help="comma-separated, of plain, eagle3, dual (default all three)")
    ap.add_argument("--workload", type=workload_arg, action="append",
                    help="IN x OUT @ C,...; repeatable")
    ap.add_argument("--budget-s", type=float, default=560.0)
    ap.add_argument("--processes", type=int, default=1,
                    help="processes per engine, taken in turn; a cell's tok/s is their median")
    ap.add_argument("--radix-cache", action="store_true",
                    help="SGLang's default radix cache on (off: --disable-radix-cache)")
    ap.add_argument("--freeze-gc", action="store_true",
                    help="every engine freezes Python's collectors once warm, before its "
                         "timed cells (SGLang's Engine.freeze_gc), as a tuned server does: a "
                         "full collection of start-up's objects then cannot stall a cell")
    ap.add_argument("--log-level", default="warning",
                    help="SGLang's log level in each engine's log (DIR/NAME.log)")
    ap.add_argument("--step-log", action="store_true",
                    help="the worker writes DIR/dual.steps.jsonl (modes and measured step "
                         "costs; a little host time a step) and DIR/step-costs.md")
    ap.add_argument("--dual-env", action="append", default=[],
                    help="DGW_NAME=VALUE for the worker (default: none, its defaults)")
    ap.add_argument("--attention-backend", default="triton",
                    help="every engine's attention backend; 'default' lets SGLang pick (fa3 on "
                         "Hopper)")
    ap.add_argument("--acc-sampling", choices=SAMPLINGS, default="diffused",
                    help="a non-integer forced accept length a step: diffused (its floor or "
                         "ceiling, deterministic, the running mean on target) or sglang "
                         "(SGLang's random draw: engines' realized acceptance differs by a few "
                         "%% in short cells)")
    ap.add_argument("--short-cell-s", type=float, default=Repeats.short_s,
                    help="a cell whose first run is shorter runs --short-cell-runs times in all; "
                         "its tok/s is their median (0: every cell once)")
    ap.add_argument("--short-cell-runs", type=int, default=Repeats.runs)
    ap.add_argument("--host-load", type=int, default=0, metavar="N",
                    help="N processes spin on the CPU while every cell runs (default 0): how a "
                         "loaded host moves the engines")
    ap.add_argument("--interleave", action="store_true",
                    help="every engine up at once (same KV pool each), each cell taken by one "
                         "engine after another in a rotating order (interleave.py)")
    ap.add_argument("--start-together", action="store_true",
                    help="with --interleave: launch every engine at once rather than each "
                         "after the last is up (start-ups one after another take most of a "
                         "short call); each KV pool is checked after and a short one warned of")
    ap.add_argument("--rounds", type=int, default=1,
                    help=f"with --interleave: every cell this many times (1-{MAX_RUNS}), one run "
                         "a round, each round in its own engine order; tok/s is the median "
                         "round (a spell of seconds then moves one round of one engine, not a "
                         "cell). Over 1, the short-cell repeats are off")
    ap.add_argument("--pin-cpus", metavar="LIST",
                    help="every engine's processes (its scheduler, detokenizer and client) on "
                         "these CPUs, e.g. 2-5: with --interleave, engines take turns, so each "
                         "serves on the same cores (on a virtual machine a thread's core can "
                         "run it slower for seconds)")
    ap.add_argument("--fill-from", metavar="JSON",
                    help="an earlier run's policy-matrix.json: its plain/EAGLE-3 records fill the "
                         "cells this run did not measure, marked cross-run")
    args = ap.parse_args(argv)
    accepts = args.accept
    if err := accept_problem("--accept", accepts):
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.short_cell_s < 0 or not 1 <= args.short_cell_runs <= MAX_RUNS:
        print(f"error: --short-cell-s must be >= 0 and --short-cell-runs 1-{MAX_RUNS}",
              file=sys.stderr)
        return 2
    repeats = Repeats(args.short_cell_s, args.short_cell_runs)
    if args.host_load < 0:
        print(f"error: --host-load must be >= 0 processes, got {args.host_load}",
              file=sys.stderr)
        return 2
    if not 1 <= args.processes <= 9:
        print(f"error: --processes must be 1-9, got {args.processes}", file=sys.stderr)
        return 2
    engines = args.engines
    workloads = args.workload or [Workload.parse(w) for w in DEFAULT_WORKLOADS]
    if args.rounds != 1 and not (args.interleave and 1 <= args.rounds <= MAX_RUNS):
        print(f"error: --rounds takes 1-{MAX_RUNS} and needs --interleave", file=sys.stderr)
        return 2
    # Several rounds read each cell that many times, so a cell's own repeats go.
    if args.rounds > 1:
        repeats = Repeats(0.0, 1)
    runs, flag = (args.rounds, "--rounds") if args.rounds > 1 else \
        (repeats.runs, "--short-cell-runs")
    if runs > 1 and max(c for w in workloads for c in w.concurrency) >= REPEAT_SEED_STRIDE:
        print(f"error: {flag} draws fresh prompts for C < {REPEAT_SEED_STRIDE} only; pass "
              f"{flag} 1 for larger C", file=sys.stderr)
        return 2
    try:
        dual_env = assignments(args.dual_env)
    except ConfigError as exc:
        print(f"error: --dual-env: {exc}", file=sys.stderr)
        return 2
    cpus = None
    if args.pin_cpus is not None:
        try:
            cpus = cpu_list(args.pin_cpus)
        except ValueError as exc:
            print(f"error: --pin-cpus: {exc}", file=sys.stderr)
            return 2
        if missing := sorted(set(cpus) - os.sched_getaffinity(0)):
            print(f"error: --pin-cpus: CPU {missing[0]} is not one this process may use "
                  f"({_spans(sorted(os.sched_getaffinity(0)))})", file=sys.stderr)
            return 2
    if args.interleave and len(engines) > 1 and \
            (total := gpu_total_mib()) is not None and total < interleave.MIN_GPU_MIB:
        print(f"error: --interleave holds {len(engines)} engines of "
              f"{interleave.ENGINE_KWARGS['max_total_tokens']} KV tokens each, which needs "
              f"{interleave.MIN_GPU_MIB / 1024:.0f} GiB or more; this GPU has "
              f"{total / 1024:.0f} GiB: leave out --interleave (the engines then run one "
              "after another) or measure one engine a call", file=sys.stderr)
        return 2
    backend = engine_attention_backend(args.attention_backend)
    gpu = gpu_name()
    settings = {"attention_backend": args.attention_backend, "dual_env": dual_env,
                "short_cells": {"below_s": repeats.short_s, "runs": repeats.runs},
                "host_load": args.host_load, "interleave": args.interleave,
                "rounds": args.rounds, "pin_cpus": args.pin_cpus and _spans(cpus),
                "radix_cache": args.radix_cache, "acc_sampling": args.acc_sampling, "gpu": gpu,
                "freeze_gc": args.freeze_gc}
    earlier = []
    if args.fill_from:
        try:
            filler = json.loads(Path(args.fill_from).read_text())
            earlier = filler["records"]
            if not isinstance(earlier, list) or not isinstance(filler.get("settings") or {}, dict) \
                    or not isinstance(filler.get("note") or "", str):
                raise TypeError("its records must be a list, its settings an object and its "
                                "note a string")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            print(f"error: --fill-from {args.fill_from}: not a policy-matrix.json ({e})",
                  file=sys.stderr)
            return 2
        if err := other_settings(filler, settings, ("attention_backend", "host_load",
                                                    "radix_cache", "acc_sampling", "gpu",
                                                    "freeze_gc")):
            print(f"error: --fill-from {args.fill_from} {err}", file=sys.stderr)
            return 2
    if args.start_together and not args.interleave:
        print("error: --start-together needs --interleave", file=sys.stderr)
        return 2
    if args.interleave and args.processes != 1:
        print("error: --interleave runs one process per engine; leave out --processes",
              file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    matrix_path = out / "policy-matrix.json"
    fix = "pass another --out or remove that file"
    try:
        previous = read_json_object(matrix_path, "the matrix in --out", fix) \
            if matrix_path.exists() else {}
        kept_records = [r for r in previous.get("records", [])
                        if r["engine"] not in engines and "from" not in r]
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (TypeError, KeyError, AttributeError) as exc:
        print(f"error: {matrix_path}: not a policy-matrix.json ({exc!r}); {fix}",
              file=sys.stderr)
        return 2
    dual_env = settings["dual_env"] = kept_worker_env(previous, engines, dual_env)
    # The records kept from an earlier run into DIR must come from the same servers; the
    # sampling of forced acceptance matters where EAGLE-3's or the worker's records are kept.
    kept = ("attention_backend", "short_cells", "host_load", "interleave", "rounds",
            "pin_cpus", "radix_cache", "gpu", "freeze_gc") \
        + (() if "dual" in engines else ("dual_env",)) \
        + (() if {"eagle3", "dual"} <= set(engines) else ("acc_sampling",))
    if previous and (err := other_settings(previous, settings, kept)):
        print(f"error: {matrix_path} {err}", file=sys.stderr)
        return 2
    deadline = time.time() + args.budget_s
    out.mkdir(parents=True, exist_ok=True)
    shapes = llama3_8b_shapes()
    target, draft = write_dummy_pair(out / "models", shapes)
    recs = kept_records
    note = (f"{gpu}, SGLang 0.5.17, Llama-3-8B shape, DUMMY weights, accept length FORCED "
            f"(SGLANG_SIMULATE_ACC_LEN, switched in-process; non-integer lengths "
            f"{'error-diffused' if args.acc_sampling == 'diffused' else 'drawn at random'} per "
            f"step), {backend or 'SGLang default'} attention, 3 steps topk 1, "
            f"radix cache {'on' if args.radix_cache else 'off'}, T=0 ignore_eos, "
            + ("collectors frozen once warm, " if args.freeze_gc else "") +
            f"worker at its defaults{' + ' + str(dual_env) if dual_env else ''}"
            + (f"; every engine's processes on CPUs {_spans(cpus)}" if cpus else "")
            + (f"; HOST LOADED ON PURPOSE: {args.host_load} processes spin on the CPU while "
               "each cell runs" if args.host_load else "")
            + ("; engines up at once" + (LAUNCHED_TOGETHER if args.start_together else "")
               + ", each cell taken in turn in a rotating order"
               + (f" in {args.rounds} rounds (tok/s: the median round)" if args.rounds > 1
                  else "") + ", KV pool "
               f"{interleave.ENGINE_KWARGS['max_total_tokens']} tokens each, worker stash "
               f"{interleave.STASH_MB} MiB" if args.interleave else ""))
    columns = merged_workloads(previous.get("workloads", []), workloads)
    accepts_seen = sorted(set(previous.get("accepts", [])) | set(accepts))
    run = Run(out=out, accepts=accepts, workloads=workloads, repeats=repeats,
              host_load=args.host_load, vocab=shapes.vocab_size, target=target, draft=draft,
              radix=args.radix_cache, log_level=args.log_level, backend=backend,
              acc_sampling=args.acc_sampling, dual_env=dual_env, step_log=args.step_log,
              rounds=args.rounds, cpus=cpus, freeze_gc=args.freeze_gc)
    writer = MatrixWriter(out, note, accepts_seen, columns, settings, earlier,
                          args.fill_from or "", previous.get("startup_s", {}),
                          previous.get("kv_pools") or {},
                          # Engines in turn ask no pool: each takes what SGLang sizes alone (a
                          # spec engine less than plain, as a real server would).
                          interleave.ENGINE_KWARGS["max_total_tokens"] if args.interleave
                          else None)
    failed: dict[str, str] = {}          # engine (process) name -> why its run failed
    with host_speed.Sampler(out / HOST_SPEED_FILE):
        if args.interleave:
            def built(results: dict[str, dict]) -> dict[str, list[dict]]:
                return {kind: records(kind, res, workloads) for kind, res in results.items()}

            def filed(results: dict[str, dict], each: dict[str, list[dict]]) -> list[dict]:
                return recs + with_host_record([r for got in each.values() for r in got],
                                               results, out)

            def phase_done(so_far: dict[str, dict]) -> None:
                # Each engine's pool with the records, so a run killed later says it too.
                for kind, res in so_far.items():
                    writer.started(kind, res)
                writer.write(filed(so_far, built(so_far)))

            results = interleave.run_all(
                {kind: engine_spec(run, kind, 0, interleave.ENGINE_KWARGS, interleave.DUAL_ENV)
                 for kind in engines},
                interleave_plan(run, engines), out, deadline,
                on_phase=phase_done,
                together=args.start_together)
            each = built(results)
            for kind, res in results.items():
                writer.started(kind, res)
                if why := failure(res, bool(each[kind])):
                    failed[kind] = why
            recs = filed(results, each)
            writer.write(recs)
        else:
            for process, kind in itertools.product(range(args.processes), engines):
                name = kind if not process else f"{kind}.p{process + 1}"
                res = run_engine(name, engine_spec(run, kind, process), out, deadline)
                got = records(kind, res, workloads)
                if why := failure(res, bool(got)):
                    failed[name] = why
                recs += [r | ({"process": process + 1} if args.processes > 1 else {})
                         for r in with_host_record(got, {kind: res}, out)]
                writer.started(name, res)
                writer.write(recs)
    print((out / "report.md").read_text() if (out / "report.md").exists() else "no cells")
    if (out / "dual.steps.jsonl").exists():
        dual = json.loads((out / "dual.json").read_text()) if (out / "dual.json").exists() \
            else None
        costs = step_costs.full_report(list(json_lines(out / "dual.steps.jsonl")), dual,
                                       host_speed.read(out / HOST_SPEED_FILE))
        (out / "step-costs.md").write_text(costs)
        print("worker step costs by place in a run (step-costs.md):\n" + costs)
    # Last, where a device call's tail of the output still holds them.
    if short := writer.short_pools():
        print(f"[matrix] WARNING: {short}", file=sys.stderr, flush=True)
    for name, why in failed.items():
        print(f"[matrix] FAILED {name}: {why}", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
