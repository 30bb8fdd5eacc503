"""bench/burst_sim.py: the SIMULATED burst runs, says it is simulated, and writes its files."""

import json

import pytest

from bench import burst_sim
from dual_graph_worker.core.modes import Mode


def test_burst_sim_writes_a_labelled_result(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert burst_sim.main(["--accept", "3", "--requests", "32", "--concurrency", "16",
                           "--out", str(out)]) == 0
    assert "SIMULATED" in capsys.readouterr().out
    data = json.loads(out.read_text())
    row = data["rows"][0]
    assert data["simulated"] and row["spec_steps"] <= row["steps"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_every_run_serves_every_request():
    w = burst_sim.Workload(requests=24, concurrency=8, input_len=64, output_len=30, accept=3)
    spec, decode = (burst_sim.simulate(w, pin) for pin in (Mode.SPEC, Mode.DECODE))
    dual, steady = burst_sim.simulate(w), burst_sim.simulate(w, steady_share=True)
    assert spec.tokens == decode.tokens == dual.tokens == steady.tokens == 24 * 30
    assert set(spec.modes) == {"s"} and set(decode.modes) == {"d"}


def test_the_ablation_holds_the_prompt_share_at_the_workloads():
    w = burst_sim.Workload(requests=64, concurrency=32, input_len=512, output_len=128)
    assert set(burst_sim.simulate(w, steady_share=True).prompt_per_output[1:]) == {4.0}
    assert max(burst_sim.simulate(w).prompt_per_output) > 4.0      # the burst's transient


def test_bad_accept_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        burst_sim.main(["--accept", "9"])
    assert exit_.value.code == 2 and "--accept in 1..4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        burst_sim.main(["--concurrency", "600"])
    assert "--concurrency in 1..256" in capsys.readouterr().err
