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


def test_gc_cost_times_full_collections_as_modules_come_in_and_after_a_freeze(tmp_path):
    """bench.sglang.gc_cost (its own process: it freezes the collector): a row per module
    imported, a module that does not import named and passed over, and after the freeze every
    object frozen."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "gc.json"
    run = subprocess.run([sys.executable, "-m", "bench.sglang.gc_cost", "--out", str(out),
                          "--collections", "1", "--modules", "json,no_such_module_xyz,csv"],
                         capture_output=True, text=True, cwd=Path(__file__).parents[1],
                         timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(out.read_text())
    assert [r["imported"] for r in got["rows"]] == ["json", "csv"]
    assert all(r["objects"] > 0 and r["full_gc_ms"] >= 0 for r in got["rows"])
    assert got["frozen"]["objects_frozen"] >= got["rows"][-1]["objects"] - 10
    assert len(got["not_imported"]) == 1 and "no_such_module_xyz" in got["not_imported"][0]
    assert "not imported here: no_such_module_xyz" in run.stdout
    assert out.with_suffix(".png").exists()
