"""The scripted profiling workload: every step it profiles replays a captured graph."""

from __future__ import annotations

import pytest

from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.core.modes import Mode
from profiling.workload import DECODE_POOL, SPEC_POOL, main, pools


@pytest.mark.parametrize("bs", [1, 8, 16, 24, 32, 40, 300, 512])
def test_both_pools_hold_the_profiled_batch_size(bs):
    # `dgw profile --bs` takes 1..512: a step above a pool would run eagerly and fail the check.
    spec, decode = pools(bs)
    table = DispatchTable.build(spec, decode, allow_eager=False)
    assert table.has_graph(Mode.SPEC, bs) and table.has_graph(Mode.DECODE, bs)
    assert set(SPEC_POOL) <= set(spec) and set(DECODE_POOL) <= set(decode)


def test_the_workload_runs_above_the_usual_pools_on_cpu(capsys):
    # bs=40 is above both usual pools (spec 16, decode 32); eager fallback is off, so any
    # step that found no graph would raise.
    assert main(["--bs", "40", "--hold", "1", "--alternate", "2", "--warmup", "0"]) == 0
    assert "profiled 4 steps at bs=40" in capsys.readouterr().out
