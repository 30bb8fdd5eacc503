"""profiling.stall_report's outputs: the JSON through write_json, the PNG without pyplot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run_dir(tmp_path: Path) -> Path:
    steps = [{"event": "ready", "t": 100.0},
             {"step": 0, "mode": "spec", "bs": 1, "t": 101.0},
             {"step": 1, "mode": "decode", "bs": 128, "t": 109.6}]
    (tmp_path / "steps-dual-bench.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    sample = {"t": 103.0, "gap_s": 2.0, "steps": 1, "stack": ["/x/worker.py:1 step"]}
    (tmp_path / "stall-dual-bench.jsonl").write_text(json.dumps(sample) + "\n")
    return tmp_path


def test_stall_report_plots_without_pyplot(tmp_path):
    # pyplot keeps a global figure registry and backend; a fresh interpreter shows whether the
    # report loaded it.
    run_dir = _run_dir(tmp_path)
    code = ("import sys; from profiling.stall_report import main; "
            f"rc = main([{str(run_dir)!r}]); "
            "sys.exit(rc or int('matplotlib.pyplot' in sys.modules) * 3)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "stall_timeline.png").read_bytes().startswith(PNG_MAGIC)
    assert f"wrote {run_dir / 'stall_report.json'} and {run_dir / 'stall_timeline.png'}" \
        in proc.stdout


def test_stall_report_json_is_written_through_write_json(tmp_path, monkeypatch):
    # write_json writes a temporary file and renames it: a reader never sees half a report.
    import profiling.stall_report as stall_report
    from dual_graph_worker.core.jsonio import write_json

    written = []
    monkeypatch.setattr(stall_report, "write_json",
                        lambda data, path: (written.append(Path(path)), write_json(data, path)))
    run_dir = _run_dir(tmp_path)
    assert stall_report.main([str(run_dir)]) == 0
    assert written == [run_dir / "stall_report.json"]
    assert json.loads(written[0].read_text())["episodes"][0]["samples"] == 1
