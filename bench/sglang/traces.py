"""Replay traces (`step_costs --trace`: a worker's step log, its batch costs in order) and what
every trace tool shares: reading them, one line for a file that is none, the clean steps, and a
controller fed a trace's rows as the worker fed its own."""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from typing import Callable, Iterator, Optional, Sequence, TypeVar

from dual_graph_worker.core.argtypes import OneLineParser, output_file
from dual_graph_worker.core.batch_costs import CatchUpWork
from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.controller import ControllerConfig, GoodputController
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.planner import exchanges_before
from dual_graph_worker.core.policy import DECIDED, PrefillTime, Reason, StepTime

MODES = {"s": Mode.SPEC, "d": Mode.DECODE}
# The draft's share of the weights in traces made before they recorded it: every GPU run served
# the matrix's one Llama-3-8B-shaped pair (model_configs), whose worker computed this.
MATRIX_DRAFT_SHARE = 0.0404
T = TypeVar("T")


def controller_for(trace: dict, prior: bool = True) -> GoodputController:
    """A controller as the traced worker built it: its graph sizes, deferring prefills, the
    draft's share of the weights, its K/V-only catch-ups' work (where it had them), with its
    start-up prior (or none)."""
    share = trace.get("draft_share", MATRIX_DRAFT_SHARE)
    return GoodputController(ControllerConfig(trace["num_steps"], defers_prefill=True,
                                              draft_share=share,
                                              catch_up_work=trace_work(trace)),
                             {Mode.SPEC: trace["spec_bs"], Mode.DECODE: trace["decode_bs"]},
                             CalibrationTable.from_json(trace["calibration"]) if prior else None)


def trace_work(trace: dict) -> Optional[CatchUpWork]:
    """The traced worker's K/V-only catch-up work, where it had it."""
    work = trace.get("catch_up_work")
    return None if work is None else CatchUpWork(**work)


def trace_parser(module: str, doc: Optional[str], out: str) -> OneLineParser:
    """A trace tool's command line, `python -m bench.sglang.MODULE TRACE.json.gz ... [--out
    FILE.json]`: the replay traces (`step_costs --trace`) and the JSON to write."""
    ap = OneLineParser(prog=f"python -m bench.sglang.{module}", description=doc,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", help="replay traces (step_costs --trace)")
    ap.add_argument("--out", type=output_file, default=out,
                    help="JSON to write (and the plot beside it, .png)")
    return ap


def read_trace(path: str) -> dict:
    """A replay trace (`step_costs --trace`)."""
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


# What reading a file that is no replay trace raises (read_trace and a reader of its rows).
TRACE_ERRORS = (OSError, EOFError, ValueError, KeyError, TypeError, IndexError, AttributeError)


def clean_step(row: list) -> bool:
    """A trace's step row with no catch-up in it and no launch of the next batch held."""
    return not row[3] and not row[4]


def not_a_trace(path: str, err: Exception) -> str:
    return (f"error: {path}: not a replay trace ({err}); make one with "
            "`python -m bench.sglang.step_costs STEP_LOG --trace FILE.json.gz`")


def read_each(paths: Sequence[str], read: Callable[[dict], T]) -> Optional[dict[str, T]]:
    """`read` of each replay trace at `paths`, by path in order; None, once one line on stderr
    has named the first that is no trace (or whose rows `read` cannot take)."""
    out = {}
    for path in paths:
        try:
            out[path] = read(read_trace(path))
        except TRACE_ERRORS as err:
            print(not_a_trace(path, err), file=sys.stderr)
            return None
    return out


def exchanged_after(steps: int, sync_every: int) -> bool:
    """Whether the worker exchanges once `steps` step times are in: as it makes the plan
    after them (planner.exchanges_before)."""
    return exchanges_before(steps + 1, sync_every)


def replay(trace: dict) -> Iterator[tuple[GoodputController, int, list]]:
    """The trace's cost rows fed to a controller in order, each yielded (with the controller,
    its index) just before the controller takes it; each step committed in the mode it ran
    (the step count), exchanging where the worker does (exchanged_after)."""
    p, steps = controller_for(trace), 0
    for at, row in enumerate(trace["costs"]):
        yield p, at, row
        if row[0] == "p":
            p.observe(PrefillTime(row[1], row[2], bool(row[3])))
            continue
        mode, pb, seconds, caught, carries, kv, bs = row
        p.commit(DECIDED[MODES[mode], Reason.GOODPUT])
        p.observe(StepTime(MODES[mode], pb, seconds, caught, bool(carries), kv, bs))
        steps += 1
        if exchanged_after(steps, p.sync_every):
            p.exchange(lambda v: v)
