"""The policy matrix's bookkeeping: ratios per cell, and baselines filled from an earlier run
only where this run lacks them, marked as such."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sglang import matrix_records as mr
from bench.sglang import matrix_report as mrep
from bench.sglang import policy_matrix as pm


# The runs here are stand-ins: the host's own GPU, if it has one, is not theirs.
pytestmark = pytest.mark.usefixtures("no_gpu")


def rec(engine, a, c, tok_s):
    return {"accept_len": a, "input_len": 256, "output_len": 256, "concurrency": c,
            "engine": engine, "tok_s": tok_s, "seconds": 1.0}


def test_ratio_against_the_better_baseline_and_fill_marks_cross_run_cells():
    now = [rec("plain", None, 1, 200.0), rec("plain", None, 128, 11000.0),
           rec("eagle3", 3.0, 1, 400.0), rec("dual", 3.0, 1, 396.0), rec("dual", 3.0, 128, 10890.0)]
    earlier = [rec("eagle3", 3.0, 1, 999.0), rec("eagle3", 3.0, 128, 6600.0),
               rec("dual", 3.0, 4, 1.0), rec("plain", None, 4, 800.0)]
    filled = mr.fill_from(now, earlier, "run2/policy-matrix.json")
    # Only cells this run lacks, never the worker's, each with its source.
    assert [r for r in filled if "from" in r] == [
        earlier[1] | {"from": "run2/policy-matrix.json"},
        earlier[3] | {"from": "run2/policy-matrix.json"}]
    again = mr.fill_from([], filled, "run5/policy-matrix.json")
    assert {r.get("from") for r in again if r["tok_s"] == 6600.0} == {"run2/policy-matrix.json"}
    cells = {c["concurrency"]: c for c in mr.ratios(filled)}
    assert cells[1]["ratio"] == 0.99 and "cross_run" not in cells[1]   # this run's EAGLE-3
    assert cells[128]["ratio"] == 0.99 and cells[128]["cross_run"] is True
    assert set(cells) == {1, 128}                                        # no worker at 4
    w = [pm.Workload.parse("256x256@1,128")]
    md = mrep.report(mr.ratios(filled), [3.0], w, "note")
    assert "| 3 | 0.990 | 0.990\u2020 |" in md and "another run" in md


@pytest.mark.parametrize("content", [{"cells": []}, [1, 2], {"records": [], "settings": [1]},
                                     {"records": {}, "settings": {}}, {"records": [], "note": 3}])
def test_fill_from_a_file_that_is_not_a_matrix_is_one_clear_error(content, tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps(content))
    assert pm.main(["--out", str(tmp_path / "o"), "--fill-from", str(bad),
                    "--engines", "plain"]) == 2
    err = capsys.readouterr().err
    assert "--fill-from" in err and "not a policy-matrix.json" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"records": [3]}'])
def test_a_damaged_matrix_in_out_is_one_clear_error_before_any_work(tmp_path, capsys, content):
    """A run killed mid-write, or another file under that name: one line naming it and the fix."""
    old = tmp_path / "o"
    old.mkdir()
    (old / "policy-matrix.json").write_text(content)
    assert pm.main(["--out", str(old), "--engines", "plain"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "remove that file" in err[0]
    assert not (old / "models").exists()


def test_a_misspelt_worker_setting_is_one_clear_error_before_any_work(tmp_path, capsys):
    assert pm.main(["--out", str(tmp_path / "o"), "--dual-env", "DGW_SPEC_MAX_B=256"]) == 2
    assert "DGW_SPEC_MAX_BS" in capsys.readouterr().err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("engines, said", [("dual,dual", "a name repeats"), (",", "no name"),
                                            ("dual,vllm", "unknown 'vllm'")])
def test_a_bad_engine_list_is_one_clear_error_before_any_work(tmp_path, capsys, engines, said):
    with pytest.raises(SystemExit) as exit_:
        pm.main(["--out", str(tmp_path / "o"), "--engines", engines])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and said in err and not (tmp_path / "o").exists()


def test_a_bad_workload_is_one_clear_error_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        pm.main(["--out", str(tmp_path / "o"), "--workload", "256x256@0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "bad workload '256x256@0'" in err and "256x256@1,4,8" in err
    assert not (tmp_path / "o").exists()


def test_rounds_name_themselves_where_they_cannot_draw_fresh_prompts(tmp_path, capsys):
    assert pm.main(["--out", str(tmp_path / "o"), "--interleave", "--rounds", "3",
                    "--workload", "256x256@512"]) == 2
    err = capsys.readouterr().err
    assert "--rounds draws fresh prompts" in err and "--short-cell-runs" not in err


def test_records_of_other_servers_are_never_mixed_into_a_matrix(tmp_path, capsys):
    """A matrix measured on triton (or before settings were recorded) keeps its records only
    beside runs on triton; the worker's settings matter only where its records are kept."""
    old = tmp_path / "o"
    old.mkdir()
    (old / "policy-matrix.json").write_text(json.dumps({"records": [rec("plain", None, 1, 1.0)]}))
    assert pm.main(["--out", str(old), "--engines", "plain", "--attention-backend", "default"]) == 2
    assert "--attention-backend 'triton'" in capsys.readouterr().err
    assert not (old / "models").exists()                       # refused before any work
    assert pm.main(["--out", str(old), "--engines", "plain",
                    "--dual-env", "DGW_SPEC_MAX_BS=256"]) == 2   # the old dual records stay
    assert "--dual-env {}" in capsys.readouterr().err
    assert pm.main(["--out", str(tmp_path / "new"), "--engines", "dual", "--attention-backend",
                    "default", "--fill-from", str(old / "policy-matrix.json")]) == 2
    assert "--fill-from" in capsys.readouterr().err
    same = {"records": [], "settings": {"attention_backend": "default", "dual_env": {}}}
    assert mr.other_settings(same, same["settings"], ("attention_backend", "dual_env")) is None


def test_baselines_added_to_a_workers_matrix_go_on_with_its_settings():
    """A call that runs no worker and names no --dual-env keeps the worker records' settings;
    naming other ones is still refused (above)."""
    env = {"DGW_CATCH_UP_KV_ONLY": "1"}
    prev = {"records": [rec("dual", 1.5, 1, 1.0)], "settings": {"dual_env": env}}
    assert pm.kept_worker_env(prev, ["eagle3", "plain"], {}) == env
    assert pm.kept_worker_env(prev, ["dual"], {}) == {}
    assert pm.kept_worker_env(prev, ["plain"], {"DGW_SPEC_MAX_BS": "256"}) == \
        {"DGW_SPEC_MAX_BS": "256"}
    assert pm.kept_worker_env({}, ["plain"], {}) == {}


def test_default_attention_backend_leaves_the_choice_to_sglang(tmp_path):
    kw = pm.engine_kwargs("dual", tmp_path, tmp_path, radix=True, log_level="warning",
                          attention_backend=None)
    assert kw["attention_backend"] is None
    assert pm.engine_kwargs("plain", tmp_path, tmp_path, True, "warning")["attention_backend"] \
        == "triton"


