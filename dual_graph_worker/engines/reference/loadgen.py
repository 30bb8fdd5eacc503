"""Closed-loop load for a worker: keep `concurrency` requests running, measure tokens/s.

Used by `dgw demo` (a load ramp on CPU or GPU) and `dgw bench` (a concurrency sweep on GPU).
Timing covers the whole phase (prefills included) and, separately, the decode steps alone.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Phase:
    concurrency: int
    num_requests: int
    input_len: int
    output_len: int


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
    outputs: tuple = ()         # (prompt, output) per request in admission order, if collected

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_phase(worker, phase: Phase, vocab: int, seed: int = 0, prefill_chunk: int = 64,
              collect_outputs: bool = False) -> PhaseResult:
    rng = np.random.default_rng(seed)
    device = worker.engine.device
    admitted = tokens = 0
    step_seconds = 0.0
    done, recs = [], []
    _sync(device)
    t0 = time.perf_counter()
    while admitted < phase.num_requests or worker.num_running:
        room = min(phase.concurrency - worker.num_running, phase.num_requests - admitted, prefill_chunk)
        if room > 0:
            prompts = rng.integers(0, vocab, size=(room, phase.input_len)).tolist()
            res = worker.add_requests(prompts, phase.output_len)
            tokens += len(res.first_tokens)
            admitted += room
            continue
        ts = time.perf_counter()
        result = worker.step()
        step_seconds += time.perf_counter() - ts      # step() waits for its outputs
        tokens += int(result.accept_lens.sum())
        recs.append(result.record)
        done.extend(worker.take_finished())
    _sync(device)
    seconds = time.perf_counter() - t0
    spec = [r.mean_accept_len for r in recs if r.mode.value == "spec"]
    return PhaseResult(phase.concurrency, admitted, tokens, sum(r.tokens for r in recs), seconds,
                       step_seconds, len(recs), dict(Counter(r.mode.value for r in recs)),
                       float(np.mean(spec)) if spec else 0.0,
                       tuple((f.prompt, f.output) for f in sorted(done, key=lambda f: f.rid))
                       if collect_outputs else ())
