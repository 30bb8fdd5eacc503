"""Keep-current's width-1 draft-extend graphs (draft_extend_graph.py, draft_sync.py) on CPU.

Imports SGLang 0.5.17 (skipped when it is not importable). The capture itself needs a GPU; here
the runner's width/batch-size descriptors, the width override's restore, and the decode step's
choice between graph replay and eager forward are driven with fakes.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch



@pytest.fixture
def sgl(supported_sglang):
    from dual_graph_worker.engines.sglang import draft_extend_graph, draft_sync

    return SimpleNamespace(graph=draft_extend_graph, sync=draft_sync)


def test_runner_keeps_width_one_and_the_decode_pool_sizes(sgl):
    runner = object.__new__(sgl.graph.OneTokenDraftExtendRunner)
    runner._pool_bs = [1, 2, 4, 256]
    # What EAGLEDraftExtendCudaGraphRunner.__init__ writes: num_draft_tokens and the spec list.
    runner.captured_req_width = 4
    runner.capture_bs, _ = [1, 2, 4, 8, 48], []
    assert runner.captured_req_width == 1
    assert runner.capture_bs == [1, 2, 4, 256]


class _FakeContext:
    def __init__(self, spec):
        self.spec, self.log = spec, []

    def override(self, source, **fields):
        self.log.append((source, dict(fields)))
        for k, v in fields.items():
            setattr(self.spec, k, v)


def test_draft_width_restores_the_server_width_even_on_failure(sgl, monkeypatch):
    spec = SimpleNamespace(speculative_num_draft_tokens=4)
    ctx = _FakeContext(spec)
    monkeypatch.setattr(sgl.graph, "get_spec", lambda: spec)
    monkeypatch.setattr(sgl.graph, "get_context", lambda: ctx)
    with pytest.raises(RuntimeError):
        with sgl.graph.draft_width(1):
            assert spec.speculative_num_draft_tokens == 1
            raise RuntimeError("capture failed")
    assert spec.speculative_num_draft_tokens == 4
    assert [fields for _, fields in ctx.log] == [{"speculative_num_draft_tokens": 1},
                                                 {"speculative_num_draft_tokens": 4}]


class _FakeGraphRunner:
    def __init__(self, can_run, logits, hidden):
        self.can_run, self.logits, self.hidden, self.executed = can_run, logits, hidden, 0

    def can_run_graph(self, forward_batch):
        return self.can_run

    def execute(self, forward_batch):
        self.executed += 1
        return SimpleNamespace(next_token_logits=self.logits, hidden_states=self.hidden)


def _drive(sgl, monkeypatch, graph_runner):
    """One run_one_token_draft_extend with SGLang's planner stubbed; returns (out, eager calls)."""
    bs, vocab, hidden = 3, 11, 5
    eager_logits = torch.zeros(bs, vocab)
    eager_logits[:, 7] = 1.0                             # eager forward proposes token 7
    eager_calls = []

    def forward(fb):
        eager_calls.append(fb)
        return SimpleNamespace(logits_output=SimpleNamespace(
            next_token_logits=eager_logits, hidden_states=torch.ones(bs, hidden)))

    planned = []

    def prepare(extend_input, batch, predict, width, draft_runner, cuda_graph_runner, **kw):
        planned.append((width, cuda_graph_runner, extend_input.num_tokens_per_req))
        return SimpleNamespace(batch_size=bs)

    monkeypatch.setattr(sgl.sync, "prepare_for_draft_extend", prepare)
    from dual_graph_worker.engines.sglang import draft_context

    for name in ("speculative_moe_backend_context", "speculative_moe_a2a_backend_context"):
        monkeypatch.setattr(draft_context, name, contextlib.nullcontext)
    monkeypatch.setattr(sgl.sync, "spec_stage_span", lambda stage: contextlib.nullcontext())
    draft = SimpleNamespace(topk=1, draft_runner=SimpleNamespace(forward=forward, tp_group=None),
                            draft_tp_context=lambda group: contextlib.nullcontext())
    batch = SimpleNamespace(seq_lens=torch.tensor([5, 6, 7]), sampling_info=None)
    out = sgl.sync.run_one_token_draft_extend(
        draft, batch, target_hidden=torch.zeros(bs, 3 * hidden),
        sampled=torch.tensor([1, 2, 3]), out_cache_loc=torch.tensor([10, 11, 12]),
        graph_runner=graph_runner)
    assert planned == [(1, graph_runner, 1)]             # width 1, planned against the runner
    assert batch.out_cache_loc.tolist() == [10, 11, 12]  # draft KV goes to the step's slots
    return out, eager_calls


def test_decode_step_replays_the_width_one_graph_and_owns_its_output(sgl, monkeypatch):
    logits = torch.zeros(3, 11)
    logits[:, 2] = 1.0                                   # graph proposes token 2
    static_hidden = torch.full((3, 5), 3.0)
    runner = _FakeGraphRunner(True, logits, static_hidden)
    out, eager_calls = _drive(sgl, monkeypatch, runner)
    assert out.graphed and runner.executed == 1 and eager_calls == []
    assert out.next_draft_input.topk_index.flatten().tolist() == [2, 2, 2]
    hidden = out.next_draft_input.hidden_states
    assert torch.equal(hidden, static_hidden)
    # A copy, not a view of the graph's static output that the next replay overwrites.
    assert hidden.data_ptr() != static_hidden.data_ptr()
    assert out.next_draft_input.bonus_tokens.dtype == torch.int32


def test_decode_step_runs_eagerly_beyond_the_graphs_or_without_them(sgl, monkeypatch):
    refusing = _FakeGraphRunner(False, None, None)
    out, eager_calls = _drive(sgl, monkeypatch, refusing)
    assert not out.graphed and refusing.executed == 0 and len(eager_calls) == 1
    assert out.next_draft_input.topk_index.flatten().tolist() == [7, 7, 7]
    out, eager_calls = _drive(sgl, monkeypatch, None)
    assert not out.graphed and len(eager_calls) == 1


def test_config_switch_for_the_graphs():
    from dual_graph_worker.core.settings import Settings
    from dual_graph_worker.core.errors import ConfigError

    assert Settings.from_env({}).draft_extend_graphs is True
    assert Settings.from_env({"DGW_DRAFT_EXTEND_GRAPHS": "0"}).draft_extend_graphs is False
    assert Settings.from_env({"DGW_DRAFT_EXTEND_GRAPHS": "true"}).draft_extend_graphs is True
    with pytest.raises(ConfigError, match="DGW_DRAFT_EXTEND_GRAPHS"):
        Settings.from_env({"DGW_DRAFT_EXTEND_GRAPHS": "maybe"})


def test_draft_proposals_are_eagles_own(sgl):
    """Both continuity strategies make the next step's proposals as EAGLE's draft extend does:
    topk 1 is the argmax at probability 1, wider the top of the softmax."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    p, index = sgl.sync.draft_proposals(logits, None, 1)
    assert index.tolist() == [[1], [0]] and p.tolist() == [[1.0], [1.0]]
    assert p.dtype == torch.float32 and index.shape == (2, 1)
    p, index = sgl.sync.draft_proposals(logits, None, 2)
    assert index.tolist() == [[1, 2], [0, 2]]
    assert torch.allclose(p, torch.softmax(logits, -1).topk(2, dim=-1).values)
