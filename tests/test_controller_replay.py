"""The controller through the policy matrix's sequence, in a SIMULATED server whose step and
prefill costs are fitted to the H200 measurements of plain SGLang (no draft to prefill) and EAGLE-3
(results/sglang/policy-matrix-run1), with a catch-up's fixed cost and SGLang's overlap order (a
step's cost is reported after the next launch and holds a switch's host launch) and step costs that
grow with the context (fitted to the worker's H200 step log). Every cell: the worker's simulated tok/s against the better
of the same simulator pinned to decode (plain) or to speculation (EAGLE-3). What it guards: the
decisions the matrix run exposed (a stale acceptance after a phase change, prompt costs that
drown speculation, warm-up samples that stick, a size measured over long prompts taken for the
same size over short ones), not the GPU's numbers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest

from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.core.modes import GraphKey, Mode
from dual_graph_worker.core.planner import StepPlanner
from dual_graph_worker.core.policies import PolicyContext, build_policy
from dual_graph_worker.core.policy import Admitted, PrefillTime, StepTime, accepted
from dual_graph_worker.core.simple_policies import PinnedPolicy
from dual_graph_worker.core.settings import Settings

RESULTS = Path(__file__).resolve().parents[1] / "results/sglang"
MATRIX = RESULTS / "policy-matrix-run1/policy-matrix.json"
# SGLang's default backend: EAGLE-3 ahead of plain at accept 1.5 up to C=32, 11% at C=1.
MATRIX_FA3 = RESULTS / "policy-matrix-fa3-run1/policy-matrix.json"
K = 3
SPEC = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 40, 44, 48, 56,
        64)
DECODE = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136,
          144, 152, 160, 168, 176, 184, 192, 200, 208, 216, 224, 232, 240, 248, 256)
PREFILL_S_PER_TOKEN = 26e-6        # target prefill (2048x64 C=64, plain: 4.0 s, ~0.6 s decode)
DRAFT_S_PER_TOKEN = 2e-6           # the draft's extend over a token (prefill or catch-up)
CATCH_UP_FIXED_S = 2e-3            # a catch-up is one more (eager) draft forward, whatever its size
DRAFT_SHARE = 0.040                # Llama-3-8B's EAGLE-3 head: batch_costs.draft_share
# Host launch of a step of another kind (a switch, a catch-up): eager and kernel-launch-bound at
# small batches, it idles the GPU; under overlap it lands in the previous step's measured cost.
SWITCH_HOST_S = 3e-3
CHUNK = 8192
# Step seconds per context token (attention), by padded batch: fitted to the worker's H200 step
# log (policy matrix run 5), e.g. a spec step at bs 16 took 25.7 ms over 2048-token prompts and
# 10.8 ms over 256-token ones, at bs 1 11.2 against 6.8 ms; a decode step at bs 64 12.1 and 6.6.
CONTEXT_S_PER_TOKEN = {Mode.SPEC: {1: 1.8e-6, 16: 0.53e-6, 32: 0.34e-6, 64: 0.55e-6},
                       Mode.DECODE: {1: 0.33e-6, 16: 0.032e-6, 64: 0.05e-6, 128: 0.036e-6,
                                     256: 0.036e-6}}
WARM = {"first_spec": 1.13, "first_spec_steps": 3, Mode.SPEC: 0.91, Mode.DECODE: 0.71,
        "before_last": 1.45, "last": 0.58, "after_catch_up": 0.97}
# As on H200 run 20's slower host: the process's first prefill (32 tokens with the draft) took
# 2.2 s, a prefill at a size not seen before ~0.1 s more (256 tokens 157 ms, 1024 138 ms, 8192
# 170 ms); bs 1's first ~36 spec steps 1.1-1.5x (other sizes' first 32 steps 1.00-1.18x their
# next 32), here every spec size's first 40.
FIRST_CALLS = WARM | {"first_spec": 1.3, "first_spec_steps": 40, "first_prefill_s": 2.0,
                      "new_prefill_s": 0.1}
# As in 5 of H200 runs 16-21's 16 processes: the process's first 40-120 spec steps, of any size,
# 1.13-1.29x their steady time; where the worker decodes, they come as sparse re-measurements.
SPEC_WARMING = WARM | {"spec_mode": 1.25, "spec_mode_steps": 100}
REF_CONTEXT = 384                   # a request's mean context in the cells the fit comes from


@dataclass
class Truth:
    """Step seconds per padded batch, fitted to the 256 in / 256 out cells."""

    dec: dict = field(default_factory=dict)
    spec: dict = field(default_factory=dict)

    @classmethod
    def from_matrix(cls, records: list[dict]) -> "Truth":
        t = cls()
        for r in records:
            if (r["input_len"], r["output_len"]) != (256, 256):
                continue
            c = r["concurrency"]
            seconds = c * 256 / r["tok_s"]
            if r["engine"] == "plain":
                t.dec[c] = (seconds - c * 256 * PREFILL_S_PER_TOKEN) / 256
            elif r["engine"] == "eagle3" and r["accept_len"] == 3.0:
                prefill = c * 256 * (PREFILL_S_PER_TOKEN + DRAFT_S_PER_TOKEN)
                t.spec[c] = (seconds - prefill) * 3.0 / 256
        return t

    @staticmethod
    def _interp(table: dict, bs: int) -> float:
        xs = sorted(table)
        return float(np.interp(bs, xs, [table[x] for x in xs]))

    def step(self, mode: Mode, pb: int, kv_tokens: int = 0, bs: int = 0) -> float:
        """At `pb`; with `kv_tokens`, moved from the fit's context (`bs` requests of
        REF_CONTEXT tokens) to the batch's."""
        base = self._interp(self.spec if mode is Mode.SPEC else self.dec, pb)
        if not kv_tokens:
            return base
        rate = self._interp(CONTEXT_S_PER_TOKEN[mode], pb)
        return max(base + rate * (kv_tokens - bs * REF_CONTEXT), base / 2)


