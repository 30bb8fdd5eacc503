"""bench/matrix_sim.py: the SIMULATED matrix serves every cell's requests, says it is simulated,
and the controller, serving the cells in turn, follows the better pinned mode."""

import json

import pytest

from bench import matrix_sim
from bench.sglang.matrix_records import Workload
from dual_graph_worker.core.modes import Mode


def test_a_wave_serves_every_requested_token_in_either_mode():
    for pin in (Mode.SPEC, Mode.DECODE, None):
        tokens, seconds = matrix_sim.server(pin, 0, 0.02).serve(2.5, 2048, 40, 6)
        assert tokens == 6 * 40 and seconds > 6 * 2048 * matrix_sim.PREFILL_S_PER_TOKEN


def test_the_controller_follows_the_crossover_over_cells_served_in_turn():
    """Speculation wins at accept 3.5 C=1 and decode at accept 1.5 C=256 (the step lines say
    so); one controller serving both cells in turn, from an optimistic prior, comes within 3%
    of the better pinned mode in each."""
    cells = matrix_sim.simulate([3.5, 1.5], 0, 0.0, (Workload(256, 256, (1, 256)),))
    by = {(c["accept_len"], c["concurrency"]): c for c in cells}
    assert by[3.5, 1]["eagle3"] > by[3.5, 1]["plain"] and by[1.5, 256]["plain"] > \
        by[1.5, 256]["eagle3"]
    assert all(c["ratio"] >= 0.97 for c in cells)


def test_the_matrix_sim_writes_a_labelled_result(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(matrix_sim, "WORKLOADS", (Workload(64, 32, (1, 4)),))
    out = tmp_path / "m.json"
    assert matrix_sim.main(["--accept", "2", "--out", str(out)]) == 0
    assert "SIMULATED" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["simulated"] and len(data["cells"]) == 2 and "SIMULATED" in data["note"]
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("args, says", [(["--accept", "5"], "--accept in 1..4"),
                                        (["--accept", "x"], "--accept wants numbers"),
                                        (["--noise", "2"], "--noise in 0..0.5")])
def test_bad_arguments_are_one_line(args, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        matrix_sim.main(args)
    assert exit_.value.code == 2 and says in capsys.readouterr().err
