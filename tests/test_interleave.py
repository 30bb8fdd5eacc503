"""The interleaved policy matrix end to end on a stand-in SGLang (tests/fake_sglang): every
engine process up at once with the same KV pool, each cell run by one engine after another in
an order that rotates from cell to cell, plain in the first accept phase only, every engine's
points filed as the sequential matrix files them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sglang import interleave
from bench.sglang import policy_matrix as pm

FAKE = Path(__file__).parent / "fake_sglang"


# The runs here are stand-ins: the host's own GPU, if it has one, is not theirs.
pytestmark = pytest.mark.usefixtures("no_gpu")


def _matrix(tmp_path, monkeypatch, *extra):
    log = tmp_path / "served.jsonl"
    monkeypatch.setenv("FAKE_SGLANG_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    out = tmp_path / "m"
    rc = pm.main(["--out", str(out), "--interleave", "--accept", "2,3", "--workload", "16x32@1,4",
                  "--short-cell-runs", "1", "--budget-s", "120", *extra])
    served = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return rc, out, served


def test_each_cell_runs_on_every_engine_in_a_rotating_order(tmp_path, monkeypatch):
    rc, out, served = _matrix(tmp_path, monkeypatch, "--engines", "dual,eagle3,plain")
    assert rc == 0
    # Every engine warms first, alone (a 2-prompt warm-up, then each shape at 16 tokens) ...
    warm = [(s["kind"], s["bs"]) for s in served[:9]]
    assert warm == [(k, bs) for k in ("dual", "eagle3", "plain") for bs in (2, 1, 4)]
    # ... then per phase the speculating engines' warm-up after the accept switch (2 prompts,
    # untimed), and each cell on every engine, the order rotating; plain in phase one only.
    rest = [(s["kind"], s["bs"], s["tokens"]) for s in served[9:]]
    settle = [("dual", 2, 64), ("eagle3", 2, 64)]
    assert rest == settle + [("dual", 1, 32), ("eagle3", 1, 32), ("plain", 1, 32),
                             ("eagle3", 4, 32), ("plain", 4, 32), ("dual", 4, 32)] + \
        settle + [("dual", 1, 32), ("eagle3", 1, 32), ("eagle3", 4, 32), ("dual", 4, 32)]
    assert {s["kv"] for s in served} == {interleave.ENGINE_KWARGS["max_total_tokens"]}
    matrix = json.loads((out / "policy-matrix.json").read_text())
    assert {(c["accept_len"], c["concurrency"]) for c in matrix["cells"]} == \
        {(2.0, 1), (2.0, 4), (3.0, 1), (3.0, 4)}
    by_engine = {e: sorted((r["accept_len"] or 0, r["concurrency"]) for r in matrix["records"]
                           if r["engine"] == e) for e in ("plain", "eagle3", "dual")}
    assert by_engine["plain"] == [(0, 1), (0, 4)]
    assert by_engine["dual"] == by_engine["eagle3"] == [(2.0, 1), (2.0, 4), (3.0, 1), (3.0, 4)]
    assert set(matrix["startup_s"]) == {"dual", "eagle3", "plain"}
    assert matrix["settings"]["interleave"] and "engines up at once" in matrix["note"]
    spec = json.loads((out / "dual.spec.json").read_text())
    assert spec["env"]["DGW_LAZY_STASH_MB"] == interleave.DUAL_ENV["DGW_LAZY_STASH_MB"]


def test_frozen_collectors_are_asked_of_every_engine_and_each_cell_records_its_pauses(
        tmp_path, monkeypatch, capsys):
    """--freeze-gc: every engine freezes its collectors once warm, before its first timed
    batch (as a tuned server does), and the matrix says so; with or without it every record
    holds the bench process's collection pauses over its runs, and the report their longest."""
    rc, out, served = _matrix(tmp_path, monkeypatch, "--engines", "dual,eagle3",
                              "--freeze-gc")
    assert rc == 0
    for kind in ("dual", "eagle3"):
        mine = [s for s in served if s["kind"] == kind]
        first = next(i for i, s in enumerate(mine) if s.get("froze"))
        timed = next(i for i, s in enumerate(mine) if s.get("tokens") == 32)   # a cell's batch
        assert 0 < first < timed                     # after the warm-up, before any timed batch
    matrix = json.loads((out / "policy-matrix.json").read_text())
    assert matrix["settings"]["freeze_gc"] and "collectors frozen once warm" in matrix["note"]
    for r in matrix["records"]:
        assert set(r["machine"]["bench_gc_ms"]) == {"gen0", "gen1", "gen2"}
    assert "bench GC: longest ms" in (out / "report.md").read_text()
    # A run without it into the same folder would mix the two: refused, one line.
    capsys.readouterr()
    rc, _, _ = _matrix(tmp_path, monkeypatch, "--engines", "dual,eagle3")
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--freeze-gc True" in err
    # An SGLang without Engine.freeze_gc: each engine's run fails with the line that says so.
    monkeypatch.setenv("FAKE_SGLANG_OLD", "1")
    rc, out, _ = _matrix(tmp_path / "old", monkeypatch, "--engines", "dual", "--freeze-gc")
    assert rc != 0
    assert "no freeze_gc (0.5.17 has): run without --freeze-gc" in \
        json.loads((out / "dual.json").read_text())["error"]


