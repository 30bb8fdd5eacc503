"""The controller's step-time estimates against the worker's own H200 step costs in policy
matrix run 6 (tests/data/h200_run6_step_costs.json.gz: every timed decode step in run order with
the context its batch attended over, as the worker counted it on SGLang). Each step is predicted
just before it is observed; what matters most is the first steps at a size after the batch moved
to it, where a decision rests on an estimate taken under other prompts."""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path

import numpy as np

from dual_graph_worker.core.controller import ControllerConfig, GoodputController
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import StepTime, same_rank

TRACE = json.loads(gzip.open(Path(__file__).parent / "data/h200_run6_step_costs.json.gz",
                             "rt").read())
MODE = {"s": Mode.SPEC, "d": Mode.DECODE}


@functools.lru_cache(maxsize=2)
def errors_after_a_move(with_context: bool) -> np.ndarray:
    """Relative error of the estimate for the 2nd-4th step at a (mode, padded bs) after a step
    at another one (the first is a transition), at sizes measured before."""
    p = GoodputController(ControllerConfig(TRACE["num_steps"]),
                          {Mode.SPEC: TRACE["spec_bs"], Mode.DECODE: TRACE["decode_bs"]})
    out, prev, since = [], None, 0
    for k, (mode, pb, seconds, caught, carries, kv) in enumerate(TRACE["steps"]):
        kv = kv if with_context else 0
        since = since + 1 if (mode, pb) == prev else 0
        prev = (mode, pb)
        if 1 <= since <= 3 and not caught and not carries and p.step_time(MODE[mode], pb) \
                and p.estimates()["step_s"][MODE[mode].value].get(pb):
            out.append(abs(p.step_time(MODE[mode], pb, kv) - seconds) / seconds)
        p.observe(StepTime(MODE[mode], pb, seconds, caught, bool(carries), kv))
        if k % 8 == 7:
            p.exchange(same_rank)
    return np.asarray(out)


def test_estimates_after_a_move_follow_the_context():
    # Measured here: with the context, median 4.6% off, 12% of them more than 20% off; blind to
    # it, 7.5% and 27%.
    got, blind = errors_after_a_move(True), errors_after_a_move(False)
    assert len(got) > 400
    assert np.median(got) < 0.06 and np.mean(got > 0.2) < 0.15
    assert np.mean(blind > 0.2) > 2 * np.mean(got > 0.2)
