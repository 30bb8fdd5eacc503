"""Shared fixtures for the CPU tests: toy checkpoints (written once per session), small engine
and worker factories, a seeded random mode policy, and a driver that runs a request schedule
while checking KV-slot conservation after every step.

Helpers are exposed as fixtures (not imported from this module) so test files never depend on
how pytest puts `tests/` on sys.path.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import pytest
import torch

from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.engines.reference.build import (EngineSpec, engine_from_checkpoints,
                                                       engine_from_dummy)
from dual_graph_worker.engines.reference.config import ModelPair, tiny_shape
from dual_graph_worker.engines.reference.engine import ReferenceEngine
from dual_graph_worker.engines.reference.weights import load_draft, load_target
from dual_graph_worker.engines.reference.toy import ToyPermutations, toy_permutations, write_toy_checkpoints
from dual_graph_worker.engines.reference.kv_slots import DUMMY_SLOT
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import Accepted, Decision, PolicyInputs, PolicyState, Reason
from dual_graph_worker.core.simple_policies import AcceptLengthEMA
from dual_graph_worker.engines.reference.results import StepResult
from dual_graph_worker.engines.reference.worker import DualGraphWorker, WorkerConfig

# Tiny models: per-op overhead dominates, and extra intra-op threads only add contention.
torch.set_num_threads(1)

TOY_VOCAB = 64          # write_toy_checkpoints default: vocab == hidden == 64
ATTN_NOISE = 0.06


# ---------------------------------------------------------------- checkpoints and engines


@pytest.fixture(scope="session")
def toy_ckpts(tmp_path_factory):
    """target + draft-f100 / draft-f50 / draft-f0, written once for the whole session."""
    return write_toy_checkpoints(tmp_path_factory.mktemp("toy-checkpoints"))


@pytest.fixture(scope="session")
def toy_perm() -> ToyPermutations:
    """The toy target's permutation p: greedy next(t) = p[t]."""
    return toy_permutations(TOY_VOCAB, 1.0)


@pytest.fixture(scope="session")
def toy_engine(toy_ckpts):
    """Factory: a reference engine over the toy target and the draft of one agreement level."""

    def make(level: str = "f100", k: int = 3, max_requests: int = 16, max_context: int = 64,
             num_slots: int = 0):
        spec = EngineSpec(num_draft_tokens=k, max_requests=max_requests, max_context=max_context,
                          num_slots=num_slots)
        return engine_from_checkpoints(toy_ckpts.target, toy_ckpts.drafts[level], spec)

    return make


@pytest.fixture(scope="session")
def toy_attn_engine(toy_ckpts):
    """Factory: the toy pair in float64 with small random attention in the target's last three
    layers (after every EAGLE-3 capture layer, so the draft still sees clean one-hot features).

    The target's tokens then depend on the context through the paged KV cache, while the draft
    still proposes the permutation chain: this is the one configuration where a spec step
    accepts several tokens AND a wrong KV slot would change the tokens. ATTN_NOISE = 0.06 gives
    a mean accept length near 3.3 and dozens of tokens off the pure permutation (asserted by the
    tests that use it)."""

    def make(level: str = "f100", k: int = 3, max_requests: int = 16, max_context: int = 64,
             num_slots: int = 0, noise: float = ATTN_NOISE):
        tcfg, tw = load_target(toy_ckpts.target, torch.float64)
        dcfg, dw = load_draft(toy_ckpts.drafts[level], torch.float64)
        g = torch.Generator().manual_seed(1)
        for lw in tw.layers[5:]:
            lw.qkv.copy_(torch.randn(lw.qkv.shape, generator=g, dtype=torch.float64) * noise)
            lw.o.copy_(torch.randn(lw.o.shape, generator=g, dtype=torch.float64) * noise)
        return ReferenceEngine(ModelPair(tcfg, dcfg), tw, dw, num_draft_tokens=k,
                               max_requests=max_requests, max_context=max_context,
                               num_slots=num_slots or max_requests * max_context + 1,
                               dtype=torch.float64, weights_note="toy + attention noise")

    return make


