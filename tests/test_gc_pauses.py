"""The collection-pause diagnostic counts each generation's collections, their time and the
longest one since the last take."""

from __future__ import annotations

import gc

from dual_graph_worker.core.gc_pauses import GcPauses


def test_collections_are_counted_by_generation_and_reset_by_a_take():
    pauses = GcPauses().start()
    try:
        gc.collect(2)
        gc.collect(2)
        got = pauses.take()
        count, total_ms, longest_ms = got["gen2"]
        assert count >= 2 and 0 < longest_ms <= total_ms
        gc.collect(1)
        again = pauses.take()
        assert again["gen1"][0] >= 1 and again["gen2"] == [0, 0.0, 0.0]     # reset by the take
    finally:
        pauses.stop()
    gc.collect(2)
    assert pauses.take()["gen2"][0] == 0                               # stopped: not counted
