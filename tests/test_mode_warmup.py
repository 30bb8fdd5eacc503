"""bench.sglang.mode_warmup: each mode's first steps in a process over its settled ones."""

import json

import pytest

from bench.sglang import mode_warmup as mw


def _spec(seconds: float, caught: int = 0, kv: int = 1000, pb: int = 2) -> list:
    return ["s", pb, seconds, caught, 0, kv, pb]


def test_windows_read_a_warm_up_against_the_settled_steps_of_the_same_key():
    costs = [["p", 512, 0.1, 1]] + [_spec(0.013) for _ in range(16)] + \
        [_spec(0.010) for _ in range(300)]
    w = mw.window_ratios(costs, "s")
    assert w[:2] == pytest.approx([1.3, 1.3]) and w[2:] == [1.0] * (mw.WINDOWS - 2)
    assert mw.window_ratios(costs, "d") == [None] * mw.WINDOWS


def test_catch_ups_far_contexts_and_other_keys_are_no_samples():
    costs = [_spec(0.05, caught=4096)] * 8 + [_spec(0.02, kv=100_000)] * 8 + \
        [_spec(0.03, pb=4)] * 8 + [_spec(0.010) for _ in range(300)]
    w = mw.window_ratios(costs, "s")
    assert w[:3] == [None, None, None] and w[3] == 1.0


def test_the_table_and_json_come_from_the_traces(tmp_path, capsys):
    import gzip
    trace = tmp_path / "costs.json.gz"
    costs = [_spec(0.012) for _ in range(8)] + [_spec(0.010) for _ in range(300)]
    with gzip.open(trace, "wt") as fh:
        json.dump({"costs": costs}, fh)
    out = tmp_path / "w.json"
    assert mw.main([str(trace), "--out", str(out)]) == 0
    spec = json.loads(out.read_text())["modes"]["spec"]["by_window"]
    assert spec[0]["median"] == pytest.approx(1.2) and spec[0]["share_slow"] == 1.0
    assert spec[1]["median"] == 1.0 and spec[1]["share_slow"] == 0.0
    assert "| 0-7 | 1 | 1.200 |" in capsys.readouterr().out


def test_a_file_that_is_no_trace_is_one_line(tmp_path, capsys):
    bad = tmp_path / "x.json.gz"
    bad.write_text("not gzip")
    assert mw.main([str(bad), "--out", str(tmp_path / "w.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a replay trace" in err[0]
