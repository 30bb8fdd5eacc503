"""bench.sglang.traces' replay (estimate_error's and catch_up_fit's): exchanges as often as the
controller's own sync_every says, not a copy of its default."""

from __future__ import annotations

import pytest

from bench.sglang import catch_up_fit, traces
from dual_graph_worker.core.controller import ControllerConfig, GoodputController
from dual_graph_worker.core.modes import Mode

SIZES = [1, 2, 4]


def _every(monkeypatch, sync_every: int) -> list[GoodputController]:
    """The replay's controllers exchange every `sync_every` steps; the ones it built."""
    built = []

    def controller_for(trace, prior=True):
        p = GoodputController(ControllerConfig(trace["num_steps"], defers_prefill=True,
                                               sync_every=sync_every),
                              {Mode.SPEC: SIZES, Mode.DECODE: SIZES}, None)
        built.append(p)
        return p

    monkeypatch.setattr(traces, "controller_for", controller_for)
    return built


# A prefill, then seven decode steps at batch 1.
TRACE = {"num_steps": 3, "costs": [["p", 16, 0.01, 1]]
         + [["d", 1, 0.005, 0, 0, 100 + k, 1] for k in range(7)]}


def test_the_replay_exchanges_every_sync_every_steps(monkeypatch):
    built = _every(monkeypatch, 3)
    exchanged, rows = [], []
    for p, at, row in traces.replay(TRACE):
        if at == 0:
            p.exchange = lambda reduce: exchanged.append(len(rows))
        rows.append(row)
    # After the 2nd and 5th step: the worker exchanges as it plans the 3rd and 6th, before
    # the step ahead of it is timed.
    assert len(built) == 1 and exchanged == [3, 6]


def test_the_catch_up_fit_reads_the_line_after_each_exchange(monkeypatch):
    _every(monkeypatch, 3)
    read = []
    monkeypatch.setattr(catch_up_fit, "_read_fit", lambda out, p, steps: read.append(steps))
    catch_up_fit.fit_history(TRACE)
    assert read == [2, 5, 7]                             # and once after the last row


# Spec steps at batch 4: five clean ones of 10 ms, then a decode step that held the next launch
# (2 ms over its 5), a catch-up of 9000 tokens (12 ms over a step) and two steps more; one of
# 100 tokens after a prefill (no step before it held its launch), 1 ms over.
CATCH_UPS = {"num_steps": 3, "spec_bs": SIZES, "decode_bs": SIZES, "calibration": None,
             "costs": [["s", 4, 0.010, 0, 0, 64, 4]] * 5 + [["d", 4, 0.005, 0, 0, 64, 4]] * 5
             + [["d", 4, 0.007, 0, 1, 64, 4], ["s", 4, 0.022, 9000, 0, 64, 4]]
             + [["s", 4, 0.010, 0, 0, 64, 4]] * 2
             + [["p", 16, 0.01, 0], ["s", 4, 0.011, 100, 0, 64, 4]]}


def test_each_catch_up_is_priced_against_what_it_took(monkeypatch):
    _every(monkeypatch, 3)
    prices = catch_up_fit.price_errors(CATCH_UPS)
    assert [r["tokens"] for r in prices] == [9000, 100]
    assert prices[0]["taken_s"] == pytest.approx(0.012 + 0.002)
    assert prices[1]["taken_s"] == pytest.approx(0.001)
    # Priced just before it: the first, before any catch-up was seen, at nothing; the second
    # at the line the first one's exchange left.
    assert prices[0]["priced_s"] == 0.0 < prices[1]["priced_s"]
    summary = catch_up_fit.price_summary([{"tokens": 1, "priced_s": p, "taken_s": t}
                                          for p, t in ((0.4, 1), (1, 1), (3, 1), (1, 1),
                                                       (0, 1e-3), (1, -1e-3))])
    assert summary == {"catch_ups": 5, "took_nothing": 1, "priced_nothing": 1, "median": 1.0,
                       "under_half": 0.4, "over_twice": 0.2, "sums": round(5.4 / 4.001, 3)}


def test_the_replay_prices_the_draft_at_the_traced_workers_share():
    """Traces record the worker's draft share; older ones read the matrix's model pair's."""
    trace = {"num_steps": 3, "spec_bs": SIZES, "decode_bs": SIZES, "calibration": None}
    assert traces.controller_for(trace, prior=False).config.draft_share == \
        traces.MATRIX_DRAFT_SHARE
    trace["draft_share"] = 0.02
    assert traces.controller_for(trace, prior=False).config.draft_share == 0.02


def test_a_re_measurement_is_read_against_the_steps_it_led_to(tmp_path, capsys):
    """re_measure_error finds a short spec run between decode steps and sets the controller's
    step time after it against the same size's later clean spec steps; a file that is no trace
    is one line."""
    from bench.sglang import re_measure_error

    steady = [["s", 2, 0.010, 0, 0, 200 + k, 2] for k in range(12)]
    costs = ([["p", 16, 0.01, 1]] + [["d", 2, 0.005, 0, 0, 100 + k, 2] for k in range(6)]
             + [["s", 2, 0.010, 0, 0, 110 + k, 2] for k in range(3)]
             + [["d", 2, 0.005, 0, 0, 120 + k, 2] for k in range(9)] + steady)
    trace = {"num_steps": 3, "spec_bs": [2], "decode_bs": [2], "costs": costs,
             "calibration": {"num_draft_tokens": 3, "latency_s": [
                 {"mode": "spec", "bs": 2, "seconds": 0.02},
                 {"mode": "decode", "bs": 2, "seconds": 0.005}]}}
    (got,) = re_measure_error.ratios(trace)
    assert got["padded_bs"] == 2 and got["ratio"] == pytest.approx(1.0, abs=0.01)
    bad = tmp_path / "x.json.gz"
    bad.write_text("{}")
    assert re_measure_error.main([str(bad)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_trace_with_no_re_measurement_writes_its_summary_and_no_plot(tmp_path, capsys):
    """A run whose re-measurements of speculation never led to spec steps (a decode cell) has
    nothing to plot: the summary still comes, with a line saying why there is no plot."""
    import gzip
    import json

    from bench.sglang import re_measure_error

    costs = [["p", 16, 0.01, 1]] + [["d", 2, 0.005, 0, 0, 100 + k, 2] for k in range(20)]
    trace = tmp_path / "t.json.gz"
    with gzip.open(trace, "wt") as fh:
        json.dump({"num_steps": 3, "spec_bs": [2], "decode_bs": [2], "costs": costs,
                   "calibration": {"num_draft_tokens": 3, "latency_s": [
                       {"mode": "spec", "bs": 2, "seconds": 0.02},
                       {"mode": "decode", "bs": 2, "seconds": 0.005}]}}, fh)
    out = tmp_path / "r.json"
    assert re_measure_error.main([str(trace), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["summary"] == {"n": 0}
    assert not out.with_suffix(".png").exists()
    assert "no plot" in capsys.readouterr().out
