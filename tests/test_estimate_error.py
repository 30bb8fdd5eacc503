"""bench.sglang.estimate_error's replay (and catch_up_fit's, which reads it): exchanges as often
as the controller's own sync_every says, not a copy of its default."""

from __future__ import annotations

from bench.sglang import catch_up_fit, estimate_error
from dual_graph_worker.core.controller import ControllerConfig, GoodputController
from dual_graph_worker.core.modes import Mode

SIZES = [1, 2, 4]


def _every(monkeypatch, sync_every: int) -> list[GoodputController]:
    """estimate_error's controllers exchange every `sync_every` steps; the ones it built."""
    built = []

    def controller_for(trace, prior=True):
        p = GoodputController(ControllerConfig(trace["num_steps"], defers_prefill=True,
                                               sync_every=sync_every),
                              {Mode.SPEC: SIZES, Mode.DECODE: SIZES}, None)
        built.append(p)
        return p

    monkeypatch.setattr(estimate_error, "controller_for", controller_for)
    return built


# A prefill, then seven decode steps at batch 1.
TRACE = {"num_steps": 3, "costs": [["p", 16, 0.01, 1]]
         + [["d", 1, 0.005, 0, 0, 100 + k, 1] for k in range(7)]}


def test_the_replay_exchanges_every_sync_every_steps(monkeypatch):
    built = _every(monkeypatch, 3)
    exchanged, rows = [], []
    for p, at, row in estimate_error.replay(TRACE):
        if at == 0:
            p.exchange = lambda reduce: exchanged.append(len(rows))
        rows.append(row)
    assert len(built) == 1 and exchanged == [4, 7]       # after the 3rd and 6th step


def test_the_catch_up_fit_reads_the_line_after_each_exchange(monkeypatch):
    _every(monkeypatch, 3)
    read = []
    monkeypatch.setattr(catch_up_fit, "_read_fit", lambda out, p, steps: read.append(steps))
    catch_up_fit.fit_history(TRACE)
    assert read == [3, 6, 7]                             # and once after the last row
