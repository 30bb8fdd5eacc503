"""KV slot accounting: the allocator, the per-step planner, and the worker's conservation law
(free + held by running requests == every slot but the dummy) across random steps, mode
switches, finishes, aborts and KV pressure."""

from __future__ import annotations

import numpy as np
import pytest

from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.core.errors import ConfigError, KVPoolExhausted
from dual_graph_worker.engines.reference.kv_slots import DUMMY_SLOT, KVSlotPlanner, SlotAccountingError, SlotAllocator
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import Reason
from dual_graph_worker.core.simple_policies import PinnedPolicy

K = 3
TOY_VOCAB = 64


# ---------------------------------------------------------------- SlotAllocator


def test_allocator_hands_out_distinct_slots_and_never_the_dummy():
    a = SlotAllocator(33)
    assert a.num_free == 32 and a.num_allocated == 0
    got = np.concatenate([a.alloc(5), a.alloc(27)])
    assert sorted(got.tolist()) == list(range(1, 33))
    assert DUMMY_SLOT not in got
    assert a.num_free == 0 and a.num_allocated == 32
    a.check()
    a.free(got)
    assert a.num_free == 32 and a.num_allocated == 0
    a.check()


def test_allocator_exhausted_raises_kv_pool_exhausted_and_changes_nothing():
    a = SlotAllocator(9)
    a.alloc(6)
    with pytest.raises(KVPoolExhausted, match="only 2 are free"):
        a.alloc(3)
    assert a.num_free == 2
    a.check()


def test_allocator_double_free_raises():
    a = SlotAllocator(9)
    s = a.alloc(4)
    a.free(s[:2])
    with pytest.raises(SlotAccountingError, match="double free"):
        a.free(s[:1])
    with pytest.raises(SlotAccountingError, match="double free"):
        a.free(np.array([s[2], s[2]]))              # twice in one call
    a.check()
    assert a.num_free == 6


@pytest.mark.parametrize("bad", [[0], [-1], [9], [100]])
def test_allocator_free_of_dummy_or_out_of_range_slot_raises(bad):
    a = SlotAllocator(9)
    a.alloc(8)
    with pytest.raises(SlotAccountingError, match="out-of-range"):
        a.free(np.array(bad))


def test_allocator_free_of_never_allocated_slot_raises():
    a = SlotAllocator(9)
    with pytest.raises(SlotAccountingError):
        a.free(np.array([3]))


def test_allocator_check_detects_corruption():
    a = SlotAllocator(9)
    s = a.alloc(3)
    a._allocated[s[0]] = False          # simulate a lost slot
    with pytest.raises(SlotAccountingError):
        a.check()


def test_allocator_needs_a_real_slot_besides_the_dummy():
    with pytest.raises(ConfigError, match="at least 2 slots"):
        SlotAllocator(1)


def test_allocator_empty_free_is_a_no_op():
    a = SlotAllocator(4)
    a.free(np.zeros(0, dtype=np.int64))
    assert a.num_free == 3


# ---------------------------------------------------------------- KVSlotPlanner


def test_planner_slots_needed_per_mode():
    p = KVSlotPlanner(SlotAllocator(100), K)
    assert p.slots_needed(Mode.SPEC, 5) == 5 * (K + 1)
    assert p.slots_needed(Mode.DECODE, 5) == 5
    assert p.can_run(Mode.SPEC, 24) and not p.can_run(Mode.SPEC, 25)
    assert p.can_run(Mode.DECODE, 99) and not p.can_run(Mode.DECODE, 100)


def test_planner_commit_keeps_accepted_and_returns_k_minus_n_slots():
    alloc = SlotAllocator(64)
    p = KVSlotPlanner(alloc, K)
    plan = p.plan(Mode.SPEC, 3)
    assert plan.slots.shape == (3, K + 1) and plan.width == K + 1
    assert alloc.num_free == 63 - 12
    accept = np.array([1, 3, 4])            # n = accept - 1 drafts accepted: frees K - n each
    keep = p.commit(plan, accept)
    assert alloc.num_free == 63 - 12 + sum(K - (a - 1) for a in accept)
    assert keep.sum(1).tolist() == accept.tolist()
    assert keep[:, 0].all()                                     # always the first columns
    assert alloc._allocated[plan.slots[keep]].all()
    assert not alloc._allocated[plan.slots[~keep]].any()
    alloc.check()


