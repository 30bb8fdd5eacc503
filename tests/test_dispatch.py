"""The dispatch table: batch size -> smallest covering graph of the right pool, an explicit eager
answer beyond the pool, or a NoGraphForBatch error when eager fallback is disabled."""

from __future__ import annotations

import dataclasses
import random

import pytest

from dual_graph_worker.core.dispatch import DispatchTable, EagerDispatch
from dual_graph_worker.core.errors import ConfigError, NoGraphForBatch
from dual_graph_worker.core.modes import GraphKey, Mode, Stage
from dual_graph_worker.core.simple_policies import PinnedPolicy


def _brute_force(sizes, bs):
    covering = [s for s in sizes if s >= bs]
    return min(covering) if covering else None


def _random_pools(rng: random.Random):
    spec = rng.sample(range(1, 40), rng.randint(0, 6))
    decode = rng.sample(range(1, 80), rng.randint(1, 10))
    if spec and max(decode) < max(spec):
        decode.append(max(spec) + rng.randint(0, 10))
    return spec, decode


def test_every_batch_size_maps_to_smallest_covering_key_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        spec, decode = _random_pools(rng)
        table = DispatchTable.build(spec, decode)
        for mode, sizes in ((Mode.SPEC, spec), (Mode.DECODE, decode)):
            top = max(sizes) if sizes else 0
            for bs in range(1, top + 12):
                want = _brute_force(sizes, bs)
                got = table.lookup(mode, bs)
                if want is None:
                    assert got == EagerDispatch(mode, bs, got.reason), (spec, decode, mode, bs)
                    assert table.padded_bs(mode, bs) == bs
                    assert not table.has_graph(mode, bs)
                else:
                    assert isinstance(got, GraphKey)
                    assert got == GraphKey(mode, want), (spec, decode, mode, bs)
                    assert table.padded_bs(mode, bs) == want
                    assert table.has_graph(mode, bs)


def test_lookup_key_belongs_to_the_requested_pool():
    table = DispatchTable.build([1, 2, 4], [1, 8, 64])
    assert table.lookup(Mode.SPEC, 3) == GraphKey(Mode.SPEC, 4)
    assert table.lookup(Mode.DECODE, 3) == GraphKey(Mode.DECODE, 8)
    assert table.lookup(Mode.DECODE, 9) == GraphKey(Mode.DECODE, 64)
    assert table.lookup(Mode.DECODE, 1) == GraphKey(Mode.DECODE, 1)


def test_sizes_are_deduplicated_and_sorted():
    table = DispatchTable.build([4, 1, 4, 2], [16, 1, 8, 8])
    assert table.spec_sizes == (1, 2, 4)
    assert table.decode_sizes == (1, 8, 16)
    assert table.max_spec_bs == 4 and table.max_decode_bs == 16
    assert table.keys() == (GraphKey(Mode.SPEC, 1), GraphKey(Mode.SPEC, 2), GraphKey(Mode.SPEC, 4),
                            GraphKey(Mode.DECODE, 1), GraphKey(Mode.DECODE, 8),
                            GraphKey(Mode.DECODE, 16))


def test_beyond_the_pool_is_an_explicit_eager_answer_with_a_reason():
    table = DispatchTable.build([1, 2, 4], [1, 2, 4, 8])
    got = table.lookup(Mode.SPEC, 5)
    assert isinstance(got, EagerDispatch)
    assert (got.mode, got.bs) == (Mode.SPEC, 5)
    assert "bs=5" in got.reason and "largest captured bs=4" in got.reason
    got = table.lookup(Mode.DECODE, 100)
    assert isinstance(got, EagerDispatch) and got.bs == 100 and "decode" in got.reason


def test_empty_spec_pool_never_has_a_spec_graph():
    table = DispatchTable.build([], [1, 2, 4])
    assert table.max_spec_bs == 0
    for bs in range(1, 6):
        assert not table.has_graph(Mode.SPEC, bs)
        got = table.lookup(Mode.SPEC, bs)
        assert isinstance(got, EagerDispatch) and "captured no graphs" in got.reason


