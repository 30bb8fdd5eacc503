"""bench.sglang.early_steps: a batch's first steps after its prefill against its later ones."""

from __future__ import annotations

import gzip
import json

import pytest

from bench.sglang.early_steps import batch_ratios, by_position, main


def _batch(first: list[float], rest: float = 0.010) -> list:
    steps = [["s", 16, t, 0, 0, 4096, 16] for t in first]
    return [["p", 4096, 0.05, 0]] + steps + [["s", 16, rest, 0, 0, 4096, 16]] * (10 - len(first))


def test_each_position_is_read_against_the_batchs_later_clean_steps(tmp_path, capsys):
    costs = _batch([0.006, 0.008]) + _batch([0.007, 0.0105])
    costs += [["p", 64, 0.01, 0], ["d", 4, 0.005, 0, 0, 64, 4]] * 3      # too short: no batch
    ratios = batch_ratios(costs)
    assert [r[:2] for r in ratios] == [pytest.approx([0.6, 0.8]), pytest.approx([0.7, 1.05])]
    rows = by_position(ratios)
    assert [r["share_short"] for r in rows[:3]] == [1.0, 0.5, 0.0]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"costs": costs}, fh)
    out = tmp_path / "e.json"
    assert main([str(path), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["positions"][1]["share_short"] == 0.5
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| 1 | 2 | 0.925 | 0.50 |" in capsys.readouterr().out
    assert main([str(tmp_path / "none.json.gz"), "--out", str(out)]) == 2
    assert "not a replay trace" in capsys.readouterr().err
