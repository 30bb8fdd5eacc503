"""bench/matrix_sim.py: the SIMULATED matrix serves every cell's requests, says it is simulated,
and the controller, serving the cells in turn, follows the better pinned mode."""

import json
from dataclasses import dataclass

import pytest

from bench import matrix_sim
from bench.capture_lists import DECODE_BS, SPEC_BS
from bench.sglang.matrix_records import Workload
from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.planner import StepPlanner
from dual_graph_worker.core.policy import Decision, Reason
from dual_graph_worker.core.simple_policies import PinnedPolicy


def test_a_wave_serves_every_requested_token_in_either_mode():
    for pin in (Mode.SPEC, Mode.DECODE, None):
        tokens, seconds = matrix_sim.server(pin, 0, 0.02).serve(2.5, 2048, 40, 6)
        assert tokens == 6 * 40 and seconds > 6 * 2048 * matrix_sim.PREFILL_S_PER_TOKEN


def test_forced_acceptance_keeps_its_mean_step_by_step():
    s = matrix_sim.server(Mode.SPEC, 0, 0.0)
    assert [s.accept_len(1.5) for _ in range(6)] == [1, 2, 1, 2, 1, 2]
    assert sum(s.accept_len(3.5) for _ in range(10)) == 35


@dataclass(kw_only=True)
class DecodeThenSpec(PinnedPolicy):
    """Decode for `decode_steps` committed steps, then speculation (a preview counts none)."""
    decode_steps: int = 3
    committed: int = 0

    def decide(self, inputs):
        return Decision(Mode.DECODE if self.committed < self.decode_steps else Mode.SPEC,
                        Reason.PINNED)

    def commit(self, decision):
        self.committed += 1


def test_a_wave_costs_its_prefill_its_steps_and_a_switchs_catch_up():
    """Without noise a wave's seconds add up: plain's prefill without the draft, EAGLE-3's with
    it; the worker deferring the draft's prefill pays it, and what decode steps left, as one
    catch-up on its first speculative step."""
    step = matrix_sim.step_seconds
    prefill = 2 * 64 * matrix_sim.PREFILL_S_PER_TOKEN
    plain = matrix_sim.server(Mode.DECODE, 0, 0.0).serve(2.0, 64, 1, 2)
    eagle = matrix_sim.server(Mode.SPEC, 0, 0.0).serve(2.0, 64, 1, 2)
    assert plain == (2, pytest.approx(prefill + step(Mode.DECODE, 2, 2 * 64)))
    assert eagle == (2, pytest.approx(prefill + 2 * 64 * matrix_sim.DRAFT_S_PER_TOKEN
                                      + step(Mode.SPEC, 2, 2 * 64)))
    s = matrix_sim.server(None, 0, 0.0)
    s.planner = StepPlanner(DispatchTable.build(SPEC_BS, DECODE_BS), DecodeThenSpec())
    tokens, seconds = s.serve(2.0, 64, 8, 2)
    # 3 decode steps, then spec steps of 2, 2 and 1 token a request: 3 + 5 = 8.
    steps = sum(step(Mode.DECODE, 2, 2 * (64 + k)) for k in range(3)) + sum(
        step(Mode.SPEC, 2, 2 * (64 + k)) for k in (3, 5, 7))
    catch_up = matrix_sim.CATCH_UP_FIXED_S + 2 * (64 + 3) * matrix_sim.DRAFT_S_PER_TOKEN
    assert (tokens, seconds) == (16, pytest.approx(prefill + steps + catch_up))


def test_a_kv_only_catch_up_is_priced_as_assumed_from_its_bound_on_and_for_the_worker_alone():
    """DGW_CATCH_UP_KV_ONLY in the sim: a catch-up of passes under KV_ONLY_MIN_TOKENS keeps the
    whole layer's price; a larger one pays its tokens at KV_ONLY_SHARE, each request's last row
    whole, and KV_ONLY_PASS_S a pass; pinned servers never take it."""
    kv = matrix_sim.Settings.from_env({"DGW_CATCH_UP_KV_ONLY": "1"})
    worker, plain = (matrix_sim.server(pin, 0, 0.0, settings=kv) for pin in (None, Mode.DECODE))
    whole = matrix_sim.server(None, 0, 0.0)
    assert worker.kv_only and not plain.kv_only and not whole.kv_only
    assert worker.catch_up_seconds(0, 0) == 0.0
    small = matrix_sim.KV_ONLY_MIN_TOKENS - 1
    assert worker.catch_up_seconds(small, 8) == whole.catch_up_seconds(small, 8) == \
        pytest.approx(matrix_sim.CATCH_UP_FIXED_S + small * matrix_sim.DRAFT_S_PER_TOKEN)
    big = 3 * matrix_sim.CATCH_UP_PASS_TOKENS
    assert worker.catch_up_seconds(big, 256) == pytest.approx(
        matrix_sim.CATCH_UP_FIXED_S + 3 * matrix_sim.KV_ONLY_PASS_S
        + (matrix_sim.KV_ONLY_SHARE * big + 256) * matrix_sim.DRAFT_S_PER_TOKEN)
    assert worker.catch_up_seconds(big, 256) < whole.catch_up_seconds(big, 256) / 2
    # A last pass under the bound runs the whole layer.
    assert worker.catch_up_seconds(big + 100, 256) == pytest.approx(
        worker.catch_up_seconds(big, 256) + 100 * matrix_sim.DRAFT_S_PER_TOKEN)


