"""The benches write JSON through core.jsonio.write_json (a temporary file renamed over the
target, so a reader never sees half a file), none through a copy of it."""

from __future__ import annotations

import json

from dual_graph_worker.core import jsonio


def _recording(monkeypatch, module) -> list:
    written = []
    monkeypatch.setattr(module, "write_json", lambda data, path: (
        written.append(path), jsonio.write_json(data, path)))
    return written


def test_the_engine_child_and_the_interleaver_share_the_one_writer():
    from bench.sglang import engine_child, interleave

    assert engine_child.write_json is jsonio.write_json
    assert interleave.write_json is jsonio.write_json


def test_an_engine_childs_inbox_answer_is_written_whole(tmp_path, monkeypatch):
    from bench.sglang import engine_child

    written = _recording(monkeypatch, engine_child)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "0000.json").write_text(json.dumps({"name": "x", "kind": "nope"}))
    (inbox / "0001.json").write_text(json.dumps({"name": "exit", "kind": "exit"}))
    assert engine_child.serve(None, inbox, lambda name, answer: None) == 0
    assert written == [inbox / "0000.out.json"]
    assert "error" in json.loads((inbox / "0000.out.json").read_text())


def test_the_burst_simulation_is_written_whole(tmp_path, monkeypatch):
    from bench import burst_sim

    written = _recording(monkeypatch, burst_sim)
    out = tmp_path / "sub" / "b.json"
    assert burst_sim.main(["--accept", "3", "--requests", "16", "--concurrency", "8",
                           "--out", str(out)]) == 0
    assert written == [out] and json.loads(out.read_text())["simulated"]


def test_a_merged_matrix_is_written_whole(tmp_path, monkeypatch):
    from bench.sglang import merge_matrix as mm

    part = tmp_path / "a"
    part.mkdir()
    recs = [{"accept_len": a, "input_len": 256, "output_len": 256, "concurrency": 1,
             "engine": e, "tok_s": v, "seconds": 1.0}
            for e, a, v in (("plain", None, 200.0), ("eagle3", 3.0, 400.0), ("dual", 3.0, 396.0))]
    (part / "policy-matrix.json").write_text(json.dumps({
        "note": "note", "accepts": [3.0], "records": recs,
        "workloads": [{"input_len": 256, "output_len": 256, "concurrency": [1]}]}))
    written = _recording(monkeypatch, mm)
    assert mm.main(["--out", str(tmp_path / "m"), str(part)]) == 0
    assert written == [tmp_path / "m" / "policy-matrix.json"]
    assert json.loads(written[0].read_text())["cells"][0]["ratio"] == 0.99

