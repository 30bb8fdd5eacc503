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
    recs = [_record("plain", None, c, 1.0) for c in (1, 8)]
    recs += [_record(e, a, c, 2.0 if e == "dual" else 3.0)
             for e in ("dual", "eagle3") for a in (1.5, 2.0) for c in (1, 8)]
    path = tmp_path / "policy-matrix.json"
    path.write_text(json.dumps({"records": recs}))
    return path


def test_plain_runs_once_a_cell_and_the_others_once_an_accept_length(matrix, capsys):
    assert matrix_plan.main([str(matrix), "--accept", "1.5,2", "--workload", "256x256@1,8",
                             "--rounds", "2", "--startup-s", "10", "--per-run-s", "0.5"]) == 0
    out = capsys.readouterr().out
    # Per round: plain 1 s a cell, the worker 2 and EAGLE-3 3 at each accept: 2 cells x
    # (1 + 2 x 5) = 22 s; 2 rounds 44 s; runs 2 x (1 + 2 x 2) x 2 = 20, 10 s; start-up 10 s.
    assert "cells 44 s + 20 runs x 0.5 s + start-up 10 s = 64 s" in out
    assert "| a1.5 256x256 C=8 | 12.0 |" in out and "| a2 256x256 C=8 | 10.0 |" in out


def test_a_call_past_its_limit_exits_1_and_a_cell_without_records_2(matrix, capsys):
    args = [str(matrix), "--accept", "1.5", "--workload", "256x256@1"]
    assert matrix_plan.main(args + ["--limit-s", "50", "--startup-s", "45"]) == 1
    capsys.readouterr()
    assert matrix_plan.main([str(matrix), "--accept", "3", "--workload", "256x256@1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "accept 3.0 256x256 C=1" in err
