"""The simple mode policies (threshold with hysteresis and dwell, pinned, cycle), identical
decisions on every TP rank, and the calibration table's JSON form. The goodput controller has
its own file (test_controller.py)."""

from __future__ import annotations

import json
import random

import pytest

from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import GraphKey, Mode
from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.batch_costs import draft_share
from dual_graph_worker.core.policies import PolicyContext, build_policy, needs_prior
from dual_graph_worker.core.policy import Decision, PolicyInputs, Reason, accepted
from dual_graph_worker.core.simple_policies import (AcceptLengthEMA, CyclePolicy, PinnedPolicy,
                                                    ThresholdPolicy)
from dual_graph_worker.core.settings import PolicyKind, Settings

K = 3
SPEC_SIZES = (1, 2, 4, 8, 16)
DECODE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _pad(sizes, bs):
    return min((s for s in sizes if s >= bs), default=None)


def inputs(bs: int) -> PolicyInputs:
    return PolicyInputs(bs, _pad(SPEC_SIZES, bs), _pad(DECODE_SIZES, bs))


def step(policy, bs: int, accept: float | None = None) -> Decision:
    """One worker step as the worker drives a policy: decide, observe (spec only), commit."""
    d = policy.decide(inputs(bs))
    if d.mode is Mode.SPEC and accept is not None:
        policy.observe(accepted(Mode.SPEC, [accept]))
    policy.commit(d)
    return d


# ---------------------------------------------------------------- threshold


def test_threshold_without_band_switches_at_the_threshold():
    p = ThresholdPolicy(threshold=8, num_draft_tokens=K)
    assert [step(p, bs).mode for bs in (1, 8, 9, 16, 8, 2)] == [
        Mode.SPEC, Mode.SPEC, Mode.DECODE, Mode.DECODE, Mode.SPEC, Mode.SPEC]


def test_threshold_hysteresis_band():
    """threshold 8, band 2: leave spec above 10, come back at 6 or below; in between keep."""
    p = ThresholdPolicy(threshold=8, num_draft_tokens=K, band=2)
    seq = [(8, Mode.SPEC, Reason.HYSTERESIS), (10, Mode.SPEC, Reason.HYSTERESIS),
           (11, Mode.DECODE, Reason.THRESHOLD), (10, Mode.DECODE, Reason.HYSTERESIS),
           (7, Mode.DECODE, Reason.HYSTERESIS), (6, Mode.SPEC, Reason.THRESHOLD),
           (3, Mode.SPEC, Reason.THRESHOLD), (9, Mode.SPEC, Reason.HYSTERESIS),
           (12, Mode.DECODE, Reason.THRESHOLD)]
    for bs, mode, reason in seq:
        d = step(p, bs)
        assert (d.mode, d.reason) == (mode, reason), bs


def test_threshold_minimum_dwell():
    p = ThresholdPolicy(threshold=4, num_draft_tokens=K, min_dwell_steps=3)
    assert step(p, 2).mode is Mode.SPEC
    assert step(p, 2).mode is Mode.SPEC
    assert step(p, 2).mode is Mode.SPEC                 # 3 steps served in spec
    assert step(p, 9) == Decision(Mode.DECODE, Reason.THRESHOLD)
    # back below the threshold at once: must serve 3 decode steps first
    assert step(p, 1) == Decision(Mode.DECODE, Reason.DWELL)
    assert step(p, 1) == Decision(Mode.DECODE, Reason.DWELL)
    assert step(p, 1) == Decision(Mode.SPEC, Reason.THRESHOLD)


def test_threshold_first_decision_owes_no_dwell():
    """Nothing has run yet, so a fresh policy goes straight to the mode the load calls for."""
    p = ThresholdPolicy(threshold=4, num_draft_tokens=K, min_dwell_steps=5)
    assert step(p, 12) == Decision(Mode.DECODE, Reason.THRESHOLD)


def test_threshold_no_spec_graph_means_decode():
    p = ThresholdPolicy(threshold=100, num_draft_tokens=K)
    assert p.decide(PolicyInputs(20, None, 32)) == Decision(Mode.DECODE, Reason.NO_SPEC_GRAPH)


@pytest.mark.parametrize("kw", [dict(threshold=-1), dict(threshold=4, band=-1),
                                dict(threshold=4, min_dwell_steps=-2)])
