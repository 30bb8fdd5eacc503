"""SIMULATED: the policy matrix's cells served in turn by one goodput controller, as one worker
process serves them in `bench.sglang.policy_matrix` (accept lengths in turn; each workload's
levels ascending; a cell is one wave of C requests, all queued before its first 8192-token chunk
and prefilled before the next decode step, as SGLang's scheduler puts a waiting prefill first; the
worker runs or defers the draft's prefill of each chunk as its preview of the grown batch says),
against the same simulated server pinned to speculation (EAGLE-3) and to decode (plain), each
cell alone.
Step times are lines through H100 run 8's median steps (results/sglang/policy-matrix-h100-run8/
step-costs.md) with the context's cost per token, times seeded noise; prefill, the draft's
prefill and catch-up at that run's measured rates; accept lengths forced, error-diffused per
step for the whole batch (as SGLANG_SIMULATE_ACC_LEN). It shows where the controller's choices
and re-measurements cost against the better pinned mode; the GPU decides what a server does.

    python -m bench.matrix_sim [--accept 1.5,2,3,3.5] [--seed 0] [--noise 0.02]
                               [--dual-env DGW_NAME=VALUE ...] [--out out/matrix-sim.json]

--seed takes a list (0,7,14): each seed serves the whole matrix, the summary counts each
seed's cells, and the heatmap shows each cell's mean ratio over them. --dual-env sets the
worker's settings as policy_matrix's does: a CPU check of a setting before a GPU pass of it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from bench.burst_sim import K, sim_planner
from bench.capture_lists import DECODE_BS, SPEC_BS
from bench.sglang.matrix_records import Workload
from bench.sglang.matrix_report import cell_of, heatmap
from dual_graph_worker.core.argtypes import OneLineParser, float_range, output_file
from dual_graph_worker.core.batch_costs import CatchUpWork
from dual_graph_worker.core.errors import ConfigError, report_user_errors
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.planner import StepPlanner
from dual_graph_worker.core.policy import Admitted, PrefillTime, StepTime, accepted
from dual_graph_worker.core.settings import Settings, assignments
from dual_graph_worker.engines.sglang.kv_fill import KV_ONLY_MIN_TOKENS

# Median step ms per padded batch size at 256x256's mean context (384 a request), measured on an
# H100: results/sglang/policy-matrix-h100-run8/step-costs.md.
STEP_MS = {Mode.SPEC: {1: 8.37, 4: 8.57, 8: 8.76, 16: 9.07, 32: 10.06, 48: 11.30, 64: 12.23,
                       128: 20.50, 256: 35.17},
           Mode.DECODE: {1: 6.22, 4: 6.39, 8: 6.51, 16: 6.98, 32: 7.18, 48: 7.47, 64: 8.03,
                         128: 9.82, 256: 13.33}}
CONTEXT_S_PER_TOKEN = 40e-9          # both modes, from its 64x1024 and 2048x64 cells
MEAN_CONTEXT = 384
PREFILL_S_PER_TOKEN = 24e-6          # its 8192-token prefills
DRAFT_S_PER_TOKEN = 0.9e-6           # the draft's prefill and catch-up
CATCH_UP_FIXED_S = 1e-3
# DGW_CATCH_UP_KV_ONLY, ASSUMED from multiply-adds, not measured: a split pass's tokens at the
# share of the draft layer's work their K/V take (fc and the k/v rows, docs/design.md), its
# last rows at the whole rate, and the host work it adds.
KV_ONLY_SHARE = 67 / 293
KV_ONLY_PASS_S = 1e-3
CATCH_UP_PASS_TOKENS = 8192
PREFILL_CHUNK = 8192
PRIOR_SCALE = {Mode.SPEC: 0.7, Mode.DECODE: 0.75}     # start-up replays miss host work
WORKLOADS = (Workload(256, 256, (1, 4, 8, 16, 32, 48, 64, 128, 256)),
             Workload(64, 1024, (1, 32, 128)), Workload(2048, 64, (1, 16, 64)))


def step_seconds(mode: Mode, padded_bs: int, kv_tokens: int) -> float:
    sizes = sorted(STEP_MS[mode])
    base = float(np.interp(padded_bs, sizes, [STEP_MS[mode][b] for b in sizes])) / 1e3
    return max(base + CONTEXT_S_PER_TOKEN * (kv_tokens - MEAN_CONTEXT * padded_bs), base / 2)


@dataclass
class Server:
    """One engine process: its planner, its acceptance's error diffusion, its noise and the mode
    it is pinned to (plain: decode, EAGLE-3: spec, the worker: none)."""
    planner: StepPlanner
    rng: np.random.Generator
    noise: float
    pin: Optional[Mode] = None
    work: Optional[CatchUpWork] = None       # DGW_CATCH_UP_KV_ONLY's passes (the worker's)
    owed: float = 0.0

    @property
    def kv_only(self) -> bool:
        return self.work is not None

    def accept_len(self, accept: float) -> int:
        """The whole batch's accept length this step: the running mean stays at `accept`."""
        self.owed += accept
        n = int(self.owed)
        self.owed -= n
        return n

    def serve(self, accept: float, input_len: int, output_len: int, c: int) -> tuple[int, float]:
        """One wave of `c` requests: (tokens, seconds)."""
        policy, tokens, seconds = self.planner.policy, 0, 0.0
        live = np.zeros(c, bool)
        generated, behind = np.zeros(c, int), np.zeros(c, int)
        waiting = c
        while waiting or live.any():
            while waiting:
                new = np.flatnonzero(~live)[:min(waiting, max(PREFILL_CHUNK // input_len, 1))]
                draft = self.drafts(np.flatnonzero(live), waiting, input_len, generated, behind)
                live[new], generated[new] = True, 0
                waiting -= len(new)
                prompt = len(new) * input_len
                behind[new] = 0 if draft else input_len       # plain never catches up
                took = prompt * (PREFILL_S_PER_TOKEN + (DRAFT_S_PER_TOKEN if draft else 0.0))
                policy.observe(Admitted(prompt, new))
                policy.observe(PrefillTime(prompt, took, draft))
                seconds += took
            rows = np.flatnonzero(live)
            kv = int((input_len + generated[rows]).sum())
            backlog = int(behind[rows].sum())
            plan = self.planner.plan(len(rows), rows=rows, catch_up_tokens=backlog, kv_tokens=kv)
            mode = plan.mode
            spec = mode is Mode.SPEC
            caught_up = backlog if spec else 0
            took = step_seconds(mode, plan.padded_bs, kv) * float(
                np.exp(self.noise * self.rng.standard_normal())) + \
                self.catch_up_seconds(caught_up, int((behind[rows] > 0).sum()))
            lens = np.minimum(self.accept_len(accept) if spec else 1, output_len - generated[rows])
            policy.observe(StepTime(mode, plan.padded_bs, took, catch_up_tokens=caught_up,
                                    kv_tokens=kv))
            policy.observe(accepted(mode, lens.astype(float), rows))
            seconds += took
            tokens += int(lens.sum())
            generated[rows] += lens
            behind[rows] = 0 if spec else behind[rows] + lens
            live[rows[generated[rows] >= output_len]] = False
        return tokens, seconds

    def catch_up_seconds(self, tokens: int, requests: int) -> float:
        """A catch-up of `tokens` draft tokens over `requests` rows (0: none)."""
        if not tokens:
            return 0.0
        if self.work is None:
            return CATCH_UP_FIXED_S + DRAFT_S_PER_TOKEN * tokens
        passes = self.work.split(tokens)[0]     # each with its fill's host work
        return CATCH_UP_FIXED_S + passes * KV_ONLY_PASS_S + DRAFT_S_PER_TOKEN * (
            self.work.tokens(tokens) + (requests if passes else 0))

    def drafts(self, joins: np.ndarray, waiting: int, input_len: int, generated: np.ndarray,
               behind: np.ndarray) -> bool:
        """Whether the draft prefills the next chunk: EAGLE-3 always, plain never; the worker
        as the SGLang worker does, by its preview of the batch grown by every waiting prompt
        (the chunk and those queued behind it), over the backlog of the rows it joins."""
        if self.pin is not None:
            return self.pin is Mode.SPEC
        kv = int((input_len + generated[joins]).sum()) + waiting * input_len
        return self.planner.preview(len(joins) + waiting, kv_tokens=kv,
                                    prefill_tokens=waiting * input_len,
                                    catch_up_tokens=int(behind[joins].sum())) is Mode.SPEC


def server(pin: Optional[Mode], seed: int, noise: float, rows: int = 256,
           settings: Settings = Settings()) -> Server:
    work = CatchUpWork(KV_ONLY_MIN_TOKENS, KV_ONLY_SHARE, CATCH_UP_PASS_TOKENS) \
        if pin is None and settings.catch_up_kv_only else None
    planner = sim_planner({Mode.SPEC: SPEC_BS, Mode.DECODE: DECODE_BS},
                          lambda m, b: PRIOR_SCALE[m] * step_seconds(m, b, MEAN_CONTEXT * b),
                          rows, pin, settings=settings, catch_up_work=work)
    return Server(planner, np.random.default_rng(seed), noise, pin, work=work)


def simulate(accepts: list[float], seed: int, noise: float,
             workloads: tuple[Workload, ...] = WORKLOADS,
             settings: Settings = Settings()) -> list[dict]:
    """Every cell's tok/s per engine and the worker's ratio to the better pinned one."""
    engines = {"dual": server(None, seed, noise, settings=settings),
               "eagle3": server(Mode.SPEC, seed + 1, noise),
               "plain": server(Mode.DECODE, seed + 2, noise)}
    cells = []
    for a in accepts:
        for w in workloads:
            for c in w.concurrency:
                tok_s = {}
                for name, s in engines.items():
                    tokens, seconds = s.serve(a, w.input_len, w.output_len, c)
                    tok_s[name] = tokens / seconds
                best = max(tok_s["eagle3"], tok_s["plain"])
                cells.append({"seed": seed, "accept_len": a, "input_len": w.input_len,
                              "output_len": w.output_len, "concurrency": c,
                              **{k: round(v, 1) for k, v in tok_s.items()},
                              "ratio": round(tok_s["dual"] / best, 4)})
    return cells


def summary(cells: list[dict]) -> dict:
    ratios = [c["ratio"] for c in cells]
    return {"at_least_0_98": sum(r >= 0.98 for r in ratios), "cells": len(ratios),
            "mean": float(np.mean(ratios)), "lowest": min(ratios)}


def mean_over_seeds(cells: list[dict]) -> list[dict]:
    """One cell per (accept, workload, C): its mean ratio over the seeds that served it."""
    by: dict[tuple, list[dict]] = {}
    for c in cells:
        by.setdefault(cell_of(c), []).append(c)
    return [{**runs[0], "ratio": round(float(np.mean([r["ratio"] for r in runs])), 4),
             "seed": [r["seed"] for r in runs]} for runs in by.values()]


def serve_seeds(accepts: list[float], seeds: list[int], noise: float,
                settings: Settings) -> tuple[list[dict], list[dict]]:
    """The matrix once per seed, each seed's summary printed as it ends: every cell, and the
    summaries."""
    cells, per_seed = [], []
    for seed in seeds:
        mine = simulate(accepts, seed, noise, WORKLOADS, settings)
        cells += mine
        per_seed.append(s := {"seed": seed, **summary(mine)})
        if len(seeds) == 1:
            for a in accepts:
                print(f"accept {a}: " + " ".join(f"{c['ratio']:.3f}" for c in mine
                                                 if c["accept_len"] == a))
        print(f"seed {seed}: {s['at_least_0_98']} of {s['cells']} cells >= 0.98, mean "
              f"{s['mean']:.3f}, lowest {s['lowest']:.3f}")
    if len(seeds) > 1:
        print(f"over {len(seeds)} seeds: "
              f"{np.mean([s['at_least_0_98'] for s in per_seed]):.1f} cells >= 0.98 on average")
    return cells, per_seed


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(prog="python -m bench.matrix_sim", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--accept", default="1.5,2,3,3.5", help="forced accept lengths in 1..4")
    ap.add_argument("--seed", default="0", help="a seed or a list of seeds, e.g. 0,7,14")
    ap.add_argument("--noise", type=float_range(0.0, 0.5), default=0.02,
                    help="step times' lognormal sigma")
    ap.add_argument("--dual-env", action="append", default=[],
                    help="DGW_NAME=VALUE for the simulated worker (default: its defaults)")
    ap.add_argument("--out", type=output_file, default="out/matrix-sim.json")
    args = ap.parse_args(argv)
    try:
        accepts = [float(a) for a in args.accept.split(",")]
    except ValueError:
        ap.error(f"--accept wants numbers like 1.5,2, got {args.accept!r}")
    try:
        seeds = [int(s) for s in args.seed.split(",")]
    except ValueError:
        ap.error(f"--seed wants integers like 0 or 0,7,14, got {args.seed!r}")
    if min(seeds) < 0:
        ap.error(f"--seed wants integers >= 0 like 0 or 0,7,14, got {args.seed!r}")
    if not all(1.0 <= a <= K + 1 for a in accepts):
        ap.error(f"--accept wants accept lengths in 1..{K + 1}, got {args.accept!r}")
    try:
        dual_env = assignments(args.dual_env)
    except ConfigError as exc:
        ap.error(f"--dual-env: {exc}")
    settings = Settings.from_env(dual_env)
    note = (f"SIMULATED server (step lines through H100 run 8's medians, noise {args.noise}, "
            f"seed {args.seed}), accept forced, worker at its defaults"
            f"{' + ' + str(dual_env) if dual_env else ''}"
            + ("; K/V-only catch-ups at an ASSUMED price (multiply-adds)"
               if settings.catch_up_kv_only else "") + "; not a measurement")
    print(note)
    cells, per_seed = serve_seeds(accepts, seeds, args.noise, settings)
    out = Path(args.out)
    write_json({"simulated": True, "note": note, "dual_env": dual_env,
                "seeds": [s | {"mean": round(s["mean"], 4)} for s in per_seed], "cells": cells},
               out)
    heatmap(mean_over_seeds(cells), accepts, list(WORKLOADS), out.with_suffix(".png"), note)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(report_user_errors(main))
