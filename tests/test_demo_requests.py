"""bench.demo_requests: a demo phase's requests drawn as the demo draws them, and the accept
lengths of the toy chain."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from bench.demo_requests import (chain_draws, first_and_later, first_estimate_slope, main,
                                 phase_requests, sides)
from bench.reference.demo import parser as demo_parser, ramp_phase
from bench.reference.loadgen import PhaseRun


def test_a_step_accepts_its_agreeing_run_at_most_k_and_no_more_than_the_tokens_left():
    p = np.array([1, 2, 3, 0])
    assert chain_draws(p, np.ones(4, bool), 0, 10, 3).draws == [4, 4, 1]
    assert chain_draws(p, np.zeros(4, bool), 0, 10, 3).draws == [1] * 9
    # Agreement after tokens 1 and 2 only: from token p(0)=1 the run is 1, 2, then 3 disagrees.
    agree = np.array([False, True, True, False])
    assert chain_draws(p, agree, 0, 4, 3).draws[0] == 3


def test_the_phase_holds_the_requests_the_demo_admits():
    args = demo_parser().parse_args(["--ramp", "1,4"])
    for index in (0, 1):
        seen = []

        class Recorder:
            num_running = 0

            def take_finished(self):
                return []

            def add_requests(self, prompts, lens):
                seen.extend(zip((int(p[-1]) for p in prompts), lens))
                return SimpleNamespace(rids=list(range(len(seen) - len(lens), len(seen))),
                                       first_tokens=[0] * len(lens))

        phase = ramp_phase(args, args.ramp[index])
        run = PhaseRun(Recorder(), phase, args.hidden, seed=index)
        while run.admitted < phase.num_requests:
            run.advance()
        requests = phase_requests(args, index)
        assert [(r.prompt_end, r.tokens + 1) for r in requests] == seen


def test_it_writes_each_requests_share_of_the_phase(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--phase", "0"]) == 0
    saved = json.loads((tmp_path / "requests.json").read_text())
    assert len(saved["requests"]) == 4 and (tmp_path / "requests.png").stat().st_size > 0
    assert saved["speculation_speedup"] == pytest.approx(
        sum(r["tokens"] for r in saved["requests"]) * 7.02
        / sum(len(r["draws"]) for r in saved["requests"]) / 13.25)
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path), "--phase", "7"])
    assert exit_.value.code == 2 and "--phase 7" in capsys.readouterr().err


def test_a_first_estimate_deserves_a_partial_weight_on_the_half_agreeing_chain():
    """The toy draft agrees on half the tokens: a request's first four draws say something of
    its later ones (short cycles), far from all."""
    args = demo_parser().parse_args([])
    assert 0.2 < first_estimate_slope(*first_and_later(args, 3000)[1:]) < 0.6
    # A draft that always agrees: every first estimate alike, no slope to fit.
    always = demo_parser().parse_args(["--agreement", "f100"])
    assert first_estimate_slope(*first_and_later(always, 200)[1:]) is None
    assert first_estimate_slope(*first_and_later(args, 1)[1:]) is None


def test_on_the_half_agreeing_chain_first_estimates_spread_beyond_noise_only_above():
    """What the controller's weights by side rest on: below the first estimates' mean they
    spread no wider than four draws' noise, and those requests go on to accept about what all
    do; above it they spread wider (short cycles the draft always agrees on)."""
    firsts, first, later = first_and_later(demo_parser().parse_args([]), 3000)
    by_side = sides(firsts, first, later)
    below, above = by_side["below"], by_side["above"]
    assert below["requests"] > above["requests"] > 100
    assert below["spread_beyond_noise"] < 0.05 < 0.2 < above["spread_beyond_noise"]
    assert below["later_mean"] == pytest.approx(np.mean(later), abs=0.15)
    assert above["later_mean"] > below["later_mean"] + 0.1


def test_one_token_outputs_are_refused_in_one_line(tmp_path, capsys):
    """--output-len 1: every output would be the prefill's token, no step to measure."""
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path), "--output-len", "1", "--output-spread", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "an integer >= 2" in err


def test_lengths_the_toy_model_cannot_hold_are_one_line(tmp_path, capsys):
    """As `dgw demo` checks them (toy_context): no traceback from deep in the draws."""
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path), "--output-len", "100000"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "context" in err