@pytest.mark.parametrize("previews", [Mode.SPEC, Mode.DECODE])
def test_the_worker_prefills_a_whole_wave_first_and_drafts_as_its_preview_says(previews):
    """A wave of 8 prompts of 2048 tokens is two 8192-token chunks, both prefilled before the
    first decode step (as SGLang runs a waiting prefill first); the worker's draft prefills them
    only where its preview of the grown batch says speculate."""
    seen = []

    @dataclass(kw_only=True)
    class Recording(PinnedPolicy):
        def decide(self, inputs):
            seen.append((inputs.bs, inputs.prefill_tokens))
            return super().decide(inputs)

    s = matrix_sim.server(None, 0, 0.0)
    s.planner = StepPlanner(DispatchTable.build(SPEC_BS, DECODE_BS), Recording(mode=previews))
    tokens, seconds = s.serve(2.0, 2048, 2, 8)
    assert seen[:3] == [(8, 8 * 2048), (8, 4 * 2048), (8, 0)]     # two previews, then a step
    draft = 8 * 2048 * matrix_sim.DRAFT_S_PER_TOKEN if previews is Mode.SPEC else 0.0
    prefill = 8 * 2048 * matrix_sim.PREFILL_S_PER_TOKEN
    step = matrix_sim.step_seconds
    steps = step(previews, 8, 8 * 2048) + (step(previews, 8, 8 * 2049)
                                            if previews is Mode.DECODE else 0.0)
    assert (tokens, seconds) == (16, pytest.approx(prefill + draft + steps))


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


def test_several_seeds_are_summed_up_and_a_setting_reaches_the_worker_alone(tmp_path, capsys,
                                                                           monkeypatch):
    monkeypatch.setattr(matrix_sim, "WORKLOADS", (Workload(64, 32, (1, 4)),))
    out = tmp_path / "m.json"
    assert matrix_sim.main(["--accept", "2", "--seed", "0,7", "--dual-env", "DGW_MARGIN=0.2",
                            "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "seed 7:" in printed and "over 2 seeds" in printed and "DGW_MARGIN" in printed
    data = json.loads(out.read_text())
    assert [s["seed"] for s in data["seeds"]] == [0, 7] and len(data["cells"]) == 4
    assert data["dual_env"] == {"DGW_MARGIN": "0.2"}
    settings = matrix_sim.Settings.from_env(data["dual_env"])
    assert matrix_sim.server(None, 0, 0.0, settings=settings).planner.policy.config.margin == 0.2
    assert matrix_sim.server(None, 0, 0.0).planner.policy.config.margin != 0.2


def test_a_cells_mean_over_seeds_is_its_ratios_mean():
    cells = [{"seed": s, "accept_len": 2.0, "input_len": 64, "output_len": 32,
              "concurrency": 1, "ratio": r} for s, r in ((0, 0.97), (7, 0.99))]
    (cell,) = matrix_sim.mean_over_seeds(cells)
    assert cell["ratio"] == pytest.approx(0.98) and cell["seed"] == [0, 7]


@pytest.mark.parametrize("args, says", [(["--accept", "5"], "accept lengths in 1..4"),
                                        (["--accept", "x"], "--accept wants numbers"),
                                        (["--noise", "2"], "--noise"),
                                        (["--seed", "0,x"], "--seed wants integers"),
                                        (["--seed", "-1"], "--seed wants integers >= 0"),
                                        (["--dual-env", "DGW_MARGN=1"], "did you mean")])
def test_bad_arguments_are_one_line(args, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        matrix_sim.main(args)
    assert exit_.value.code == 2 and says in capsys.readouterr().err
