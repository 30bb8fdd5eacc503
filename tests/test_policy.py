"""Mode policies: threshold with hysteresis and dwell, goodput from a calibration table (margin,
dwell, probing, no spec graph), identical decisions on every TP rank, and the calibration
table's JSON form."""

from __future__ import annotations

import json
import random

import pytest

from dual_graph_worker.errors import ConfigError
from dual_graph_worker.modes import GraphKey, Mode
from dual_graph_worker.policy import (AcceptLengthEMA, CalibrationTable, Decision, GoodputPolicy,
                                      PinnedPolicy, PolicyInputs, Reason, ThresholdPolicy)

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
        policy.observe_accept(accept)
    policy.commit(d.mode)
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


# ---------------------------------------------------------------- goodput


def synthetic_table(spec_cost: float = 1.0) -> CalibrationTable:
    """decode: t = 1 + 0.01 bs (flat: bandwidth-bound); spec: t = spec_cost * (1 + 0.25 bs)
    (compute grows with (K+1) tokens a request). At accept length a, spec wins while
    a / (1 + 0.25 pad) > 1 / (1 + 0.01 pad)."""
    lat = {GraphKey(Mode.DECODE, b): 1.0 + 0.01 * b for b in DECODE_SIZES}
    lat |= {GraphKey(Mode.SPEC, b): spec_cost * (1.0 + 0.25 * b) for b in SPEC_SIZES}
    return CalibrationTable(lat, K, source="synthetic")


def _faster(table: CalibrationTable, bs: int, accept: float) -> Mode:
    i = inputs(bs)
    spec = bs * accept / table.latency(Mode.SPEC, i.spec_padded_bs)
    dec = bs / table.latency(Mode.DECODE, i.decode_padded_bs)
    return Mode.SPEC if spec > dec else Mode.DECODE


def test_goodput_picks_the_faster_mode_from_the_calibration_table():
    table = synthetic_table()
    for bs in range(1, 17):
        # a fresh policy (EMA at its optimistic prior K+1) decides with no history
        p = GoodputPolicy(table, margin=0.0, min_dwell_steps=0, probe_every=0)
        assert p.accept_len_ema == K + 1
        d = p.decide(inputs(bs))
        assert d.reason is Reason.GOODPUT
        assert d.mode is _faster(table, bs, K + 1.0), bs
    # both answers occur: the crossover lies inside the spec pool
    modes = {GoodputPolicy(table, 0.0, 0, 0).decide(inputs(bs)).mode for bs in range(1, 17)}
    assert modes == {Mode.SPEC, Mode.DECODE}


def test_goodput_follows_the_accept_length_ema():
    table = synthetic_table()
    p = GoodputPolicy(table, margin=0.0, min_dwell_steps=0, probe_every=0, ema_alpha=1.0)
    assert p.decide(inputs(4)).mode is Mode.SPEC             # a = 4: 16/2 > 4/1.04
    p.observe_accept(1.0)                                     # alpha 1: EMA = 1
    assert p.accept_len_ema == 1.0
    assert p.decide(inputs(4)).mode is Mode.DECODE


def test_goodput_margin_is_a_relative_hysteresis():
    # spec/decode goodput ratio at bs=1 with accept 4: 4/(1.25 c) vs 1/1.01
    def ratio(c):
        return (4 / (c * 1.25)) / (1 / 1.01)

    c_small_win = 4 * 1.01 / 1.25 / 1.05          # spec ahead by 5% exactly
    assert ratio(c_small_win) == pytest.approx(1.05)
    for c, margin, want_switch in [(c_small_win * 1.01, 0.10, False),   # ahead ~4%: below margin
                                   (c_small_win * 0.90, 0.10, True),    # ahead ~17%: above margin
                                   (c_small_win * 1.01, 0.0, True)]:
        p = GoodputPolicy(synthetic_table(c), margin=margin, min_dwell_steps=0, probe_every=0)
        step(p, 64)                                       # no spec graph -> now in decode
        d = p.decide(inputs(1))
        assert (d.mode is Mode.SPEC) is want_switch, (c, margin)
    # and the same margin holds spec in place when decode is only slightly ahead
    c_dec_ahead = 4 * 1.01 / 1.25 * 1.04           # decode ahead ~4%
    p = GoodputPolicy(synthetic_table(c_dec_ahead), margin=0.10, min_dwell_steps=0, probe_every=0)
    assert p.decide(inputs(1)).mode is Mode.SPEC
    p = GoodputPolicy(synthetic_table(c_dec_ahead), margin=0.0, min_dwell_steps=0, probe_every=0)
    assert p.decide(inputs(1)).mode is Mode.DECODE


