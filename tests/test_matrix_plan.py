"""bench.sglang.matrix_plan: a call's seconds from a matrix's records, before the call."""

from __future__ import annotations

import json

import pytest

from bench.sglang import matrix_plan


def _record(engine, accept, c, seconds, rounds=3):
    return {"engine": engine, "accept_len": accept, "input_len": 256, "output_len": 256,
            "concurrency": c, "seconds": 99.0, "seconds_total": seconds * rounds,
            "runs_tok_s": [1.0] * rounds}


@pytest.fixture
def matrix(tmp_path):
    recs = [_record("plain", None, c, 3.0) for c in (1, 8)]
    recs += [_record(e, a, c, 4.0 if e == "dual" else 5.0)
             for e in ("dual", "eagle3") for a in (1.5, 2.0) for c in (1, 8)]
    path = tmp_path / "policy-matrix.json"
    path.write_text(json.dumps({"records": recs}))
    return path


def test_plain_runs_once_a_cell_and_the_others_once_an_accept_length(matrix, capsys):
    assert matrix_plan.main([str(matrix), "--accept", "1.5,2,2", "--workload", "256x256@1,8",
                             "--rounds", "2", "--startup-s", "10", "--per-run-s", "0.5"]) == 0
    out = capsys.readouterr().out
    # Per round and cell: plain 3 s, the worker 4 and EAGLE-3 5 at each of two accept lengths
    # (the repeated one counts once): 2 cells x (3 + 2 x 9) = 42 s; 2 rounds 84 s; runs
    # 2 x (1 + 2 x 2) x 2 = 20, 10 s; start-up 10 s.
    assert "cells 84 s + 20 runs x 0.5 s + start-up 10 s = 104 s" in out
    assert "| plain 256x256 C=8 | 6.0 |" in out and "| a2 256x256 C=8 | 18.0 |" in out
    assert matrix_plan.main([str(matrix), "--accept", "1.5", "--workload", "256x256@1",
                             "--engines", "plain", "--startup-s", "10"]) == 0
    assert "| plain 256x256 C=1 | 3.0 |" in capsys.readouterr().out


def test_at_one_round_a_short_cell_counts_its_repeats(matrix, capsys):
    args = [str(matrix), "--accept", "1.5", "--workload", "256x256@1", "--startup-s", "10"]
    assert matrix_plan.main(args + ["--short-cell-s", "4.5"]) == 0
    # Plain (3 s) and the worker (4 s) run three times each, EAGLE-3 (5 s) once.
    assert "| plain 256x256 C=1 | 9.0 |" in capsys.readouterr().out
    assert matrix_plan.main(args + ["--short-cell-s", "4.5", "--short-cell-runs", "2"]) == 0
    assert "| a1.5 256x256 C=1 | 13.0 |" in capsys.readouterr().out


def test_a_call_past_its_budget_exits_1_and_a_cell_or_record_it_cannot_read_2(matrix, tmp_path,
                                                                            capsys):
    args = [str(matrix), "--accept", "1.5", "--workload", "256x256@1", "--short-cell-s", "0"]
    assert matrix_plan.main(args + ["--budget-s", "50", "--startup-s", "45"]) == 1
    capsys.readouterr()
    assert matrix_plan.main([str(matrix), "--accept", "3", "--workload", "256x256@1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "accept 3 256x256 C=1" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"records": [{"engine": "dual"}]}))
    assert matrix_plan.main([str(bad), "--accept", "1.5", "--workload", "256x256@1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "record 0 is no policy-matrix record" in err
