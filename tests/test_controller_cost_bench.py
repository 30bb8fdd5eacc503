"""bench.controller_cost on the CPU: every batch size measured in every round, with and without
request turnover where asked, and its arguments checked."""

from __future__ import annotations

import json

import pytest

from bench.controller_cost import BATCHES, PARTS, main


def test_both_batches_are_measured_in_every_round(tmp_path):
    out = tmp_path / "cc.json"
    assert main(["--steps", "200", "--rounds", "2", "--both", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rounds"] == 2 and report["step_times"] == "synthetic"
    assert out.with_suffix(".png").stat().st_size > 0
    rows = report["rows"]
    assert sorted((r["turnover"], r["bs"]) for r in rows) == \
        sorted((t, bs) for t in (True, False) for bs in BATCHES)
    for r in rows:
        assert len(r["round_medians_us"]) == 2
        # Pooled over equal rounds, the median lies between the rounds' medians.
        lo, hi = min(r["round_medians_us"]), max(r["round_medians_us"])
        assert lo - 0.01 <= r["median_us"] <= hi + 0.01
        assert 0.0 <= r["spec_share"] <= 1.0


def test_steady_alone_measures_no_turnover(tmp_path):
    out = tmp_path / "cc.json"
    assert main(["--steps", "200", "--rounds", "1", "--steady", "--out", str(out)]) == 0
    assert {r["turnover"] for r in json.loads(out.read_text())["rows"]} == {False}


def test_split_times_each_part_of_a_step_and_only_when_asked(tmp_path, capsys):
    out = tmp_path / "cc.json"
    assert main(["--steps", "200", "--rounds", "1", "--steady", "--split", "--out", str(out)]) == 0
    assert "accepted" in capsys.readouterr().out
    for r in json.loads(out.read_text())["rows"]:
        parts = r["parts_median_us"]
        assert set(parts) == set(PARTS) and all(v > 0 for v in parts.values())
        # Every part lies inside its step, so no part's median passes the steps' median.
        assert max(parts.values()) <= r["median_us"] + 0.01
    assert main(["--steps", "200", "--rounds", "1", "--steady", "--out", str(out)]) == 0
    assert not any("parts_median_us" in r for r in json.loads(out.read_text())["rows"])


def test_low_acceptance_times_a_loaded_server_that_decodes(tmp_path):
    out = tmp_path / "cc.json"
    assert main(["--steps", "400", "--rounds", "1", "--accept", "1.5", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    share = {r["bs"]: r["spec_share"] for r in report["rows"]}
    assert report["accept_len"] == 1.5
    # The synthetic step times put the crossover near bs 16 at accept 1.5: a lone request
    # speculates, a loaded batch decodes (re-measuring speculation now and then).
    assert share[1] > 0.9 and share[64] < 0.1 and share[256] < 0.1


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--steps", "10"], ["--steady", "--both"],
                                  ["--sync-every", "0"], ["--out", "."], ["--accept", "0.5"],
                                  ["--accept", "nan"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "error:" in capsys.readouterr().err