def test_beyond_the_pool_with_eager_disabled_raises_no_graph_for_batch():
    table = DispatchTable.build([1, 2, 4], [1, 2, 4, 8], allow_eager=False)
    assert table.lookup(Mode.DECODE, 8) == GraphKey(Mode.DECODE, 8)    # inside: still fine
    with pytest.raises(NoGraphForBatch, match="capture larger batch sizes") as exc:
        table.lookup(Mode.DECODE, 9)
    assert "eager fallback is disabled" in str(exc.value)
    assert "8" in str(exc.value)                      # names the pool's top
    with pytest.raises(NoGraphForBatch, match="spec pool"):
        table.lookup(Mode.SPEC, 5)


def test_decode_pool_smaller_than_spec_pool_is_a_config_error():
    with pytest.raises(ConfigError, match="add larger decode batch sizes"):
        DispatchTable.build([1, 2, 16], [1, 2, 8])
    DispatchTable.build([1, 2, 8], [1, 8])           # equal tops are fine


@pytest.mark.parametrize("spec,decode", [([0, 1], [1, 2]), ([1, 2], [-1, 2]), ([1], [0])])
def test_batch_sizes_below_one_are_a_config_error(spec, decode):
    with pytest.raises(ConfigError, match=">= 1"):
        DispatchTable.build(spec, decode)


def test_lookup_of_a_non_positive_batch_size_is_rejected():
    table = DispatchTable.build([1], [1, 2])
    with pytest.raises(ValueError, match=">= 1"):
        table.lookup(Mode.DECODE, 0)


def test_dispatch_table_is_immutable():
    table = DispatchTable.build([1], [1, 2])
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field"):
        table.allow_eager = False      # type: ignore[misc]
    assert table.allow_eager is True


def test_stages_per_mode():
    assert Stage.for_mode(Mode.DECODE, 3) == (Stage.DECODE,)
    assert Stage.for_mode(Mode.SPEC, 3) == (Stage.DRAFT, Stage.VERIFY, Stage.DRAFT_EXTEND)
    assert Stage.for_mode(Mode.SPEC, 1) == (Stage.VERIFY, Stage.DRAFT_EXTEND)
    assert Mode.SPEC.tokens_per_request(3) == 4 and Mode.DECODE.tokens_per_request(3) == 1
    assert GraphKey(Mode.SPEC, 4).label() == "spec-bs4"


@pytest.mark.parametrize("mode", [Mode.SPEC, Mode.DECODE])
def test_worker_steps_run_at_the_dispatched_padded_size(mode, dummy_engine, make_worker,
                                                        make_prompts, slot_check):
    """Each step's record carries the padded bs the table gives for its batch size."""
    w = make_worker(dummy_engine(), PinnedPolicy(mode=mode, num_draft_tokens=3), spec_bs=(2, 5), decode_bs=(3, 6, 9))
    prompts = make_prompts(0, 9, 128)
    w.add_requests(prompts, [2 + i for i in range(9)])      # finish one by one: bs 9 .. 1
    seen = set()
    while w.num_running:
        bs = w.num_running
        rec = w.step().record
        assert rec.bs == bs
        want = w.dispatch.padded_bs(rec.mode, bs)
        assert rec.padded_bs == want
        if mode is Mode.SPEC and bs > 5:
            assert rec.mode is Mode.DECODE            # no spec graph: the policy falls back
        else:
            assert rec.mode is mode
        seen.add((rec.mode, bs, rec.padded_bs))
        slot_check(w)
    assert (Mode.DECODE, 7, 9) in seen and (Mode.DECODE, 6, 6) in seen
    if mode is Mode.SPEC:
        assert (Mode.SPEC, 3, 5) in seen and (Mode.SPEC, 1, 2) in seen
    else:
        assert (Mode.DECODE, 4, 6) in seen and (Mode.DECODE, 1, 3) in seen
