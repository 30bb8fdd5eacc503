"""The capture config: round trip, stale configs and malformed ones refused with a message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capture.config import (SCHEMA, CaptureConfig, build_capture_config, load_capture_config,
                            save_capture_config)
from capture.distribution import parse_distribution
from capture.measurements import GpuInfo, Measurements, load_measurements
from capture.tuner import tune
from dual_graph_worker.core.errors import ConfigError, StaleConfig
from dual_graph_worker.core.modes import GraphKey, Mode

FIXTURE = Path(__file__).parent / "data" / "capture" / "synthetic_h200_llama8b_k3.json"


@pytest.fixture(scope="module")
def measurements():
    return load_measurements(FIXTURE)


@pytest.fixture(scope="module")
def config(measurements) -> CaptureConfig:
    result = tune(measurements, 2 << 30, 10.0, parse_distribution("uniform:1-256", 256), 3.0)
    return build_capture_config(measurements, result)


def _write(tmp_path: Path, data) -> Path:
    p = tmp_path / "config.json"
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_round_trip_and_contents(tmp_path: Path, measurements, config: CaptureConfig) -> None:
    path = tmp_path / "sub" / "config.json"
    save_capture_config(config, path)
    loaded = load_capture_config(path, expected_gpu=measurements.gpu,
                                 expected_shape=measurements.model.shape)
    assert loaded == config
    raw = json.loads(path.read_text())
    assert raw["schema"] == SCHEMA and raw["synthetic"] is True
    assert raw["gpu"] == {"name": "NVIDIA H200", "compute_capability": "9.0"}
    assert raw["model"]["fingerprint"] == measurements.model.fingerprint
    assert raw["spec_bs"][-1] == raw["tuning"]["crossover_bs"] == 40
    assert raw["decode_bs"][-1] == 256 and raw["num_draft_tokens"] == 3
    assert raw["budgets"] == {"memory_bytes": 2 << 30, "capture_s": 10.0}
    assert raw["savings"]["chosen"]["memory_bytes"] <= 2 << 30
    assert raw["savings"]["all_candidates"]["graphs"] == len(measurements.graphs)
    # Savings use the shared-pool model, say so, and keep the old isolated sum alongside.
    assert raw["savings"]["memory_model"] == {
        "kind": "shared-pool", "per_graph_bytes": 128 << 10, "source": "total_pool_bytes",
        "measured_total_bytes": measurements.total_pool_bytes,
        "measured_peak_bytes": max(g.pool_bytes for g in measurements.graphs),
        "measured_keys": len(measurements.graphs)}
    assert raw["savings"]["all_candidates"]["memory_bytes"] == measurements.total_pool_bytes
    assert raw["savings"]["all_candidates"]["isolated_sum_bytes"] == sum(
        g.pool_bytes for g in measurements.graphs)
    assert raw["tuning"]["exclude_compile_outlier"] is True
    assert raw["tuning"]["capture_outliers"] == []
    assert {(e["mode"], e["bs"]) for e in raw["calibration"]["latency_s"]} == {
        (k.mode.value, k.bs) for k in config.keys()}
    assert raw["tuning"]["distribution"]["description"] == "uniform:1-256"


def test_config_round_trips_capture_outliers(tmp_path: Path, measurements) -> None:
    raw = measurements.to_json()
    raw["graphs"][0]["capture_s"] = 3.0          # decode bs=1: one-time compile in its capture
    m = Measurements.from_json(raw)
    config = build_capture_config(m, tune(m, 2 << 30, 10.0,
                                          parse_distribution("uniform:1-256", 256), 3.0))
    path = tmp_path / "c.json"
    save_capture_config(config, path)
    assert load_capture_config(path) == config
    (out,) = json.loads(path.read_text())["tuning"]["capture_outliers"]
    assert out["mode"] == "decode" and out["bs"] == 1 and out["measured_s"] == 3.0
    assert 0 < out["used_s"] < 0.5


def test_config_written_before_the_shared_pool_model_still_loads(tmp_path: Path,
                                                                 config: CaptureConfig) -> None:
    data = config.to_json()
    del data["savings"]["memory_model"]
    for t in ("chosen", "all_candidates"):
        del data["savings"][t]["isolated_sum_bytes"]
    del data["tuning"]["exclude_compile_outlier"], data["tuning"]["capture_outliers"]
    old = load_capture_config(_write(tmp_path, data))
    assert old.memory_model is None and old.exclude_compile_outlier is None
    assert old.chosen.isolated_sum_bytes is None and old.spec_bs == config.spec_bs


SGLANG_H200 = Path(__file__).resolve().parent.parent / "results" / "capture" / "sglang-h200"


@pytest.mark.skipif(not (SGLANG_H200 / "measurements.json").exists(),
                    reason="no SGLang H200 measurements in this checkout")
def test_sglang_config_records_a_pool_per_mode(tmp_path: Path) -> None:
    m = load_measurements(SGLANG_H200 / "measurements.json")
    config = build_capture_config(m, tune(m, 1 << 30, 30.0,
                                          parse_distribution("uniform:1-256", 256), 3.0,
                                          spec_max_bs=64))
    path = tmp_path / "c.json"
    save_capture_config(config, path)
    assert load_capture_config(path) == config
    raw = json.loads(path.read_text())["savings"]["memory_model"]
    assert raw["kind"] == "pool-per-mode" and raw["per_graph_bytes"] == 2 << 20
    assert raw["peak_factor"] == pytest.approx(1.589, abs=1e-3)
    assert raw["measured_total_bytes"] == m.total_pool_bytes


@pytest.mark.parametrize("name", ["config_acc3_uniform.json", "compare-served/config.json"])
def test_configs_tuned_with_one_shared_pool_still_load(name: str) -> None:
    """Written by the one-shared-pool model (largest + 16 MiB a graph): read back as such."""
    path = SGLANG_H200 / name
    if not path.exists():
        pytest.skip(f"no {path} in this checkout")
    old = load_capture_config(path)
    assert old.memory_model is not None and old.memory_model.shared
    assert old.memory_model.per_graph_bytes == 16906108


def test_config_builds_the_dispatch_table(config: CaptureConfig) -> None:
    table = config.dispatch_table()
    assert table.spec_sizes == config.spec_bs and table.decode_sizes == config.decode_bs
    assert table.lookup(Mode.SPEC, 40) == GraphKey(Mode.SPEC, 40)
    assert table.lookup(Mode.DECODE, 255) == GraphKey(Mode.DECODE, 256)


def test_config_from_another_gpu_is_stale(tmp_path: Path, measurements,
                                          config: CaptureConfig) -> None:
    path = tmp_path / "c.json"
    save_capture_config(config, path)
    with pytest.raises(StaleConfig, match=r"was tuned on 'NVIDIA H200' \(SM90\) but this GPU is "
                                          r"'NVIDIA H100 80GB HBM3' \(SM90\); re-run "
                                          "`make capture-tune`"):
        load_capture_config(path, expected_gpu=GpuInfo("NVIDIA H100 80GB HBM3", "9.0"))
    with pytest.raises(StaleConfig, match=r"this GPU is 'NVIDIA H200' \(SM100\)"):
        load_capture_config(path, expected_gpu=GpuInfo("NVIDIA H200", "10.0"))


def test_config_for_another_model_is_stale(tmp_path: Path, measurements,
                                           config: CaptureConfig) -> None:
    path = tmp_path / "c.json"
    save_capture_config(config, path)
    other = dict(measurements.model.shape, num_layers=8)
    with pytest.raises(StaleConfig, match="num_layers: 32 when tuned, 8 now.*make capture-tune"):
        load_capture_config(path, expected_gpu=measurements.gpu, expected_shape=other)
    with pytest.raises(StaleConfig, match="tp_size: '<absent>' when tuned, 2 now"):
        load_capture_config(path, expected_shape=dict(measurements.model.shape, tp_size=2))
    # Stale is not malformed: callers can tell "re-tune" from "fix the file".
    assert not issubclass(StaleConfig, ConfigError)


def _mutated(config: CaptureConfig, mutate) -> dict:
    data = config.to_json()
    mutate(data)
    return data


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(schema="dgw-capture-config/0"), "schema 'dgw-capture-config/0'"),
    (lambda d: d.update(spec_bs=[]), "spec_bs is empty"),
    (lambda d: d.update(decode_bs=[]), "decode_bs is empty"),
    (lambda d: d.update(decode_bs=[1, 2, 4, 8]), "decode pool tops out at bs=8 below the spec"),
    (lambda d: d.update(spec_bs=[8, 4]), "ascending"),
    (lambda d: d.update(spec_bs="4,8"), "list of integer batch sizes"),
    (lambda d: d["calibration"]["latency_s"].pop(), "no latency for"),
    (lambda d: d["calibration"].update(latency_s=[{"mode": "spec"}]), "calibration table is "
                                                                      "malformed"),
    (lambda d: d.update(num_draft_tokens=4), "num_draft_tokens disagree"),
    (lambda d: d["model"]["shape"].update(num_layers=8), "fingerprint"),
    (lambda d: d.pop("budgets"), "budgets must be a JSON object"),
    (lambda d: d["tuning"].update(accept_len="3"), "accept_len must be a finite number"),
    (lambda d: d["gpu"].update(name=""), "gpu.name"),
    (lambda d: d["savings"]["memory_model"].update(kind="sum"),
     r"kind must be one of \['shared-pool', 'pool-per-mode'\], got 'sum'"),
    (lambda d: d["savings"]["memory_model"].update(per_graph_bytes=-1), "per_graph_bytes"),
    (lambda d: d["savings"]["memory_model"].update(source="guess"), "source must be one of"),
    (lambda d: d["tuning"].update(exclude_compile_outlier="yes"), "exclude_compile_outlier"),
    (lambda d: d["tuning"].update(exact="false"), "tuning.exact must be true or false"),
    (lambda d: d["tuning"].update(capture_outliers=[{"mode": "x", "bs": 1}]), "'spec' or"),
])
def test_malformed_config_is_refused(tmp_path: Path, config: CaptureConfig, mutate,
                                     message: str) -> None:
    path = _write(tmp_path, _mutated(config, mutate))
    with pytest.raises(ConfigError, match=message) as info:
        load_capture_config(path)
    assert str(path) in str(info.value) and "make capture-tune" in str(info.value)


def test_unreadable_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"not valid JSON \(line 1, column 2"):
        load_capture_config(_write(tmp_path, "{oops"))
    with pytest.raises(ConfigError, match="cannot read capture config"):
        load_capture_config(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="capture config must be a JSON object"):
        load_capture_config(_write(tmp_path, "[1, 2]"))
