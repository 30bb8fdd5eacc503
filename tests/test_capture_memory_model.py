"""The tuner's memory model on SGLang's graphs: a graph pool per mode, against what the H200
servers measured (results/capture/sglang-h200)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from capture.distribution import parse_distribution
from capture.measurements import Measurements, load_measurements
from capture.synthetic import Cost, measurements_from_costs
from capture.memory_model import FALLBACK_PEAK_FACTOR, SEGMENT_BYTES, MemoryModel
from capture.tuner import priced_graphs, tune
from dual_graph_worker.core.errors import ConfigError

SGLANG_H200 = Path(__file__).resolve().parent.parent / "results" / "capture" / "sglang-h200"
MEASUREMENTS = SGLANG_H200 / "measurements.json"
MiB = 1 << 20
TOLERANCE = 0.15
needs_h200 = pytest.mark.skipif(not MEASUREMENTS.exists(),
                                reason="no SGLang H200 measurements in this checkout")


def _sglang(m: Measurements) -> Measurements:
    return dataclasses.replace(m, meta={"engine": "sglang"})


def _three_keys(total_pool_bytes=None) -> Measurements:
    # Spec bs 1 and 2 alone: 10 and 40 MiB; decode bs 2 alone: 25 MiB.
    return _sglang(measurements_from_costs(
        spec={1: Cost(0.010, 10 * MiB), 2: Cost(0.011, 40 * MiB)},
        decode={2: Cost(0.010, 25 * MiB)}, num_draft_tokens=1,
        total_pool_bytes=total_pool_bytes))


def test_sglang_measurements_get_a_graph_pool_per_mode() -> None:
    # Together, as a server measures its pools: 1.5 x (40 + 25) + 3 segments. The factor is
    # what one together-capture fits; a graph's own share stays a segment.
    m = _three_keys(total_pool_bytes=int(1.5 * 65 * MiB) + 3 * SEGMENT_BYTES)
    model = MemoryModel.from_measurements(m)
    assert model.pools == "per-mode" and not model.shared
    assert model.per_graph_bytes == SEGMENT_BYTES and model.peak_factor == pytest.approx(1.5)
    assert model.measured_peak_bytes == 65 * MiB and model.measured_keys == 3
    assert model.memory(m.graphs) == m.total_pool_bytes
    spec1, dec2, spec2 = sorted(m.graphs, key=lambda g: g.pool_bytes)
    # Each mode's peak counts, even when the other mode's is larger.
    assert model.memory([spec1, dec2]) == math.ceil(1.5 * 35 * MiB) + 2 * SEGMENT_BYTES
    assert model.memory([spec2]) == 60 * MiB + SEGMENT_BYTES
    # The same file from the reference engine: one shared pool, the peak once, the rest split
    # between the graphs.
    shared = MemoryModel.from_measurements(dataclasses.replace(m, meta={}))
    assert shared.shared and shared.memory(m.graphs) - m.total_pool_bytes in range(3)
    assert shared.memory([spec1, dec2]) == 25 * MiB + 2 * shared.per_graph_bytes


def test_per_mode_fallback_and_noise() -> None:
    fallback = MemoryModel.from_measurements(_three_keys())
    assert fallback.source == "fallback" and fallback.peak_factor == FALLBACK_PEAK_FACTOR
    assert "fallback" in fallback.describe() and "a pool per mode" in fallback.describe()
    # Together for less than the peaks alone (noise): the peaks still count once each.
    noisy = MemoryModel.from_measurements(_three_keys(total_pool_bytes=50 * MiB))
    assert noisy.peak_factor == 1.0


@pytest.mark.parametrize("model", [
    MemoryModel(SEGMENT_BYTES, "total_pool_bytes", "per-mode", 1.59, 2 << 30, 1 << 30, 63),
    MemoryModel(SEGMENT_BYTES, "fallback", "per-mode", FALLBACK_PEAK_FACTOR),
    MemoryModel(77673, "total_pool_bytes", "shared", 1.0, 488636416, 484442112, 54),
])
def test_memory_model_json_round_trip(model: MemoryModel) -> None:
    raw = model.to_json()
    assert raw["kind"] == ("shared-pool" if model.shared else "pool-per-mode")
    assert ("peak_factor" in raw) is not model.shared
    assert MemoryModel.from_json(json.loads(json.dumps(raw))) == model


@pytest.mark.parametrize("raw, message", [
    ({"kind": "pool-per-mode", "per_graph_bytes": 1, "source": "fallback"},
     "memory_model.peak_factor is missing"),
    ({"kind": "pool-per-mode", "per_graph_bytes": 1, "source": "fallback", "peak_factor": 0.5},
     "peak_factor must be a finite number >= 1"),
    ({"kind": "max-plus", "per_graph_bytes": 1, "source": "fallback"},
     r"kind must be one of \['shared-pool', 'pool-per-mode'\]"),
])
def test_bad_memory_model_json_is_one_line(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        MemoryModel.from_json(raw)
    assert "\n" not in str(info.value)


def test_a_shared_model_counts_its_peak_once() -> None:
    with pytest.raises(ConfigError, match="peak_factor must be 1"):
        MemoryModel(SEGMENT_BYTES, "fallback", "shared", 1.5)


def test_tuning_pays_each_modes_peak() -> None:
    # Both modes at bs 1 and 2 (K = 1, accept 2: spec wins at both); 1.5 x the peaks.
    m = _sglang(measurements_from_costs(
        spec={1: Cost(0.010, 10 * MiB), 2: Cost(0.011, 40 * MiB)},
        decode={1: Cost(0.010, 5 * MiB), 2: Cost(0.010, 25 * MiB)}, num_draft_tokens=1,
        total_pool_bytes=int(1.5 * 65 * MiB) + 4 * SEGMENT_BYTES))
    uniform = parse_distribution("uniform:1-2", 2)
    roomy = tune(m, 1 << 30, 10.0, uniform, 2.0)
    assert roomy.memory_model.pools == "per-mode"
    assert roomy.chosen.memory_bytes == m.total_pool_bytes
    # The rows add up: a graph pool each.
    assert roomy.chosen.memory_bytes == sum(t.memory_bytes for t in roomy.chosen_by_mode.values())
    tops = math.ceil(1.5 * 65 * MiB) + 2 * SEGMENT_BYTES
    tight = tune(m, tops + SEGMENT_BYTES, 10.0, uniform, 2.0)
    assert len(tight.spec_bs) + len(tight.decode_bs) == 3
    assert tight.chosen.memory_bytes == tops + SEGMENT_BYTES
    text = " ".join(roomy.table().split())
    assert "a pool per mode = 1.50 x" in text and "their memory the sum of the rows" in text
    with pytest.raises(ConfigError, match=r"a pool per mode: 1.50 x \(the tops' isolated "
                                          r"40.00 MiB \+ 25.00 MiB\) \+ 2 x 2.00 MiB a graph"):
        tune(m, tops - 1, 10.0, uniform, 2.0)


# ---- against the H200 servers ----------------------------------------------------------------

def _servers() -> dict[tuple, int]:
    """(spec_bs, decode_bs) -> graph bytes, for every server capture_compare measured."""
    out = {}
    for run in ("compare", "compare-served"):
        path = SGLANG_H200 / run / "compare.json"
        for row in json.loads(path.read_text())["rows"] if path.exists() else []:
            pools = row["pools"]
            out[(tuple(pools["spec_bs"]), tuple(pools["decode_bs"]))] = row["graph_bytes"]
    return out


@needs_h200
def test_the_served_config_is_modelled_within_15_percent() -> None:
    """The 9-graph config compare-served ran: the server measured 787 MiB for its pools."""
    m = load_measurements(MEASUREMENTS)
    lists = ((1, 2, 16, 64), (1, 2, 16, 64, 256))
    measured = _servers()[lists]
    assert round(measured / MiB) == 787
    model = MemoryModel.from_measurements(m)
    assert model.pools == "per-mode"
    assert model.memory(m.graphs) == m.total_pool_bytes
    predicted = model.memory(priced_graphs(m, *lists))
    assert abs(predicted / measured - 1) <= TOLERANCE, (predicted / MiB, measured / MiB)
    # One shared pool fitted on the same capture (largest + 16 MiB a graph) said 455 MiB.
    peak = max(g.pool_bytes for g in m.graphs)
    old = MemoryModel(math.ceil((m.total_pool_bytes - peak) / len(m.graphs)), "total_pool_bytes")
    assert old.memory(priced_graphs(m, *lists)) / measured < 1 - TOLERANCE


@needs_h200
def test_every_h200_server_is_modelled_within_15_percent() -> None:
    m = load_measurements(MEASUREMENTS)
    model = MemoryModel.from_measurements(m)
    servers = _servers()
    assert sorted(len(s) + len(d) for s, d in servers) == [9, 37, 63]
    for (spec_bs, decode_bs), measured in servers.items():
        predicted = model.memory(priced_graphs(m, spec_bs, decode_bs))
        assert abs(predicted / measured - 1) <= TOLERANCE, (len(spec_bs) + len(decode_bs),
                                                            predicted / MiB, measured / MiB)
