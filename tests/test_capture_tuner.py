"""The tuner: crossover, pool tops, budgets, waste, and the distribution presets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capture.distribution import BatchDistribution, parse_distribution
from capture.measurements import load_measurements
from capture.padding import expected_waste
from capture.synthetic import SHARED_RESIDUE_BYTES, Cost, measurements_from_costs
from capture.memory_model import SEGMENT_BYTES, MemoryModel
from capture.tuner import (TuningError, find_compile_outliers, find_crossover, plan_pools,
                           tune)
from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import GraphKey, Mode
from dual_graph_worker.core.controller import ControllerConfig, GoodputController

FIXTURE = Path(__file__).parent / "data" / "capture" / "synthetic_h200_llama8b_k3.json"
REAL_H200 = (Path(__file__).resolve().parent.parent / "results" / "capture"
             / "measurements_h200_llama3-8b.json")
GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10


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


def test_table_lists_losses_below_the_crossover() -> None:
    # The crossover rule stays "largest winning bs" (4); the table must not hide the loss at 2.
    m = measurements_from_costs(spec={1: 0.012, 2: 0.025, 4: 0.015, 8: 0.030, 16: 0.050},
                                decode={1: 0.010, 2: 0.010, 4: 0.010, 8: 0.010, 16: 0.010},
                                num_draft_tokens=1)
    assert [p.bs for p in find_crossover(m, 2.0).losses_below()] == [2]
    text = tune(m, GiB, 10.0, _uniform(16), 2.0).table()
    assert "speculation pays up to bs=4 (533 vs 400 tok/s; decode faster at bs=2)" in text
    assert "old model" not in text


@pytest.mark.skipif(not REAL_H200.exists(), reason="no H200 measurements in this checkout")
def test_h200_table_shows_the_loss_a_noisy_win_above_it_hides() -> None:
    m = load_measurements(REAL_H200)
    text = tune(m, 4 * GiB, 30.0, _uniform(256), 2.5).table()
    assert "speculation pays up to bs=224" in text and "decode faster at bs=208;" not in text
    assert "decode faster at bs=208)" in text


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
    # The spec graphs above the crossover are what is saved: in the shared pool, their peak
    # (spec bs=128 is the largest graph measured) and their per-graph residue; in the old
    # isolated sum, their whole footprints.
    above = [g for g in h200.graphs if g.key.mode is Mode.SPEC and g.key.bs > 40]
    assert (r.all_candidates.isolated_sum_bytes - r.chosen.isolated_sum_bytes
            == sum(g.pool_bytes for g in above))
    peak_all = max(g.pool_bytes for g in h200.graphs)
    peak_chosen = max(h200.get(Mode.SPEC, 40).pool_bytes, h200.get(Mode.DECODE, 256).pool_bytes)
    assert peak_all == h200.get(Mode.SPEC, 128).pool_bytes
    assert (r.all_candidates.memory_bytes - r.chosen.memory_bytes
            == peak_all - peak_chosen + SHARED_RESIDUE_BYTES * len(above))
    r2 = tune(h200, 64 * GiB, 1000.0, _uniform(256), 2.0)
    assert r2.spec_bs[-1] == 8 == r2.crossover_bs


def test_spec_max_bs_caps_the_spec_pool_below_the_crossover(h200) -> None:
    r = tune(h200, 64 * GiB, 1000.0, _uniform(256), 3.0, spec_max_bs=20)
    assert r.crossover_bs == 40           # the replays' crossover is kept, for the table
    assert r.spec_bs == tuple(b for b in h200.sizes(Mode.SPEC) if b <= 20)
    assert "spec pool capped at bs=20" in r.table()
    # The config's crossover (the threshold prior) is capped with it.
    from capture.config import build_capture_config
    assert build_capture_config(h200, r).crossover_bs == 20
    # A cap above the crossover changes nothing; a cap below every size is refused.
    assert tune(h200, 64 * GiB, 1000.0, _uniform(256), 3.0, spec_max_bs=200).spec_bs == \
        tune(h200, 64 * GiB, 1000.0, _uniform(256), 3.0).spec_bs
    m = measurements_from_costs(spec={4: 0.006, 8: 0.007}, decode={4: 0.005, 8: 0.005})
    with pytest.raises(TuningError, match="--spec-max-bs 2 is below every measured spec batch"):
        tune(m, GiB, 10.0, parse_distribution("uniform:1-8", 8), 3.0, spec_max_bs=2)


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

# The fixture's shared pool: the decode top (bs=256, ~199.3 MiB alone) + 128 KiB a graph, so
# 201 MiB leaves room for ~13 graphs and 202 MiB for ~21; the other memory budgets do not bind.
@pytest.mark.parametrize("mem, seconds", [(4 * GiB, 30.0), (2 * GiB, 10.0), (1 * GiB, 5.0),
                                          (3 * GiB, 4.0), (512 * MiB, 30.0), (201 * MiB, 30.0),
                                          (202 * MiB, 5.0)])
def test_budgets_are_respected(h200, mem: int, seconds: float) -> None:
    r = tune(h200, mem, seconds, _uniform(256), 3.0)
    by_key = h200.by_key()
    keys = [GraphKey(Mode.SPEC, b) for b in r.spec_bs] + [GraphKey(Mode.DECODE, b)
                                                          for b in r.decode_bs]
    isolated = [by_key[k].pool_bytes for k in keys]
    shared = max(isolated) + SHARED_RESIDUE_BYTES * len(keys)
    assert shared == r.chosen.memory_bytes <= mem
    assert sum(isolated) == r.chosen.isolated_sum_bytes
    assert sum(by_key[k].capture_s for k in keys) == pytest.approx(r.chosen.capture_s)
    assert r.chosen.capture_s <= seconds * (1 + 1e-9)
    assert r.exact
    assert r.spec_bs[-1] == 40 and r.decode_bs[-1] == 256
    probs = r.distribution.probs
    assert r.chosen.waste_tokens == pytest.approx(expected_waste(r.spec_bs, probs, 4)
                                                  + expected_waste(r.decode_bs, probs, 1))
    assert set(r.calibration.latency_s) == set(keys)


def test_tighter_budgets_never_waste_less(h200) -> None:
    results = [tune(h200, mem, 1000.0, _uniform(256), 3.0)
               for mem in (GiB, 206 * MiB, 203 * MiB, 201 * MiB, 200 * MiB)]
    wastes = [r.chosen.waste_tokens for r in results]
    assert wastes == sorted(wastes)
    assert wastes[-1] > wastes[0]
    # Shared-pool memory binds through the graph count: fewer graphs as the budget shrinks.
    counts = [r.chosen.graphs for r in results]
    assert counts == sorted(counts, reverse=True) and counts[-1] < counts[0]


def test_waste_hand_computed_through_tune() -> None:
    # K = 1: a spec step computes 2 tokens a request. Uniform bs 1..4.
    m = measurements_from_costs(spec={2: 0.012, 4: 0.012}, decode={2: 0.010, 4: 0.010},
                                num_draft_tokens=1)
    roomy = tune(m, GiB, 10.0, _uniform(4), 2.0)
    # spec [2, 4]: pads 1, 0, 1, 0 -> 0.5 requests * 2 tokens; decode [2, 4]: 0.5 tokens.
    assert roomy.chosen_by_mode[Mode.SPEC].waste_tokens == pytest.approx(1.0)
    assert roomy.chosen_by_mode[Mode.DECODE].waste_tokens == pytest.approx(0.5)
    # No total_pool_bytes: the fallback 2 MiB a graph on top of the largest (1 MiB) graph, so
    # 5 MiB is room for the two tops only.
    assert roomy.memory_model.source == "fallback"
    assert roomy.chosen.memory_bytes == MiB + 4 * SEGMENT_BYTES
    tight = tune(m, 5 * MiB, 10.0, _uniform(4), 2.0)
    assert tight.spec_bs == (4,) and tight.decode_bs == (4,)
    assert tight.chosen.memory_bytes == 5 * MiB and tight.chosen.isolated_sum_bytes == 2 * MiB
    # spec [4]: pads 3, 2, 1, 0 -> 1.5 requests * 2 tokens; decode [4]: 1.5 tokens.
    assert tight.chosen.waste_tokens == pytest.approx(4.5)
    assert tight.all_candidates.waste_tokens == pytest.approx(1.5)


def test_infeasible_budget_names_the_minimum(h200) -> None:
    # The two tops in one shared pool: the decode top's 199.33 MiB + 2 x 128 KiB.
    with pytest.raises(TuningError, match=r"needs 199.58 MiB \(one shared pool: the larger top's "
                                          r"isolated 199.33 MiB \+ 2 x 128.00 KiB a graph\).*"
                                          r"--memory-budget to at least 199.58 MiB"):
        tune(h200, 100 * MiB, 30.0, _uniform(256), 3.0)
    tune(h200, int(199.59 * MiB), 30.0, _uniform(256), 3.0)   # just enough: no error
    with pytest.raises(TuningError, match="--time-budget to at least 0.72 s"):
        tune(h200, 4 * GiB, 0.5, _uniform(256), 3.0)


# ---- memory model and capture-time outliers ---------------------------------------------------

def test_shared_pool_model_from_total_pool_bytes() -> None:
    # Three keys alone: 10, 40 and 25 MiB; all three captured together into one pool: 46 MiB.
    # Shared pool = the largest alone + (46 - 40) / 3 = 2 MiB a graph.
    m = measurements_from_costs(spec={1: Cost(0.010, 10 * MiB), 2: Cost(0.011, 40 * MiB)},
                                decode={2: Cost(0.010, 25 * MiB)}, num_draft_tokens=1,
                                total_pool_bytes=46 * MiB)
    model = MemoryModel.from_measurements(m)
    assert model.per_graph_bytes == 2 * MiB and model.source == "total_pool_bytes"
    assert model.shared and model.peak_factor == 1.0
    assert model.memory(m.graphs) == 46 * MiB == m.total_pool_bytes
    spec1, dec2, _ = sorted(m.graphs, key=lambda g: g.pool_bytes)
    assert model.memory([dec2, spec1]) == 25 * MiB + 2 * 2 * MiB
    r = tune(m, GiB, 10.0, _uniform(2), 2.0)
    assert r.spec_bs == (1, 2) and r.decode_bs == (2,)
    assert r.chosen.memory_bytes == 46 * MiB and r.chosen.isolated_sum_bytes == 75 * MiB
    # Per pool: each pool's graphs alone in a shared pool; the rows do not add up to chosen.
    assert r.chosen_by_mode[Mode.SPEC].memory_bytes == 40 * MiB + 2 * 2 * MiB
    assert r.chosen_by_mode[Mode.DECODE].memory_bytes == 25 * MiB + 2 * MiB
    # A budget below the largest graph + 3 residues drops the spec bs=1 graph, not to 2 tops'
    # sum (65 MiB): the shared pool of the two tops is 44 MiB.
    r2 = tune(m, 45 * MiB, 10.0, _uniform(2), 2.0)
    assert r2.spec_bs == (2,) and r2.chosen.memory_bytes == 44 * MiB
    # Captured together for less than the largest alone (measurement noise): no negative cost.
    m0 = measurements_from_costs(spec={1: Cost(0.010, 10 * MiB)}, decode={1: Cost(0.01, MiB)},
                                 total_pool_bytes=9 * MiB)
    assert MemoryModel.from_measurements(m0).per_graph_bytes == 0


def test_fixture_shared_pool_matches_its_total(h200) -> None:
    model = MemoryModel.from_measurements(h200)
    assert model.per_graph_bytes == SHARED_RESIDUE_BYTES
    # Every key in the model reproduces the measured every-key-together pool.
    assert model.memory(h200.graphs) == h200.total_pool_bytes
    r = tune(h200, GiB, 1000.0, _uniform(256), 3.0)
    assert r.all_candidates.memory_bytes == h200.total_pool_bytes
    assert r.all_candidates.isolated_sum_bytes == sum(g.pool_bytes for g in h200.graphs)


def test_fallback_memory_model_without_total_pool_bytes() -> None:
    m = measurements_from_costs(spec={1: 0.01, 2: 0.011}, decode={1: 0.01, 2: 0.01})
    model = MemoryModel.from_measurements(m)
    assert model.source == "fallback" and model.per_graph_bytes == SEGMENT_BYTES
    assert "fallback" in model.describe()
    assert MemoryModel.from_json(model.to_json()) == model


def _with_compile_outlier(**extra) -> object:
    # Spec bs=1 and decode bs=1 were each the first key of their mode captured: 2.4 s and
    # 0.8 s of one-time compilation against ~0.1 s a graph.
    cap = {1: 0.8, 2: 0.10, 3: 0.11, 4: 0.09}
    return measurements_from_costs(
        spec={b: Cost(0.010 + 0.001 * b, MiB, cap[b]) for b in (1, 2, 3, 4)},
        decode={b: Cost(0.010, MiB, 2.4 if b == 1 else cap[b]) for b in (1, 2, 3, 4)},
        num_draft_tokens=1, **extra)


def test_compile_outliers_are_replaced_by_the_mode_median() -> None:
    m = _with_compile_outlier()
    outliers = find_compile_outliers(m)
    assert [(o.key, o.measured_s) for o in outliers] == [(GraphKey(Mode.SPEC, 1), 0.8),
                                                         (GraphKey(Mode.DECODE, 1), 2.4)]
    assert outliers[0].median_s == pytest.approx(0.105)    # median of 0.8, 0.10, 0.11, 0.09
    assert outliers[1].median_s == pytest.approx(0.105)
    # 5x the median is the line: 0.5 s would not be replaced.
    assert find_compile_outliers(m, factor=8.0) == (outliers[1],)
    r = tune(m, GiB, 10.0, _uniform(4), 2.0)
    assert r.exclude_compile_outlier and r.capture_outliers == outliers
    assert r.all_candidates.capture_s == pytest.approx(0.30 + 0.105 + 0.30 + 0.105)
    text = _flat(r.table())
    assert "REPLACED by that median" in text and "decode bs=1 2.400 s -> 0.105 s" in text
    assert "one-time Triton JIT compilation" in text
    # Off: the measured values are the costs, and the table says they were kept.
    kept = tune(m, GiB, 10.0, _uniform(4), 2.0, exclude_compile_outlier=False)
    assert kept.all_candidates.capture_s == pytest.approx(0.30 + 0.8 + 0.30 + 2.4)
    assert "kept as measured" in _flat(kept.table())


def test_compile_outlier_changes_the_choice_under_a_time_budget() -> None:
    # With bs=1 priced at its compile time, a 1.2 s budget cannot afford decode bs=1; priced at
    # the median it can.
    m = _with_compile_outlier()
    with_median = tune(m, GiB, 1.2, _uniform(4), 2.0)
    raw = tune(m, GiB, 1.2, _uniform(4), 2.0, exclude_compile_outlier=False)
    assert 1 in with_median.decode_bs and 1 not in raw.decode_bs
    assert with_median.chosen.capture_s <= 1.2 and raw.chosen.capture_s <= 1.2


def _flat(text: str) -> str:
    return " ".join(text.split())   # the table wraps its notes


def test_table_names_the_memory_model(h200) -> None:
    table = tune(h200, 2 * GiB, 10.0, _uniform(256), 3.0).table()
    text = _flat(table)
    assert "memory model: shared pool = largest isolated pool of the chosen graphs + " \
           "128.00 KiB x graphs" in text
    assert "from total_pool_bytes" in text and "isolated sum" in text
    assert "capture time:" not in table and "REPLACED" not in table   # the fixture has none
    fallback = _flat(tune(_with_compile_outlier(), GiB, 10.0, _uniform(4), 2.0).table())
    assert "2.00 MiB x graphs (fallback" in fallback


@pytest.mark.skipif(not REAL_H200.exists(), reason="no H200 measurements in this checkout")
def test_first_h200_measurements_tune_to_many_graphs() -> None:
    # The bug this model fixes: summing isolated pools (5.68 GiB for 54 keys that measured
    # 466 MiB together) left 3 graphs a pool under 1 GiB.
    m = load_measurements(REAL_H200)
    model = MemoryModel.from_measurements(m)
    assert model.shared   # the reference engine: one graph pool for both modes
    assert model.memory(m.graphs) - m.total_pool_bytes in range(len(m.graphs))
    assert {o.key for o in find_compile_outliers(m)} == {GraphKey(Mode.SPEC, 1),
                                                         GraphKey(Mode.DECODE, 1)}
    r = tune(m, GiB, 4.0, _uniform(256), 2.0)
    assert r.chosen.memory_bytes <= GiB and r.chosen.capture_s <= 4.0
    assert len(r.spec_bs) >= 10 and len(r.decode_bs) >= 10


def test_calibration_is_the_controllers_prior_at_every_padded_size(h200) -> None:
    # The controller looks its prior up at each mode's padded size: every one must be there.
    r = tune(h200, 2 * GiB, 10.0, _uniform(256), 3.0)
    policy = GoodputController(ControllerConfig(3), {Mode.SPEC: r.spec_bs,
                                                     Mode.DECODE: r.decode_bs}, r.calibration)
    table = DispatchTable.build(r.spec_bs, r.decode_bs)

    def tok_s(mode: Mode, bs: int, accept: float) -> float:
        t = policy.step_time(mode, table.padded_bs(mode, bs))
        assert t is not None
        return bs * accept / t

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
    assert "saved " in text and "of shared-pool memory" in text


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


def test_a_servers_step_log_is_a_distribution(tmp_path: Path) -> None:
    from dual_graph_worker.core.modes import Mode
    from dual_graph_worker.core.policy import Reason
    from dual_graph_worker.core.results import StepRecord
    from dual_graph_worker.core.step_log import StepLogWriter

    log = StepLogWriter(tmp_path / "steps.jsonl")
    for i, bs in enumerate([4, 4, 4, 32]):
        log.write(StepRecord(i, Mode.DECODE, bs, bs, Reason.GOODPUT, True, bs, 1.0), float(i))
    log.write_event("catch_up", 9.0, tokens=12)            # events are not steps
    log.close()
    assert parse_distribution(f"steplog:{tmp_path / 'steps.jsonl'}", 256).probs == {4: 0.75,
                                                                                    32: 0.25}
    # The committed H200 step log (gzipped) reads the same way.
    logged = parse_distribution(
        f"steplog:{Path(__file__).parents[1] / 'results/sglang/stall15/steps-dual-bench.jsonl.gz'}", 256)
    assert sum(logged.probs.values()) == pytest.approx(1.0) and logged.max_bs >= 1


@pytest.mark.parametrize("text, message", [
    ("uniform:0-5", "uniform:LO-HI"), ("uniform:9-3", "uniform:LO-HI"),
    ("uniform:abc", "uniform:LO-HI"), ("poisson:3", "unknown batch-size distribution"),
    ("{bad", "not valid JSON"), ('{"x": 1}', "not an integer"), ('{"4": -1}', ">= 0"),
    ('{"4": 0}', "no positive weight"), ("geometric:2", "geometric:P"),
    ("fixed:0", "fixed:N"), ("@/nonexistent/d.json", "cannot read distribution file"),
    ("steplog:/nonexistent/steps.jsonl", "DGW_STEP_LOG=PATH"),
])
def test_bad_distributions(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_distribution(text, 256)


def test_a_malformed_step_log_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "steps.jsonl").write_text('{"step": 1, "t": 0}\n')
    with pytest.raises(ConfigError, match=r"malformed step line \(KeyError: 'mode'\)"):
        parse_distribution(f"steplog:{tmp_path / 'steps.jsonl'}", 256)


@pytest.mark.parametrize("text", ["uniform:1-99999999", "uniform:99999999",
                                  "geometric:0.5,max=99999999", "uniform:1-" + "9" * 5000])
def test_a_huge_preset_top_is_refused_before_listing_every_size(text: str) -> None:
    # Each would build a dict of every size up to its top (MemoryError, or int() refusing).
    with pytest.raises(ConfigError, match=r"above bs=4096, the largest a preset lists"):
        parse_distribution(text, 256)


def test_a_callers_larger_max_bs_raises_the_preset_bound() -> None:
    assert parse_distribution("uniform:1-4096", 256).max_bs == 4096
    assert parse_distribution("geometric:0.001,max=6000", 8192).max_bs == 6000
    with pytest.raises(ConfigError, match="above bs=8192"):
        parse_distribution("uniform:1-8193", 8192)


def test_costs_helper_defaults() -> None:
    m = measurements_from_costs(spec={1: Cost(0.01, 5, 0.2)}, decode={1: 0.005})
    assert m.get(Mode.SPEC, 1).pool_bytes == 5 and m.get(Mode.DECODE, 1).pool_bytes == MiB
    assert m.synthetic
