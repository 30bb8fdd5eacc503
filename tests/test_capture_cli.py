"""The `capture.cli` entry points and the report: files written, exit code 2 on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capture.cli import main
from capture.config import load_capture_config
from capture.distribution import parse_distribution
from capture.measurements import load_measurements
from capture.report import Chosen, graph_table, write_report
from dual_graph_worker.core.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).parent / "data" / "capture" / "synthetic_h200_llama8b_k3.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tune_args(out: Path, **overrides: str) -> list[str]:
    opts = {"--measurements": str(FIXTURE), "--memory-budget": "2GiB", "--time-budget": "10",
            "--distribution": "uniform:1-256", "--accept-len": "3.0", "--out": str(out)}
    opts.update(overrides)
    return ["tune"] + [x for kv in opts.items() for x in kv]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tune") / "config.json"
    assert main(_tune_args(out)) == 0
    return out


def test_tune_writes_a_loadable_config(tuned: Path, capsys) -> None:
    m = load_measurements(FIXTURE)
    config = load_capture_config(tuned, expected_gpu=m.gpu, expected_shape=m.model.shape)
    assert config.spec_bs[-1] == 40 and config.decode_bs[-1] == 256
    assert config.budgets.memory_bytes == 2 << 30 and config.budgets.capture_s == 10.0
    assert config.chosen.memory_bytes <= 2 << 30 and config.chosen.capture_s <= 10.0


def test_tune_prints_the_table(tmp_path: Path, capsys) -> None:
    assert main(_tune_args(tmp_path / "c.json", **{"--memory-budget": "4GiB",
                                                   "--time-budget": "30s"})) == 0
    out, err = capsys.readouterr()
    assert "crossover: speculation pays up to bs=40" in out and "wrote capture config" in out
    assert "memory model: shared pool" in out
    assert "SYNTHETIC" in err


def test_tune_compile_outlier_flag(tmp_path: Path, capsys) -> None:
    raw = json.loads(FIXTURE.read_text())
    first = next(g for g in raw["graphs"] if g["mode"] == "decode" and g["bs"] == 1)
    first["capture_s"] = 2.4                      # one-time compile inside the first capture
    m_path = tmp_path / "m.json"
    m_path.write_text(json.dumps(raw))
    assert main(_tune_args(tmp_path / "on.json", **{"--measurements": str(m_path)})) == 0
    on = " ".join(capsys.readouterr().out.split())
    assert "REPLACED by that median: decode bs=1 2.400 s ->" in on
    assert main(_tune_args(tmp_path / "off.json", **{"--measurements": str(m_path)})
                + ["--no-exclude-compile-outlier"]) == 0
    off = " ".join(capsys.readouterr().out.split())
    assert "kept as measured (--no-exclude-compile-outlier): decode bs=1 2.400 s" in off
    assert load_capture_config(tmp_path / "on.json").exclude_compile_outlier is True
    off_config = load_capture_config(tmp_path / "off.json")
    assert off_config.exclude_compile_outlier is False
    assert off_config.all_candidates.capture_s > load_capture_config(
        tmp_path / "on.json").all_candidates.capture_s + 2.0


@pytest.mark.parametrize("overrides, message", [
    ({"--memory-budget": "4XB"}, "cannot read size '4XB'"),
    ({"--time-budget": "soon"}, "cannot read duration 'soon'"),
    ({"--distribution": "poisson:3"}, "unknown batch-size distribution"),
    ({"--distribution": "uniform:1-512"}, "reaches bs=512"),
    ({"--accept-len": "9"}, "accept length must be in 1..K+1"),
    ({"--memory-budget": "1MiB"}, "over budget"),
    ({"--measurements": "/nonexistent/m.json"}, "cannot read measurements file"),
])
def test_tune_bad_input_exits_2_with_a_message(tmp_path: Path, capsys, overrides,
                                               message: str) -> None:
    assert main(_tune_args(tmp_path / "c.json", **overrides)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "c.json").exists()


def test_usage_errors_exit_2(capsys) -> None:
    for argv in ([], ["tune"], ["tune", "--measurements", str(FIXTURE)], ["frobnicate"],
                 ["tune", "--measurements", str(FIXTURE), "--memory-budget", "1GiB",
                  "--time-budget", "9", "--accept-len", "three"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2


def test_malformed_measurements_exit_2(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "m.json"
    bad.write_text("{not json")
    assert main(_tune_args(tmp_path / "c.json", **{"--measurements": str(bad)})) == 2
    assert "is not valid JSON" in capsys.readouterr().err


def test_module_entry_point_prints_no_traceback(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "capture.cli"] + _tune_args(
        tmp_path / "c.json", **{"--memory-budget": "lots"}), cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "error: cannot read size 'lots'" in proc.stderr


def test_report_with_config_writes_pngs(tuned: Path, tmp_path: Path, capsys) -> None:
    out_dir = tmp_path / "report"
    assert main(["report", "--measurements", str(FIXTURE), "--config", str(tuned),
                 "--out-dir", str(out_dir)]) == 0
    for name in ("memory_capture.png", "waste_vs_graphs.png", "latency.png"):
        data = (out_dir / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    table = (out_dir / "report.txt").read_text()
    assert "spec-bs40" in table and "yes" in table and "SYNTHETIC" in table
    assert "every graph in one shared pool" in table and "isolated sum" in table
    assert "chosen: " in table and "memory model: shared pool" in table
    assert "wrote" in capsys.readouterr().out


def test_report_refuses_a_config_from_other_measurements(tuned: Path, tmp_path: Path,
                                                         capsys) -> None:
    raw = json.loads(FIXTURE.read_text())
    raw["gpu"]["name"] = "NVIDIA B200"
    raw["gpu"]["compute_capability"] = "10.0"
    other = tmp_path / "b200.json"
    other.write_text(json.dumps(raw))
    assert main(["report", "--measurements", str(other), "--config", str(tuned),
                 "--out-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "was tuned on 'NVIDIA H200' (SM90) but this GPU is 'NVIDIA B200' (SM100)" in err


def test_report_needs_an_accept_length_without_config(tmp_path: Path, capsys) -> None:
    assert main(["report", "--measurements", str(FIXTURE), "--out-dir", str(tmp_path)]) == 2
    assert "--accept-len" in capsys.readouterr().err


def test_report_of_measurements_alone(tmp_path: Path) -> None:
    m = load_measurements(FIXTURE)
    files = write_report(m, tmp_path, parse_distribution("geometric", 256), 2.0)
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in files[1:])
    assert "-" in graph_table(m) and "yes" not in graph_table(m)
    chosen_table = graph_table(m, Chosen((4, 8), (8, 256)))
    assert chosen_table.count("yes") == 4


def test_pool_table_sets_each_pools_memory_and_capture_against_its_padding_waste() -> None:
    from capture.report import pool_table

    m = load_measurements(FIXTURE)
    dist = parse_distribution("uniform:1-256", 256)
    rows = pool_table(m, dist, 2.0, Chosen((4, 8), (8, 256))).splitlines()[1:]
    spec_all, spec_chosen, decode_all, decode_chosen = (r.split() for r in rows)
    assert spec_chosen[-2:] == ["chosen:", "4,8"] and spec_all[-2] == "all:"
    assert decode_chosen[-2:] == ["chosen:", "8,256"] and decode_all[-2] == "all:"
    # Fewer graphs: less capture time, more padding per step.
    assert int(decode_chosen[1]) == 2 < int(decode_all[1])
    assert float(decode_chosen[-4]) < float(decode_all[-4])
    assert float(decode_chosen[-3]) > float(decode_all[-3])
    # Without a config, the pools' tops come from the crossover.
    assert len(pool_table(m, dist, 2.0).splitlines()) == 3


@pytest.mark.parametrize("extra, why", [
    (["--accept-len", "1.0"], "speculation wins at no measured batch size at accept length 1"),
    (["--accept-len", "3.0", "--distribution", "uniform:1-512"],
     "the distribution reaches bs=512, above the largest measured decode size 256"),
])
def test_report_without_config_falls_back_to_the_largest_sizes(tmp_path: Path, extra,
                                                                why: str) -> None:
    # Inputs the tuner refuses still make a report, its pool tops the largest measured sizes.
    out_dir = tmp_path / "r"
    assert main(["report", "--measurements", str(FIXTURE), "--out-dir", str(out_dir)]
                + extra) == 0
    text = " ".join((out_dir / "report.txt").read_text().split())
    assert "pool tops: each mode's largest measured size (spec 128, decode 256)" in text
    assert why in text
    assert all((out_dir / n).read_bytes().startswith(PNG_MAGIC)
               for n in ("memory_capture.png", "waste_vs_graphs.png", "latency.png"))


def test_report_refuses_bad_input_before_making_its_folder(tuned: Path, tmp_path: Path,
                                                          capsys) -> None:
    out_dir = tmp_path / "r"
    assert main(["report", "--measurements", str(FIXTURE), "--accept-len", "9",
                 "--out-dir", str(out_dir)]) == 2
    assert "accept length must be in 1..K+1" in capsys.readouterr().err
    chosen = Chosen((4, 8, 999), (8, 256))
    with pytest.raises(ConfigError, match="never measured"):
        write_report(load_measurements(FIXTURE), out_dir, parse_distribution("uniform:64", 256),
                     3.0, chosen)
    assert not out_dir.exists()


def test_pool_table_counts_capture_time_as_graph_table_does(tmp_path: Path) -> None:
    from capture.report import pool_table

    raw = json.loads(FIXTURE.read_text())
    first = next(g for g in raw["graphs"] if g["mode"] == "decode" and g["bs"] == 1)
    first["capture_s"] = 2.4                      # one-time compile inside the first capture
    (tmp_path / "m.json").write_text(json.dumps(raw))
    m = load_measurements(tmp_path / "m.json")
    dist, chosen = parse_distribution("uniform:1-256", 256), Chosen((4, 8), (1, 8, 256))

    def pools_capture(exclude: bool) -> float:
        rows = pool_table(m, dist, 2.0, chosen, exclude).splitlines()[1:]
        return sum(float(r.split()[-4]) for r in rows if "chosen:" in r)

    def table_capture(exclude: bool) -> float:
        note = " ".join(graph_table(m, chosen, exclude).split())
        return float(note.split("chosen: ")[1].split(" s capture")[0].split()[-1])

    for exclude in (True, False):
        assert pools_capture(exclude) == pytest.approx(table_capture(exclude), abs=0.011)
    assert pools_capture(False) > pools_capture(True) + 2.0


def test_tune_writes_under_out_by_default() -> None:
    from capture.cli import build_parser

    args = build_parser().parse_args(_tune_args(Path("unused"))[:-2])
    assert args.out == "out/capture/config.json"
