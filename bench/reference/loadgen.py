"""Closed-loop load for a worker: keep `concurrency` requests running, measure tokens/s.

Used by `dgw demo` (a load ramp on CPU or GPU), `dgw accept-shift`, `dgw bench` (a concurrency
sweep on GPU) and bench.demo_requests.
Timing covers the whole phase (prefills included) and, separately, the decode steps alone.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import numpy as np

from dual_graph_worker.core.modes import Mode


@dataclass(frozen=True)
class Phase:
    concurrency: int
    num_requests: int
    input_len: int
    output_len: int
    output_spread: float = 0.0      # output lengths uniform in output_len * (1 -/+ spread)

    def output_lens(self, rng: np.random.Generator, n: int) -> list[int]:
        if not self.output_spread:
            return [self.output_len] * n
        lo, hi = output_range(self.output_len, self.output_spread)
        return rng.integers(lo, hi + 1, size=n).tolist()


# Every request decodes at least once: one output token is the prefill's alone.
MIN_OUTPUT_LEN = 2


def output_range(output_len: int, spread: float) -> tuple[int, int]:
    """Shortest and longest output of a phase: output_len x (1 -/+ spread), at least
    MIN_OUTPUT_LEN."""
    lo = max(MIN_OUTPUT_LEN, round(output_len * (1 - spread)))
    return lo, max(lo, round(output_len * (1 + spread)))


class RequestOutput(NamedTuple):
    prompt: tuple
    output: tuple
    requested: int              # max_new_tokens it was admitted with


@dataclass(frozen=True)
class PhaseResult:
    concurrency: int
    requests: int
    tokens: int                 # generated tokens, first tokens from prefill included
    step_tokens: int            # tokens from decode/spec steps only
    seconds: float              # whole phase
    step_seconds: float         # decode/spec steps only
    steps: int
    modes: dict                 # mode -> steps
    mean_accept_len: float      # over spec steps (0 when none)
    outputs: tuple = ()         # RequestOutput per request in admission order, if collected

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def step_tok_s(self) -> float:
        return self.step_tokens / self.step_seconds if self.step_seconds else 0.0

    @property
    def tpot_s(self) -> float:
        """Time per output token of one request: decode time over tokens a request got per step."""
        return self.step_seconds / self.steps / (self.step_tokens / self.steps / self.concurrency) \
            if self.steps and self.step_tokens else 0.0

    def to_json(self) -> dict:
        return {"concurrency": self.concurrency, "requests": self.requests, "tokens": self.tokens,
                "step_tokens": self.step_tokens, "seconds": self.seconds,
                "step_seconds": self.step_seconds, "steps": self.steps, "modes": self.modes,
                "mean_accept_len": self.mean_accept_len, "tok_s": self.tok_s,
                "step_tok_s": self.step_tok_s, "tpot_ms": self.tpot_s * 1e3}


# (rng, number of prompts, prompt length) -> prompts
PromptSource = Callable[[np.random.Generator, int, int], list]


def uniform_prompts(vocab: int) -> PromptSource:
    return lambda rng, n, length: rng.integers(0, vocab, size=(n, length)).tolist()


def request_streams(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """A phase's prompt and output-length streams: their own, so every worker gets the same
    requests in the same order, however its admissions are batched."""
    return np.random.default_rng(seed), np.random.default_rng((seed, 1))


class PhaseRun:
    """One worker's way through a phase, one action (an admission or a step) per `advance`, so
    several workers can share a noisy machine fairly (`run_side_by_side`). Seconds are the
    worker's own actions, not the wall time between them."""

    def __init__(self, worker, phase: Phase, vocab: int, seed: int = 0, prefill_chunk: int = 64,
                 collect_outputs: bool = False, prompts: Optional[PromptSource] = None,
                 on_step: Optional[Callable[[object], None]] = None) -> None:
        self.worker, self.phase, self.prefill_chunk = worker, phase, prefill_chunk
        self.collect_outputs, self.on_step = collect_outputs, on_step
        self.rng, self.len_rng = request_streams(seed)
        self.prompts = prompts or uniform_prompts(vocab)
        self.admitted = self.tokens = 0
        self.seconds = self.step_seconds = 0.0
        self.done, self.recs = [], []
        self.requested: dict[int, int] = {}

    @property
    def finished(self) -> bool:
        return self.admitted >= self.phase.num_requests and not self.worker.num_running

    def advance(self) -> None:
        w, phase = self.worker, self.phase
        t0 = time.perf_counter()
        room = min(phase.concurrency - w.num_running, phase.num_requests - self.admitted,
                   self.prefill_chunk)
        if room > 0:
            lens = phase.output_lens(self.len_rng, room)
            res = w.add_requests(self.prompts(self.rng, room, phase.input_len), lens)
            self.requested.update(zip(res.rids, lens))
            self.done.extend(w.take_finished())       # a prefill may finish requests too
            # add_requests returns the prefill's host tokens, so the device has finished.
            self.tokens += len(res.first_tokens)
            self.admitted += room
            self.seconds += time.perf_counter() - t0
            return
        result = w.step()                  # step() waits for its outputs
        dt = time.perf_counter() - t0
        self.seconds += dt
        self.step_seconds += dt
        self.tokens += int(result.accept_lens.sum())
        self.recs.append(result.record)
        self.done.extend(w.take_finished())
        if self.on_step is not None:
            self.on_step(result)

    def result(self) -> PhaseResult:
        recs = self.recs
        spec = [r.mean_accept_len for r in recs if r.mode is Mode.SPEC]
        outputs = (tuple(RequestOutput(f.prompt, f.output, self.requested[f.rid])
                         for f in sorted(self.done, key=lambda f: f.rid))
                   if self.collect_outputs else ())
        return PhaseResult(self.phase.concurrency, self.admitted, self.tokens,
                           sum(r.tokens for r in recs), self.seconds, self.step_seconds,
                           len(recs), dict(Counter(r.mode.value for r in recs)),
                           float(np.mean(spec)) if spec else 0.0, outputs)


def run_phase(worker, phase: Phase, vocab: int, **kwargs) -> PhaseResult:
    """One worker through `phase` (PhaseRun's arguments): `prompts` draws the prompts (default:
    uniform over the vocabulary); `on_step` sees every StepResult after its step."""
    run = PhaseRun(worker, phase, vocab, **kwargs)
    while not run.finished:
        run.advance()
    return run.result()


def run_side_by_side(runs: dict[str, PhaseRun]) -> dict[str, PhaseResult]:
    """Advance every run one action in turn until all are done: a slow spell of a shared
    machine then falls on every worker alike, and their ratios stay meaningful."""
    while not all(r.finished for r in runs.values()):
        for r in runs.values():
            if not r.finished:
                r.advance()
    return {name: r.result() for name, r in runs.items()}
