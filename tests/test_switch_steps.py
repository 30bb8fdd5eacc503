"""bench.sglang.switch_steps: speculation's first steps after a catch-up against its size's
settled steps in the trace."""

from __future__ import annotations

import gzip
import json

import pytest

from bench.sglang.switch_steps import SETTLED, by_length, by_position, main, switch_runs


def _spec(t: float, bs: int = 1, kv: int = 2048, caught: int = 0, carries: int = 0) -> list:
    return ["s", bs, t, caught, carries, kv, bs]


def _decode(n: int, bs: int = 1) -> list:
    return [["d", bs, 0.005, 0, 0, 2048, bs]] * n


def _costs() -> list:
    # Settled: ten steps past a first SETTLED of 9 ms, five of 6 ms and five of 7 ms (median 6.5);
    # a short run of 9 ms adds unsettled ones, which the median leaves out, as it does its
    # SETTLED-th step (one more 9 would move it to 7).
    steady = [_spec(0.009)] * SETTLED + [_spec(0.006)] * 5 + [_spec(0.007)] * 5 \
        + _decode(1) + [_spec(0.009)] * 7
    entered = [_spec(0.020, caught=2048), _spec(0.0078), _spec(0.0065), _spec(0.004, carries=1)]
    unswitched = [_spec(0.009)]                                    # no catch-up: not read
    carried = [_spec(0.020, caught=2048), _spec(0.003, carries=1)]  # no clean step 1 or 2
    far = [_spec(0.020, caught=64, kv=64), _spec(0.009, kv=64)]    # no reference at its context
    return (steady + _decode(3) + entered + _decode(3) + unswitched + _decode(2) + carried
            + _decode(2) + far + [["p", 2048, 0.03, 0]])


def test_a_switchs_clean_steps_are_read_against_their_sizes_settled_median(tmp_path, capsys):
    runs = switch_runs(_costs(), positions=2)
    assert runs == [(1, (pytest.approx(1.2), pytest.approx(1.0))), (1, (None, None))]
    assert switch_runs(_costs(), max_bs=0) == []
    assert len(switch_runs(_costs())[0][1]) == 6                   # POSITIONS by default
    rows = by_position(runs, 2)
    assert [(r["bs"], r["position"], r["steps"], r["whole_runs"]) for r in rows] == \
        [([1, 2], 1, 1, 1), ([1, 2], 2, 1, 1)]
    # The first run clean at both steps: its first step alone reads 1.2, the mean of two 1.1.
    assert by_length(runs, 2) == [{"bs": [1, 2], "runs": 1, "over": [1.0, 1.0]}]
    assert by_length([(1, (1.2, 0.8))], 2)[0]["over"] == [1.0, 0.0]
    # A step every run reaches against one only long runs do: the medians say which runs.
    mixed = [(1, (1.2, None)), (1, (1.0, 1.0)), (1, (1.3, None))]
    first = by_position(mixed, 2)[0]
    assert first["median"] == pytest.approx(1.2) and first["whole_median"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="2 positions"):
        by_length([(1, (1.0,))], 2)
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"costs": _costs()}, fh)
    out = tmp_path / "s.json"
    assert main([str(path), "--out", str(out), "--positions", "2"]) == 0
    written = json.loads(out.read_text())
    assert written["rows"][0]["median"] == pytest.approx(1.2)
    assert written["lengths"][0]["runs"] == 1
    assert out.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "| 1-2 | 2 | 1 | 1.000 | 1.00-1.00 | 1.000 (1) |" in printed
    assert "| 1-2 | 1 | 1.00 | 1.00 |" in printed
    assert main([str(tmp_path / "none.json.gz"), "--out", str(out)]) == 2
    assert "not a replay trace" in capsys.readouterr().err
