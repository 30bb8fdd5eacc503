"""GPU tests: Triton attention vs torch, graphs vs eager, mode switches that cost a lookup.

Skipped without CUDA (and Triton). Token-equality tests use float32 so that both attention paths
and every mode compute the same greedy tokens; the toy checkpoints give real acceptance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
triton = pytest.importorskip("triton")

from dual_graph_worker.core.continuity import Continuity  # noqa: E402
from dual_graph_worker.engines.reference.attention import AttnBatch, TorchPagedAttention  # noqa: E402
from dual_graph_worker.engines.reference.attention_triton import TritonPagedAttention  # noqa: E402
from dual_graph_worker.engines.reference.build import (EngineSpec, engine_from_checkpoints,  # noqa: E402
                                                       engine_from_dummy)
from dual_graph_worker.engines.reference.config import tiny_shape  # noqa: E402
from dual_graph_worker.engines.reference.toy import toy_permutations, write_toy_checkpoints  # noqa: E402
from dual_graph_worker.core.modes import Mode  # noqa: E402
from dual_graph_worker.core.policy import Decision, Reason  # noqa: E402
from dual_graph_worker.core.simple_policies import PinnedPolicy  # noqa: E402
from dual_graph_worker.engines.reference.worker import DualGraphWorker, WorkerConfig  # noqa: E402

K = 3
SPEC_BS = (1, 2, 4, 8)
DECODE_BS = (1, 2, 4, 8, 16)


class RandomSwitchPolicy(PinnedPolicy):
    def __init__(self, seed: int) -> None:
        super().__init__(mode=Mode.SPEC, num_draft_tokens=K)
        self.rng = np.random.default_rng(seed)

    def decide(self, inputs):
        if inputs.spec_padded_bs is None:
            return Decision(Mode.DECODE, Reason.NO_SPEC_GRAPH)
        return Decision(Mode.SPEC if self.rng.random() < 0.5 else Mode.DECODE, Reason.PINNED)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return write_toy_checkpoints(tmp_path_factory.mktemp("toy"))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("width", [1, 4, 37])
def test_triton_attention_matches_torch(dtype, tol, width):
    g = torch.Generator(device="cuda").manual_seed(width)
    B, h, kvh, d, ctx, slots = 5, 8, 2, 64, 160, 2048
    k_pool = torch.randn(slots, kvh, d, generator=g, device="cuda").to(dtype)
    v_pool = torch.randn(slots, kvh, d, generator=g, device="cuda").to(dtype)
    table = torch.randperm(slots - 1, generator=g, device="cuda")[: 8 * ctx].view(8, ctx) + 1
    rows = torch.tensor([3, 1, 7, 0, 5], device="cuda")
    prefix = torch.tensor([0, 17, 100, 3, 63], device="cuda")
    q = torch.randn(B * width, h, d, generator=g, device="cuda").to(dtype)
    batch = AttnBatch(rows, prefix, width, ctx)
    ref = TorchPagedAttention().attend(q.double(), k_pool.double(), v_pool.double(), table, batch, d ** -0.5)
    out = TritonPagedAttention().attend(q, k_pool, v_pool, table, batch, d ** -0.5)
    err = (out.double() - ref).norm() / ref.norm()
    assert torch.isfinite(out).all()
    assert err < tol, f"relative error {err:.2e}"


def _run(worker: DualGraphWorker, prompts, max_new) -> dict[int, tuple[int, ...]]:
    worker.capture(progress=False)
    worker.add_requests(prompts[: len(prompts) // 2], max_new)
    late = prompts[len(prompts) // 2:]
    while worker.num_running or late:
        if late and worker.num_running < 6:
            worker.add_requests(late[:2], max_new)
            late = late[2:]
        worker.step()
    return {f.rid: f.output for f in worker.take_finished()}


def _prompts(n=10, vocab=64, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(3, 20))).tolist() for _ in range(n)]


@pytest.mark.parametrize("draft", ["f100", "f50", "f0"])
@pytest.mark.parametrize("continuity", [Continuity.KEEP_CURRENT, Continuity.LAZY_CATCH_UP])
def test_toy_tokens_equal_across_modes_graphs_and_eager(toy, draft, continuity):
    spec = EngineSpec(num_draft_tokens=K, max_requests=16, max_context=256, device="cuda",
                      dtype="float32", attention="triton")
    prompts = _prompts()
    perms = toy_permutations(64, 1.0)
    expected = [tuple(perms.continuation(p[-1], 24)) for p in prompts]
    outs = {}
    for label, policy, graphs in (("plain-graph", PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=K), True),
                                  ("spec-graph", PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K), True),
                                  ("dynamic-graph", RandomSwitchPolicy(1), True),
                                  ("dynamic-eager", RandomSwitchPolicy(2), False)):
        engine = engine_from_checkpoints(toy.target, toy.drafts[draft], spec)
        w = DualGraphWorker(engine, WorkerConfig(SPEC_BS, DECODE_BS, graphs, continuity=continuity), policy)
        res = _run(w, prompts, 24)
        outs[label] = [res[i] for i in sorted(res)]
        assert w.kv.allocator.num_free == engine.limits.num_slots - 1, "KV slots leaked"
    for label, got in outs.items():
        assert got == expected, label


def test_dummy_weights_graph_equals_eager():
    spec = EngineSpec(num_draft_tokens=K, max_requests=16, max_context=256, device="cuda",
                      dtype="float32", attention="triton")
    prompts = _prompts(vocab=tiny_shape().target.vocab_size, seed=3)
    outs = []
    for graphs in (True, False):
        engine = engine_from_dummy(tiny_shape(), spec)
        w = DualGraphWorker(engine, WorkerConfig(SPEC_BS, DECODE_BS, graphs), RandomSwitchPolicy(7))
        res = _run(w, prompts, 20)
        outs.append([res[i] for i in sorted(res)])
    assert outs[0] == outs[1]


class _Counter:
    def __init__(self):
        self.n = 0

    def wrap(self, fn):
        def inner(*a, **k):
            self.n += 1
            return fn(*a, **k)
        return inner


def test_switching_adds_no_capture_allocation_or_sync(toy, monkeypatch):
    """Alternate modes every step after capture: no graph capture or instantiation, no CUDA
    allocation, and the same host syncs per step as holding one mode."""
    spec = EngineSpec(num_draft_tokens=K, max_requests=16, max_context=256, device="cuda",
                      dtype="float32", attention="triton")
    engine = engine_from_checkpoints(toy.target, toy.drafts["f50"], spec)
    w = DualGraphWorker(engine, WorkerConfig(SPEC_BS, DECODE_BS, True), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K))
    w.capture(progress=False)
    w.add_requests(_prompts(6), 200)
    for _ in range(3):
        w.step()
    captures, replays, syncs = _Counter(), _Counter(), _Counter()
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", captures.wrap(torch.cuda.CUDAGraph.capture_begin))
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", replays.wrap(torch.cuda.CUDAGraph.replay))
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", syncs.wrap(torch.cuda.Stream.synchronize))
    graphs_before = len(w.runner.graphs)

    def run(policy, steps):
        w.policy = policy
        torch.cuda.synchronize()
        stats0 = torch.cuda.memory_stats()
        syncs.n = replays.n = 0
        modes = [w.step().record.mode for _ in range(steps)]
        torch.cuda.synchronize()
        stats1 = torch.cuda.memory_stats()
        return modes, stats1["allocation.all.allocated"] - stats0["allocation.all.allocated"], syncs.n, replays.n

    class Alternate(PinnedPolicy):
        def __init__(self):
            super().__init__(mode=Mode.SPEC, num_draft_tokens=K)
            self.i = 0

        def decide(self, inputs):
            self.i += 1
            return Decision(Mode.SPEC if self.i % 2 else Mode.DECODE, Reason.PINNED)

    modes, allocs, n_sync, n_replay = run(Alternate(), 10)
    assert modes == [Mode.SPEC, Mode.DECODE] * 5
    assert captures.n == 0 and len(w.runner.graphs) == graphs_before
    assert allocs == 0, f"{allocs} CUDA allocations while alternating"
    assert n_sync == 10, "exactly one host sync per step (the output copy)"
    assert n_replay == 5 * 3 + 5 * 1, "one replay per stage: spec = 3 stages, decode = 1"
    _, allocs_held, n_sync_held, _ = run(PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=K), 10)
    assert allocs_held == 0 and n_sync_held == 10
