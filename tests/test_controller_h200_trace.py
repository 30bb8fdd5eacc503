"""The controller's step-time estimates fed the worker's real H200 step costs: every timed decode
step of a policy-matrix run in order (tests/data/h200_run{5,6,7,8}_step_costs.json.gz). Run 5's worker
read no context on SGLang (its contexts here are reconstructed from each cell), so its estimate
for a size came from whatever prompts that size last served: the four worst cells of that run.
Runs 6-8's worker counted each request's context itself; their traces carry what it counted."""

from __future__ import annotations

import copy
import functools
import gzip
import json
import statistics
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from dual_graph_worker.core.controller import ControllerConfig, GoodputController
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import PrefillTime, StepTime, same_rank

from bench.sglang.traces import controller_for, exchanged_after

ROOT = Path(__file__).resolve().parents[1]
MODE = {"s": Mode.SPEC, "d": Mode.DECODE}


@functools.lru_cache(maxsize=None)
def trace(run: int) -> dict:
    return json.loads(gzip.open(ROOT / f"tests/data/h200_run{run}_step_costs.json.gz",
                                "rt").read())


def starts(run: int) -> dict[tuple, int]:
    return {tuple(c[:4]): c[4] for c in trace(run)["cells"]}


def _controller(run: int) -> GoodputController:
    t = trace(run)
    return GoodputController(ControllerConfig(t["num_steps"]),
                             {Mode.SPEC: t["spec_bs"], Mode.DECODE: t["decode_bs"]})


def _replay(run: int, with_context: bool, at_step=lambda k, p: None) -> None:
    """Feed the run's steps in order, exchanging where the worker does (every 8th plan);
    `at_step(k, p)` sees the controller before step k is observed."""
    p = _controller(run)
    for k, (mode, pb, seconds, caught, carries, kv) in enumerate(trace(run)["steps"]):
        at_step(k, p)
        p.observe(StepTime(MODE[mode], pb, seconds, caught, bool(carries),
                           kv if with_context else 0))
        if exchanged_after(k + 1, 8):
            p.exchange(same_rank)


@functools.lru_cache(maxsize=4)
def at_cell_starts(run: int, with_context: bool) -> dict[int, GoodputController]:
    """The controller copied (after an exchange) at every cell's start."""
    first, out = set(starts(run).values()), {}

    def snap(k, p):
        if k in first:
            out[k] = copy.deepcopy(p)
            out[k].exchange(same_rank)
    _replay(run, with_context, snap)
    return out


def measured_ms(cell: tuple, mode: str, pb: int, run: int = 5) -> float:
    """A run's median step of (mode, pb) inside `cell`, plain steps only."""
    s = starts(run)
    start = s[cell]
    end = min([v for v in s.values() if v > start] or [len(trace(run)["steps"])])
    steps = [sec for m, b, sec, caught, carries, _ in trace(run)["steps"][start:end]
             if m == mode and b == pb and not caught and not carries]
    return 1e3 * statistics.median(steps)


# (cell the estimate is taken before, its key and context a request), (cell whose steps measured
# that key over such prompts)
CASES = [
    (((3.5, 256, 256, 16), "s", 16, 384), (2.0, 256, 256, 16)),    # run 5: 0.63
    (((3.5, 256, 256, 64), "d", 64, 384), (2.0, 256, 256, 64)),    # run 5: 0.89
    (((3.0, 2048, 64, 16), "s", 16, 2080), (3.0, 2048, 64, 16)),   # run 5: 0.92
    (((3.5, 2048, 64, 64), "s", 64, 2080), (3.5, 2048, 64, 64)),   # run 5: 0.87
]


@pytest.mark.parametrize("where, truth", CASES)
def test_run5_estimates_follow_the_context_of_the_cell_at_hand(where, truth):
    cell, mode, pb, per_request = where
    want = measured_ms(truth, mode, pb)
    kv = pb * per_request
    got = 1e3 * at_cell_starts(5, True)[starts(5)[cell]].step_time(MODE[mode], pb, kv)
    blind = 1e3 * at_cell_starts(5, False)[starts(5)[cell]].step_time(MODE[mode], pb, kv)
    assert got == pytest.approx(want, rel=0.15), (got, want)
    # What run 5's worker believed: off by about 2x, one way or the other.
    assert max(blind / want, want / blind) > 1.8, (blind, want)