@pytest.fixture(scope="session")
def dummy_engine():
    """Factory: a tiny float64 dummy-random engine (float64 so that rounding differences between
    the batched verify and single-token decode cannot flip an argmax)."""

    def make(k: int = 3, max_requests: int = 16, max_context: int = 64, num_slots: int = 0,
             seed: int = 0):
        spec = EngineSpec(num_draft_tokens=k, max_requests=max_requests, max_context=max_context,
                          num_slots=num_slots, dtype="float64", seed=seed)
        return engine_from_dummy(tiny_shape(), spec)

    return make


@pytest.fixture(scope="session")
def make_worker():
    """Factory: a worker with small pools; keyword arguments override WorkerConfig fields."""

    def make(engine, policy, spec_bs=(1, 2, 4, 8), decode_bs=(1, 2, 4, 8, 16),
             continuity=Continuity.LAZY_CATCH_UP, **cfg):
        return DualGraphWorker(engine, WorkerConfig(spec_bs=tuple(spec_bs), decode_bs=tuple(decode_bs),
                                                    continuity=continuity, **cfg), policy)

    return make


# ---------------------------------------------------------------- a random mode policy


class RandomModePolicy:
    """Test-only ModePolicy: a seeded random mode every step (the worst case for switching).

    Honours the protocol's one hard rule: no spec graph for this batch -> decode. Records the
    committed modes so tests can check that switches really happened."""

    sync_every = 0

    def __init__(self, seed: int, num_draft_tokens: int, p_spec: float = 0.5) -> None:
        self._rng = random.Random(seed)
        self._p_spec = p_spec
        self._ema = AcceptLengthEMA(num_draft_tokens)
        self.committed: list[Mode] = []

    def decide(self, inputs: PolicyInputs) -> Decision:
        # Drawn on every call (a lazy worker's admission previews call it too), so the modes
        # depend on the seed and the schedule only; previews make some prefills deferred.
        draw = self._rng.random()
        if inputs.spec_padded_bs is None:
            return Decision(Mode.DECODE, Reason.NO_SPEC_GRAPH)
        return Decision(Mode.SPEC if draw < self._p_spec else Mode.DECODE, Reason.PINNED)

    def observe(self, event) -> None:
        if isinstance(event, Accepted) and event.mode is Mode.SPEC:
            self._ema.update(float(np.mean(event.accept_lens)))

    def exchange(self, reduce) -> None:
        pass

    def state(self) -> PolicyState:
        return PolicyState(self._ema.value)

    def estimates(self):
        return None

    def commit(self, decision: Decision) -> None:
        self.committed.append(decision.mode)

    @property
    def num_switches(self) -> int:
        c = self.committed
        return sum(a is not b for a, b in zip(c, c[1:]))


@pytest.fixture(scope="session")
def random_policy():
    """Factory: RandomModePolicy(seed, num_draft_tokens, p_spec=0.5)."""
    return RandomModePolicy


# ---------------------------------------------------------------- slot conservation


def check_slots(worker: DualGraphWorker) -> None:
    """The allocator's own invariant, plus conservation: free + held by running requests ==
    every slot but the dummy; held slots are distinct, allocated, and never the dummy slot."""
    alloc = worker.kv.allocator
    alloc.check()
    rows = worker.table.running
    lens = worker.table.seq_lens[rows]
    assert alloc.num_free + int(lens.sum()) == alloc.num_slots - 1, (
        f"{alloc.num_free} free + {int(lens.sum())} held != {alloc.num_slots - 1}")
    held = (np.concatenate([worker.table.slots[r, :n] for r, n in zip(rows, lens)])
            if len(rows) else np.zeros(0, dtype=np.int64))
    assert np.unique(held).size == held.size, "a slot is held by two positions"
    assert not (held == DUMMY_SLOT).any(), "a request holds the dummy slot"
    assert alloc.num_allocated == held.size


@pytest.fixture(scope="session")
def slot_check() -> Callable[[DualGraphWorker], None]:
    return check_slots


# ---------------------------------------------------------------- driving a schedule