def test_goodput_minimum_dwell():
    table = synthetic_table()
    p = GoodputPolicy(table, margin=0.0, min_dwell_steps=3, probe_every=0)
    assert _faster(table, 1, K + 1) is Mode.SPEC and _faster(table, 16, K + 1) is Mode.DECODE
    assert step(p, 1).mode is Mode.SPEC
    assert step(p, 16) == Decision(Mode.SPEC, Reason.DWELL)       # 1 step in spec so far
    assert step(p, 16) == Decision(Mode.SPEC, Reason.DWELL)
    assert step(p, 16) == Decision(Mode.DECODE, Reason.GOODPUT)   # 3 served
    assert step(p, 1) == Decision(Mode.DECODE, Reason.DWELL)
    assert step(p, 1) == Decision(Mode.DECODE, Reason.DWELL)
    assert step(p, 1) == Decision(Mode.SPEC, Reason.GOODPUT)


def test_goodput_first_decision_owes_no_dwell():
    p = GoodputPolicy(synthetic_table(), margin=0.0, min_dwell_steps=4, probe_every=0)
    assert step(p, 16) == Decision(Mode.DECODE, Reason.GOODPUT)


def test_goodput_probes_while_off_then_returns_to_decode():
    """Low acceptance keeps speculation off; every probe_every decode steps one spec step runs
    (if spec could win at the best acceptance) to refresh the EMA, and only one."""
    p = GoodputPolicy(synthetic_table(), margin=0.0, min_dwell_steps=2, probe_every=5,
                      ema_alpha=1.0)
    assert step(p, 2, accept=1.0).mode is Mode.SPEC          # optimistic prior; observes a = 1
    assert step(p, 2, accept=1.0) == Decision(Mode.SPEC, Reason.DWELL)
    modes = [step(p, 2, accept=1.0) for _ in range(20)]
    assert [d.reason for d in modes[:5]] == [Reason.GOODPUT] * 5
    assert all(d.mode is Mode.DECODE for d in modes[:5])
    probes = [i for i, d in enumerate(modes) if d.reason is Reason.PROBE]
    assert probes == [5, 11, 17]                             # 5 decode steps, probe, 5, probe...
    for i in probes:
        assert modes[i].mode is Mode.SPEC
        assert modes[i + 1] == Decision(Mode.DECODE, Reason.GOODPUT), "a probe is one step"


def test_goodput_probe_that_finds_good_acceptance_stays_in_spec():
    p = GoodputPolicy(synthetic_table(), margin=0.0, min_dwell_steps=0, probe_every=3,
                      ema_alpha=1.0)
    step(p, 2, accept=1.0)                    # spec, observes a = 1 -> decode wins from now
    seq = [step(p, 2, accept=4.0) for _ in range(6)]
    assert [d.mode for d in seq[:3]] == [Mode.DECODE] * 3
    assert seq[3] == Decision(Mode.SPEC, Reason.PROBE)      # observes a = 4
    assert seq[4] == Decision(Mode.SPEC, Reason.GOODPUT)


def test_goodput_never_probes_when_spec_cannot_win():
    p = GoodputPolicy(synthetic_table(), margin=0.0, min_dwell_steps=0, probe_every=2)
    assert _faster(p.calibration, 16, K + 1) is Mode.DECODE
    assert all(step(p, 16).mode is Mode.DECODE for _ in range(12))