def test_planner_decode_step_keeps_its_one_slot():
    alloc = SlotAllocator(16)
    p = KVSlotPlanner(alloc, K)
    plan = p.plan(Mode.DECODE, 4)
    assert plan.slots.shape == (4, 1)
    p.commit(plan, np.ones(4, dtype=np.int64))
    assert alloc.num_free == 15 - 4


def test_planner_plan_beyond_pool_names_the_fix_and_cancel_returns_everything():
    alloc = SlotAllocator(10)
    p = KVSlotPlanner(alloc, K)
    with pytest.raises(KVPoolExhausted, match="max running"):
        p.plan(Mode.SPEC, 3)
    assert alloc.num_free == 9
    plan = p.plan(Mode.SPEC, 2)
    p.cancel(plan)
    assert alloc.num_free == 9
    alloc.check()


# ---------------------------------------------------------------- worker: conservation


def _expected(toy_perm, prompt, n):
    return toy_perm.continuation(prompt[-1], n)


@pytest.mark.parametrize("continuity", [Continuity.KEEP_CURRENT, Continuity.LAZY_CATCH_UP],
                         ids=lambda c: c.value)
def test_no_leak_over_random_steps_switches_finishes_and_aborts(continuity, toy_engine, toy_perm,
                                                                make_worker, random_policy,
                                                                slot_check):
    """Random admissions, aborts and mode switches under a tight pool: conservation after every
    operation, finished outputs exact, aborted outputs a prefix; at the end every slot is free."""
    rng = np.random.default_rng(11)
    num_slots = 161
    w = make_worker(toy_engine("f50", num_slots=num_slots), random_policy(3, K),
                    continuity=continuity, max_running=8)
    budget: dict[int, int] = {}           # rid -> prompt + max_new (admission control)
    prompts: dict[int, list[int]] = {}
    wanted: dict[int, int] = {}            # rid -> max_new_tokens
    finished, aborted = {}, {}
    reasons_seen = set()
    for it in range(90):
        room = num_slots - 1 - sum(budget.values())
        if it < 70 and w.num_running < 8 and rng.random() < 0.35:
            n = int(rng.integers(1, 4))
            new = [rng.integers(0, TOY_VOCAB, size=int(rng.integers(1, 8))).tolist() for _ in range(n)]
            max_new = [int(rng.integers(3, 20)) for _ in range(n)]
            if sum(len(p) + m for p, m in zip(new, max_new)) <= room and w.num_running + n <= 8:
                pre = w.add_requests(new, max_new)
                for rid, p, m in zip(pre.rids, new, max_new):
                    budget[rid], prompts[rid], wanted[rid] = len(p) + m, p, m
                slot_check(w)
        if w.num_running and rng.random() < 0.08:
            rid = int(w.table.rid_of_row[rng.choice(w.table.running)])
            done = w.abort(rid)
            assert done.reason == "abort"
            aborted[rid] = done
            slot_check(w)
        if w.num_running:
            rec = w.step().record
            reasons_seen.add(rec.reason)
            slot_check(w)
        for f in w.take_finished():
            finished[f.rid] = f
        for rid in list(budget):
            if rid in finished or rid in aborted:
                del budget[rid]
    while w.num_running:
        w.step()
        slot_check(w)
    for f in w.take_finished():
        finished[f.rid] = f
    alloc = w.kv.allocator
    assert alloc.num_free == num_slots - 1 and alloc.num_allocated == 0
    alloc.check()

    assert len(finished) >= 10 and len(aborted) >= 2          # the schedule did exercise both
    assert w.stats.switches >= 5
    for rid, f in finished.items():
        assert f.reason == "length"
        assert len(f.output) == wanted[rid]
        assert list(f.output) == _expected(toy_perm, prompts[rid], wanted[rid])
    for rid, f in aborted.items():
        assert 1 <= len(f.output) < wanted[rid]
        assert list(f.output) == _expected(toy_perm, prompts[rid], len(f.output))


@pytest.mark.parametrize("continuity", [Continuity.KEEP_CURRENT, Continuity.LAZY_CATCH_UP],
                         ids=lambda c: c.value)