def test_run7_a_long_context_spec_step_is_priced_at_its_modes_long_context_rate():
    """Accept 3.5, 2048 in / 64 out, C=16: run 7's worker priced the spec step at bs 16 over 33k
    context tokens from its line over 4-8k (21.8 ms) and speculated; it took ~26 ms. Beyond the
    contexts a size has seen, the mode's rate (fitted where contexts were long) prices it."""
    cell = (3.5, 2048, 64, 16)
    want = measured_ms(cell, "s", 16, run=7)
    p = at_cell_starts(7, True)[starts(7)[cell]]
    got = 1e3 * p.step_time(Mode.SPEC, 16, 16 * 2080)
    decode = 1e3 * p.step_time(Mode.DECODE, 16, 16 * 2080)
    assert want > 24.0 and got == pytest.approx(want, rel=0.12), (got, want)   # was 20% low
    # Decode wins by a margin now (measured: by 20%), not by a hair (0.6% with the old line).
    assert 3.5 / got < 0.95 / decode


# run: (right with the context at least, right blind at most); measured 49 / 43, 49 / 41,
# 51 / 44 and 49 / 44 (runs 7 and 8 have 51 and 49 such cells).
PICKS = {5: (48, 44), 6: (48, 44), 7: (50, 45), 8: (49, 45)}
CELLS = {5: 50, 6: 50, 7: 51, 8: 49}