@dataclass
class Run:
    outputs: dict[int, tuple[int, ...]]              # request index -> FinishedRequest.output
    reasons: dict[int, str]                          # request index -> finish reason
    received: dict[int, list[int]]                   # request index -> tokens handed back per step
    results: list[StepResult] = field(default_factory=list)
    rid_of: dict[int, int] = field(default_factory=dict)


def drive(worker: DualGraphWorker, prompts: Sequence[Sequence[int]],
          max_new: int | Sequence[int], admit_at: Optional[Sequence[int]] = None,
          max_steps: int = 2000, check: bool = True) -> Run:
    """Admit request i at step admit_at[i] (continuous batching), step until all finish.
    Checks slot conservation after every admission and step when `check`."""
    n = len(prompts)
    max_new = [max_new] * n if isinstance(max_new, int) else list(max_new)
    admit_at = [0] * n if admit_at is None else list(admit_at)
    pending = sorted(range(n), key=lambda i: (admit_at[i], i))
    rid_of, idx_of = {}, {}
    received: dict[int, list[int]] = {i: [] for i in range(n)}
    finished = {}
    results = []
    step = 0
    while pending or worker.num_running:
        if pending and not worker.num_running:
            step = max(step, admit_at[pending[0]])        # idle: jump to the next admission
        due = [i for i in pending if admit_at[i] <= step]
        if due:
            pre = worker.add_requests([prompts[i] for i in due], [max_new[i] for i in due])
            for i, rid, tok in zip(due, pre.rids, pre.first_tokens):
                rid_of[i], idx_of[rid] = rid, i
                received[i].append(int(tok))
            pending = [i for i in pending if i not in due]
            if check:
                check_slots(worker)
        if worker.num_running:
            res = worker.step()
            results.append(res)
            for rid, toks in res.per_request().items():
                received[idx_of[rid]].extend(toks)
            if check:
                check_slots(worker)
        for f in worker.take_finished():
            finished[f.rid] = f
        step += 1
        assert step < max_steps, "schedule did not finish"
    outputs = {idx_of[rid]: f.output for rid, f in finished.items()}
    reasons = {idx_of[rid]: f.reason for rid, f in finished.items()}
    return Run(outputs, reasons, received, results, rid_of)


@pytest.fixture(scope="session")
def run_schedule():
    """drive(worker, prompts, max_new, admit_at=None, ...) -> Run (outputs keyed by request index)."""
    return drive


def random_prompts(rng: np.random.Generator, n: int, vocab: int, min_len: int = 1,
                   max_len: int = 9) -> list[list[int]]:
    return [rng.integers(0, vocab, size=int(rng.integers(min_len, max_len + 1))).tolist()
            for _ in range(n)]


@pytest.fixture(scope="session")
def make_prompts():
    """make_prompts(seed, n, vocab, min_len=1, max_len=9) -> list of prompts of varied length."""
    return lambda seed, n, vocab, min_len=1, max_len=9: random_prompts(
        np.random.default_rng(seed), n, vocab, min_len, max_len)


@pytest.fixture
def supported_sglang() -> None:
    """Skip unless SGLang's supported release (0.5.17) is importable: the tests that drive the
    plugin against SGLang's real classes on CPU use it."""
    from dual_graph_worker.engines.sglang import version as version_mod

    pytest.importorskip("sglang.srt.speculative.eagle_worker_v2",
                        reason="SGLang is not importable here")
    installed = version_mod.installed_sglang_version()
    if installed != version_mod.SUPPORTED_SGLANG_VERSION:
        pytest.skip(f"SGLang {installed} installed, tests need "
                    f"{version_mod.SUPPORTED_SGLANG_VERSION}")


# ---------------------------------------------------------------- the SGLang worker, bare


@pytest.fixture
def bare_sglang_worker():
    """Factory: a DualGraphEagleWorker holding only its per-step state (no model, no graphs, no
    GPU), for tests of the worker's glue. Needs SGLang importable; `continuity` defaults to a
    strategy with nothing to do."""
    from bench.sglang.bare_worker import bare_worker

    return bare_worker


@pytest.fixture
def no_gpu(monkeypatch):
    """The policy matrix sees no GPU (its memory check reads none), whatever the host has."""
    monkeypatch.setattr("bench.sglang.policy_matrix.gpu_total_mib", lambda: None)