def test_a_second_run_into_the_same_folder_starts_afresh(tmp_path, monkeypatch):
    """Earlier result files and accept acknowledgements never pass for this run's: engines
    still start one after another and every accept switch is acknowledged anew."""
    assert _matrix(tmp_path, monkeypatch, "--engines", "dual,eagle3")[0] == 0
    (tmp_path / "served.jsonl").unlink()
    rc, out, served = _matrix(tmp_path, monkeypatch, "--engines", "dual,eagle3")
    assert rc == 0
    assert [s["kind"] for s in served[:6]] == ["dual"] * 3 + ["eagle3"] * 3
    matrix = json.loads((out / "policy-matrix.json").read_text())
    assert not any("error" in json.loads((out / f"{k}.json").read_text())
                   for k in ("dual", "eagle3"))
    assert len([r for r in matrix["records"] if r["engine"] == "dual"]) == 4


def test_engines_launched_together_serve_the_same_matrix(tmp_path, monkeypatch):
    """--start-together: every engine launched at once (each its own entry-point shim), then
    the same plan, engine by engine, as when each starts after the last is up."""
    rc, out, served = _matrix(tmp_path, monkeypatch, "--engines", "dual,eagle3,plain",
                              "--start-together")
    assert rc == 0
    matrix = json.loads((out / "policy-matrix.json").read_text())
    assert {(c["accept_len"], c["concurrency"]) for c in matrix["cells"]} == \
        {(2.0, 1), (2.0, 4), (3.0, 1), (3.0, 4)}
    assert set(matrix["startup_s"]) == {"dual", "eagle3", "plain"}
    assert "launched together" in matrix["note"]
    assert {p.name for p in (out / "shim").iterdir()} == {"dual", "eagle3", "plain"}
    assert pm.main(["--out", str(tmp_path / "x"), "--start-together"]) == 2


def test_an_engine_that_dies_is_set_aside_with_what_it_measured(
        tmp_path, monkeypatch):
    # EAGLE-3 dies in its 6th batch (3 warm-ups, the accept switch's, C=1): at C=4.
    monkeypatch.setenv("FAKE_SGLANG_DIE", "eagle3:6")
    rc, out, served = _matrix(tmp_path, monkeypatch, "--engines", "dual,eagle3,plain")
    assert rc == 1                                     # what it kept is filed; the run failed
    matrix = json.loads((out / "policy-matrix.json").read_text())
    eagle = [r for r in matrix["records"] if r["engine"] == "eagle3"]
    assert [(r["accept_len"], r["concurrency"]) for r in eagle] == [(2.0, 1)]
    assert len([r for r in matrix["records"] if r["engine"] == "dual"]) == 4
    assert "exited" in json.loads((out / "eagle3.json").read_text())["error"]


