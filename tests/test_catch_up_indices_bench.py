"""bench.catch_up_indices on the CPU: both index paths timed, JSON and plot written."""

from __future__ import annotations

import json

import pytest


def test_catch_up_indices_bench_times_both_paths(tmp_path):
    from bench.catch_up_indices import SHAPES
    from bench.catch_up_indices import main as bench_main

    assert bench_main(["--device", "cpu", "--iters", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "catch-up-indices.json").read_text())["rows"]
    assert [(r["requests"], r["tokens_each"]) for r in rows] == list(SHAPES)
    assert all(r["host_us"] > 0 and r["device_us"] > 0 for r in rows)
    assert (tmp_path / "catch-up-indices.png").stat().st_size > 0
    for bad in (["--iters", "0"], ["--device", "gpu"]):
        with pytest.raises(SystemExit) as exit_:
            bench_main(["--out", str(tmp_path), *bad])
        assert exit_.value.code == 2