def test_kv_pressure_falls_back_to_decode_without_leaks(continuity, toy_engine, toy_perm,
                                                       make_worker, slot_check):
    """A pool that holds every request's full context but not K+1 more slots per request near
    the end: spec steps fall back to decode (Reason.KV_PRESSURE), tokens stay exact."""
    prompts = [[i, 2 * i + 1, 3 * i + 2] for i in range(6)]
    max_new = [22, 22, 23, 22, 24, 22]     # 1 + 4 + 4 + 4 + 4 + 4 = 21 < max_new: a short tail
    num_slots = 1 + sum(len(p) + m for p, m in zip(prompts, max_new))
    w = make_worker(toy_engine("f100", num_slots=num_slots), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K),
                    continuity=continuity)
    w.add_requests(prompts, max_new)
    slot_check(w)
    free_before = []
    while w.num_running:
        free_before.append((w.kv.allocator.num_free, w.num_running))
        w.step()
        slot_check(w)
    outs = {f.rid: f.output for f in w.take_finished()}
    for i, p in enumerate(prompts):
        assert list(outs[i]) == _expected(toy_perm, p, max_new[i])
    recs = list(w.stats.records)
    pressured = [r for r in recs if r.reason is Reason.KV_PRESSURE]
    assert pressured, "the pool never ran short: the test lost its point"
    assert any(r.mode is Mode.SPEC for r in recs)
    for r, (free, bs) in zip(recs, free_before):
        if r.reason is Reason.KV_PRESSURE:
            assert r.mode is Mode.DECODE and free < bs * (K + 1)
        else:
            assert r.mode is Mode.SPEC and free >= bs * (K + 1)
    assert w.kv.allocator.num_free == num_slots - 1


def test_abort_returns_the_requests_slots(toy_engine, make_worker, slot_check):
    w = make_worker(toy_engine("f100"), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K))
    pre = w.add_requests([[1, 2, 3], [4, 5]], 20)
    w.step()
    w.step()
    row = w.table.row(pre.rids[0])
    held = int(w.table.seq_lens[row])
    free = w.kv.allocator.num_free
    done = w.abort(pre.rids[0])
    assert w.kv.allocator.num_free == free + held
    assert done.reason == "abort" and len(done.output) == 1 + 2 * (K + 1)
    slot_check(w)
    with pytest.raises(KeyError, match="not running"):
        w.abort(pre.rids[0])
    w.abort(pre.rids[1])
    assert w.kv.allocator.num_free == w.kv.allocator.num_slots - 1


def test_admission_beyond_the_pool_admits_nothing(toy_engine, make_worker, slot_check):
    w = make_worker(toy_engine("f100", num_slots=12), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K))
    with pytest.raises(KVPoolExhausted):
        w.add_requests([[1] * 6, [2] * 6], 4)
    assert w.num_running == 0
    assert w.kv.allocator.num_free == 11
    slot_check(w)


def test_every_forward_reads_the_kv_slots_it_writes(dummy_engine, make_worker, random_policy,
                                                    run_schedule):
    """Write-then-read: for every query of every forward (prefill, decode, draft chain, verify,
    draft extend, catch-up), the request->slot table maps (row, position) to the slot that the
    forward writes, so attention reads the K/V just written and never a stale or foreign slot."""
    eng = dummy_engine()
    bad: list[tuple[str, int]] = []

    def wrap(model, name, n_leading):
        orig = model.forward

        def forward(*args):
            pos, loc, batch = args[n_leading:]
            rows = batch.req_rows.repeat_interleave(batch.width)
            real = loc != DUMMY_SLOT                      # padding rows/queries use the dummy slot
            mapped = model.table.table[rows[real], pos[real]]
            if not bool((mapped == loc[real]).all()):
                bad.append((name, batch.width))
            return orig(*args)

        model.forward = forward

    wrap(eng.target, "target", 1)      # forward(ids, positions, loc, batch)
    wrap(eng.draft, "draft", 2)        # forward(ids, hidden, positions, loc, batch)
    w = make_worker(eng, random_policy(5, K), continuity=Continuity.LAZY_CATCH_UP)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 128, size=n).tolist() for n in (3, 7, 1, 5)]
    run_schedule(w, prompts, 14, [0, 0, 3, 6])
    assert w.stats.catch_up_tokens > 0 and w.stats.switches > 2
    assert not bad, f"forwards whose table does not map to the written slot: {sorted(set(bad))}"


def test_a_step_no_mode_fits_raises_before_the_policy_commits(toy_engine, make_worker, slot_check):
    """A full pool raises at the step, not after the policy counted it (dwell, exchange cadence,
    a schedule's position all move with a committed step)."""
    w = make_worker(toy_engine("f100", num_slots=12), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K))
    w.add_requests([[1] * 5, [2] * 5], 4)
    assert w.kv.allocator.num_free < 2
    steps = w.planner.steps
    with pytest.raises(KVPoolExhausted, match="decode step for 2 requests"):
        w.step()
    assert w.planner.steps == steps and w.num_running == 2
    slot_check(w)