def test_the_budget_ends_the_run_without_waiting_on_the_engines(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_SLOW_S", "60")        # every engine's first task outlasts it
    rc, out, served = _matrix(tmp_path, monkeypatch, "--engines", "dual,eagle3,plain",
                              "--budget-s", "4")
    assert rc == 1
    results = [json.loads((out / f"{k}.json").read_text()) for k in ("dual", "eagle3", "plain")]
    # Engines warm in turn: the worker is left mid-task when the budget runs out, not waited
    # for, and the others are not started on theirs.
    assert [r["error"].split(" the budget ran out ")[1].split()[0] for r in results] == \
        ["during", "before", "before"]


def test_an_engine_that_fails_to_start_leaves_the_others_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_FAIL", "eagle3")
    rc, out, served = _matrix(tmp_path, monkeypatch, "--engines", "dual,eagle3,plain")
    assert rc == 1
    assert {s["kind"] for s in served} == {"dual", "plain"}
    matrix = json.loads((out / "policy-matrix.json").read_text())
    assert {r["engine"] for r in matrix["records"]} == {"dual", "plain"}
    assert matrix["cells"] == []                       # no ratio without EAGLE-3


def test_interleaving_takes_one_process_per_engine(tmp_path, capsys):
    assert pm.main(["--out", str(tmp_path / "x"), "--interleave", "--processes", "2"]) == 2
    assert "--interleave runs one process per engine" in capsys.readouterr().err


def test_rounds_take_each_cell_in_turn_and_read_the_median_round(tmp_path, monkeypatch):
    """--rounds 3: the phase's cells three times over, one run of each a round, each round of a
    cell in its own engine order; a cell's record reads the median round and keeps every
    round's."""
    rc, out, served = _matrix(tmp_path, monkeypatch, "--engines", "dual,eagle3", "--rounds", "3")
    assert rc == 0
    timed = [(s["kind"], s["bs"]) for s in served[6:] if s["tokens"] == 32]
    assert timed[:12] == [("dual", 1), ("eagle3", 1), ("eagle3", 4), ("dual", 4),
                          ("eagle3", 1), ("dual", 1), ("dual", 4), ("eagle3", 4),
                          ("dual", 1), ("eagle3", 1), ("eagle3", 4), ("dual", 4)]
    assert len(timed) == 2 * 2 * 2 * 3          # accepts x sizes x engines x rounds
    matrix = json.loads((out / "policy-matrix.json").read_text())
    assert len(matrix["records"]) == 8 and matrix["settings"]["rounds"] == 3
    for r in matrix["records"]:
        assert r["rounds"] == 3 and len(r["runs_tok_s"]) == len(r["runs_t"]) == 3
        assert r["tok_s"] == sorted(r["runs_tok_s"])[1]
        assert r["runs_t"] == sorted(r["runs_t"])
    assert "in 3 rounds" in matrix["note"]
    dual = json.loads((out / "dual.json").read_text())["tasks"]
    assert {"a2.0-16x32#r0", "a2.0-16x32#r2", "a3.0-16x32#r1"} <= set(dual)


def test_rounds_need_interleave(tmp_path, capsys):
    assert pm.main(["--out", str(tmp_path / "m"), "--rounds", "3"]) == 2
    assert "--rounds takes 1-9 and needs --interleave" in capsys.readouterr().err


def test_every_engine_can_be_pinned_to_the_same_cpus(tmp_path, monkeypatch, capsys):
    """--pin-cpus: each engine process (and so SGLang's processes it starts) on those CPUs,
    recorded in its result and the matrix; a CPU the machine lacks or bad text is one line."""
    rc, out, _ = _matrix(tmp_path, monkeypatch, "--engines", "dual,eagle3", "--pin-cpus", "0")
    assert rc == 0
    for kind in ("dual", "eagle3"):
        assert json.loads((out / f"{kind}.json").read_text())["cpus"] == [0]
    matrix = json.loads((out / "policy-matrix.json").read_text())
    assert matrix["settings"]["pin_cpus"] == "0" and "processes on CPUs 0" in matrix["note"]
    capsys.readouterr()
    for bad, says in (("100000", "CPU 100000 is not one this process may use"),
                      ("3-1", "'3-1' is no CPU or range")):
        assert pm.main(["--out", str(tmp_path / "x"), "--interleave", "--pin-cpus", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err


def test_cpu_lists_read_as_written():
    assert pm.cpu_list("4-7,9, 2") == [2, 4, 5, 6, 7, 9]
    assert pm._spans([2, 4, 5, 6, 7, 9]) == "2,4-7,9"
