"""bench/sglang/capture_compare.py without a GPU: engines replaced by canned results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sglang import capture_compare
from capture.config import load_capture_config
from capture.measurements import load_measurements
from capture.tuner import modelled_cost

FIXTURE = Path(__file__).parent / "data" / "capture" / "synthetic_h200_llama8b_k3.json"
# The fixture's sizes as a default server with --spec-max-bs 16 captures them.
DEFAULT_SPEC = [1, 2, 4, 8, 12, 16]
DEFAULT_DECODE = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128,
                  136, 144, 152, 160, 168, 176, 184, 192, 200, 208, 216, 224, 232, 240, 248, 256]


def _result(graph_gb: dict, graph_s: dict, tok_s: dict, spec_bs, decode_bs) -> dict:
    points = [{"concurrency": c, "tok_s": t} for c, t in tok_s.items()]
    return {"ok": True, "startup_s": 50.0,
            "server_info": {"memory_usage": {"graph": graph_gb},
                            "startup_time": {"cuda_graph": graph_s},
                            "dual_graph_pools": {"spec_bs": spec_bs, "decode_bs": decode_bs}},
            "tasks": {"r0": {"points": points}, "r1": {"points": points}}}


def test_pool_cost_counts_the_pools_runners_only():
    cost = capture_compare.pool_cost({
        "memory_usage": {"graph": {"prefill": 1.0, "target_verify": 0.25, "decode_pool": 0.25}},
        "startup_time": {"cuda_graph": {"prefill": 9.0, "draft_decode": 2.0, "decode_pool": 1.5}}})
    assert cost["graph_bytes"] == 2**29 and cost["capture_s"] == 3.5
    assert "prefill" not in cost["by_runner"]
    assert capture_compare.pool_cost({}) == {"graph_bytes": None, "capture_s": None,
                                            "by_runner": {}}


def test_the_tuned_server_is_budgeted_by_what_the_default_lists_cost(tmp_path, monkeypatch):
    """Tuning runs between the two engines, its budgets lowered to the default server's pool
    memory and capture time; the tuned engine gets the config through DGW_CAPTURE_CONFIG."""
    started = []

    def fake_run_child(folder, spec, *, shim_dir, timeout):
        started.append(spec)
        if spec["name"] == "default":
            res = _result({"target_verify": 0.4, "decode_pool": 0.2},
                          {"target_verify": 6.0, "decode_pool": 4.0},
                          {1: 100.0, 16: 1000.0}, DEFAULT_SPEC, DEFAULT_DECODE)
        else:
            assert load_capture_config(spec["env"]["DGW_CAPTURE_CONFIG"]).spec_bs[-1] <= 16
            res = _result({"target_verify": 0.3, "decode_pool": 0.1},
                          {"target_verify": 5.0, "decode_pool": 3.0},
                          {1: 101.0, 16: 990.0}, [1, 4], [2, 8])
        return res | {"returncode": 0}

    monkeypatch.setattr(capture_compare, "run_child", fake_run_child)
    rc = capture_compare.main(["--out", str(tmp_path), "--measurements", str(FIXTURE),
                               "--workload", "256x256@1,16", "--spec-max-bs", "16",
                               "--memory-budget", "64GiB", "--time-budget", "1000",
                               "--distribution", "uniform:1-256"])
    assert rc == 0
    assert [s["name"] for s in started] == ["default", "tuned"]
    assert all(s["env"]["SGLANG_SIMULATE_ACC_LEN"] == "3.0" for s in started)
    out = json.loads((tmp_path / "compare.json").read_text())
    # Caps in the tuner's own units: its model of the default server's lists, not the 0.6 GB
    # and 10 s that server measured (the model is what it checks the tuned lists against).
    priced = modelled_cost(load_measurements(FIXTURE), DEFAULT_SPEC, DEFAULT_DECODE)
    assert out["budgets"]["memory_bytes"] == priced.memory_bytes != int(0.6 * 2**30)
    assert out["budgets"]["capture_s"] == pytest.approx(priced.capture_s)
    assert out["budgets"]["priced_by"] == "the tuner's model of the default lists"
    assert out["ratios"]["graph_bytes"] == pytest.approx(0.4 / 0.6, abs=1e-4)
    assert out["ratios"]["tok_s"] == {"1": 1.01, "16": 0.99}
    text = (tmp_path / "report.md").read_text()
    assert "| tuned / default |" in text and "DUMMY weights" in text
    assert (tmp_path / "compare.png").exists() and (tmp_path / "tune.txt").exists()
    # The model's memory of the tuned lists beside what the tuned server measured (0.4 GB).
    model = out["tuned"]["model_bytes"]
    assert model > 0
    assert (f"at {model / 2**20:.0f} MiB; the tuned server measured {0.4 * 2**30 / 2**20:.0f} "
            f"MiB ({0.4 * 2**30 / model:.2f}x the model)") in text


def test_budgets_price_the_default_lists_by_the_model_or_else_by_what_was_measured():
    m = load_measurements(FIXTURE)
    measured = {"graph_bytes": 2**30, "capture_s": 10.0}
    priced = modelled_cost(m, [1, 2, 4], [1, 2, 4, 8])
    assert capture_compare.budgets(measured | {"pools": {"spec_bs": [1, 2, 4],
                                                         "decode_bs": [1, 2, 4, 8]}},
                                   m, 2**40, 1000.0) == (
        priced.memory_bytes, priced.capture_s, "the tuner's model of the default lists")
    # A size the measurements lack is priced as the next measured one up (bs 3 as bs 4).
    assert modelled_cost(m, [1, 3], [1]) == modelled_cost(m, [1, 4], [1])
    # No lists reported, or a size above every measured one: the server's own figures.
    for pools in (None, {"spec_bs": [1, 512], "decode_bs": [1]}, {"spec_bs": [], "decode_bs": [1]}):
        assert capture_compare.budgets(measured | {"pools": pools}, m, 2**40, 1000.0) == (
            2**30, 10.0, "what the default server measured")
    # The user's budget stays the cap where it is the lower.
    assert capture_compare.budgets(measured | {"pools": None}, m, 2**20, 1.0)[:2] == (2**20, 1.0)


def test_by_default_it_tunes_for_the_batch_sizes_the_default_server_ran(tmp_path, monkeypatch):
    """The default engine writes a step log; the tuner weighs batch sizes by it, so sizes the
    workload runs get a graph of their own (uniform:1-256 padded bs 1 to 6 on the H200)."""
    from dual_graph_worker.core.modes import Mode
    from dual_graph_worker.core.policy import Reason
    from dual_graph_worker.core.results import StepRecord
    from dual_graph_worker.core.step_log import StepLogWriter

    def fake_run_child(folder, spec, *, shim_dir, timeout):
        if spec["name"] == "default":
            log = StepLogWriter(spec["env"]["DGW_STEP_LOG"])
            for i, bs in enumerate([1] * 50 + [16] * 50):
                log.write(StepRecord(i, Mode.SPEC, bs, bs, Reason.GOODPUT, True, 3 * bs, 3.0),
                          0.0)
            log.close()
        else:
            assert "DGW_STEP_LOG" not in spec["env"]
        return _result({"target_verify": 0.4}, {"target_verify": 6.0}, {1: 100.0, 16: 1000.0},
                       [1, 16], [1, 16]) | {"returncode": 0}

    monkeypatch.setattr(capture_compare, "run_child", fake_run_child)
    assert capture_compare.main(["--out", str(tmp_path), "--measurements", str(FIXTURE),
                                 "--workload", "256x256@1,16", "--memory-budget", "64GiB",
                                 "--time-budget", "1000"]) == 0
    out = json.loads((tmp_path / "compare.json").read_text())
    assert out["tuned"]["spec_bs"] == [1, 16] and out["tuned"]["decode_bs"] == [1, 16]
    assert "steplog:" in out["note"]


def test_bad_measurements_are_one_line(tmp_path, capsys):
    rc = capture_compare.main(["--out", str(tmp_path), "--measurements",
                               str(tmp_path / "none.json")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")


def test_a_bad_distribution_is_one_line_before_any_engine_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(capture_compare, "run_child", lambda *a, **k: pytest.fail("started"))
    rc = capture_compare.main(["--out", str(tmp_path), "--measurements", str(FIXTURE),
                               "--distribution", "bogus:3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "unknown batch-size distribution" in err[0]


@pytest.mark.parametrize("flag, value, says", [("--accept-len", "9", "outside 1..K+1 = 1..4"),
                                                ("--time-budget", "-1", "give seconds > 0")])
def test_bad_numbers_are_one_line_before_any_engine_starts(tmp_path, capsys, monkeypatch,
                                                           flag, value, says):
    monkeypatch.setattr(capture_compare, "run_child", lambda *a, **k: pytest.fail("started"))
    rc = capture_compare.main(["--out", str(tmp_path), "--measurements", str(FIXTURE),
                               flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and says in err[0]


def test_a_failed_default_server_stops_before_tuning(tmp_path, capsys, monkeypatch):
    started = []

    def fake_run_child(folder, spec, *, shim_dir, timeout):
        started.append(spec["name"])
        return {"ok": False, "error": "engine start failed: OOM", "returncode": 2}

    monkeypatch.setattr(capture_compare, "run_child", fake_run_child)
    monkeypatch.setenv("DGW_CAPTURE_CONFIG", "/elsewhere/config.json")
    rc = capture_compare.main(["--out", str(tmp_path), "--measurements", str(FIXTURE)])
    assert rc == 1 and started == ["default"]
    assert "the default server failed (engine start failed: OOM)" in capsys.readouterr().err
    import os
    assert "DGW_CAPTURE_CONFIG" not in os.environ      # the default engine ran the defaults
