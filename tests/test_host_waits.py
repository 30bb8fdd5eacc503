"""profiling.host_waits on synthetic SQLite exports: the calls that hold a range's time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fixtures_profile import LAUNCH_KERNEL, MEMCPY, ProfileBuilder  # noqa: E402

from profiling.host_waits import host_waits, main  # noqa: E402
from profiling.nsys_sqlite import load_sqlite  # noqa: E402

SYNC = "cudaStreamSynchronize_v3020"


def _profile(tmp_path: Path) -> Path:
    b = ProfileBuilder()
    for wait in (3_000_000, 0, 2_500_000):
        with b.range("step:spec:bs1"), b.range("stage:catch_up"):
            b.api(MEMCPY)
            if wait:
                b.api(SYNC, wait)
            for _ in range(4):
                b.api(LAUNCH_KERNEL, kernel="k")
        b.api(LAUNCH_KERNEL, kernel="outside", dur=9_000_000)   # outside every range
    with b.range("step:spec:bs1"), b.range("stage:verify"):
        b.api(SYNC, 5_000_000)
    return b.write_sqlite(tmp_path / "p.sqlite")


def test_the_wait_inside_a_range_is_named_and_others_are_not_counted(tmp_path):
    w = host_waits(load_sqlite(_profile(tmp_path)), "stage:catch_up", min_us=100)
    assert [r.calls for r in w.ranges] == [6, 5, 6]
    assert [r.long_calls for r in w.ranges] == [(("cudaStreamSynchronize", 3000.0),), (),
                                                (("cudaStreamSynchronize", 2500.0),)]
    assert w.ranges[0].duration_us > 3000 > w.ranges[1].duration_us
    top = w.by_api[0]
    assert (top.api, top.count, top.total_us) == ("cudaStreamSynchronize", 2, 5500.0)
    assert {t.api for t in w.by_api} == {"cudaStreamSynchronize", "cudaMemcpyAsync",
                                         "cudaLaunchKernel"}


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "w.json"
    assert main([str(_profile(tmp_path)), "--range", "stage:verify", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1 ranges 'stage:verify'" in text and "cudaStreamSynchronize 5000.0" in text
    assert json.loads(out.read_text())["ranges"][0]["calls"] == 1
    assert main([str(tmp_path / "missing.sqlite")]) == 2