def test_a_matrix_built_over_runs_keeps_every_runs_columns():
    earlier = [{"input_len": 256, "output_len": 256, "concurrency": [1, 64, 256]},
               {"input_len": 2048, "output_len": 64, "concurrency": [16]}]
    now = [pm.Workload.parse("256x256@1,4,64"), pm.Workload.parse("64x1024@32")]
    got = mr.merged_workloads(earlier, now)
    assert [(w.name, w.concurrency) for w in got] == [
        ("256x256", (1, 4, 64, 256)), ("2048x64", (16,)), ("64x1024", (32,))]


def test_diffused_forced_acceptance_keeps_every_engine_on_target():
    from bench.sglang.acc_control import DiffusedAcceptance

    for target in (1.5, 2.0, 2.25, 3.5):
        draw = DiffusedAcceptance()
        got = [draw(target, "match-expected", 4) for _ in range(37)]
        assert set(got) <= {int(target), int(target) + 1}
        # The running mean after every step is on target within one token over the steps.
        for n in range(1, len(got) + 1):
            assert abs(sum(got[:n]) - target * n) < 1.0
    draw = DiffusedAcceptance()
    assert [draw(3.5, "", 4) for _ in range(4)] == [3, 4, 3, 4]
    assert [draw(1.5, "", 4) for _ in range(2)] == [1, 2]          # a new target starts afresh
    assert draw(9.0, "", 4) == 4 and draw(0.2, "", 4) == 1         # clamped as SGLang clamps


def test_the_sampler_replaces_sglangs_draw_only_when_asked(supported_sglang, monkeypatch):
    import pytest
    from sglang.srt.speculative import spec_utils

    from bench.sglang.acc_control import DiffusedAcceptance, apply_sampling

    original = spec_utils._sample_simulated_acc_len
    monkeypatch.setattr(spec_utils, "_sample_simulated_acc_len", original)
    apply_sampling("sglang")
    assert spec_utils._sample_simulated_acc_len is original
    apply_sampling("diffused")
    assert isinstance(spec_utils._sample_simulated_acc_len, DiffusedAcceptance)
    with pytest.raises(ValueError, match="BENCH_ACC_SAMPLING='exact'"):
        apply_sampling("exact")


def test_sglangs_verify_path_draws_through_the_replaced_sampler(supported_sglang, monkeypatch):
    import torch
    from sglang.srt.speculative import spec_utils

    from bench.sglang.acc_control import apply_sampling

    monkeypatch.setattr(spec_utils, "_sample_simulated_acc_len",
                        spec_utils._sample_simulated_acc_len)
    apply_sampling("diffused")
    drafts = []
    for _ in range(4):
        correct = torch.zeros(2, dtype=torch.int32)
        spec_utils.generate_simulated_accept_index(
            accept_index=torch.zeros(2, 4, dtype=torch.int32), predict=torch.zeros(8),
            num_correct_drafts=correct, candidates=None, target_predict=None, bs=2,
            spec_steps=3, simulate_acc_len=3.5, simulate_acc_method="match-expected",
            simulate_acc_token_mode="fixed")
        drafts.append(int(correct[0]))
    assert drafts == [2, 3, 2, 3]                 # accept lengths 3, 4, 3, 4


def _matrix(tmp_path, name, records, settings=None, note="note"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "policy-matrix.json").write_text(json.dumps({
        "note": note, "accepts": sorted({r["accept_len"] for r in records if r["accept_len"]}),
        "workloads": [{"input_len": 256, "output_len": 256,
                       "concurrency": sorted({r["concurrency"] for r in records})}],
        "records": records, "settings": settings or {"attention_backend": "default"}}))
    return str(folder)


def test_a_matrix_merged_from_calls_rates_each_cell_within_its_call(tmp_path, capsys):
    from bench.sglang import merge_matrix as mm

    repeats = {"below_s": 2.0, "runs": 3}
    a = _matrix(tmp_path, "a", [rec("plain", None, 1, 200.0), rec("eagle3", 3.0, 1, 400.0),
                                rec("dual", 3.0, 1, 396.0)],
                {"attention_backend": "default", "short_cells": repeats})
    b = _matrix(tmp_path, "b", [rec("plain", None, 64, 8000.0), rec("eagle3", 3.0, 64, 9000.0),
                                rec("dual", 3.0, 64, 9090.0)])
    out = tmp_path / "m"
    assert mm.main(["--out", str(out), a, b]) == 0
    merged = json.loads((out / "policy-matrix.json").read_text())
    # How each call repeated its short cells is its own; the servers' settings are shared.
    # Those the parts predate as their note tells them: its head names the GPU.
    assert merged["settings"] == {"attention_backend": "default", "host_load": 0,
                                  "interleave": False, "pin_cpus": None, "radix_cache": None,
                                  "acc_sampling": None, "gpu": "note", "freeze_gc": False,
                                  "short_cells": {"a": repeats, "b": None}}
    assert {(c["concurrency"], c["ratio"]) for c in merged["cells"]} == {(1, 0.99), (64, 1.01)}
    assert {r["call"] for r in merged["records"]} == {"a", "b"}
    assert (out / "heatmap.png").exists() and "merged from 2 calls" in merged["note"]
    # A cell two calls measured, or a call with other settings: one line, nothing written.
    again = _matrix(tmp_path, "c", [rec("dual", 3.0, 64, 1.0)])
    other = _matrix(tmp_path, "d", [rec("dual", 3.0, 8, 1.0)], {"attention_backend": "triton"})
    split_a = _matrix(tmp_path, "e", [rec("plain", None, 8, 1.0), rec("dual", 3.0, 8, 1.0)])
    split_b = _matrix(tmp_path, "f", [rec("eagle3", 3.0, 8, 1.0)])
    for parts in ([a, b, again], [a, other], [split_a, split_b]):
        capsys.readouterr()
        assert mm.main(["--out", str(tmp_path / "bad"), *parts]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "bad").exists()
    # A baseline a part filled from an earlier run yields to a part that measured that cell.
    filled = _matrix(tmp_path, "g", [rec("eagle3", 3.0, 8, 1.0), rec("dual", 3.0, 8, 1.0),
                                     {"from": "old.json"} | rec("plain", None, 64, 1.0),
                                     {"from": "old.json"} | rec("plain", None, 8, 100.0)])
    assert mm.main(["--out", str(tmp_path / "h"), filled, b]) == 0
    merged = json.loads((tmp_path / "h" / "policy-matrix.json").read_text())
    assert {(c["concurrency"], c["plain"], c.get("cross_run", False)) for c in merged["cells"]} \
        == {(8, 100.0, True), (64, 8000.0, False)}
    # Filled from a matrix whose processes each measured the baseline: their median, and the
    # calls of that matrix are not this merge's.
    old = {"from": "old.json", "call": "x1"}
    spread = _matrix(tmp_path, "s", [rec("eagle3", 3.0, 8, 100.0), rec("dual", 3.0, 8, 150.0)] +
                     [old | rec("plain", None, 8, v) | {"process": n}
                      for n, v in enumerate((100.0, 300.0, 200.0), 1)])
    assert mm.main(["--out", str(tmp_path / "sm"), spread]) == 0
    merged = json.loads((tmp_path / "sm" / "policy-matrix.json").read_text())
    assert [(c["plain"], c["ratio"]) for c in merged["cells"]] == [(200.0, 0.75)]
    assert "merged from 1 calls" in merged["note"] and len(merged["records"]) == 5


