"""The measurements file: schema, fingerprint, round trip and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capture.measurements import (SCHEMA, GpuInfo, GraphMeasurement, Measurements,
                                  load_measurements, save_measurements)
from capture.synthetic import LLAMA3_8B_EAGLE3_SHAPE, synthetic_h200_measurements
from capture.units import format_bytes, parse_duration, parse_size
from dual_graph_worker.core.capture_schema import model_fingerprint
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import GraphKey, Mode, Stage

FIXTURE = Path(__file__).parent / "data" / "capture" / "synthetic_h200_llama8b_k3.json"


def _raw() -> dict:
    return json.loads(FIXTURE.read_text())


def _load_raw(tmp_path: Path, data: dict) -> Measurements:
    p = tmp_path / "m.json"
    p.write_text(json.dumps(data))
    return load_measurements(p)


def test_fixture_is_marked_synthetic_and_loads() -> None:
    m = load_measurements(FIXTURE)
    assert m.synthetic and "SYNTHETIC" in m.notes
    assert m.gpu == GpuInfo("NVIDIA H200", "9.0") and m.gpu.sm == "SM90"
    assert m.num_draft_tokens == 3
    assert m.sizes(Mode.DECODE)[-1] == 256 and m.sizes(Mode.SPEC)[-1] == 128
    g = m.get(Mode.SPEC, 8)
    assert set(g.stage_replay_s) == {Stage.DRAFT, Stage.VERIFY, Stage.DRAFT_EXTEND}


def test_fixture_matches_its_generator() -> None:
    # The recorded file and capture.synthetic must not drift apart.
    assert load_measurements(FIXTURE) == synthetic_h200_measurements()


def test_round_trip(tmp_path: Path) -> None:
    m = load_measurements(FIXTURE)
    save_measurements(m, tmp_path / "out" / "m.json")
    assert load_measurements(tmp_path / "out" / "m.json") == m
    assert json.loads((tmp_path / "out" / "m.json").read_text())["schema"] == SCHEMA


def test_fingerprint_is_canonical_and_sensitive() -> None:
    shape = dict(LLAMA3_8B_EAGLE3_SHAPE)
    reordered = dict(reversed(list(shape.items())))
    fp = model_fingerprint(shape)
    assert fp == model_fingerprint(reordered)
    assert len(fp) == 16 and all(c in "0123456789abcdef" for c in fp)
    assert model_fingerprint(dict(shape, num_layers=8)) != fp
    assert model_fingerprint(dict(shape, attention_backend="flashinfer")) != fp
    assert model_fingerprint(dict(shape, tp_size=2)) != fp


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(schema="dgw-capture-measurements/0"), "schema"),
    (lambda d: d["model"]["shape"].update(num_layers=8), "fingerprint"),
    (lambda d: d["model"]["shape"].pop("vocab_size"), "vocab_size"),
    (lambda d: d["graphs"].append(dict(d["graphs"][0])), "twice"),
    (lambda d: d["graphs"][0].update(replay_s=0), "replay_s must be > 0"),
    (lambda d: d["graphs"][0].update(pool_bytes=-1), "pool_bytes"),
    (lambda d: d["graphs"][0].update(mode="fast"), "'spec' or 'decode'"),
    (lambda d: d["graphs"][0].update(bs=True), "bs must be int"),
    (lambda d: d["graphs"][0].update(stage_replay_s={"verify": 0.001}), "stage"),
    (lambda d: d.update(graphs=[g for g in d["graphs"] if g["mode"] == "decode"]), "no spec"),
    (lambda d: d["gpu"].update(compute_capability="sm90"), "compute_capability"),
    (lambda d: d.pop("gpu"), "gpu must be a JSON object"),
])
def test_bad_measurements_are_refused_with_a_message(tmp_path: Path, mutate, message) -> None:
    data = _raw()
    mutate(data)
    with pytest.raises(ConfigError, match=message):
        _load_raw(tmp_path, data)


def test_malformed_json_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "dgw-capture-measurements/1",')
    with pytest.raises(ConfigError, match="not valid JSON .line 1"):
        load_measurements(bad)
    with pytest.raises(ConfigError, match="cannot read measurements file"):
        load_measurements(tmp_path / "nope.json")


def test_units() -> None:
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("1024") == 1024
    assert parse_size("2gib") == 2 << 30
    assert parse_duration("30") == 30.0 and parse_duration("500ms") == 0.5
    assert parse_duration("2min") == 120.0
    for bad in ("4XB", "", "GiB", "-1GiB", "0"):
        with pytest.raises(ConfigError):
            parse_size(bad)
    with pytest.raises(ConfigError):
        parse_duration("soon")
    for parse in (parse_size, parse_duration):      # past a float: an infinite budget
        with pytest.raises(ConfigError, match="finite"):
            parse("1e400")
    assert format_bytes(1536) == "1.50 KiB" and format_bytes(3 << 30) == "3.00 GiB"


@pytest.mark.parametrize("fields, message", [
    (dict(key=GraphKey(Mode.SPEC, 0)), r"spec-bs0.bs must be >= 1, got 0"),
    (dict(replay_s=0.0), r"replay_s must be > 0"),
    (dict(replay_s=float("nan")), r"replay_s must be a finite number"),
    (dict(pool_bytes=-1), r"pool_bytes must be >= 0, got -1"),
    (dict(pool_bytes=1.5), r"pool_bytes must be int"),
    (dict(capture_s=float("inf")), r"capture_s must be a finite number"),
    (dict(stage_replay_s={Stage.VERIFY: -1.0}), r"stage_replay_s.verify must be >= 0"),
])
def test_graph_measurements_built_in_memory_are_range_checked(fields, message) -> None:
    # As an engine's probe builds them (capture.sglang_probe): no file, the same checks.
    good = dict(key=GraphKey(Mode.SPEC, 4), capture_s=0.1, pool_bytes=1 << 20, replay_s=0.005)
    GraphMeasurement(**good)
    with pytest.raises(ConfigError, match=message):
        GraphMeasurement(**dict(good, **fields))


def test_a_files_range_error_names_the_entry(tmp_path: Path) -> None:
    data = _raw()
    data["graphs"][3].update(bs=0)
    with pytest.raises(ConfigError, match=r"graphs\[3\]: .*bs must be >= 1, got 0"):
        _load_raw(tmp_path, data)