def test_threshold_rejects_negative_parameters(kw):
    with pytest.raises(ConfigError, match=">= 0"):
        ThresholdPolicy(num_draft_tokens=K, **kw)


# ---------------------------------------------------------------- determinism across TP ranks


@pytest.mark.parametrize("make", [
    lambda: ThresholdPolicy(threshold=6, num_draft_tokens=K, band=2, min_dwell_steps=3),
    lambda: CyclePolicy(hold=3, num_draft_tokens=K),
    lambda: PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K),
], ids=["threshold", "cycle", "pinned"])
def test_two_ranks_fed_identical_inputs_make_identical_decisions(make):
    rank0, rank1 = make(), make()
    rng = random.Random(42)
    bs = 4
    trace0, trace1 = [], []
    for _ in range(400):
        bs = min(max(1, bs + rng.randint(-3, 3)), 64)
        accept = rng.uniform(1.0, K + 1.0)
        inp = inputs(bs)
        d0, d1 = rank0.decide(inp), rank1.decide(inp)
        trace0.append(d0)
        trace1.append(d1)
        for p, d in ((rank0, d0), (rank1, d1)):
            if d.mode is Mode.SPEC:
                p.observe(accepted(Mode.SPEC, [accept]))
            p.commit(d)
        assert rank0.state() == rank1.state()
    assert trace0 == trace1
    # Both modes ran, so what the ranks agree on is a real sequence; pinned speculates wherever
    # the spec pool has the batch.
    assert {d.mode for d in trace0} == {Mode.SPEC, Mode.DECODE}
    if isinstance(rank0, PinnedPolicy):
        assert {(d.mode, d.reason) for d in trace0} == {(Mode.SPEC, Reason.PINNED),
                                                        (Mode.DECODE, Reason.NO_SPEC_GRAPH)}


# ---------------------------------------------------------------- accept-length EMA


def test_accept_length_ema_prior_update_and_clamp():
    e = AcceptLengthEMA(K, alpha=0.5)
    assert e.value == K + 1.0
    e.update(2.0)
    assert e.value == pytest.approx(3.0)
    e.update(100.0)                          # clamped to K + 1
    assert e.value == pytest.approx(3.5)
    e.update(-5.0)                           # clamped to 1
    assert e.value == pytest.approx(2.25)
    with pytest.raises(ConfigError, match="alpha"):
        AcceptLengthEMA(K, alpha=0.0)


def test_pinned_policy():
    p = PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K)
    assert p.decide(inputs(2)) == Decision(Mode.SPEC, Reason.PINNED)
    assert p.decide(PolicyInputs(40, None, 64)) == Decision(Mode.DECODE, Reason.NO_SPEC_GRAPH)
    assert PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=K).decide(inputs(2)) == Decision(Mode.DECODE, Reason.PINNED)


def test_cycle_policy_holds_then_alternates():
    p = CyclePolicy(hold=2, num_draft_tokens=K)
    modes = [step(p, 2).mode.value[0] for _ in range(16)]
    assert "".join(modes) == "ssddsdsd" * 2
    with pytest.raises(ConfigError, match="DGW_MIN_DWELL"):
        CyclePolicy(hold=0, num_draft_tokens=K)


# ---------------------------------------------------------------- calibration table JSON


def synthetic_table(spec_cost: float = 1.0) -> CalibrationTable:
    lat = {GraphKey(Mode.DECODE, b): 1.0 + 0.01 * b for b in DECODE_SIZES}
    lat |= {GraphKey(Mode.SPEC, b): spec_cost * (1.0 + 0.25 * b) for b in SPEC_SIZES}
    return CalibrationTable(lat, K, source="synthetic")


def test_calibration_table_json_round_trip(tmp_path):
    table = synthetic_table(1.3)
    data = json.loads(json.dumps(table.to_json()))
    back = CalibrationTable.from_json(data)
    assert back == table
    assert back.latency(Mode.SPEC, 4) == pytest.approx(1.3 * 2.0)
    assert back.latency(Mode.SPEC, 64) is None
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(table.to_json()))
    assert CalibrationTable.load(path) == table == CalibrationTable.load(path, K)
    # Measured drafting K tokens a step: a server drafting another K cannot take it.
    with pytest.raises(ConfigError, match=f"measured drafting {K} tokens.*drafts {K + 1}"):
        CalibrationTable.load(path, K + 1)


