"""The tuner: crossover, pool tops, budgets, waste, and the distribution presets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capture.distribution import BatchDistribution, parse_distribution
from capture.measurements import load_measurements
from capture.padding import expected_waste
from capture.synthetic import Cost, measurements_from_costs
from capture.tuner import TuningError, find_crossover, plan_pools, tune
from dual_graph_worker.dispatch import DispatchTable
from dual_graph_worker.errors import ConfigError
from dual_graph_worker.modes import GraphKey, Mode
from dual_graph_worker.policy import GoodputPolicy

FIXTURE = Path(__file__).parent / "data" / "capture" / "synthetic_h200_llama8b_k3.json"
GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture(scope="module")
def h200():
    return load_measurements(FIXTURE)


def _uniform(hi: int) -> BatchDistribution:
    return parse_distribution(f"uniform:1-{hi}", hi)


# ---- crossover ------------------------------------------------------------------------------

def test_crossover_is_the_largest_bs_where_spec_wins() -> None:
    # K = 1, accept length 2: spec wins where t_spec < 2 * t_decode = 20 ms. Not monotone on
    # purpose: the crossover is the largest winning bs (4), not the first loss (2).
    m = measurements_from_costs(spec={1: 0.012, 2: 0.025, 4: 0.015, 8: 0.030, 16: 0.050},
                                decode={1: 0.010, 2: 0.010, 4: 0.010, 8: 0.010, 16: 0.010},
                                num_draft_tokens=1)
    c = find_crossover(m, 2.0)
    assert c.bs == 4
    assert [p.bs for p in c.points] == [1, 2, 4, 8, 16]
    assert c.point(4).spec_tok_s == pytest.approx(4 * 2.0 / 0.015)
    assert c.point(4).decode_tok_s == pytest.approx(4 / 0.010)
    assert c.first_loss_above().bs == 8
    assert find_crossover(m, 1.0).bs is None


def test_crossover_on_the_h200_fixture_moves_with_acceptance(h200) -> None:
    for accept, expected in ((3.0, 40), (2.0, 8), (4.0, 72)):
        c = find_crossover(h200, accept)
        assert c.bs == expected
        assert c.point(expected).spec_wins
        nxt = c.first_loss_above()
        assert nxt is None or not nxt.spec_wins


def test_speculation_that_never_pays_is_an_error() -> None:
    m = measurements_from_costs(spec={1: 0.03, 2: 0.03}, decode={1: 0.01, 2: 0.01})
    with pytest.raises(TuningError, match="loses to plain decode at every measured batch size"):
        tune(m, GiB, 10.0, _uniform(2), 2.0)


# ---- pool tops ------------------------------------------------------------------------------

def test_spec_top_sits_at_the_crossover(h200) -> None:
    r = tune(h200, 64 * GiB, 1000.0, _uniform(256), 3.0)
    assert r.crossover_bs == 40
    assert r.spec_bs[-1] == 40 and max(r.spec_bs) <= r.crossover_bs
    # A roomy budget takes every candidate in range, and nothing above the crossover.
    assert r.spec_bs == tuple(b for b in h200.sizes(Mode.SPEC) if b <= 40)
    assert r.decode_bs == h200.sizes(Mode.DECODE)
    assert r.exact and r.chosen.waste_tokens == pytest.approx(r.all_candidates.waste_tokens)
    # The spec graphs above the crossover are the memory saved.
    above = sum(g.pool_bytes for g in h200.graphs if g.key.mode is Mode.SPEC and g.key.bs > 40)
    assert r.all_candidates.memory_bytes - r.chosen.memory_bytes == above
    r2 = tune(h200, 64 * GiB, 1000.0, _uniform(256), 2.0)
    assert r2.spec_bs[-1] == 8 == r2.crossover_bs


def test_tops_follow_a_small_distribution(h200) -> None:
    r = tune(h200, 64 * GiB, 1000.0, _uniform(10), 3.0)
    assert r.spec_bs[-1] == 12 and r.decode_bs[-1] == 12   # smallest sizes covering bs 10


def test_decode_top_is_raised_to_cover_the_spec_top() -> None:
    # Candidate sets differ: spec bs 3 is ranked against decode bs 4, the graph that would
    # serve a decode step of 3 requests; the decode pool must reach 4 to cover the spec top.
    m = measurements_from_costs(spec={1: 0.006, 3: 0.007}, decode={1: 0.005, 2: 0.005, 4: 0.005})
    assert find_crossover(m, 3.0).point(3).decode_tok_s == pytest.approx(3 / 0.005)
    r = tune(m, GiB, 10.0, parse_distribution("fixed:3", 4), 3.0)
    assert r.spec_bs == (3,) and r.decode_bs == (4,)


def test_batches_beyond_every_decode_graph_are_refused(h200) -> None:
    with pytest.raises(TuningError, match="reaches bs=300 but the largest measured decode graph "
                                          "is bs=256.*eagerly"):
        tune(h200, 64 * GiB, 1000.0, _uniform(300), 3.0)


def test_accept_length_out_of_range(h200) -> None:
    for bad in (0.5, 4.5):
        with pytest.raises(TuningError, match=r"1\.\.K\+1 = 1\.\.4"):
            tune(h200, GiB, 10.0, _uniform(256), bad)


# ---- budgets and waste ----------------------------------------------------------------------

@pytest.mark.parametrize("mem, seconds", [(4 * GiB, 30.0), (2 * GiB, 10.0), (1 * GiB, 5.0),
                                          (3 * GiB, 4.0), (512 * MiB, 30.0)])
def test_budgets_are_respected(h200, mem: int, seconds: float) -> None:
    r = tune(h200, mem, seconds, _uniform(256), 3.0)
    by_key = h200.by_key()
    keys = [GraphKey(Mode.SPEC, b) for b in r.spec_bs] + [GraphKey(Mode.DECODE, b)
                                                          for b in r.decode_bs]
    assert sum(by_key[k].pool_bytes for k in keys) == r.chosen.memory_bytes <= mem
    assert sum(by_key[k].capture_s for k in keys) == pytest.approx(r.chosen.capture_s)
    assert r.chosen.capture_s <= seconds * (1 + 1e-9)
    assert r.exact
    assert r.spec_bs[-1] == 40 and r.decode_bs[-1] == 256
    probs = r.distribution.probs
    assert r.chosen.waste_tokens == pytest.approx(expected_waste(r.spec_bs, probs, 4)
                                                  + expected_waste(r.decode_bs, probs, 1))
    assert set(r.calibration.latency_s) == set(keys)


def test_tighter_budgets_never_waste_less(h200) -> None:
    wastes = [tune(h200, mem, 1000.0, _uniform(256), 3.0).chosen.waste_tokens
              for mem in (8 * GiB, 3 * GiB, 2 * GiB, GiB, 512 * MiB)]
    assert wastes == sorted(wastes)
    assert wastes[-1] > wastes[0]


def test_waste_hand_computed_through_tune() -> None:
    # K = 1: a spec step computes 2 tokens a request. Uniform bs 1..4.
    m = measurements_from_costs(spec={2: 0.012, 4: 0.012}, decode={2: 0.010, 4: 0.010},
                                num_draft_tokens=1)
    roomy = tune(m, GiB, 10.0, _uniform(4), 2.0)
    # spec [2, 4]: pads 1, 0, 1, 0 -> 0.5 requests * 2 tokens; decode [2, 4]: 0.5 tokens.
    assert roomy.chosen_by_mode[Mode.SPEC].waste_tokens == pytest.approx(1.0)
    assert roomy.chosen_by_mode[Mode.DECODE].waste_tokens == pytest.approx(0.5)
    tight = tune(m, 2 * MiB, 10.0, _uniform(4), 2.0)    # room for the two tops only
    assert tight.spec_bs == (4,) and tight.decode_bs == (4,)
    # spec [4]: pads 3, 2, 1, 0 -> 1.5 requests * 2 tokens; decode [4]: 1.5 tokens.
    assert tight.chosen.waste_tokens == pytest.approx(4.5)
    assert tight.all_candidates.waste_tokens == pytest.approx(1.5)


def test_infeasible_budget_names_the_minimum(h200) -> None:
    with pytest.raises(TuningError, match="--memory-budget to at least 358.05 MiB"):
        tune(h200, 100 * MiB, 30.0, _uniform(256), 3.0)
    with pytest.raises(TuningError, match="--time-budget to at least 0.72 s"):
        tune(h200, 4 * GiB, 0.5, _uniform(256), 3.0)


def test_calibration_feeds_the_goodput_policy(h200) -> None:
    # The policy looks latencies up at each mode's padded size: every one must be calibrated.
    r = tune(h200, 2 * GiB, 10.0, _uniform(256), 3.0)
    policy = GoodputPolicy(r.calibration)
    table = DispatchTable.build(r.spec_bs, r.decode_bs)

    def tok_s(mode: Mode, bs: int, accept: float) -> float:
        t = policy.predicted_tok_s(mode, bs, table.padded_bs(mode, bs), accept)
        assert t is not None
        return t

    for bs in range(1, r.spec_bs[-1] + 1):
        tok_s(Mode.SPEC, bs, 3.0)
    for bs in range(1, 257):
        tok_s(Mode.DECODE, bs, 1.0)
    assert tok_s(Mode.SPEC, 4, 3.0) > tok_s(Mode.DECODE, 4, 1.0)
    assert tok_s(Mode.SPEC, 4, 1.0) < tok_s(Mode.DECODE, 4, 1.0)


def test_table_is_readable(h200) -> None:
    r = tune(h200, 2 * GiB, 10.0, _uniform(256), 3.0)
    text = r.table()
    assert "speculation pays up to bs=40" in text and "decode wins at bs=48" in text
    assert "SYNTHETIC" in text
    assert f"spec bs   ({len(r.spec_bs)}): " + " ".join(map(str, r.spec_bs)) in text
    assert "saved " in text


def test_plan_pools_matches_tune(h200) -> None:
    plan = plan_pools(h200, _uniform(256), 3.0)
    assert plan.spec.top == 40 and plan.decode.top == 256
    assert plan.spec.tokens_per_request == 4 and plan.decode.tokens_per_request == 1


# ---- distribution presets -------------------------------------------------------------------

def test_distribution_presets(tmp_path: Path) -> None:
    u = parse_distribution("uniform:1-256", 1)
    assert len(u.probs) == 256 and u.probs[1] == pytest.approx(1 / 256) and u.max_bs == 256
    assert parse_distribution("uniform:64", 1).probs == parse_distribution("uniform:1-64", 1).probs
    assert min(parse_distribution("uniform:16-32", 1).probs) == 16
    g = parse_distribution("geometric", 128)
    assert g.max_bs == 128 and g.probs[1] > g.probs[2] > g.probs[128]
    assert g.probs[2] / g.probs[1] == pytest.approx(0.98)
    g2 = parse_distribution("geometric:0.1,max=32", 999)
    assert g2.max_bs == 32 and g2.probs[2] / g2.probs[1] == pytest.approx(0.9)
    assert parse_distribution("fixed:64", 1).probs == {64: 1.0}
    inline = parse_distribution('{"1": 1, "64": 3}', 1)
    assert inline.probs == {1: 0.25, 64: 0.75}
    f = tmp_path / "d.json"
    f.write_text(json.dumps({"8": 1, "16": 1}))
    assert parse_distribution(f"@{f}", 1).probs == {8: 0.5, 16: 0.5}
    assert sum(g.probs.values()) == pytest.approx(1.0)


@pytest.mark.parametrize("text, message", [
    ("uniform:0-5", "uniform:LO-HI"), ("uniform:9-3", "uniform:LO-HI"),
    ("uniform:abc", "uniform:LO-HI"), ("poisson:3", "unknown batch-size distribution"),
    ("{bad", "not valid JSON"), ('{"x": 1}', "not an integer"), ('{"4": -1}', ">= 0"),
    ('{"4": 0}', "no positive weight"), ("geometric:2", "geometric:P"),
    ("fixed:0", "fixed:N"), ("@/nonexistent/d.json", "cannot read distribution file"),
])
def test_bad_distributions(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_distribution(text, 256)


def test_costs_helper_defaults() -> None:
    m = measurements_from_costs(spec={1: Cost(0.01, 5, 0.2)}, decode={1: 0.005})
    assert m.get(Mode.SPEC, 1).pool_bytes == 5 and m.get(Mode.DECODE, 1).pool_bytes == MiB
    assert m.synthetic
