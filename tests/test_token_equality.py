"""The correctness contract (docs/design.md): at temperature 0 a request receives the same tokens
whichever mode ran each step, across any sequence of switches, with either continuity strategy,
with or without padding, and whatever else shares its batch. On the toy checkpoints the answer is
also known in advance (the target's permutation), and acceptance is real: the measured accept
length follows the draft's agreement level."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.core.dispatch import EagerDispatch
from dual_graph_worker.core.modes import GraphKey, Mode
from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.controller import ControllerConfig, GoodputController
from dual_graph_worker.core.simple_policies import PinnedPolicy, ThresholdPolicy

K = 3
TOY_VOCAB = 64
DUMMY_VOCAB = 128
CONTINUITIES = [Continuity.KEEP_CURRENT, Continuity.LAZY_CATCH_UP]

# A continuous-batching schedule: prompts of different lengths, different max_new_tokens, and
# requests admitted while others are running (at steps 2, 5 and 9).
PROMPT_LENS = [1, 4, 9, 2, 6, 3]
MAX_NEW = [16, 21, 24, 17, 19, 22]
ADMIT_AT = [0, 0, 0, 2, 5, 9]


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in PROMPT_LENS]


def _policy(kind: str, k: int, random_policy):
    if kind == "decode":
        return PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=k)
    if kind == "spec":
        return PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=k)
    return random_policy(int(kind.rsplit("-", 1)[1]), k)


def _assert_really_switched(worker, policy) -> None:
    """Guards the test itself: a random schedule must actually mix modes."""
    modes = [r.mode for r in worker.stats.records]
    assert Mode.SPEC in modes and Mode.DECODE in modes
    assert worker.stats.switches >= 3
    if worker.config.continuity is Continuity.LAZY_CATCH_UP:
        assert worker.stats.catch_up_tokens > 0, "no catch-up ran: the lazy path went untested"
    else:
        assert worker.stats.catch_up_tokens == 0

def _assert_policies_match_plain(new_engine, k, continuity, prompts, kinds, make_worker,
                                 random_policy, run_schedule) -> dict:
    """Every policy kind gives plain greedy's tokens (a fresh engine each run); random kinds must
    really have switched. Returns the plain reference outputs."""
    ref = run_schedule(make_worker(new_engine(), PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=k),
                                   continuity=continuity), prompts, MAX_NEW, ADMIT_AT).outputs
    for kind in kinds:
        policy = _policy(kind, k, random_policy)
        w = make_worker(new_engine(), policy, continuity=continuity)
        assert run_schedule(w, prompts, MAX_NEW, ADMIT_AT).outputs == ref, kind
        if kind.startswith("random"):
            _assert_really_switched(w, policy)
    return ref



# ---------------------------------------------------------------- toy checkpoints: known answer


@pytest.mark.parametrize("continuity", CONTINUITIES, ids=lambda c: c.value)
@pytest.mark.parametrize("level,policy_kind", [(lvl, kind) for lvl in ("f100", "f50", "f0")
                                               for kind in ("spec", "random-0", "random-1")]
                         + [("f50", "decode")])
def test_toy_tokens_equal_known_continuation(level, policy_kind, continuity, toy_engine, toy_perm,
                                             make_worker, random_policy, run_schedule):
    prompts = _prompts(1, TOY_VOCAB)
    policy = _policy(policy_kind, K, random_policy)
    w = make_worker(toy_engine(level), policy, continuity=continuity)
    run = run_schedule(w, prompts, MAX_NEW, ADMIT_AT)
    for i, p in enumerate(prompts):
        assert list(run.outputs[i]) == toy_perm.continuation(p[-1], MAX_NEW[i]), f"request {i}"
        assert run.reasons[i] == "length"
    if policy_kind.startswith("random"):
        _assert_really_switched(w, policy)


@pytest.mark.parametrize("level", ["f100", "f50", "f0"])
def test_toy_accept_length_is_real_and_matches_agreement(level, toy_engine, toy_perm, make_worker,
                                                         run_schedule):
    """Spec mode's accept length comes from the draft really agreeing with the target: 4.0 at
    f=1, 1 + f + f^2 + f^3 = 1.875 at f=0.5 (up to the finite sample), 1.0 at f=0. Step by step
    it equals an independent simulation of the two permutations."""
    from dual_graph_worker.engines.reference.toy import expected_accept_len, toy_permutations

    n_req, max_new = 16, 24
    prompts = [[(7 * i) % TOY_VOCAB, (4 * i + 1) % TOY_VOCAB] for i in range(n_req)]
    w = make_worker(toy_engine(level, max_requests=n_req + 1), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K),
                    spec_bs=(1, 2, 4, 8, 16), decode_bs=(1, 2, 4, 8, 16))
    run = run_schedule(w, prompts, max_new)
    for i, p in enumerate(prompts):
        assert list(run.outputs[i]) == toy_perm.continuation(p[-1], max_new)

    # Independent simulation: d1 = s(x_L), then the chain walks s; draft j is accepted while
    # every step so far agreed (s == p on the token it extends).
    perms = toy_permutations(TOY_VOCAB, {"f100": 1.0, "f50": 0.5, "f0": 0.0}[level])
    p_, s_ = perms.p.tolist(), perms.s.tolist()

    def simulate(x: int) -> list[int]:
        generated, accs = 1, []
        while generated < max_new:
            acc, t = 1, x
            while acc <= K and s_[t] == p_[t]:
                acc, t = acc + 1, p_[t]
            for _ in range(acc):
                x = p_[x]
            generated += acc
            accs.append(acc)
        return accs

    sims = [simulate(toy_perm.continuation(p[-1], 1)[0]) for p in prompts]
    records = list(w.stats.records)
    assert all(r.mode is Mode.SPEC for r in records)
    assert len(records) == max(len(a) for a in sims)
    for step, rec in enumerate(records):
        live = [a[step] for a in sims if len(a) > step]
        assert rec.bs == len(live)
        assert rec.mean_accept_len == pytest.approx(np.mean(live), abs=1e-12), f"step {step}"

    per_request_step = np.concatenate([a for a in sims])
    measured = sum(r.mean_accept_len * r.bs for r in records) / sum(r.bs for r in records)
    assert measured == pytest.approx(per_request_step.mean(), abs=1e-12)
    expected = expected_accept_len(perms.agreement, K)
    if level == "f100":
        assert measured == 4.0
    elif level == "f0":
        assert measured == 1.0
    else:
        assert expected == pytest.approx(1.875)
        assert measured == pytest.approx(expected, abs=0.2)
        assert 1.2 < measured < 3.0


@pytest.mark.parametrize("continuity", CONTINUITIES, ids=lambda c: c.value)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_toy_f100_draft_is_never_stale_after_decode_steps(k, continuity, toy_engine, make_worker,
                                                          random_policy, run_schedule):
    """With a draft that always agrees, every spec step accepts all K drafts, including the
    first spec step after any run of decode steps: the draft state was kept current (or caught
    up) and never drafted from stale state."""
    prompts = _prompts(7, TOY_VOCAB)
    policy = random_policy(11, k)
    w = make_worker(toy_engine("f100", k=k), policy, continuity=continuity)
    run_schedule(w, prompts, MAX_NEW, ADMIT_AT)
    _assert_really_switched(w, policy)
    recs = list(w.stats.records)
    after_decode = [b for a, b in zip(recs, recs[1:]) if a.mode is Mode.DECODE and b.mode is Mode.SPEC]
    assert after_decode
    for r in recs:
        if r.mode is Mode.SPEC:
            assert r.mean_accept_len == k + 1, r


# ---------------------------------------------------------------- toy + attention: KV matters


def test_toy_attn_fixture_exercises_kv_and_multi_token_acceptance(toy_attn_engine, toy_perm,
                                                                  make_worker, run_schedule):
    """Guards the fixture behind the next test: tokens depend on the context (attention reads
    the paged KV) and spec steps accept several tokens."""
    prompts = _prompts(2, TOY_VOCAB)
    w = make_worker(toy_attn_engine(), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K))
    run = run_schedule(w, prompts, MAX_NEW, ADMIT_AT)
    off_perm = sum(a != b for i, p in enumerate(prompts)
                   for a, b in zip(run.outputs[i], toy_perm.continuation(p[-1], MAX_NEW[i])))
    assert off_perm >= 10, "attention no longer changes the tokens: the fixture lost its point"
    recs = list(w.stats.records)
    mean_acc = sum(r.mean_accept_len * r.bs for r in recs) / sum(r.bs for r in recs)
    assert 1.5 < mean_acc < 4.0


@pytest.mark.parametrize("continuity", CONTINUITIES, ids=lambda c: c.value)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_toy_attn_any_switch_sequence_gives_plain_greedy_tokens(k, continuity, toy_attn_engine,
                                                                make_worker, random_policy,
                                                                run_schedule):
    _assert_policies_match_plain(lambda: toy_attn_engine(k=k), k, continuity,
                                 _prompts(2, TOY_VOCAB), ["spec", "random-0", "random-1"],
                                 make_worker, random_policy, run_schedule)


# ---------------------------------------------------------------- dummy weights (float64)


@pytest.mark.parametrize("continuity", CONTINUITIES, ids=lambda c: c.value)
@pytest.mark.parametrize("k", [1, 3])
def test_dummy_any_switch_sequence_gives_plain_greedy_tokens(k, continuity, dummy_engine,
                                                             make_worker, random_policy,
                                                             run_schedule):
    prompts = _prompts(3, DUMMY_VOCAB)
    ref = _assert_policies_match_plain(lambda: dummy_engine(k=k), k, continuity, prompts,
                                       ["spec", "random-2"], make_worker, random_policy,
                                       run_schedule)
    # The reference is not degenerate: requests produce different, non-constant outputs.
    assert len({ref[i] for i in ref}) == len(prompts)
    assert all(len(set(o)) > 1 for o in ref.values())


def test_dummy_request_tokens_do_not_depend_on_batch_mates(dummy_engine, make_worker, run_schedule):
    """Each request alone (one at a time) gets what it gets in the continuous batch."""
    prompts = _prompts(4, DUMMY_VOCAB)
    batched = run_schedule(make_worker(dummy_engine(), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K)),
                           prompts, MAX_NEW, ADMIT_AT).outputs
    for i, p in enumerate(prompts):
        alone = run_schedule(make_worker(dummy_engine(), PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=K)),
                             [p], MAX_NEW[i]).outputs[0]
        assert alone == batched[i], f"request {i}"


# ---------------------------------------------------------------- padding and eager


PADDING_LAYOUTS = {
    # every batch size has its own graph: no padding at all
    "exact": dict(spec_bs=tuple(range(1, 9)), decode_bs=tuple(range(1, 9))),
    # one size per pool: every step with fewer than 8 requests pads up to 8 rows
    "padded": dict(spec_bs=(8,), decode_bs=(8,)),
    # tiny pools, the rest runs eagerly at the exact batch size
    "eager": dict(spec_bs=(1,), decode_bs=(1, 2), max_running=8),
}


@pytest.mark.parametrize("engine_kind", ["dummy", "toy_attn"])
def test_padded_exact_and_eager_batches_give_identical_tokens(engine_kind, dummy_engine,
                                                              toy_attn_engine, make_worker,
                                                              random_policy, run_schedule):
    make_engine = dummy_engine if engine_kind == "dummy" else toy_attn_engine
    vocab = DUMMY_VOCAB if engine_kind == "dummy" else TOY_VOCAB
    prompts = _prompts(5, vocab)
    ref = run_schedule(make_worker(make_engine(), PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=K),
                                   **PADDING_LAYOUTS["exact"]), prompts, MAX_NEW, ADMIT_AT).outputs
    saw_padding = saw_eager = False
    for name, layout in PADDING_LAYOUTS.items():
        for policy in (PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K), random_policy(7, K)):
            w = make_worker(make_engine(), policy, **layout)
            got = run_schedule(w, prompts, MAX_NEW, ADMIT_AT).outputs
            assert got == ref, (name, type(policy).__name__)
            saw_padding |= any(r.padded_bs > r.bs for r in w.stats.records)
            eager = [isinstance(w.dispatch.lookup(r.mode, r.bs), EagerDispatch)
                     for r in w.stats.records]
            saw_eager |= any(eager)
            if name == "exact":
                assert all(r.padded_bs == r.bs for r in w.stats.records)
                assert not any(eager)
    assert saw_padding and saw_eager


# ---------------------------------------------------------------- the shipped policies


def test_threshold_and_goodput_policies_give_plain_greedy_tokens(toy_attn_engine, make_worker,
                                                                 run_schedule):
    """Policies that switch on load (threshold crossed as requests come and go)."""
    prompts = _prompts(6, TOY_VOCAB)
    ref = run_schedule(make_worker(toy_attn_engine(), PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=K)),
                       prompts, MAX_NEW, ADMIT_AT).outputs
    w = make_worker(toy_attn_engine(), ThresholdPolicy(threshold=3, num_draft_tokens=K))
    assert run_schedule(w, prompts, MAX_NEW, ADMIT_AT).outputs == ref
    assert w.stats.switches >= 2

    # The controller on a prior where decode latency is flat and spec latency linear in the
    # padded bs: with accept length a, spec wins while a > padded bs, i.e. at bs <= 2 here
    # (a ~ 3.3), decode above. It measures real (CPU) timings as it goes, and explores.
    lat = {GraphKey(Mode.DECODE, b): 1.0 for b in (1, 2, 4, 8, 16)}
    lat |= {GraphKey(Mode.SPEC, b): 1.0 * b for b in (1, 2, 4, 8)}
    gp = GoodputController(ControllerConfig(K, margin=0.0, min_dwell_steps=1, explore_budget=0.3,
                                            explore_steps=1, stale_after=4, sync_every=2),
                           {Mode.SPEC: (1, 2, 4, 8), Mode.DECODE: (1, 2, 4, 8, 16)},
                           CalibrationTable(lat, K))
    w = make_worker(toy_attn_engine(), gp)
    assert run_schedule(w, prompts, MAX_NEW, ADMIT_AT).outputs == ref
    assert {r.mode for r in w.stats.records} == {Mode.SPEC, Mode.DECODE}


def test_lazy_defers_the_draft_prefill_of_prompts_joining_a_decoding_batch(dummy_engine,
                                                                          make_worker):
    """Prompts admitted while the batch decodes skip the draft (lazy catch-up's deferral): the
    first catch-up then covers the whole prompt from the stashed target features and leaves the
    draft in the state its own prefill would have (dummy weights: features matter), and the
    tokens are the same."""
    prompts = [p for p in _prompts(8, DUMMY_VOCAB) if p][:3]
    runs = {}
    for defer in (True, False):
        w = make_worker(dummy_engine(k=K), PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=K),
                        defer_prefill=defer)
        untouched = w.engine.state.draft_hidden.clone()
        w.add_requests(prompts, 20)
        rows = w.table.running.copy()
        behind = w.continuity.start[rows] == 0
        assert behind.all() if defer else not behind.any()
        # Deferred: the draft did not run over the prompts (its state is as before).
        assert torch.equal(w.engine.state.draft_hidden, untouched) == defer
        for _ in range(3):
            w.step()
        caught = w.continuity.before_spec_step(rows)
        state = (w.engine.state.draft_token[rows].clone(), w.engine.state.draft_hidden[rows].clone())
        w.policy = PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K)
        while w.num_running:
            w.step()
        done = sorted(w.take_finished(), key=lambda f: f.rid)
        runs[defer] = (caught, state, [tuple(f.output) for f in done])
    (caught, (tok, hid), out), (caught0, (tok0, hid0), out0) = runs[True], runs[False]
    assert caught == caught0 + sum(len(p) for p in prompts)
    assert torch.equal(tok, tok0) and torch.allclose(hid, hid0, atol=1e-9)
    assert out == out0