@pytest.mark.parametrize("data", [
    {"latency_s": []},                                                    # no num_draft_tokens
    {"num_draft_tokens": 3},                                              # no latency_s
    {"num_draft_tokens": 3, "latency_s": [{"mode": "turbo", "bs": 1, "seconds": 1.0}]},
    {"num_draft_tokens": 3, "latency_s": [{"mode": "spec", "bs": 1}]},
    {"num_draft_tokens": 3, "latency_s": [{"mode": "spec", "bs": "x", "seconds": 1.0}]},
    {"num_draft_tokens": 3, "latency_s": [{"mode": "spec", "bs": 1, "seconds": 0.0}]},
    {"num_draft_tokens": 3, "latency_s": [{"mode": "spec", "bs": 1, "seconds": -2.0}]},
    {"num_draft_tokens": 3, "latency_s": [{"mode": "spec", "bs": 1, "seconds": "Infinity"}]},
    {"num_draft_tokens": 3, "latency_s": [{"mode": "spec", "bs": 1, "seconds": "NaN"}]},
    {"num_draft_tokens": 3, "latency_s": 7},
    [1, 2, 3],
], ids=["no-k", "no-latencies", "bad-mode", "no-seconds", "bad-bs", "zero-latency",
        "negative-latency", "infinite-latency", "nan-latency", "latencies-not-a-list",
        "not-an-object"])
def test_malformed_calibration_table_is_a_config_error(data):
    with pytest.raises(ConfigError, match="capture-tune"):
        CalibrationTable.from_json(data)


def test_non_positive_latency_is_a_config_error():
    with pytest.raises(ConfigError, match="> 0"):
        CalibrationTable({GraphKey(Mode.DECODE, 1): 0.0}, K)


def test_calibration_file_missing_or_not_json_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read calibration table"):
        CalibrationTable.load(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="capture-tune"):
        CalibrationTable.load(bad)


def test_the_drafts_share_leaves_embeddings_and_lm_heads_out():
    """Llama-3-8B and its EAGLE-3 head by SGLang's parameter names: the draft's one layer and
    fc are ~4% of a prefill token's weights; embeddings (a lookup) and LM heads (a prefill's
    logits are its last token's) count for neither."""
    h, inter = 4096, 14336
    layer = [("self_attn.qkv_proj.weight", 6144 * h), ("self_attn.o_proj.weight", h * h),
             ("mlp.gate_up_proj.weight", 2 * inter * h), ("mlp.down_proj.weight", h * inter),
             ("input_layernorm.weight", h), ("post_attention_layernorm.weight", h)]
    target = [("model.embed_tokens.weight", 128256 * h), ("model.norm.weight", h),
              ("lm_head.weight", 128256 * h)]
    target += [(f"model.layers.{i}.{n}", size) for i in range(32) for n, size in layer]
    draft = [("model.embed_tokens.weight", 128256 * h), ("model.fc.weight", 3 * h * h),
             ("lm_head.weight", 32000 * h)]
    draft += [(f"model.midlayer.{n}", size * (2 if "qkv" in n else 1)) for n, size in layer]
    share = draft_share(target, draft)
    assert 0.04 < share < 0.05
    assert draft_share(target, draft[:1] + draft[2:]) < share
    assert draft_share(target, [("lm_head.weight", 10 ** 9)]) == 0.0
    others = [("transformer.wte.weight", 10 ** 9), ("word_embeddings.weight", 10 ** 9),
              ("model.layers.3.shared_head.head.weight", 10 ** 9)]
    assert draft_share(target, draft + others) == share
    assert draft_share([], []) == 0.0


@pytest.mark.parametrize("kind", list(PolicyKind))
def test_every_policy_kind_builds_and_says_whether_it_reads_a_prior(kind):
    """Engines build any DGW_POLICY the same way and calibrate at start-up only for a policy
    whose builder reads the prior (without one it must still build)."""
    settings = Settings(policy=kind)
    ctx = PolicyContext(K, {Mode.SPEC: SPEC_SIZES, Mode.DECODE: DECODE_SIZES}, max_rows=8)
    policy = build_policy(settings, ctx)
    assert step(policy, 1, accept=3.0).mode in (Mode.SPEC, Mode.DECODE)
    assert needs_prior(settings) is (kind is PolicyKind.GOODPUT)