def test_calls_whose_engines_were_launched_otherwise_merge_and_say_so(tmp_path, capsys):
    """How the engines came up (one after another, or launched together) is not what they are:
    such calls merge, and the merged note names the ones launched together; any other
    difference in the note still refuses."""
    from bench.sglang import merge_matrix as mm
    from bench.sglang.matrix_records import LAUNCHED_TOGETHER

    cell = [rec("plain", None, 1, 200.0), rec("eagle3", 3.0, 1, 400.0), rec("dual", 3.0, 1, 396.0)]
    before = _matrix(tmp_path, "before", cell, note="engines up at once, KV")
    together = _matrix(tmp_path, "together",
                       [rec("plain", None, 8, 900.0), rec("eagle3", 3.0, 8, 1000.0),
                        rec("dual", 3.0, 8, 1000.0)],
                       note=f"engines up at once{LAUNCHED_TOGETHER}, KV")
    assert mm.main(["--out", str(tmp_path / "m"), before, together]) == 0
    note = json.loads((tmp_path / "m" / "policy-matrix.json").read_text())["note"]
    assert note.startswith("engines up at once, KV; merged from 2 calls")
    assert note.endswith("engines launched together in together")
    other = _matrix(tmp_path, "other", cell, note="engines up at once, KV pinned")
    capsys.readouterr()
    assert mm.main(["--out", str(tmp_path / "bad"), together, other]) == 2
    assert "other settings" in capsys.readouterr().err


def test_calls_at_other_accept_lengths_each_rate_against_their_own_plain(tmp_path):
    """Plain is measured once a call whatever the accept length: two calls over one workload at
    accept 1.5 and 3 each rate their worker against their own plain run."""
    from bench.sglang import merge_matrix as mm

    low = _matrix(tmp_path, "low", [rec("plain", None, 8, 1000.0), rec("eagle3", 1.5, 8, 900.0),
                                    rec("dual", 1.5, 8, 990.0)])
    high = _matrix(tmp_path, "high", [rec("plain", None, 8, 800.0), rec("eagle3", 3.0, 8, 1600.0),
                                      rec("dual", 3.0, 8, 1600.0)])
    merged = mm.merge([(Path(d).name, json.loads((Path(d) / "policy-matrix.json").read_text()))
                       for d in (low, high)])
    assert {(c["accept_len"], c["plain"], c["ratio"]) for c in merged["cells"]} == \
        {(1.5, 1000.0, 0.99), (3.0, 800.0, 1.0)}


