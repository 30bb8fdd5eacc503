"""What a step hands back: the speculative layout (stride K+1, accepted length per request) in
both modes, tokens that match what each request finally receives, finishing at max_new_tokens
and at the first EOS, and the per-step record."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import Reason
from dual_graph_worker.core.simple_policies import PinnedPolicy

TOY_VOCAB = 64


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("mode", [Mode.SPEC, Mode.DECODE])
def test_step_result_has_the_speculative_layout_in_both_modes(mode, k, toy_engine, make_worker):
    w = make_worker(toy_engine("f100", k=k), PinnedPolicy(mode=mode, num_draft_tokens=k))
    pre = w.add_requests([[1, 2], [3], [4, 5, 6]], 30)
    res = w.step()
    assert res.stride == k + 1
    assert res.token_ids.dtype == torch.int64 and res.token_ids.device.type == "cpu"
    assert res.token_ids.shape == (3 * (k + 1),)
    assert res.accept_lens.shape == (3,) and res.accept_lens.dtype == torch.int32
    assert res.rids == pre.rids
    want_len = k + 1 if mode is Mode.SPEC else 1           # toy f100 accepts every draft
    assert res.accept_lens.tolist() == [want_len] * 3
    assert res.record.mode is mode and res.record.tokens == 3 * want_len
    assert res.record.mean_accept_len == want_len
    if mode is Mode.DECODE:
        # only column 0 is meaningful; the rest of each stride is zero padding
        assert (res.token_ids.view(3, k + 1)[:, 1:] == 0).all()


def test_tokens_handed_back_are_exactly_what_requests_receive(toy_attn_engine, make_worker,
                                                              random_policy, run_schedule):
    """prefill's first token + tokens_for(i) of every step == FinishedRequest.output, under
    random switches; decode steps report accept length 1, spec steps 1..K+1."""
    k = 3
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TOY_VOCAB, size=n).tolist() for n in (2, 5, 1, 7)]
    max_new = [13, 18, 9, 21]
    w = make_worker(toy_attn_engine(), random_policy(1, k))
    run = run_schedule(w, prompts, max_new, [0, 1, 1, 4])
    for i in range(len(prompts)):
        assert run.received[i] == list(run.outputs[i])
        assert len(run.outputs[i]) == max_new[i]
    for res in run.results:
        lens = res.accept_lens.tolist()
        if res.record.mode is Mode.DECODE:
            assert lens == [1] * len(res.rids)
        else:
            assert all(1 <= n <= k + 1 for n in lens)
        assert res.record.tokens == sum(lens)
        assert res.per_request() == {rid: res.tokens_for(i) for i, rid in enumerate(res.rids)}
    assert any(max(r.accept_lens.tolist()) > 1 for r in run.results)    # multi-token steps ran


def test_last_step_is_cut_at_max_new_tokens(toy_engine, toy_perm, make_worker):
    """A spec step may accept more than a request still wants: it receives only what is left."""
    w = make_worker(toy_engine("f100"), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=3))
    pre = w.add_requests([[9]], 7)                     # 1 (prefill) + 4 + 2 (of 4 accepted)
    r1 = w.step()
    assert r1.accept_lens.tolist() == [4] and r1.finished == ()
    r2 = w.step()
    assert r2.accept_lens.tolist() == [2] and r2.finished == pre.rids
    assert r2.record.mean_accept_len == 4.0 and r2.record.tokens == 2
    (done,) = w.take_finished()
    assert done.reason == "length" and list(done.output) == toy_perm.continuation(9, 7)
    assert w.num_running == 0
    assert w.kv.allocator.num_free == w.kv.allocator.num_slots - 1


def _eos_case(toy_perm, prompt, index):
    cont = toy_perm.continuation(prompt[-1], 40)
    eos = cont[index]
    first = cont.index(eos)                       # the permutation may revisit a token
    return eos, cont[: first + 1]


@pytest.mark.parametrize("mode", [Mode.SPEC, Mode.DECODE])
@pytest.mark.parametrize("index", [0, 2, 5, 6])
def test_eos_truncates_at_the_first_eos_and_returns_slots(mode, index, toy_engine, toy_perm,
                                                          make_worker, slot_check):
    prompt = [3, 17]
    eos, want = _eos_case(toy_perm, prompt, index)
    assert len(want) == index + 1
    w = make_worker(toy_engine("f100"), PinnedPolicy(mode=mode, num_draft_tokens=3), eos_token_id=eos)
    pre = w.add_requests([prompt], 30)
    (rid,) = pre.rids
    received = [pre.first_tokens[0]]
    if index == 0:
        assert pre.finished == (rid,) and w.num_running == 0   # EOS is the first token
    while w.num_running:
        res = w.step()
        received += res.tokens_for(0)
        slot_check(w)
    (done,) = w.take_finished()
    assert done.reason == "eos"
    assert list(done.output) == want and received == want
    assert w.kv.allocator.num_free == w.kv.allocator.num_slots - 1


def test_eos_of_one_request_does_not_stop_its_batch_mates(toy_engine, toy_perm, make_worker,
                                                          slot_check):
    a, b = [3, 17], [50]
    eos, want_a = _eos_case(toy_perm, a, 5)
    cont_b = toy_perm.continuation(b[-1], 24)
    want_b = cont_b[: cont_b.index(eos) + 1] if eos in cont_b else cont_b
    w = make_worker(toy_engine("f100"), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=3), eos_token_id=eos,
                    continuity=Continuity.KEEP_CURRENT)
    w.add_requests([a, b], 24)
    finished_at = {}
    while w.num_running:
        res = w.step()
        for rid in res.finished:
            finished_at[rid] = res.record.step
        slot_check(w)
    outs = {f.rid: f for f in w.take_finished()}
    assert list(outs[0].output) == want_a and outs[0].reason == "eos"
    assert list(outs[1].output) == want_b
    assert len(want_b) > len(want_a)          # b ran on after a stopped
    assert finished_at[0] < finished_at[1]


def test_step_records_and_switch_count(toy_engine, make_worker, random_policy, run_schedule):
    policy = random_policy(4, 3)
    w = make_worker(toy_engine("f50"), policy)
    run_schedule(w, [[1, 2], [3], [4, 5]], 15)
    recs = list(w.stats.records)
    assert [r.step for r in recs] == list(range(len(recs)))
    assert w.stats.switches == sum(a.mode is not b.mode for a, b in zip(recs, recs[1:]))
    assert w.stats.switches == policy.num_switches
    for r in recs:
        assert r.reason in (Reason.PINNED, Reason.NO_SPEC_GRAPH, Reason.KV_PRESSURE)
        assert r.padded_bs >= r.bs
        if r.mode is Mode.DECODE:
            assert r.mean_accept_len == 1.0
        d = json.loads(json.dumps(r.to_json()))
        assert d["mode"] == r.mode.value and d["reason"] == r.reason.value and d["bs"] == r.bs