@pytest.mark.parametrize("run", sorted(PICKS))
def test_at_every_cells_start_the_estimates_pick_the_faster_engine(run):
    """With each cell's forced accept length, `speculate iff C a / t_spec > C / t_decode` (step
    times only: no prompt or switch costs) against the faster of plain and EAGLE-3 in that run,
    over the cells whose winner leads by 10% or more. The miss with the context, in runs 5 and
    6, is accept 1.5 C=8, where prompt costs decide."""
    matrix = json.loads((ROOT / f"results/sglang/policy-matrix-run{run}/policy-matrix.json")
                        .read_text())
    t = trace(run)
    right = {True: 0, False: 0}
    cells = [c for c in matrix["cells"]
             if max(c["eagle3"], c["plain"]) >= 1.1 * min(c["eagle3"], c["plain"])]
    for c in cells:
        key = (c["accept_len"], c["input_len"], c["output_len"], c["concurrency"])
        n = c["concurrency"]
        best = Mode.SPEC if c["eagle3"] > c["plain"] else Mode.DECODE
        if n > max(t["spec_bs"]):
            for with_context in right:
                right[with_context] += best is Mode.DECODE    # no spec graph: decode either way
            continue
        spec_pb = min(b for b in t["spec_bs"] if b >= n)
        decode_pb = min(b for b in t["decode_bs"] if b >= n)
        kv = n * (c["input_len"] + c["output_len"] // 2)
        for with_context in right:
            p = at_cell_starts(run, with_context)[starts(run)[key]]
            ts = p.step_time(Mode.SPEC, spec_pb, kv)
            td = p.step_time(Mode.DECODE, decode_pb, kv)
            pick = Mode.SPEC if n * c["accept_len"] / ts > n / td else Mode.DECODE
            right[with_context] += pick is best
    least, most_blind = PICKS[run]
    assert len(cells) == CELLS[run]
    assert right[True] >= least and right[False] <= most_blind, right


@pytest.mark.parametrize("run", [6, 7, 8])
def test_estimates_after_a_move_follow_the_context(run):
    """The estimate for the 2nd-4th step at a (mode, padded bs) after a step at another one (the
    first is a transition), at sizes measured before: where a decision rests on an estimate
    taken under other prompts. Measured with the context: median 4.6%, 3.3% and 2.5% off, 12%,
    5% and 7.5% of them more than 20% off (runs 6, 7, 8); blind to it, 7.5% / 27%, 5.7% / 21%
    and 3.8% / 17%."""
    errors = {}
    for with_context in (True, False):
        out, last = [], {"key": None, "since": 0}

        def check(k, p, out=out, last=last, with_context=with_context):
            mode, pb, seconds, caught, carries, kv = trace(run)["steps"][k]
            last["since"] = last["since"] + 1 if (mode, pb) == last["key"] else 0
            last["key"] = (mode, pb)
            if 1 <= last["since"] <= 3 and not caught and not carries and \
                    pb in p.estimates().step_times.step_s[MODE[mode].value]:
                guess = p.step_time(MODE[mode], pb, kv if with_context else 0)
                out.append(abs(guess - seconds) / seconds)
        _replay(run, with_context, check)
        errors[with_context] = np.asarray(out)
    got, blind = errors[True], errors[False]
    assert len(got) > 400
    assert np.median(got) < 0.06 and np.mean(got > 0.2) < 0.15
    assert np.mean(blind > 0.2) > 2 * np.mean(got > 0.2)


def _replay_http(prior: bool, with_batch_size: bool = True, run: int = 3,
                 draft_share: Optional[float] = None):
    """Every batch cost of an H200 HTTP run (tests/data/h200_http_fa3_run{3,4}_costs.json.gz,
    made with `python -m bench.sglang.step_costs LOG --trace`) fed in order to a controller
    (with the run's start-up prior or none; `draft_share` for the worker's) that exchanges
    where the worker does (exchanged_after); yields (controller, step, its context tokens)
    after each step's cost.
    Without the batch size, a carry counts whatever the batch did between the two steps."""
    t = json.loads(gzip.open(ROOT / f"tests/data/h200_http_fa3_run{run}_costs.json.gz",
                             "rt").read())
    if draft_share is not None:
        t["draft_share"] = draft_share
    p = controller_for(t, prior)
    step = 0
    for row in t["costs"]:
        if row[0] == "p":
            p.observe(PrefillTime(row[1], row[2], bool(row[3])))
            continue
        mode, pb, seconds, caught, carries, kv, bs = row
        p.observe(StepTime(MODE[mode], pb, seconds, caught, bool(carries), kv,
                           bs if with_batch_size else 0))
        yield p, step, kv
        step += 1
        if exchanged_after(step, 8):
            p.exchange(same_rank)


def _draft_rates_over_http(with_batch_size: bool, draft_share: Optional[float] = None
                           ) -> list[float]:
    """The draft's seconds per token (the catch-up rate the controller prices a switch into
    speculation with) after each exchange."""
    return [p.catch_up_s_per_token()
            for p, step, _ in _replay_http(False, with_batch_size, draft_share=draft_share)
            if step and exchanged_after(step, 8)]


def test_over_http_a_stall_beside_a_catch_up_does_not_pass_for_the_drafts_rate():
    """On the H200 over HTTP at C=128 the step before a 2018-token catch-up also processed 87
    finished requests: counted as the catch-up's, it put the draft at 5.9-7 us a token for a
    minute of serving (the run's own log), where its catch-ups say under 1. With the batch size
    a carry across a change of batch is dropped and the rate stays at 0-1.3 us a token (0 while
    the catch-ups' sizes give no rising line; 0.8 at most before lone stalls were held back
    from step times: a carried excess is now measured against a step without them). The
    draft's share of the weights also holds that catch-up back, as a lone one dearer a token
    than twice the share; without the share (a cap at a third of a prefill token) only the
    batch size does."""
    blind = _draft_rates_over_http(with_batch_size=False, draft_share=0.0)
    seen = _draft_rates_over_http(with_batch_size=True, draft_share=0.0)
    assert max(blind) > 5e-6
    assert 0 < max(seen) < 2e-6
    assert seen[-1] == pytest.approx(blind[-1], rel=0.2)     # the same rate once data is plenty
    assert 0 < max(_draft_rates_over_http(with_batch_size=False)) < 2e-6


def test_over_http_speculation_at_bs_128_is_not_written_off_by_a_slope_from_a_few_steps():
    """The same run's costs with its start-up prior: its first spec steps at bs 128 came over
    37-41k context tokens, then the batch decoded while contexts grew to 56k. EAGLE-3 beat plain
    there (12118 against ~9800 tok/s); a slope fitted to those few steps had the controller
    expect a spec step of 44-112 ms (18-20 ms measured), so it decoded 238 steps."""
    expected = {step: (3 * 128 / p.step_time(Mode.SPEC, 128, kv),
                       128 / p.step_time(Mode.DECODE, 128, kv))
                for p, step, kv in _replay_http(prior=True) if step in (800, 900, 1000)}
    assert all(spec > decode for spec, decode in expected.values()), expected


def test_over_http_a_lone_stall_at_a_new_size_does_not_price_speculation_out():
    """HTTP run 4 at C=128: when 22 requests finished, the batch's first step at spec bs 112
    took 135 ms (its neighbours 18-20 ms). As that size's first sample it made a spec step read
    41 ms, and the worker decoded the 117 steps left of the level, where EAGLE-3 speculated.
    Held back as a lone stall, the size reads ~18 ms and speculation stays ahead."""
    expected = [(3 * 105 / p.step_time(Mode.SPEC, 112, kv), 105 / p.step_time(Mode.DECODE, 112, kv))
                for p, step, kv in _replay_http(prior=True, run=4) if 736 <= step <= 840]
    assert len(expected) == 105
    assert all(spec > 1.2 * decode for spec, decode in expected), min(expected)


@pytest.mark.parametrize("path", ["policy-matrix-fa3-run5/costs-m5.json.gz",
                                  "policy-matrix-fa3-run6/costs-m7.json.gz",
                                  "policy-matrix-fa3-run6/costs-m8.json.gz"])
def test_a_batchs_first_decode_estimate_is_near_what_its_steps_then_take(path):
    """Fa3 matrix runs 5 and 6, open loop: at each batch's first step, the decode step expected
    against the median of that batch's own decode steps. A batch's first and last steps (short
    after its prefill; long, then cut short, as its requests finish) passed for a context rate of
    1.2 us a token and put estimates up to 31% low (mean 6-11%); held back, 5-6% (at most 14%).
    `python -m bench.sglang.estimate_error` tables both modes."""
    from bench.sglang.estimate_error import cell_errors, summary

    t = json.loads(gzip.open(ROOT / "results/sglang" / path, "rt").read())
    decode = summary(cell_errors(t))["decode"]
    assert decode["mean_abs"] < 0.065 and decode["max_abs"] < 0.15, decode


def test_a_cells_growing_context_is_most_of_its_first_step_decode_error():
    """H100 run 11: at a cell's first step the decode step expected reads ~8% under the median
    of the steps that follow, whose context has grown meanwhile; expected at those steps' own
    median context, it is within a few percent and near unbiased."""
    from bench.sglang.estimate_error import cell_errors, summary

    t = json.loads(gzip.open(ROOT / "results/sglang/policy-matrix-h100-run11/costs-m94.json.gz",
                             "rt").read())
    decode = summary(cell_errors(t))["decode"]
    assert decode["mean_signed"] < -0.05 and abs(decode["mean_signed_at_steps"]) < 0.03, decode
    assert decode["mean_abs_at_steps"] < decode["mean_abs"] / 1.5, decode


def test_estimate_error_names_a_file_that_is_no_trace(tmp_path, capsys):
    from bench.sglang.estimate_error import main

    bad = tmp_path / "x.json.gz"
    bad.write_bytes(b"not gzip")
    assert main([str(bad), "--out", str(tmp_path / "e.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "--trace" in err


def test_estimate_error_over_several_traces_ends_with_their_pooled_cells(tmp_path, capsys):
    from bench.sglang.estimate_error import main

    paths = [str(ROOT / "results/sglang" / p) for p in ("policy-matrix-fa3-run6/costs-m7.json.gz",
                                                        "policy-matrix-fa3-run6/costs-m8.json.gz")]
    assert main([*paths, "--out", str(tmp_path / "e.json")]) == 0
    rows = capsys.readouterr().out.splitlines()
    counts = [int(r.split("|")[3]) for r in rows if r.startswith("| costs-m") and "| spec |" in r]
    pooled = next(r for r in rows if r.startswith("| all 2 traces | spec |"))
    assert int(pooled.split("|")[3]) == sum(counts) > 0
    saved = json.loads((tmp_path / "e.json").read_text())["summary"]["spec"]
    assert saved["cells"] == sum(counts)
    assert (tmp_path / "e.png").stat().st_size > 0


def test_catch_up_fits_over_every_gpu_run_stay_near_the_drafts_rate(capsys, tmp_path):
    """The open-loop replay of runs 10-13's costs: a lone catch-up's first call at its shape
    made the fitted rate 20-67 us a token in runs 10, 12 and 13 (the draft's own is ~0.6), the
    fault run 10's note names; held back, no fit passes 5 us but run 12's (12.44 at the
    worker's exchange phase; 4.5 a step later), a line through its first three small bs-1
    catch-ups at switches (32, 380 and 100 tokens, 9-12 ms over a step with a switch's costs
    riding on them), which the draft's cap stops at the sizes it saw. Run 11's steepest (7.11)
    is no first call either: small catch-ups read below a step early on pull the young line's
    intercept down."""
    from bench.sglang.catch_up_fit import fit_history, main

    def steepest(path):
        t = json.loads(gzip.open(ROOT / "results/sglang" / path, "rt").read())
        return max(h["us_per_token"] for h in fit_history(t))

    for path, most in (("policy-matrix-fa3-run10/costs-m21.json.gz", 5),
                       ("policy-matrix-fa3-run12/m27/costs-m27.json.gz", 15),
                       ("policy-matrix-fa3-run13/m31/costs-m31.json.gz", 5),
                       ("policy-matrix-fa3-run13/m32/costs-m32.json.gz", 5)):
        assert steepest(path) < most, path
    fits = tmp_path / "fits.json"
    assert main([str(ROOT / "results/sglang/policy-matrix-fa3-run11/costs-m26.json.gz"),
                 "--out", str(fits)]) == 0
    out = capsys.readouterr().out
    assert "| costs-m26.json.gz |" in out and "| 7.11 (799, 0.56)" in out
    history = next(iter(json.loads(fits.read_text())["histories"].values()))
    assert max(h["us_per_token"] for h in history) == pytest.approx(7.11, abs=0.005)
    assert fits.with_suffix(".png").stat().st_size > 0
    assert main(["/nonexistent.json.gz", "--out", str(fits)]) == 2


def _step_rows(path: str):
    """A filed trace's step rows fed to the controller in order, open loop: (the controller
    before it takes the row, the steps so far this one included, the row, whether a prefill
    came just before)."""
    from bench.sglang.traces import read_trace, replay

    steps, after_prefill = 0, False
    for p, _, row in replay(read_trace(str(ROOT / "results/sglang" / path))):
        if row[0] == "p":
            after_prefill = True
            continue
        steps += 1
        yield p, steps, row, after_prefill
        after_prefill = False


def test_a_size_measured_twice_at_start_up_does_not_keep_speculation_out():
    """Run 14's m35, open loop: spec bs 16 was measured twice in the process's first ~90 steps
    (7.9 ms; bs 8 and 32 then read ~6.7 for hundreds of steps). At accept 1.5 C=16 the worker
    decoded all three rounds (0.923 of EAGLE-3) on that estimate: never re-measured, it priced
    a speculative token above a decode one. Leaning on its neighbours, it is priced below
    from the second round on (steps 2400-2700; the first round ran while bs 32 still read its
    own start-up 8.6 ms)."""
    priced = []
    for p, steps, row, _ in _step_rows("policy-matrix-fa3-run14/m35/costs-m35.json.gz"):
        if 2400 <= steps < 2700 and row[:2] == ["d", 16]:
            kv = row[5]
            priced.append(p.step_time(Mode.SPEC, 16, kv) / (16 * 1.5)
                          / (p.step_time(Mode.DECODE, 16, kv) / 16))
    assert len(priced) > 100
    assert max(priced) < 0.95, max(priced)


def test_a_large_catch_up_is_not_priced_on_small_ones_scatter():
    """Run 14, open loop: small catch-ups' scatter (bs-1 catch-ups over long contexts, a switch's
    costs riding on them) fitted 17-23 us a token, which priced a 12800-token catch-up at 225 ms
    (m33) and 307 (m35), and a re-measurement of speculation at C=32 at ~50 steps of debt; one
    of 10336 tokens took 27 ms there. Past the sizes the line has seen, a token costs no more
    than twice the draft's share of a prefill token's (the matrix's model pair: 4%): 34 and
    31 ms (40 and 88 at a third of a prefill token's, with the process's first prefill, 2 s for
    32 tokens, in the prefill line)."""
    from bench.sglang.traces import read_trace, replay

    for call, most in (("m33", 0.036), ("m35", 0.036)):
        t = read_trace(str(ROOT / f"results/sglang/policy-matrix-fa3-run14/{call}/"
                                  f"costs-{call}.json.gz"))
        priced = [p.catch_up_seconds(12800) for p, _, row in replay(t) if row[0] != "p"]
        assert max(priced) < most, (call, max(priced))


def test_a_spells_estimate_does_not_outlive_the_spell():
    """Run 15's m36, open loop: a slow spell left spec bs 32 at 8.26 ms (steady ~7.9) and, at
    accept 2, spec bs 1 at 10.1 ms (steady 6.5) when decoding took over, and no new sample
    corrected either: accept 1.5 C=32 decoded two rounds (0.951 of EAGLE-3) and accept 2 C=1
    one (210 against 291 tok/s). Relaxing toward its typical level while unmeasured, each is
    priced below decode at those batches' first steps."""
    # (first step, last step, padded bs, context tokens, forced accept length) of the batches
    checks = [(2000, 4000, 32, 8192, 1.5), (7000, 7200, 1, 256, 2.0)]
    priced = []
    for p, steps, row, batch_start in _step_rows("policy-matrix-fa3-run15/m36/costs-m36.json.gz"):
        for lo, hi, pb, kv, accept in checks:
            if batch_start and lo <= steps < hi and row[1] == pb and row[5] == kv:
                priced.append(p.step_time(Mode.SPEC, pb, kv) / accept
                              / p.step_time(Mode.DECODE, pb, kv))
    assert len(priced) == 3, priced
    assert max(priced) < 0.97, priced


def test_a_re_measurement_split_by_an_exchange_prices_speculation_as_it_ran():
    """Run 27's m72, open loop: at accept 1.5 2048x64 C=1 the first round re-measured spec bs
    1 (known only from the process's first steps, 8.5 ms) at 6.75 and 6.79 ms with an exchange
    between the two, each folded as one EMA step: 7.9 ms, and decode (5.0 ms) served the
    round's last 51 steps where speculation was 10% faster. The lone first sample now waits
    for the second, and the pair replaces the estimate."""
    priced = []
    for p, steps, row, _ in _step_rows("policy-matrix-fa3-run27/m72/costs-m72.json.gz"):
        if 956 <= steps < 1001 and row[:2] == ["d", 1]:
            kv = row[5]
            priced.append(p.step_time(Mode.SPEC, 1, kv) / 1.5 / p.step_time(Mode.DECODE, 1, kv))
    assert len(priced) == 45
    assert max(priced) < 0.95, max(priced)


def test_a_re_measurement_whose_first_step_read_short_does_not_buy_a_switch():
    """H100 run 13, accept 1.5 256x256 C=64: the re-measurement's first clean step after its
    catch-up read 9.0 ms, the next 11.7, with an exchange between them. Both folded, spec bs 64
    read 10.4 ms where it then ran 11.7, and the worker speculated 41 steps of a near-tie that
    decoding won (0.975 of plain). Held through the exchange and taken back, it reads no
    cheaper than speculation ran."""
    from bench.sglang.traces import read_trace
    from bench.sglang.re_measure_error import ratios

    trace = read_trace(str(ROOT / "results/sglang/policy-matrix-h100-run13/costs-m99.json.gz"))
    at_64 = [r["ratio"] for r in ratios(trace) if r["padded_bs"] == 64]
    assert len(at_64) == 1 and at_64[0] > 0.95, at_64


M107 = "results/sglang/kv-only-h100-m107/costs-m107.json.gz"


def test_kv_only_catch_ups_leave_the_draft_prefill_rate_to_the_whole_layers():
    """H100 m107, K/V-only catch-ups on, open loop: the draft's prefill rate (the whole
    layer's, as SGLang's draft extend of a prompt runs it) comes from catch-ups that ran the
    whole layer. Fitted on one line with the K/V-only ones (their tokens at the layer's share of
    multiply-adds), it read over 2 us a token, twice and more the layer's ~0.9, at 15% of the
    run's steps; on lines of their own, 4%."""
    from bench.sglang.traces import read_trace, replay

    t = read_trace(str(ROOT / M107))
    rates = [p.draft_prefill_s_per_token() for p, _, _ in replay(t)]
    rates = [r for r in rates if r > 0]
    assert sum(r > 2e-6 for r in rates) < 0.08 * len(rates)
    assert sum(0.6e-6 <= r <= 1.2e-6 for r in rates) > 0.78 * len(rates)


def test_catch_up_fit_tables_kv_only_catch_ups_apart(tmp_path, capsys):
    """A trace whose worker filled the draft's K/V alone (m107): those catch-ups' prices get a
    row of their own, and the fits their own line."""
    from bench.sglang.catch_up_fit import main

    out = tmp_path / "c.json"
    assert main([str(ROOT / M107), "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert set(got["price_summary"]) == {"< 8192 tokens", ">= 8192 tokens", "K/V only"}
    assert got["price_summary"]["K/V only"]["catch_ups"] >= 10
    history = got["histories"][str(ROOT / M107)]
    assert history[0]["kv_us_per_token"] is None and history[-1]["kv_us_per_token"] > 0
    assert "| K/V only |" in capsys.readouterr().out