@dataclass
class Server:
    """One engine: prefills in chunks, deferral by preview (lazy catch-up), decode steps until
    the batch finishes; reports what the SGLang worker reports."""

    truth: Truth
    planner: StepPlanner
    lazy: bool = True
    draft: bool = True          # False: plain SGLang, no draft to prefill
    clock: float = 0.0
    rng: Optional[np.random.Generator] = None
    diffused: Optional[Callable[[float, str, int], int]] = None
    # Relative standard deviation of a step's time (the H200's bs 1 spec step: 5.9%), drawn
    # from `noise_rng`; 0: every step takes its fitted time.
    noise: float = 0.0
    noise_rng: Optional[np.random.Generator] = None
    # As on the H200 (matrix runs 5-6), each spec graph's first steps in the process slow, the
    # first step after a prefill or a catch-up short, a batch's last step short and the one
    # before it long, by these factors (WARM); with FIRST_CALLS also prefills' first calls
    # dear, with SPEC_WARMING the process's first spec steps slow; None: none of these.
    warm: Optional[dict] = None
    _runs: dict = field(default_factory=dict)
    _prefilled: set = field(default_factory=set)
    _spec_steps: int = 0

    def forced_accept(self, accept: float) -> float:
        """The accept length of a step: `accept`; with an rng as SGLANG_SIMULATE_ACC_LEN
        samples it (one length a step for the whole batch, the floor or the ceiling of the
        target, so that the mean matches it); or error-diffused as the matrix forces it."""
        if self.diffused is not None:
            return float(self.diffused(accept, "", K + 1))
        if self.rng is None:
            return accept
        low = int(accept)
        return low + float(self.rng.random() < accept - low)

    def cell(self, c: int, in_len: int, out_len: int, accept: float) -> float:
        t0 = self.clock
        rows = np.arange(1, c + 1)
        behind = np.zeros(c, dtype=np.int64)
        p = self.planner
        for start in range(0, c * in_len, CHUNK):
            tokens = min(CHUNK, c * in_len - start)
            defer = self.lazy and p.preview(c, kv_tokens=c * in_len) is Mode.DECODE
            drafted = self.draft and not defer
            cost = tokens * (PREFILL_S_PER_TOKEN + (DRAFT_S_PER_TOKEN if drafted else 0)) + 0.004
            cost += self._first_call(tokens)
            # The requests of this chunk are new: their rows forget their last occupants.
            first = start // in_len
            p.policy.observe(Admitted(tokens, rows[first:first + -(-tokens // in_len)]))
            p.policy.observe(PrefillTime(tokens, cost, draft=drafted))
            if defer:
                behind += tokens // c
            self.clock += cost
        made = np.zeros(c)
        held = None               # overlap: a step's result is processed after the next launch
        while made.min() < out_len:
            kv = int(c * in_len + made.sum())
            plan = p.plan(c, rows=rows, catch_up_tokens=int(behind.sum()), kv_tokens=kv)
            seconds = self.truth.step(plan.mode, plan.padded_bs, kv, c)
            if self.noise:
                seconds *= max(1.0 + self.noise * self.noise_rng.standard_normal(), 0.5)
            if self.warm is not None:
                key = (plan.mode, plan.padded_bs)
                self._runs[key] = self._runs.get(key, 0) + 1
                if plan.mode is Mode.SPEC:
                    self._spec_steps += 1
                    if self._runs[key] <= self.warm["first_spec_steps"]:
                        seconds *= self.warm["first_spec"]
                    if self._spec_steps <= self.warm.get("spec_mode_steps", 0):
                        seconds *= self.warm["spec_mode"]
                if not made.any():
                    seconds *= self.warm[plan.mode]
                elif held is not None and held[0].catch_up_tokens:
                    seconds *= self.warm["after_catch_up"]
            caught = 0
            if plan.mode is Mode.SPEC:
                caught = int(behind.sum())
                seconds += caught * DRAFT_S_PER_TOKEN + (CATCH_UP_FIXED_S if caught else 0.0)
                behind[:] = 0
                got = np.full(c, self.forced_accept(accept))
            else:
                behind += 1 if self.lazy else 0
                got = np.ones(c)
            if self.warm is not None and held is not None and (made + got).min() >= out_len:
                # The batch's last step, launched before its requests were seen finished: the
                # step before it holds their work, it is cut short.
                extra = held[0].seconds * (self.warm["before_last"] - 1.0)
                held = (held[0]._replace(seconds=held[0].seconds + extra), held[1])
                self.clock += extra
                seconds *= self.warm["last"]
            launch = SWITCH_HOST_S if held is not None and (
                plan.mode is not held[0].mode or caught) else 0.0
            if held is not None:
                step, acc = held
                p.policy.observe(step._replace(seconds=step.seconds + launch,
                                         carries_next=launch > 0))
                p.policy.observe(acc)
            held = (StepTime(plan.mode, plan.padded_bs, seconds, caught, kv_tokens=kv),
                    accepted(plan.mode, got, rows))
            made += got
            self.clock += seconds + launch
        if held is not None:
            for event in held:
                p.policy.observe(event)
        return c * out_len / (self.clock - t0)

    def _first_call(self, tokens: int) -> float:
        """A prefill's first-call cost: the process's first, or the first at its size."""
        shape = tokens.bit_length()
        if self.warm is None or "first_prefill_s" not in self.warm or shape in self._prefilled:
            return 0.0
        first = not self._prefilled
        self._prefilled.add(shape)
        return self.warm["first_prefill_s"] if first else self.warm["new_prefill_s"]


def _planner(policy) -> StepPlanner:
    return StepPlanner(DispatchTable.build(SPEC, DECODE), policy)


def _prior(truth: Truth) -> CalibrationTable:
    # Start-up replays: a spec step looks ~3x cheaper than it is end to end, decode ~1.2x.
    lat = {GraphKey(Mode.SPEC, b): truth.step(Mode.SPEC, b) / 3 for b in SPEC}
    lat |= {GraphKey(Mode.DECODE, b): truth.step(Mode.DECODE, b) / 1.2 for b in DECODE}
    return CalibrationTable(lat, K)


WORKLOADS = ((256, 256, (1, 4, 8, 16, 32, 48, 64, 128, 256)), (64, 1024, (1, 32, 128)),
             (2048, 64, (1, 16, 64)))
ACCEPTS = (1.5, 2.0, 3.0, 3.5)


def _run(server: Server, rounds: int = 1) -> dict:
    """Each cell's tok/s; with rounds > 1 each accept length's cells are taken in turn that many
    times, as the GPU matrix's --rounds, and each reads its median round."""
    out: dict = {}
    for a in ACCEPTS:
        for i, o, levels in WORKLOADS:
            server.cell(2, 16, 8, a)                       # the sweep's warm-up
            if a == ACCEPTS[0]:
                # As the matrix's first phase: every batch shape once, short answers.
                for c in levels:
                    server.cell(c, i, min(16, o), a)
        for _ in range(rounds):
            for i, o, levels in WORKLOADS:
                for c in levels:
                    out.setdefault((a, i, o, c), []).append(server.cell(c, i, o, a))
    return {cell: float(np.median(runs)) for cell, runs in out.items()}


def simulated_ratios(seed: Optional[int] = None, diffused: bool = False, matrix: Path = MATRIX,
                     noise: float = 0.0, warm: Optional[dict] = None,
                     settings: Settings = Settings(), rounds: int = 1) -> dict:
    """worker / max(plain, spec) per matrix cell, in the simulator fitted to `matrix`; with
    `seed`, acceptance sampled as SGLang forces it (each engine its own draws from the same
    seed); `diffused`, as the policy matrix forces it (bench/sglang/acc_control.py); `noise`,
    each step's time off its fit by that relative standard deviation (seeded alike); `warm`,
    each graph's first steps off as on the H200 (WARM, FIRST_CALLS, SPEC_WARMING); `settings`, the
    worker's; `rounds`, each cell's median of that many rounds (_run)."""
    truth = Truth.from_matrix(json.loads(matrix.read_text())["records"])
    ctx = PolicyContext(K, {Mode.SPEC: SPEC, Mode.DECODE: DECODE}, _prior(truth),
                        defers_prefill=True, max_rows=512, draft_share=DRAFT_SHARE)
    from bench.sglang.acc_control import DiffusedAcceptance

    rng = (lambda: None) if seed is None else (lambda: np.random.default_rng(seed))
    forced = DiffusedAcceptance if diffused else (lambda: None)
    noisy = {"noise": noise, "noise_rng": np.random.default_rng(1000),
             "warm": warm}
    dual = _run(Server(truth, _planner(build_policy(settings, ctx)), rng=rng(),
                       diffused=forced(), **noisy), rounds)
    noisy["noise_rng"] = np.random.default_rng(1000)
    plain = _run(Server(truth, _planner(PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=K)),
                        lazy=False, draft=False, rng=rng(), diffused=forced(), **noisy),
                 rounds)
    noisy["noise_rng"] = np.random.default_rng(1000)
    spec = _run(Server(truth, _planner(PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K)),
                       lazy=False, rng=rng(), diffused=forced(), **noisy), rounds)
    return {cell: dual[cell] / max(plain[cell], spec[cell]) for cell in dual}


@pytest.mark.skipif(not MATRIX.exists(), reason="needs the committed H200 matrix")
def test_the_controller_through_the_matrix_sequence_keeps_up_with_the_best_static_mode():
    # The first phase learns from a prior three times wrong; the lowest cells pay for
    # re-measurements: near a tie, or, at accept 1.5 and 2 C=64 (0.954, 0.958), one of
    # speculation that catches up the wave's deferred prompts, which the budget affords once
    # decode is no longer re-measured where speculation leads by more than _DECODE_DRIFT (at
    # 0.3 those cells read 1.000, and the sampled variants 13% more cells below 0.98).
    ratios = simulated_ratios()
    low = {cell: round(r, 3) for cell, r in ratios.items() if r < 0.95}
    assert not low, f"cells below 0.95 of the best static mode (simulated): {low}"
    # How many fall below 0.98 moves with when the budget allows a re-measurement: 5-6 on this
    # sequence as the least priced loss (_MIN_LOSS) moves from 0.045 to 0.06, 2-5 when every
    # re-measurement ran whole; the 12 variants of __main__ read alike either way (mean 0.9965
    # against 0.9963 then).
    assert sum(r < 0.98 for r in ratios.values()) <= 6
    # As the matrix forces acceptance (error-diffused): lowest 0.923, accept 1.5 2048x64 C=16,
    # where a re-measurement of speculation caught up the wave's deferred prompts (33.5k
    # tokens) in a 64-step cell; which short cell such a costly one lands in moves with any
    # change upstream (0.968 before the warm-up pricing, that cell then 1.000).
    diffused = simulated_ratios(diffused=True)
    low = {cell: round(r, 3) for cell, r in diffused.items() if r < 0.92}
    assert not low, f"diffused acceptance: cells below 0.92 (simulated): {low}"


if __name__ == "__main__":
    # python tests/test_controller_replay.py [CATCH_UP_FIXED_S] [--seeds N] [--rounds R]: the
    # simulated ratios, a model, on both matrices' fits, acceptance error-diffused or sampled as
    # SGLANG_SIMULATE_ACC_LEN does (seeds 0-3 and 0-1, or 0..N-1 of each), step times exact or
    # off by the H200's 5.9%, each cell once or its median of R rounds. A change that moves single cells moves them by 3-9% either way:
    # more seeds tell a gain from where a costly re-measurement happened to land.
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # bench/, run as a script
    ap = argparse.ArgumentParser(prog="python tests/test_controller_replay.py")
    ap.add_argument("catch_up_fixed_s", nargs="?", type=float, default=CATCH_UP_FIXED_S)
    ap.add_argument("--seeds", type=int, help="sampled variants per matrix (default 4 and 2)")
    ap.add_argument("--no-draft-floor", action="store_true", help="the worker with "
                    "DGW_DRAFT_FLOOR=0")
    ap.add_argument("--rounds", type=int, default=1, help="each accept length's cells taken in "
                    "turn this many times, each cell its median (as the GPU matrix's --rounds)")
    args = ap.parse_args()
    CATCH_UP_FIXED_S = args.catch_up_fixed_s
    triton_seeds = range(args.seeds or 4)
    fa3_seeds = range(args.seeds or 2)
    variants = [("triton run 1, error-diffused", dict(diffused=True)),
                ("triton run 1, error-diffused, noisy steps", dict(diffused=True, noise=0.059)),
                ("fa3 run 1, error-diffused", dict(diffused=True, matrix=MATRIX_FA3)),
                ("fa3 run 1, error-diffused, noisy steps",
                 dict(diffused=True, matrix=MATRIX_FA3, noise=0.059))]
    variants += [("fa3 run 1, error-diffused, batch edges off",
                  dict(diffused=True, matrix=MATRIX_FA3, warm=WARM)),
                 ("triton run 1, error-diffused, batch edges off", dict(diffused=True, warm=WARM))]
    variants += [("fa3 run 1, error-diffused, first calls slow",
                  dict(diffused=True, matrix=MATRIX_FA3, warm=FIRST_CALLS)),
                 ("triton run 1, error-diffused, first calls slow",
                  dict(diffused=True, warm=FIRST_CALLS))]
    variants += [("fa3 run 1, error-diffused, spec warming",
                  dict(diffused=True, matrix=MATRIX_FA3, warm=SPEC_WARMING)),
                 ("triton run 1, error-diffused, spec warming",
                  dict(diffused=True, warm=SPEC_WARMING))]
    variants += [(f"triton run 1, sampled, seed {s}", dict(seed=s)) for s in triton_seeds]
    variants += [(f"fa3 run 1, sampled, seed {s}, noisy steps",
                  dict(seed=s, matrix=MATRIX_FA3, noise=0.059)) for s in fa3_seeds]
    settings = Settings(draft_floor=not args.no_draft_floor)
    every = []
    for how, kw in variants:
        r = simulated_ratios(**kw, settings=settings, rounds=args.rounds)
        every += r.values()
        print(f"catch-up fixed cost {CATCH_UP_FIXED_S * 1e3:g} ms, {how}: lowest cell "
              f"{min(r.values()):.3f}, {sum(v < 0.98 for v in r.values())} of {len(r)} cells "
              f"below 0.98, mean {np.mean(list(r.values())):.3f} (SIMULATED)", flush=True)
    every = np.array(every)
    print(f"all {len(variants)} variants: mean {every.mean():.4f}, {int((every < 0.98).sum())} "
          f"cells below 0.98, shortfall below it {np.maximum(0.98 - every, 0).sum():.3f}, "
          f"lowest {every.min():.3f} (SIMULATED)")