def test_latest_rates_a_cell_measured_again_by_its_last_call_alone(tmp_path, capsys):
    """merge_matrix --latest brings a matrix up to date after the worker changed: a worker cell
    a later call measured again reads that call's three engines; the earlier call's records
    there go (its plain record too, once none of its worker cells uses it), its other cells
    stay. Without --latest the same parts are an error."""
    from bench.sglang import merge_matrix as mm

    old = _matrix(tmp_path, "old", [rec("plain", None, 8, 1000.0), rec("eagle3", 1.5, 8, 900.0),
                                    rec("dual", 1.5, 8, 950.0), rec("plain", None, 64, 8000.0),
                                    rec("eagle3", 1.5, 64, 7000.0), rec("dual", 1.5, 64, 7800.0)])
    new = _matrix(tmp_path, "new", [rec("plain", None, 8, 1100.0), rec("eagle3", 1.5, 8, 950.0),
                                    rec("dual", 1.5, 8, 1089.0)])
    out = tmp_path / "m"
    assert mm.main(["--out", str(out), "--latest", old, new]) == 0
    merged = json.loads((out / "policy-matrix.json").read_text())
    assert {(c["concurrency"], c["plain"], c["dual"], c["ratio"]) for c in merged["cells"]} == \
        {(8, 1100.0, 1089.0, 0.99), (64, 8000.0, 7800.0, 0.975)}
    assert sorted((r["call"], r["concurrency"]) for r in merged["records"]) == \
        [("new", 8)] * 3 + [("old", 64)] * 3
    assert "1 worker cells measured again by a later call, which rates them (3 earlier " \
        "records dropped)" in merged["note"]
    # The order given decides: the other way round the old call's figures stand.
    assert mm.main(["--out", str(tmp_path / "r"), "--latest", new, old]) == 0
    merged = json.loads((tmp_path / "r" / "policy-matrix.json").read_text())
    assert {(c["concurrency"], c["ratio"]) for c in merged["cells"]} == {(8, 0.95), (64, 0.975)}
    # A plain record no worker cell of its call used stays, as without --latest.
    lone = _matrix(tmp_path, "lone", [rec("plain", None, 16, 500.0)])
    assert mm.main(["--out", str(tmp_path / "l"), "--latest", old, lone, new]) == 0
    merged = json.loads((tmp_path / "l" / "policy-matrix.json").read_text())
    assert ("lone", 16) in {(r["call"], r["concurrency"]) for r in merged["records"]}
    # Errors, one line each, nothing written: the two parts without --latest; --latest with
    # --processes; a later call that measured the worker again but not EAGLE-3 (the cell would
    # go); two parts of one name (their records would read as one call's).
    no_eagle = _matrix(tmp_path, "no-eagle", [rec("plain", None, 8, 1100.0),
                                              rec("dual", 1.5, 8, 1089.0)])
    twin = tmp_path / "twin"
    twin.mkdir()
    same_name = _matrix(twin, "new", [rec("plain", None, 64, 1.0), rec("eagle3", 3.0, 64, 1.0),
                                      rec("dual", 3.0, 64, 1.0)])
    capsys.readouterr()
    for args in ([old, new], ["--latest", "--processes", old, new], ["--latest", old, no_eagle],
                 ["--latest", new, same_name]):
        assert mm.main(["--out", str(tmp_path / "bad"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 4 and "eagle3 baseline" in err and "named 'new'" in err
    assert not (tmp_path / "bad").exists()


def test_swap_rates_another_pass_of_one_engine_against_the_parts_others(tmp_path, capsys):
    """merge_matrix --swap ENGINE=DIR: engines run in turn, one call each, and one of them ran
    again; its second pass is rated against the first matrix's other engines, and the note
    says where it came from. One line, nothing written, for a folder without that engine, one
    measured otherwise, several parts, a name that is no engine, a pass lacking some of the
    part's cells of that engine (they would drop out of the matrix) or one engine twice."""
    from bench.sglang import merge_matrix as mm

    first = _matrix(tmp_path, "m1", [rec("plain", None, 8, 1000.0), rec("eagle3", 2.0, 8, 900.0),
                                     rec("dual", 2.0, 8, 990.0)])
    again = _matrix(tmp_path, "m2", [rec("dual", 2.0, 8, 950.0)])
    eagle = _matrix(tmp_path, "m3", [rec("eagle3", 2.0, 8, 1100.0)])
    out = tmp_path / "m"
    assert mm.main(["--out", str(out), "--swap", f"dual={again}", first]) == 0
    merged = json.loads((out / "policy-matrix.json").read_text())
    assert [(c["dual"], c["ratio"]) for c in merged["cells"]] == [(950.0, 0.95)]
    assert "dual from m2" in merged["note"] and len(merged["records"]) == 3
    assert mm.main(["--out", str(tmp_path / "both"), "--swap", f"dual={again}",
                    "--swap", f"eagle3={eagle}", first]) == 0
    merged = json.loads((tmp_path / "both" / "policy-matrix.json").read_text())
    assert [(c["eagle3"], c["ratio"]) for c in merged["cells"]] == [(1100.0, 0.8636)]
    # A worker pass with its own DGW_* settings is how a setting is rated against the same
    # baselines: the matrix carries that pass's settings, in its settings and its note.
    tuned = _matrix(tmp_path, "m5", [rec("dual", 2.0, 8, 1000.0)],
                    {"attention_backend": "default", "dual_env": {"DGW_EXPLORE_BUDGET": "0.005"}},
                    note="worker at its defaults + {'DGW_EXPLORE_BUDGET': '0.005'}")
    first_noted = _matrix(tmp_path, "m6", [rec("plain", None, 8, 1000.0),
                                           rec("eagle3", 2.0, 8, 900.0), rec("dual", 2.0, 8, 1.0)],
                          note="worker at its defaults")
    assert mm.main(["--out", str(tmp_path / "tuned"), "--swap", f"dual={tuned}",
                    first_noted]) == 0
    merged = json.loads((tmp_path / "tuned" / "policy-matrix.json").read_text())
    assert merged["settings"]["dual_env"] == {"DGW_EXPLORE_BUDGET": "0.005"}
    assert "worker at its defaults + {'DGW_EXPLORE_BUDGET': '0.005'}; dual from m5" in \
        merged["note"] and [c["ratio"] for c in merged["cells"]] == [1.0]
    # A pass from before --freeze-gc (its settings lack the key) ran without it: it pairs with
    # a new pass that says so, not with one that froze.
    new_pass = _matrix(tmp_path, "m7", [rec("dual", 2.0, 8, 990.0)],
                       {"attention_backend": "default", "freeze_gc": False})
    assert mm.main(["--out", str(tmp_path / "old-new"), "--swap", f"dual={new_pass}", first]) == 0
    frozen = _matrix(tmp_path, "m8", [rec("dual", 2.0, 8, 990.0)],
                     {"attention_backend": "default", "freeze_gc": True})
    capsys.readouterr()
    assert mm.main(["--out", str(tmp_path / "old-frozen"), "--swap", f"dual={frozen}", first]) == 2
    assert "other settings" in capsys.readouterr().err
    other = _matrix(tmp_path, "o", [rec("dual", 2.0, 8, 1.0)], {"attention_backend": "triton"})
    two = _matrix(tmp_path, "m4", [rec("plain", None, c, 1000.0) for c in (8, 16)]
                  + [rec(e, 2.0, c, 900.0) for e in ("eagle3", "dual") for c in (8, 16)])
    capsys.readouterr()
    for args in (["--swap", f"plain={again}", first], ["--swap", f"dual={other}", first],
                 ["--swap", f"dual={again}", first, eagle], ["--swap", f"draft={again}", first],
                 ["--swap", f"dual={again}", two],
                 ["--swap", f"dual={again}", "--swap", f"dual={again}", first]):
        assert mm.main(["--out", str(tmp_path / "bad"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 6 and "no plain records" in err and "other settings" in err
    assert "lacks 1 of m4's dual cells" in err and "one engine twice" in err
    assert not (tmp_path / "bad").exists()


def test_swap_of_a_pass_over_some_cells_rates_those_alone(tmp_path):
    """merge_matrix --swap dual=DIR --some-cells: a worker pass of one accept length, rated
    against a matrix of two, is a matrix of that accept length's cells, each against the part's
    baselines there; the note says so. Without --some-cells the same pass is refused (above)."""
    from bench.sglang import merge_matrix as mm

    part = _matrix(tmp_path, "m1", [rec("plain", None, c, 1000.0) for c in (8, 16)]
                   + [rec(e, a, c, 900.0) for e in ("eagle3", "dual") for a in (1.5, 2.0)
                      for c in (8, 16)])
    one_accept = _matrix(tmp_path, "m2", [rec("dual", 1.5, 8, 980.0), rec("dual", 1.5, 16, 700.0)])
    out = tmp_path / "m"
    assert mm.main(["--out", str(out), "--some-cells", "--swap", f"dual={one_accept}", part]) == 0
    merged = json.loads((out / "policy-matrix.json").read_text())
    assert sorted((c["accept_len"], c["concurrency"], c["ratio"]) for c in merged["cells"]) == \
        [(1.5, 8, 0.98), (1.5, 16, 0.7)]
    assert merged["accepts"] == [1.5] and "only the 2 cells m2 measured" in merged["note"]
    assert {r["accept_len"] for r in merged["records"] if r["engine"] != "plain"} == {1.5}
    assert mm.main(["--out", str(tmp_path / "bad"), "--some-cells", part]) == 2
    # A baseline's pass of some cells would leave the others unrated: refused in one line.
    assert mm.main(["--out", str(tmp_path / "bad"), "--some-cells", "--swap",
                    f"plain={one_accept}", part]) == 2
    assert not (tmp_path / "bad").exists()


def test_calls_merged_as_processes_read_each_engines_median(tmp_path, capsys):
    """merge_matrix --processes: every call is one process of each engine, as policy_matrix
    --processes runs them; a cell measured by several calls reads each engine's median."""
    from bench.sglang import merge_matrix as mm

    speeds = [(200.0, 400.0, 396.0), (100.0, 420.0, 390.0), (210.0, 300.0, 500.0)]
    calls = [_matrix(tmp_path, f"p{n}", [rec("plain", None, 1, p), rec("eagle3", 3.0, 1, e),
                                         rec("dual", 3.0, 1, d)])
             for n, (p, e, d) in enumerate(speeds)]
    wide = _matrix(tmp_path, "wide", [rec("plain", None, 64, 8000.0),
                                      rec("eagle3", 3.0, 64, 9000.0), rec("dual", 3.0, 64, 9090.0)])
    out = tmp_path / "m"
    assert mm.main(["--out", str(out), "--processes", *calls, wide]) == 0
    merged = json.loads((out / "policy-matrix.json").read_text())
    assert {(c["concurrency"], c["plain"], c["eagle3"], c["dual"], c["ratio"])
            for c in merged["cells"]} == {(1, 200.0, 400.0, 396.0, 0.99),
                                          (64, 8000.0, 9000.0, 9090.0, 1.01)}
    assert "merged from 4 calls (each one process" in merged["note"]
    # Without --processes the same calls measured one cell three times: one line, an error.
    assert mm.main(["--out", str(tmp_path / "bad"), *calls]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    # A call that ran only the worker where another ran all three engines: its ratio would
    # read another call's baselines.
    lone = _matrix(tmp_path, "lone", [rec("dual", 3.0, 1, 150.0)])
    assert mm.main(["--out", str(tmp_path / "bad2"), "--processes", calls[0], lone]) == 2
    assert "mix calls" in capsys.readouterr().err
    # One part made by `policy_matrix --processes 3`: its cell reads each engine's median.
    one = _matrix(tmp_path, "one", [rec(e, a, 1, v) | {"process": n + 1}
                                    for n, (p, e3, d) in enumerate(speeds)
                                    for e, a, v in (("plain", None, p), ("eagle3", 3.0, e3),
                                                    ("dual", 3.0, d))])
    assert mm.main(["--out", str(tmp_path / "one-m"), one, wide]) == 0
    merged = json.loads((tmp_path / "one-m" / "policy-matrix.json").read_text())
    assert {(c["concurrency"], c["ratio"]) for c in merged["cells"]} == {(1, 0.99), (64, 1.01)}


def test_engines_in_several_processes_take_turns_and_a_cell_reads_their_median(tmp_path,
                                                                              monkeypatch):
    """--processes 3: plain, EAGLE-3, worker, plain, ... (a slow spell hits every engine alike);
    each cell's tok/s is the median of its processes, each process's kept; only the first
    worker process writes the step log."""
    runs = []
    speed = {"plain": [200.0, 100.0, 210.0], "eagle3": [400.0, 420.0, 300.0],
             "dual": [396.0, 390.0, 500.0]}

    def fake_engine(name, spec, out, deadline):
        kind = name.split(".")[0]
        runs.append((name, "DGW_STEP_LOG" in spec["env"]))
        task = "256x256" if kind == "plain" else "a3.0-256x256"
        tok_s = speed[kind][len([r for r in runs if r[0].split(".")[0] == kind]) - 1]
        return {"returncode": 0, "startup_s": 1.0,
                "tasks": {task: {"points": [{"concurrency": 1, "tok_s": tok_s, "seconds": 1.0}]}}}

    monkeypatch.setattr(pm, "run_engine", fake_engine)
    out = tmp_path / "o"
    assert pm.main(["--out", str(out), "--processes", "3", "--accept", "3", "--step-log",
                    "--workload", "256x256@1", "--engines", "plain,eagle3,dual"]) == 0
    assert [n for n, _ in runs] == ["plain", "eagle3", "dual", "plain.p2", "eagle3.p2", "dual.p2",
                                    "plain.p3", "eagle3.p3", "dual.p3"]
    assert [n for n, log in runs if log] == ["dual"]
    matrix = json.loads((out / "policy-matrix.json").read_text())
    [cell] = matrix["cells"]
    assert (cell["plain"], cell["eagle3"], cell["dual"]) == (200.0, 400.0, 396.0)
    assert cell["ratio"] == 0.99
    assert len(matrix["records"]) == 9
    assert pm.main(["--out", str(tmp_path / "x"), "--processes", "0"]) == 2


def test_the_machine_report_tells_a_slow_host_from_a_slow_engine_process():
    """Per engine and accept phase: the host probe, the SM clock and the engine's CPU seconds
    per 1000 tokens, from each cell's `machine` record; baselines from other runs are left
    out, and records without one give no section."""
    def cell(engine, a, probe, sm, cpu):
        return rec(engine, a, 1, 500.0) | {"machine": {"host_probe_ms": probe, "sm_mhz": sm,
                                                       "cpu_s": cpu}}
    recs = [cell("eagle3", 3.5, 12.0, 1980.0, 0.5), cell("eagle3", 3.5, 13.0, 1980.0, 0.5),
            cell("dual", 3.5, 12.5, 1755.0, 1.0), cell("dual", 3.5, 12.5, 1980.0, 1.0),
            cell("plain", None, 30.0, 1980.0, 0.4) | {"from": "run7"}]
    md = mrep.machine_report(recs)
    assert "| dual | 3.5 | 2 | 12.5, 12.5 | - | 1755-1980 | 2.00 |" in md
    assert "| eagle3 | 3.5 | 2 | 12.5, 13.0 | - | 1980-1980 | 1.00 |" in md
    assert "plain" not in md
    assert mrep.machine_report([rec("dual", 3.5, 1, 500.0)]) == ""


def test_the_report_shows_each_repeated_cell_first_and_fastest_run_apart(tmp_path):
    from bench.sglang import merge_matrix as mm
    from bench.sglang.matrix_records import Workload, other_readings
    from bench.sglang.matrix_report import reading_report

    w = [Workload.parse("256x256@1")]
    recs = [rec("plain", None, 1, 200.0), rec("eagle3", 3.0, 1, 400.0) | {
                "runs_tok_s": [400.0, 350.0, 410.0]},
            rec("dual", 3.0, 1, 396.0) | {"runs_tok_s": [300.0, 396.0, 400.0]}]
    other = other_readings(recs)
    text = reading_report("cells_first_run", other["cells_first_run"], [3.0], w)
    assert "first run alone" in text and "| 3 | **0.750** |" in text
    # Each engine's fastest run: 400 against EAGLE-3's 410.
    text = reading_report("cells_best_run", other["cells_best_run"], [3.0], w)
    assert "fastest run" in text and "| 3 | **0.976** |" in text
    assert other_readings(recs[:1]) == {} and reading_report("cells_first_run", None, [3.0], w) == ""
    # Merged: a baseline filled from an earlier run and a cell two processes measured are rated
    # as the main grid rates them (the filled plain, the median of the processes' first runs).
    filled = _matrix(tmp_path, "a", [
        rec("eagle3", 3.0, 1, 100.0), {"from": "old.json", "call": "x"} | rec("plain", None, 1, 50.0),
        rec("dual", 3.0, 1, 90.0) | {"runs_tok_s": [80.0, 90.0, 95.0]}])
    assert mm.main(["--out", str(tmp_path / "m"), filled]) == 0
    merged = json.loads((tmp_path / "m" / "policy-matrix.json").read_text())
    assert [c["ratio"] for c in merged["cells_first_run"]] == [0.8]
    assert [c["ratio"] for c in merged["cells_best_run"]] == [0.95]
    assert "fastest run" in (tmp_path / "m" / "report.md").read_text()
    procs = [_matrix(tmp_path, f"p{n}", [
        rec("plain", None, 1, 50.0), rec("eagle3", 3.0, 1, 100.0),
        rec("dual", 3.0, 1, 90.0) | {"runs_tok_s": [first, 90.0, 90.0]}])
        for n, first in enumerate((60.0, 70.0, 80.0))]
    assert mm.main(["--out", str(tmp_path / "pm"), "--processes", *procs]) == 0
    merged = json.loads((tmp_path / "pm" / "policy-matrix.json").read_text())
    assert [c["ratio"] for c in merged["cells_first_run"]] == [0.7]
    assert "cells below 0.98: 1 of 1" in (tmp_path / "pm" / "report.md").read_text()


def test_an_interleaved_cells_rounds_make_one_record():
    """The median round's tok/s, every round's kept; totals, CPU time and the worker's counters
    summed over the rounds, its cost model as after the last."""
    def rnd(r, tok_s, seconds, tokens, cpu, steps):
        return {"accept_len": 2.0, "input_len": 256, "output_len": 256, "concurrency": 4,
                "engine": "dual", "tok_s": tok_s, "seconds": seconds, "output_tokens": tokens,
                "t_start": 10.0 * r, "t_end": 10.0 * r + seconds, "round": r,
                "machine": {"cpu_s": cpu, "sm_mhz": 1980.0},
                "dual_graph": {"mode": f"m{r}", "catch_ups": 1, "steps": {"spec": steps},
                               "steps_by_reason": {"spec/goodput": steps}}}
    other = {"accept_len": 2.0, "input_len": 256, "output_len": 256, "concurrency": 4,
             "engine": "eagle3", "tok_s": 5.0, "seconds": 1.0}
    merged = mr.merged_rounds([rnd(1, 90.0, 2.0, 181, 1.5, 60), rnd(0, 100.0, 1.0, 100, 1.0, 50),
                               rnd(2, 50.0, 3.0, 152, None, 70), other])
    assert [r for r in merged if r["engine"] == "eagle3"] == [other]
    one = next(r for r in merged if r["engine"] == "dual")
    assert (one["tok_s"], one["seconds"], one["rounds"]) == (90.0, 2.0, 3)
    assert one["runs_tok_s"] == [100.0, 90.0, 50.0]
    assert one["runs_t"] == [[0.0, 1.0], [10.0, 12.0], [20.0, 23.0]]
    assert (one["t_start"], one["t_end"]) == (0.0, 23.0)
    assert one["output_tokens_total"] == 433 and one["seconds_total"] == 6.0
    assert one["machine"] == {"cpu_s": None, "sm_mhz": 1980.0}     # a round without it
    assert one["dual_graph"]["mode"] == "m2" and one["dual_graph"]["catch_ups"] == 3
    assert one["dual_graph"]["steps"] == {"spec": 180}
    assert "round" not in one and "output_tokens" not in one
    two = mr.merged_rounds([rnd(0, 100.0, 1.0, 100, 1.0, 50), rnd(1, 90.0, 2.0, 181, 1.5, 60)])
    assert two[0]["tok_s"] == 90.0 and two[0]["machine"]["cpu_s"] == 2.5
    # The bench process's collection pauses: counts and times summed, the longest kept; none
    # where a round has none.
    paused = [rnd(r, 90.0, 2.0, 181, 1.0, 60) for r in range(2)]
    for r, gen2 in zip(paused, ([1, 300.0, 300.0], [2, 50.0, 40.0])):
        r["machine"]["bench_gc_ms"] = {"gen0": [5, 1.0, 0.5], "gen2": gen2}
    machine = mr.merged_rounds(paused)[0]["machine"]
    assert machine["bench_gc_ms"] == {"gen0": [10, 2.0, 0.5], "gen2": [3, 350.0, 300.0]}
    del paused[1]["machine"]["bench_gc_ms"]
    assert "bench_gc_ms" not in mr.merged_rounds(paused)[0]["machine"]


def test_a_cell_whose_rounds_the_budget_cut_short_is_marked_in_the_grid(tmp_path):
    """m39 (run 17) ran out of budget in its second phase: cells read the slower of two rounds,
    or one, under a note that says three. The grid marks them; not a call that asked for two,
    merged with one that asked for three."""
    from bench.sglang import merge_matrix as mm

    def ran(engine, a, c, tok_s, rounds):
        return rec(engine, a, c, tok_s) | {"rounds": rounds, "runs_tok_s": [tok_s] * rounds}
    recs = mr.with_rounds_asked(
        [ran("plain", None, 1, 200.0, 3), ran("eagle3", 2.0, 1, 400.0, 3),
         ran("dual", 2.0, 1, 396.0, 3), ran("plain", None, 4, 800.0, 3),
         ran("eagle3", 2.0, 4, 1000.0, 2), ran("dual", 2.0, 4, 990.0, 2)], {"rounds": 3})
    cells = {c["concurrency"]: c for c in mr.ratios(recs)}
    assert "cut_short" not in cells[1] and cells[4]["cut_short"] is True
    md = mrep.report(list(cells.values()), [2.0], [pm.Workload.parse("256x256@1,4")], "note")
    assert "| 2 | 0.990 | 0.990\u2021 |" in md and "fewer rounds than its call asked" in md
    first = mr.ratios(mr.first_runs(recs))                  # one run each: none cut short
    assert not any("cut_short" in c for c in first)
    # Merged: a call that asked for two rounds and ran them is whole.
    parts = []
    for name, asked, c in (("three", 3, 1), ("two", 2, 4)):
        rs = [ran("plain", None, c, 200.0, asked), ran("eagle3", 2.0, c, 400.0, asked),
              ran("dual", 2.0, c, 396.0, asked)]
        parts.append(_matrix(tmp_path, name, rs, settings={"rounds": asked}))
    assert mm.main(["--out", str(tmp_path / "m"), *parts]) == 0
    merged = json.loads((tmp_path / "m" / "policy-matrix.json").read_text())
    assert not any("cut_short" in c for c in merged["cells"])


def _fake_engines(monkeypatch, tok_s=100.0, result=None):
    """pm.run_engine standing in for every engine: one cell at C=1 each (`result`: what each
    returns instead); the names it was asked for, in order."""
    names = []

    def fake_engine(name, spec, out, deadline):
        names.append(name)
        task = "256x256" if name.startswith("plain") else "a3.0-256x256"
        return result if result is not None else {
            "returncode": 0, "startup_s": 1.0,
            "tasks": {task: {"points": [{"concurrency": 1, "tok_s": tok_s, "seconds": 1.0}]}}}

    monkeypatch.setattr(pm, "run_engine", fake_engine)
    return names


ONE_CELL = ["--accept", "3", "--workload", "256x256@1", "--short-cell-runs", "1"]


@pytest.mark.parametrize("first, second, named", [
    (["--radix-cache"], [], "--radix-cache True"),
    (["--acc-sampling", "sglang"], [], "--acc-sampling 'sglang'"),
])
def test_records_kept_in_out_need_the_same_radix_cache_and_sampling(
        tmp_path, monkeypatch, capsys, first, second, named):
    """A worker measured with the radix cache on (or SGLang's accept draw) may not sit beside
    plain measured without: refused in one line before any work."""
    _fake_engines(monkeypatch)
    out = str(tmp_path / "o")
    assert pm.main(["--out", out, "--engines", "dual", *ONE_CELL, *first]) == 0
    capsys.readouterr()
    assert pm.main(["--out", out, "--engines", "plain", *ONE_CELL, *second]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err


def test_the_sampling_matters_only_where_speculating_records_are_kept(tmp_path, monkeypatch):
    _fake_engines(monkeypatch)
    out = str(tmp_path / "o")
    assert pm.main(["--out", out, "--engines", "plain", *ONE_CELL,
                    "--acc-sampling", "sglang"]) == 0
    # EAGLE-3 and the worker both measured again: only plain is kept, which no sampling moves.
    assert pm.main(["--out", out, "--engines", "eagle3,dual", *ONE_CELL]) == 0
    matrix = json.loads((Path(out) / "policy-matrix.json").read_text())
    assert matrix["settings"]["acc_sampling"] == "diffused" and len(matrix["cells"]) == 1


def test_records_of_another_gpu_are_never_kept_nor_filled_from(tmp_path, monkeypatch, capsys):
    _fake_engines(monkeypatch)
    monkeypatch.setattr(pm, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    old = tmp_path / "old"
    assert pm.main(["--out", str(old), "--engines", "plain,eagle3", *ONE_CELL]) == 0
    assert json.loads((old / "policy-matrix.json").read_text())["settings"]["gpu"] == \
        "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(pm, "gpu_name", lambda: "NVIDIA H200")
    capsys.readouterr()
    assert pm.main(["--out", str(old), "--engines", "dual", *ONE_CELL]) == 2
    assert "GPU 'NVIDIA H100 80GB HBM3'" in capsys.readouterr().err
    assert pm.main(["--out", str(tmp_path / "new"), "--engines", "dual", *ONE_CELL,
                    "--fill-from", str(old / "policy-matrix.json")]) == 2
    assert "GPU 'NVIDIA H100 80GB HBM3'" in capsys.readouterr().err


def test_fill_from_needs_the_same_radix_cache_and_sampling(tmp_path, monkeypatch, capsys):
    _fake_engines(monkeypatch)
    old = tmp_path / "old"
    assert pm.main(["--out", str(old), "--engines", "plain,eagle3", *ONE_CELL,
                    "--radix-cache"]) == 0
    capsys.readouterr()
    assert pm.main(["--out", str(tmp_path / "new"), "--engines", "dual", *ONE_CELL,
                    "--fill-from", str(old / "policy-matrix.json")]) == 2
    assert "--radix-cache True" in capsys.readouterr().err
    assert pm.main(["--out", str(tmp_path / "new2"), "--engines", "dual", *ONE_CELL,
                    "--radix-cache", "--acc-sampling", "sglang",
                    "--fill-from", str(old / "policy-matrix.json")]) == 2
    assert "--acc-sampling 'diffused'" in capsys.readouterr().err


def test_a_matrix_written_before_these_settings_reads_them_from_its_note(tmp_path, monkeypatch):
    """Files from before the GPU, radix cache and sampling were recorded still load: their note
    has always named them."""
    _fake_engines(monkeypatch)
    monkeypatch.setattr(pm, "gpu_name", lambda: "NVIDIA H200")
    out = tmp_path / "o"
    assert pm.main(["--out", str(out), "--engines", "plain", *ONE_CELL]) == 0
    path = out / "policy-matrix.json"
    older = json.loads(path.read_text())
    for key in ("radix_cache", "acc_sampling", "gpu"):
        del older["settings"][key]
    path.write_text(json.dumps(older))
    assert pm.main(["--out", str(out), "--engines", "eagle3,dual", *ONE_CELL]) == 0
    assert len(json.loads(path.read_text())["cells"]) == 1
    # What the notes of the stored runs say.
    note = ("NVIDIA H200, SGLang 0.5.17, Llama-3-8B shape, DUMMY weights, accept length FORCED "
            "(SGLANG_SIMULATE_ACC_LEN, switched in-process; non-integer lengths error-diffused "
            "per step), SGLang default attention, 3 steps topk 1, radix cache on, T=0")
    assert mr.settings_in_note(note) == {"radix_cache": True, "acc_sampling": "diffused",
                                         "gpu": "NVIDIA H200"}
    first = ("H200, SGLang 0.5.17, Llama-3-8B shape, DUMMY weights, accept length FORCED "
             "(SGLANG_SIMULATE_ACC_LEN, switched in-process), triton attention, radix cache on")
    assert mr.settings_in_note(first)["acc_sampling"] == "sglang"


def test_a_worker_measured_again_leaves_no_earlier_step_log(tmp_path, monkeypatch):
    """Without --step-log this call's worker writes no log: an earlier call's, and the
    step-costs.md built from it, would pass for this one's."""
    _fake_engines(monkeypatch)
    out = tmp_path / "o"
    assert pm.main(["--out", str(out), "--engines", "dual", *ONE_CELL]) == 0
    (out / "dual.steps.jsonl").write_text("not this call's\n")
    (out / "step-costs.md").write_text("not this call's\n")
    assert pm.main(["--out", str(out), "--engines", "dual", *ONE_CELL]) == 0
    assert not (out / "dual.steps.jsonl").exists() and not (out / "step-costs.md").exists()


@pytest.mark.parametrize("result", [
    {"returncode": 2, "error": "engine start failed: OOM", "tasks": {}},
    {"returncode": 3, "tasks": {"a3.0-256x256": {"error": "boom"}}},
    {"returncode": "timeout", "tasks": {}},
    {"returncode": 0, "tasks": {}},
])
def test_a_failed_engine_fails_the_call(tmp_path, monkeypatch, capsys, result):
    _fake_engines(monkeypatch, result=result)
    assert pm.main(["--out", str(tmp_path / "o"), "--engines", "dual", *ONE_CELL]) == 1
    assert "FAILED dual" in capsys.readouterr().err


@pytest.mark.parametrize("accept", ["0", "0.5", "4.5", "2,5"])
def test_an_accept_length_sglang_would_not_force_is_one_line(tmp_path, capsys, accept):
    """SGLang turns the simulation off at <= 0 and clamps above its draft tokens (4): such a
    cell would run another accept length than its label."""
    assert pm.main(["--out", str(tmp_path / "o"), "--accept", accept]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must be in 1..4" in err and not (tmp_path / "o").exists()


def test_processes_read_the_slower_middle_run_with_its_own_seconds_and_machine():
    """An even count reads the slower middle process, as rounds and repeats do; the record's
    seconds and machine are that process's, not an average's nor the first's."""
    recs = [rec("dual", 3.0, 1, 200.0) | {"seconds": 0.5, "machine": {"cpu_s": 1.0},
                                         "process": 1},
            rec("dual", 3.0, 1, 100.0) | {"seconds": 1.0, "machine": {"cpu_s": 2.0},
                                         "process": 2}]
    [one] = mr.per_cell_median(recs)
    assert (one["tok_s"], one["seconds"], one["machine"], one["process"]) == \
        (100.0, 1.0, {"cpu_s": 2.0}, 2)
    assert one["tok_s_processes"] == [200.0, 100.0]


def test_set_accept_with_nobody_listening_times_out(tmp_path):
    """As its docstring says: no acknowledgement at all is no answer, not an empty one."""
    from bench.sglang.acc_control import set_accept

    with pytest.raises(TimeoutError, match="not acknowledged"):
        set_accept(str(tmp_path / "acc"), 2.0, timeout_s=0.05)


def test_merge_names_the_part_that_is_no_matrix(tmp_path, capsys):
    from bench.sglang import merge_matrix as mm

    good = _matrix(tmp_path, "good", [rec("plain", None, 1, 1.0), rec("eagle3", 3.0, 1, 1.0),
                                      rec("dual", 3.0, 1, 1.0)])
    no_records = tmp_path / "no-records"
    no_records.mkdir()
    (no_records / "policy-matrix.json").write_text(json.dumps(
        {"note": "n", "accepts": [], "workloads": []}))
    a_list = tmp_path / "a-list"
    a_list.mkdir()
    (a_list / "policy-matrix.json").write_text("[1, 2]")
    bad_record = _matrix(tmp_path, "bad-record", [rec("dual", 3.0, 1, 1.0)])
    broken = json.loads((Path(bad_record) / "policy-matrix.json").read_text())
    del broken["records"][0]["accept_len"]
    (Path(bad_record) / "policy-matrix.json").write_text(json.dumps(broken))
    for part, says in ((no_records, "has no 'records' list"),
                       (a_list, "must be a JSON object, got list"),
                       (bad_record, "lacks 'accept_len'"),
                       (tmp_path / "missing", "cannot read")):
        capsys.readouterr()
        assert mm.main(["--out", str(tmp_path / "m"), good, str(part)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"part {part}" in err and says in err, err
    assert not (tmp_path / "m").exists()


def test_engines_short_of_the_kv_pool_asked_are_named_and_their_matrix_not_merged(tmp_path,
                                                                                  capsys):
    """An engine SGLang gave less KV than asked (memory short at its start) retracts and
    queues requests: its matrix says so at the top, in the heatmap and JSON, and is no part to
    merge."""
    from bench.sglang import merge_matrix as mm

    assert mr.short_pools({"dual": 160000, "plain": 160000}, 160000) == ""
    assert mr.short_pools({"dual": 17634, "plain": 150000}, None) == ""     # none asked
    line = mr.short_pools({"dual": 17634, "eagle3": 160000, "plain": None}, 160000)
    assert "dual 17634, eagle3 160000, plain ?" in line and "; dual short" in line
    recs = [rec("plain", None, 1, 200.0), rec("eagle3", 3.0, 1, 400.0), rec("dual", 3.0, 1, 90.0)]
    writer = pm.MatrixWriter(tmp_path, "note", [3.0], [pm.Workload.parse("256x256@1")],
                             {"attention_backend": "default"}, [], "", {}, {}, 160000)
    for kind, got in (("dual", 17634), ("eagle3", 160000), ("plain", 160000)):
        writer.started(kind, {"startup_s": 50.0,
                              "server_info": {"memory_usage": {"token_capacity": got}}})
    writer.write(recs)
    matrix = json.loads((tmp_path / "policy-matrix.json").read_text())
    assert matrix["kv_pools"] == {"dual": 17634, "eagle3": 160000, "plain": 160000}
    assert matrix["note"].startswith("NOT LIKE FOR LIKE")
    assert (tmp_path / "report.md").read_text().splitlines()[2].startswith("**NOT LIKE FOR LIKE")
    assert mm.main(["--out", str(tmp_path / "m"), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dual short" in err and "leave it out" in err
    # Pools alike: the same matrix merges.
    writer.started("dual", {"server_info": {"memory_usage": {"token_capacity": 160000}}})
    writer.write(recs)
    assert json.loads((tmp_path / "policy-matrix.json").read_text())["note"] == "note"
    assert mm.main(["--out", str(tmp_path / "m"), str(tmp_path)]) == 0
    odd = json.loads((tmp_path / "policy-matrix.json").read_text()) | {"kv_asked": "160000"}
    (tmp_path / "policy-matrix.json").write_text(json.dumps(odd))
    capsys.readouterr()
    assert mm.main(["--out", str(tmp_path / "m2"), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kv_asked '160000'" in err


def test_interleaving_engines_on_a_gpu_too_small_for_them_is_one_clear_error(tmp_path,
                                                                            monkeypatch, capsys):
    _fake_engines(monkeypatch)
    monkeypatch.setattr(pm, "gpu_total_mib", lambda: 81559.0)
    out = tmp_path / "o"
    assert pm.main(["--out", str(out), "--engines", "plain,eagle3", *ONE_CELL,
                    "--interleave"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "this GPU has 80 GiB" in err and "leave out --interleave" in err
    assert not out.exists()
    # One after another they fit: each engine alone holds its pool; so does one interleaved.
    assert pm.main(["--out", str(out), "--engines", "plain,eagle3", *ONE_CELL]) == 0
    monkeypatch.setattr(pm.interleave, "run_all", _fake_run_all(160000))
    assert pm.main(["--out", str(tmp_path / "one"), "--engines", "dual", *ONE_CELL,
                    "--interleave"]) == 0


def _fake_run_all(dual_pool: int, killed: bool = False):
    """interleave.run_all standing in for every engine: one cell each, the worker's KV pool
    `dual_pool`, the others' as asked; `killed`: interrupted after its first phase."""
    def run_all(specs, plan, out, deadline, on_phase=None, together=False):
        results = {kind: {"returncode": 0, "startup_s": 1.0,
                          "server_info": {"memory_usage": {
                              "token_capacity": dual_pool if kind == "dual" else 160000}},
                          "tasks": {"256x256" if kind == "plain" else "a3.0-256x256": {
                              "points": [{"concurrency": 1, "tok_s": 100.0, "seconds": 1.0}]}}}
                   for kind in specs}
        on_phase(results)
        if killed:
            raise KeyboardInterrupt
        return results
    return run_all


def test_an_interleaved_run_with_a_short_pool_ends_by_naming_it(tmp_path, monkeypatch, capsys):
    """The warning is the output's last lines, beside any failure, where a device call's tail
    keeps it; a run killed after its first phase has filed the pools with its records."""
    monkeypatch.setattr(pm.interleave, "run_all", _fake_run_all(17634))
    out = tmp_path / "o"
    assert pm.main(["--out", str(out), *ONE_CELL, "--interleave"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("[matrix] WARNING: NOT LIKE FOR LIKE") and "dual 17634" in err[-1]
    assert json.loads((out / "policy-matrix.json").read_text())["kv_pools"]["dual"] == 17634
    monkeypatch.setattr(pm.interleave, "run_all", _fake_run_all(17634, killed=True))
    killed = tmp_path / "k"
    with pytest.raises(KeyboardInterrupt):
        pm.main(["--out", str(killed), *ONE_CELL, "--interleave"])
    assert "dual 17634" in json.loads((killed / "policy-matrix.json").read_text())["note"]
    # Measured again with room, the worker's pool is its new one and the note is plain again.
    monkeypatch.setattr(pm.interleave, "run_all", _fake_run_all(160000))
    assert pm.main(["--out", str(killed), *ONE_CELL, "--interleave"]) == 0
    assert not json.loads((killed / "policy-matrix.json").read_text())["note"].startswith("NOT")


@pytest.mark.parametrize("main", [pm.main, None])
def test_an_accept_list_that_is_no_numbers_is_one_line(tmp_path, capsys, main):
    """policy_matrix and matrix_plan read --accept alike (argtypes.float_list)."""
    from bench.sglang import matrix_plan
    args = ["--out", str(tmp_path / "o"), "--accept", "1.5,x"] if main else \
        [str(tmp_path / "m.json"), "--accept", "1.5,x", "--workload", "256x256@1"]
    with pytest.raises(SystemExit) as stop:
        (main or matrix_plan.main)(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "1.5,x" in err
    assert not (tmp_path / "o").exists()