def test_goodput_goes_to_decode_without_a_spec_graph():
    p = GoodputPolicy(synthetic_table(), margin=0.0, min_dwell_steps=100, probe_every=1)
    for _ in range(3):
        assert step(p, 40) == Decision(Mode.DECODE, Reason.NO_SPEC_GRAPH)


def test_goodput_uncalibrated_size_falls_back_to_the_ranked_mode():
    lat = {GraphKey(Mode.DECODE, b): 1.0 for b in DECODE_SIZES}      # no spec latencies at all
    p = GoodputPolicy(CalibrationTable(lat, K), min_dwell_steps=0)
    assert p.decide(inputs(1)).mode is Mode.DECODE


@pytest.mark.parametrize("kw", [dict(margin=-0.1), dict(min_dwell_steps=-1), dict(probe_every=-1),
                                dict(ema_alpha=0.0), dict(ema_alpha=1.5)])
def test_goodput_rejects_bad_parameters(kw):
    with pytest.raises(ConfigError):
        GoodputPolicy(synthetic_table(), **kw)


# ---------------------------------------------------------------- determinism across TP ranks


@pytest.mark.parametrize("make", [
    lambda: ThresholdPolicy(threshold=6, num_draft_tokens=K, band=2, min_dwell_steps=3),
    lambda: GoodputPolicy(synthetic_table(), margin=0.05, min_dwell_steps=3, probe_every=7),
    lambda: PinnedPolicy(Mode.SPEC, K),
], ids=["threshold", "goodput", "pinned"])
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
                p.observe_accept(accept)
            p.commit(d.mode)
        assert rank0.accept_len_ema == rank1.accept_len_ema
    assert trace0 == trace1
    if not isinstance(rank0, PinnedPolicy):
        assert {d.mode for d in trace0} == {Mode.SPEC, Mode.DECODE}


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
    p = PinnedPolicy(Mode.SPEC, K)
    assert p.decide(inputs(2)) == Decision(Mode.SPEC, Reason.PINNED)
    assert p.decide(PolicyInputs(40, None, 64)) == Decision(Mode.DECODE, Reason.NO_SPEC_GRAPH)
    assert PinnedPolicy(Mode.DECODE, K).decide(inputs(2)) == Decision(Mode.DECODE, Reason.PINNED)


# ---------------------------------------------------------------- calibration table JSON


def test_calibration_table_json_round_trip(tmp_path):
    table = synthetic_table(1.3)
    data = json.loads(json.dumps(table.to_json()))
    back = CalibrationTable.from_json(data)
    assert back == table
    assert back.latency(Mode.SPEC, 4) == pytest.approx(1.3 * 2.0)
    assert back.latency(Mode.SPEC, 64) is None
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(table.to_json()))
    assert CalibrationTable.load(path) == table


@pytest.mark.parametrize("data", [
    {"latency_s": []},                                                    # no num_draft_tokens
    {"num_draft_tokens": 3},                                              # no latency_s
    {"num_draft_tokens": 3, "latency_s": [{"mode": "turbo", "bs": 1, "seconds": 1.0}]},
    {"num_draft_tokens": 3, "latency_s": [{"mode": "spec", "bs": 1}]},
    {"num_draft_tokens": 3, "latency_s": [{"mode": "spec", "bs": "x", "seconds": 1.0}]},
    {"num_draft_tokens": 3, "latency_s": [{"mode": "spec", "bs": 1, "seconds": 0.0}]},
    {"num_draft_tokens": 3, "latency_s": [{"mode": "spec", "bs": 1, "seconds": -2.0}]},
    {"num_draft_tokens": 3, "latency_s": 7},
    [1, 2, 3],
], ids=["no-k", "no-latencies", "bad-mode", "no-seconds", "bad-bs", "zero-latency",
        "negative-latency", "latencies-not-a-list", "not-an-object"])
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
