"""SGLang plugin: everything testable on CPU.

The first part needs neither SGLang nor a GPU (version check, config, step planning, result
layout, calibration, step log, server-argument adjustments). The second part imports SGLang
0.5.17 (skipped cleanly when it is not importable) and runs the registration, the real
ServerArgs handling and plugin discovery against the real registry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.engines.sglang import version as version_mod
from dual_graph_worker.core.calibration import measure_calibration, wall_clock_timer
from dual_graph_worker.core.controller import GoodputController
from dual_graph_worker.core.ledger import StepLedger
from dual_graph_worker.core.planner import StepPlan, StepPlanner
from dual_graph_worker.engines.sglang.hooks import expected_batch_size
from dual_graph_worker.core.policies import PolicyContext, build_policy
from dual_graph_worker.core.settings import PolicyKind, Settings
from dual_graph_worker.engines.sglang.layout import (
    decode_lengths,
    decode_out_cache_loc,
    decode_step_layout,
    per_request_logprobs,
)
from dual_graph_worker.engines.sglang.server_args_hook import (
    apply_dual_graph_server_args,
    cap_batch_sizes,
    fit_to_request_pool,
    plain_decode_batch_sizes,
)
from dual_graph_worker.core.jsonl import json_lines
from dual_graph_worker.core.step_log import (
    StepLogWriter,
    read_step_events,
    read_step_log,
)
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import GraphKey, Mode
from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.policy import Reason, StepTime, accepted
from dual_graph_worker.core.simple_policies import PinnedPolicy, ThresholdPolicy
from dual_graph_worker.core.results import StepRecord

ROOT = Path(__file__).resolve().parents[1]
SPEC_BS = [1, 2, 3, 4, 6, 8, 16, 32, 48]
DECODE_BS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256]


# ------------------------------------------------------------------ version check / entry point

def test_version_check_accepts_only_the_supported_release():
    version_mod.check_sglang_version("0.5.17")
    with pytest.raises(version_mod.SGLangVersionError) as exc:
        version_mod.check_sglang_version("0.5.18")
    msg = str(exc.value)
    assert "0.5.18" in msg and "0.5.17" in msg and "dual-graph-worker[sglang]" in msg


def test_version_check_names_missing_sglang():
    with pytest.raises(version_mod.SGLangVersionError, match="not installed"):
        version_mod.check_sglang_version(None)


def test_register_fails_loudly_on_wrong_version(monkeypatch, caplog):
    from dual_graph_worker.engines.sglang import plugin

    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.4.0")
    with caplog.at_level("ERROR"), pytest.raises(version_mod.SGLangVersionError):
        plugin.register()
    assert "NOT registered" in caplog.text and "0.4.0" in caplog.text


def test_entry_point_is_declared_and_callable():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = data["project"]["entry-points"]["sglang.srt.plugins"]["dual_graph_worker"]
    assert target == "dual_graph_worker.engines.sglang.plugin:register"
    module, func = target.split(":")
    mod = __import__(module, fromlist=[func])
    assert callable(getattr(mod, func))


def test_engine_agnostic_modules_do_not_import_sglang():
    code = textwrap.dedent("""
        import sys
        import dual_graph_worker.core.settings, dual_graph_worker.core.planner
        import dual_graph_worker.engines.sglang.layout, dual_graph_worker.core.calibration
        import dual_graph_worker.engines.sglang.row_context
        import dual_graph_worker.core.step_log, dual_graph_worker.engines.sglang.plugin
        import dual_graph_worker.engines.sglang.server_args_hook
        import dual_graph_worker.engines.sglang.capture_config
        assert not any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules), \
            sorted(m for m in sys.modules if m.startswith('sglang'))
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_launch_checks_do_not_import_the_strategies():
    """The validator and the server-args handling run in the main process, before any worker:
    they read each continuity's launch needs without importing its GPU stack."""
    code = textwrap.dedent("""
        import sys
        from types import SimpleNamespace
        from dual_graph_worker.engines.sglang import spec_algo
        spec_algo.validate_server_args(SimpleNamespace(attention_backend="triton"))
        heavy = [m for m in ("dual_graph_worker.engines.sglang.lazy_sync",
                             "dual_graph_worker.engines.sglang.continuity",
                             "dual_graph_worker.engines.sglang.worker") if m in sys.modules]
        assert not heavy, heavy
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)

# --------------------------------------------------------------------------- policy, planner

def _table(k=3):
    lat = {GraphKey(Mode.DECODE, b): 0.005 + b * 1e-5 for b in DECODE_BS}
    lat.update({GraphKey(Mode.SPEC, b): 0.007 + b * 1e-4 for b in SPEC_BS})
    return CalibrationTable(lat, num_draft_tokens=k)


def _ctx(prior=None):
    return PolicyContext(3, {Mode.SPEC: SPEC_BS, Mode.DECODE: DECODE_BS}, prior)


def test_build_policy_kinds():
    assert isinstance(build_policy(Settings(), _ctx(_table())), GoodputController)
    assert isinstance(build_policy(Settings(policy=PolicyKind.THRESHOLD), _ctx()),
                      ThresholdPolicy)
    pinned = build_policy(Settings(policy=PolicyKind.DECODE), _ctx())
    assert isinstance(pinned, PinnedPolicy) and pinned.mode is Mode.DECODE


def test_planner_inputs_from_dispatch_table():
    planner = StepPlanner(DispatchTable.build(SPEC_BS, DECODE_BS), ThresholdPolicy())
    assert planner.inputs(5).spec_padded_bs == 6
    assert planner.inputs(5).decode_padded_bs == 8
    big = planner.inputs(100)
    assert big.spec_padded_bs is None and big.decode_padded_bs == 128
    assert planner.inputs(300).decode_padded_bs == 300     # eager beyond both pools
    eager = StepPlanner(DispatchTable.build(SPEC_BS, DECODE_BS), ThresholdPolicy(),
                        graphs_enabled=False)
    assert eager.inputs(70).spec_padded_bs == 70


def test_threshold_planner_switches_on_a_load_ramp():
    table = DispatchTable.build(SPEC_BS, DECODE_BS)
    sel = StepPlanner(table, ThresholdPolicy(threshold=4, num_draft_tokens=3))
    ramp = [1, 2, 4, 8, 16, 8, 4, 2, 1, 8, 2]
    plans = [sel.plan(bs) for bs in ramp]
    modes = [p.mode for p in plans]
    assert modes == [Mode.SPEC] * 3 + [Mode.DECODE] * 3 + [Mode.SPEC] * 3 + [Mode.DECODE,
                                                                             Mode.SPEC]
    assert all(p.graph for p in plans)
    assert plans[3].padded_bs == 8 and plans[0].padded_bs == 1
    switches = sum(a is not b for a, b in zip(modes, modes[1:]))
    assert switches == 4


def test_pinned_spec_falls_back_to_decode_beyond_the_spec_pool():
    table = DispatchTable.build(SPEC_BS, DECODE_BS)
    sel = StepPlanner(table, PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=3))
    assert sel.plan(48) == StepPlan(Mode.SPEC, 48, 48, True, Reason.PINNED)
    assert sel.plan(49) == StepPlan(Mode.DECODE, 49, 64, True, Reason.NO_SPEC_GRAPH)
    assert sel.plan(300) == StepPlan(Mode.DECODE, 300, 300, False, Reason.NO_SPEC_GRAPH)


def test_goodput_planner_starts_from_the_calibration_prior():
    table = DispatchTable.build(SPEC_BS, DECODE_BS)
    sel = StepPlanner(table, build_policy(Settings(min_dwell_steps=0), _ctx(_table())))
    assert sel.plan(1).mode is Mode.SPEC          # 4 tokens in 7 ms beat 1 in 5 ms
    assert sel.plan(64).mode is Mode.DECODE       # no spec graph


def test_preview_commits_nothing_dwell_and_exploration_included():
    table = DispatchTable.build(SPEC_BS, DECODE_BS)
    dwell = StepPlanner(table, ThresholdPolicy(threshold=4, num_draft_tokens=3,
                                               min_dwell_steps=3))
    assert dwell.plan(2).mode is Mode.SPEC
    assert dwell.preview(16) is Mode.SPEC            # dwell: 1 step in spec, 3 owed
    for _ in range(5):
        assert dwell.preview(16) is Mode.SPEC        # previews do not pay the dwell off
    assert [dwell.plan(16).mode for _ in range(3)] == [Mode.SPEC, Mode.SPEC, Mode.DECODE]
    assert dwell.preview(1) is Mode.DECODE and dwell.last_mode is Mode.DECODE

    def controller():
        return build_policy(Settings(min_dwell_steps=0, stale_after=2, explore_budget=0.5,
                                     explore_steps=2), _ctx(_table()))

    # Acceptance 1.5: decode is faster at bs 40, spec could win at full acceptance, so the
    # controller re-measures spec now and then: previews must not change when it does.
    previewed, planned = StepPlanner(table, controller()), StepPlanner(table, controller())
    for p in (previewed, planned):
        p.policy.observe(accepted(Mode.SPEC, [1.5] * 40))

    def run(planner, preview):
        modes = []
        for _ in range(60):
            if preview:
                planner.preview(40)
            plan = planner.plan(40)
            if preview:
                planner.preview(40)                   # a preview after the plan, too
            planner.policy.observe(StepTime(plan.mode, plan.padded_bs,
                                            _table().latency(plan.mode, plan.padded_bs)))
            modes.append(plan.mode)
        return modes

    modes = run(previewed, preview=True)
    assert modes == run(planned, preview=False)
    assert Mode.SPEC in modes and Mode.DECODE in modes


def test_a_prefill_does_not_foresee_a_re_measurement():
    # It is priced at its own step with the catch-up it needs; a prefill that ran the draft for
    # it would pay that draft work unpriced.
    table = DispatchTable.build(SPEC_BS, DECODE_BS)
    settings = Settings(min_dwell_steps=0, stale_after=2, explore_budget=0.5, explore_steps=2,
                        sync_every=1024)       # exchanged by hand: the probe sees what plan sees
    planner = StepPlanner(table, build_policy(settings, _ctx(_table())))
    planner.policy.observe(accepted(Mode.SPEC, [1.5] * 40))
    for _ in range(100):
        now = planner.policy.decide(planner.inputs(40))
        if planner.last_mode is Mode.DECODE and (now.mode, now.reason) == (Mode.SPEC,
                                                                           Reason.EXPLORE):
            break
        plan = planner.plan(40)
        planner.policy.observe(StepTime(plan.mode, plan.padded_bs,
                                        _table().latency(plan.mode, plan.padded_bs)))
        planner.policy.exchange(planner.reduce)
    else:
        raise AssertionError("no re-measurement of spec within 100 steps")
    assert planner.preview(40) is Mode.DECODE
    plan = planner.plan(40)
    assert (plan.mode, plan.reason) == (Mode.SPEC, Reason.EXPLORE)


def test_expected_batch_size_reads_the_request_pool_and_the_queue():
    pool = SimpleNamespace(size=10, available_size=lambda: 7)
    assert expected_batch_size(pool) == 3
    assert expected_batch_size(pool, queued=4) == 7
    # a server admits at most its pool's rows (max running requests), however long the queue
    assert expected_batch_size(pool, queued=50) == 10
    assert expected_batch_size(SimpleNamespace(size=10)) is None   # not a ReqToTokenPool
    assert expected_batch_size(None, queued=3) is None


def test_held_rows_drop_the_rows_the_request_pool_has_freed():
    from dual_graph_worker.engines.sglang.hooks import held_rows

    pool = SimpleNamespace(free_slots=[3, 5, 9])
    assert held_rows(pool, np.array([1, 3, 4, 5])).tolist() == [1, 4]
    assert held_rows(SimpleNamespace(), np.array([1, 3])).tolist() == [1, 3]   # no free list
    assert held_rows(pool, np.array([], dtype=np.int64)).tolist() == []


def test_ledger_pairs_results_in_launch_order():
    clock = iter(range(100, 200)).__next__
    ledger = StepLedger(clock=lambda: float(clock()))
    spec = StepPlan(Mode.SPEC, 2, 2, True, Reason.THRESHOLD)
    dec = StepPlan(Mode.DECODE, 3, 4, True, Reason.THRESHOLD)
    ledger.launched(spec)
    ledger.launched(dec)
    first = ledger.completed([3, 1], batch_size=2)
    assert first.record == StepRecord(0, Mode.SPEC, 2, 2, Reason.THRESHOLD, True, 6, 3.0)
    assert first.wall_time == 100.0
    second = ledger.completed([0, 0, 0], batch_size=3)
    assert second.record.mode is Mode.DECODE and second.record.tokens == 3
    assert second.record.mean_accept_len == 1.0 and ledger.in_flight == 0
    assert ledger.completed([0], batch_size=1) is None      # nothing launched


def test_each_step_logs_the_workers_planning_and_sglangs_launch_apart(registered, tmp_path,
                                                                      bare_sglang_worker):
    """plan_us: the worker's host time before the launch; launch_us: SGLang's forward call (a
    slow spell of the steps that neither shares lies on the device)."""
    w = bare_sglang_worker(ThresholdPolicy(threshold=4, num_draft_tokens=3),
                           step_log=tmp_path / "steps.jsonl")
    w._ledger.launched(StepPlan(Mode.SPEC, 2, 2, True, Reason.THRESHOLD), np.array([3, 4]),
                       host_s=120e-6, launch_s=2.5e-3)
    w.on_verify_complete_cpu([1, 0], batch_size=2)
    w._step_log.close()
    (step,) = [e for e in json_lines(tmp_path / "steps.jsonl") if "step" in e]
    assert (step["plan_us"], step["launch_us"]) == (120.0, 2500.0)


@pytest.mark.parametrize("counts", [[2, 0], np.array([2, 0]), [np.int64(2), np.int64(0)],
                                    torch.tensor([2, 0], dtype=torch.int32)])
def test_ledger_takes_accepted_drafts_as_any_sequence_of_integers(counts):
    """SGLang 0.5.17 hands the verify hook a list of ints; another release's array or tensor
    must not break a step's bookkeeping."""
    ledger = StepLedger()
    ledger.launched(StepPlan(Mode.SPEC, 2, 2, True, Reason.THRESHOLD))
    done = ledger.completed(counts, batch_size=2)
    assert done.accept_lens == [3.0, 1.0] and done.record.tokens == 4
    assert done.record.mean_accept_len == 2.0


def test_ledger_drops_a_mismatched_result_instead_of_mislabelling():
    ledger = StepLedger()
    ledger.launched(StepPlan(Mode.SPEC, 2, 2, True, Reason.THRESHOLD))
    assert ledger.completed([0, 0, 0], batch_size=3) is None
    assert ledger.mismatches == 1 and ledger.in_flight == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_ledger_drops_a_launch_whose_result_was_lost(depth):
    """A launch whose result never came would pair every later result with the launch before
    its own, batch sizes alike: a result finds at most `depth` launches pending (2 under
    overlap: its own and the next), and older ones are dropped."""
    ledger = StepLedger(depth=depth)
    ledger.launched(StepPlan(Mode.SPEC, 3, 4, True, Reason.GOODPUT))      # its result is lost
    ledger.launched(StepPlan(Mode.DECODE, 3, 4, True, Reason.GOODPUT))
    if depth == 2:
        ledger.launched(StepPlan(Mode.SPEC, 3, 4, True, Reason.GOODPUT))  # overlap: launched next
    done = ledger.completed([0, 0, 0], batch_size=3)
    assert done.record.mode is Mode.DECODE and ledger.mismatches == 1
    if depth == 2:
        done = ledger.completed([2, 2, 2], batch_size=3)
        assert done.record.mode is Mode.SPEC and done.record.tokens == 9
    assert ledger.in_flight == 0 and ledger.mismatches == 1


def test_ledger_bounds_in_flight_entries():
    ledger = StepLedger(max_in_flight=2)
    for _ in range(5):
        ledger.launched(StepPlan(Mode.DECODE, 1, 1, True, Reason.THRESHOLD))
    assert ledger.in_flight == 2 and ledger.mismatches == 3


# ------------------------------------------------------------------------------------ layout

def test_decode_step_layout_is_the_speculative_layout_with_stride_one():
    lengths = decode_lengths(torch.tensor([5, 9, 2], dtype=torch.int64), None, None)
    lay = decode_step_layout(lengths)
    assert lay.new_seq_lens is lengths.seq_lens       # the forward's: computed once
    assert lay.stride == 1
    assert lay.accept_lens.dtype == torch.int32 and lay.accept_lens.tolist() == [1, 1, 1]
    assert lay.new_seq_lens.tolist() == [6, 10, 3] and lay.new_seq_lens.dtype == torch.int64
    # The scheduler slices request i's tokens as ids[i*S : i*S + accept[i]].
    ids = [11, 22, 33]
    got = [ids[i * lay.stride: i * lay.stride + int(lay.accept_lens[i])] for i in range(3)]
    assert got == [[11], [22], [33]]


def test_decode_step_layout_slices_a_preallocated_ones_buffer():
    ones = torch.ones(8, dtype=torch.int32)
    lay = decode_step_layout(decode_lengths(torch.tensor([5, 9, 2]), None, None), ones)
    assert lay.accept_lens.tolist() == [1, 1, 1]
    assert lay.accept_lens.data_ptr() == ones.data_ptr()       # a view: nothing launched
    nine = decode_lengths(torch.zeros(9, dtype=torch.int64), None, None)
    assert decode_step_layout(nine, ones).accept_lens.shape == (9,)


def test_decode_lengths_shift_positions_to_seq_lens():
    ln = decode_lengths(torch.tensor([5, 9]), torch.tensor([5, 9]), 14)
    assert ln.seq_lens.tolist() == [6, 10] and ln.seq_lens_cpu.tolist() == [6, 10]
    assert ln.seq_lens_sum == 16
    # DECODE positions are seq_lens - 1: the new token lands at the old seq_lens.
    assert (ln.seq_lens - 1).tolist() == [5, 9]
    gpu_only = decode_lengths(torch.tensor([3]), None, None)
    assert gpu_only.seq_lens_cpu is None and gpu_only.seq_lens_sum is None


def test_prefill_lengths_always_give_each_row_a_length():
    from types import SimpleNamespace as NS

    from dual_graph_worker.engines.sglang.row_context import prefill_lengths

    assert prefill_lengths(NS(seq_lens_cpu=torch.tensor([7, 9])), 2).tolist() == [7, 9]
    chunk = NS(seq_lens_cpu=None, prefix_lens=[100, 0], extend_lens=[28, 64])
    assert prefill_lengths(chunk, 2).tolist() == [128, 64]
    # Nothing to read: zeros, never the previous occupant's length.
    assert prefill_lengths(NS(seq_lens_cpu=None), 3).tolist() == [0, 0, 0]


def test_decode_out_cache_loc_reads_the_slot_at_seq_lens():
    req_to_token = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    loc = decode_out_cache_loc(req_to_token, torch.tensor([2, 0]), torch.tensor([3, 7]))
    assert loc.tolist() == [23, 7] and loc.dtype == torch.int64


def test_per_request_logprobs_shape():
    assert per_request_logprobs(torch.tensor([-0.5, -0.25])).tolist() == [[-0.5], [-0.25]]


# ------------------------------------------------------------------------------- calibration

def test_measure_calibration_times_every_stage_of_a_step():
    calls = []
    times = {"verify": 0.004, "draft": 0.001, "extend": 0.001, "decode": 0.003}

    def fake_timer(fns, *, warmup, iters):
        calls.append((len(fns), warmup, iters))
        return sum(f() for f in fns)

    mk = lambda name: (lambda: times[name])  # noqa: E731
    table = measure_calibration({1: [mk("decode")], 8: [mk("decode")]},
                                {1: [mk("draft"), mk("verify"), mk("extend")]},
                                num_draft_tokens=3, timer=fake_timer, iters=4)
    assert table.latency(Mode.SPEC, 1) == pytest.approx(0.006)
    assert table.latency(Mode.DECODE, 8) == pytest.approx(0.003)
    assert table.num_draft_tokens == 3 and (3, 2, 4) in calls
    assert CalibrationTable.from_json(table.to_json()).latency_s == table.latency_s
    with pytest.raises(ConfigError, match="both pools"):
        measure_calibration({}, {1: [mk("verify")]}, num_draft_tokens=3, timer=fake_timer)


def test_wall_clock_timer_takes_the_median_of_synced_iterations():
    ticks = iter([0.0, 1.0, 10.0, 12.0, 20.0, 21.5])
    syncs = []
    timer = wall_clock_timer(lambda: next(ticks), sync=lambda: syncs.append(1))
    ran = []
    assert timer([lambda: ran.append(1)], warmup=2, iters=3) == 1.5
    assert len(ran) == 5 and len(syncs) == 4


# ---------------------------------------------------------------------------------- step log

def test_step_log_round_trip(tmp_path):
    path = tmp_path / "log" / "steps.jsonl"
    w = StepLogWriter(path)
    w.write_event("ready", 1.0, spec_bs=[1, 2])
    rec = StepRecord(3, Mode.DECODE, 17, 24, Reason.THRESHOLD, True, 17, 1.0)
    w.write(rec, 2.5, accept_ema=3.2)
    w.close()
    w.write(rec, 9.0)                     # after close: ignored, no exception
    with open(path, "a") as fh:
        fh.write('{"step": 4, "mode": "sp')          # torn tail of a live writer
    assert list(read_step_log(path)) == [(rec, 2.5)]
    assert read_step_events(path)[0]["spec_bs"] == [1, 2]


def test_a_logs_lines_that_hold_no_object_are_skipped_and_counted_unless_last(tmp_path, capsys):
    """A torn last line is a live writer's: skipped quietly. Bad lines before a good one are
    named (a restart's torn line, or a log cut about): one warning. A binary file: one error."""
    path = tmp_path / "steps.jsonl"
    path.write_text('{"a": 1}\n5\n{"b": 2\n\n{"c": 3}\n{"torn')
    assert list(json_lines(path)) == [{"a": 1}, {"c": 3}]
    assert capsys.readouterr().err == f"warning: {path}: skipped 2 line(s) that hold no JSON " \
                                      "object\n"
    path.write_text('{"a": 1}\n{"torn')
    assert list(json_lines(path)) == [{"a": 1}] and capsys.readouterr().err == ""
    path.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ConfigError, match="is not a JSONL log"):
        list(json_lines(path))


# -------------------------------------------------------------------- server-arg adjustments

def _server_args(mrr=48, bs=(1, 2, 4, 8, 16, 32, 48, 64, 128, 256), max_bs=256):
    return SimpleNamespace(max_running_requests=mrr,
                           cuda_graph_config=SimpleNamespace(
                               decode=SimpleNamespace(bs=list(bs), max_bs=max_bs)))


def test_server_args_lift_the_eagle_cap_and_cap_the_spec_pool():
    sa = _server_args()
    adj = apply_dual_graph_server_args(sa, spec_max_bs=48, max_running_requests_was_unset=True)
    assert sa.max_running_requests is None and adj.max_running_requests_restored
    assert sa.cuda_graph_config.decode.bs == [1, 2, 4, 8, 16, 32, 48]
    assert sa.cuda_graph_config.decode.max_bs == 256          # the decode pool's top
    assert "48" in adj.describe()


def test_server_args_keep_an_explicit_max_running_requests():
    sa = _server_args(mrr=64)
    apply_dual_graph_server_args(sa, spec_max_bs=16, max_running_requests_was_unset=False)
    assert sa.max_running_requests == 64 and max(sa.cuda_graph_config.decode.bs) == 16


def test_cap_batch_sizes_keeps_one_graph():
    assert cap_batch_sizes([8, 4, 16], 5) == [4]
    assert cap_batch_sizes([8, 16], 2) == [8]


def test_server_args_uncapped_keep_the_servers_spec_list():
    sa = _server_args()
    adj = apply_dual_graph_server_args(sa, spec_max_bs=None, max_running_requests_was_unset=True)
    assert sa.cuda_graph_config.decode.bs == [1, 2, 4, 8, 16, 32, 48, 64, 128, 256]
    assert "server's list, up to bs 256" in adj.describe()


def test_plain_decode_batch_sizes_calls_the_generator_as_a_plain_server():
    seen = {}

    def gen(self, max_bs):
        seen.update(vars(self), max_bs=max_bs)
        return [4, 1, 2, max_bs, 2]

    assert plain_decode_batch_sizes(gen, max_bs=64, disable_cuda_graph_padding=False) == [
        1, 2, 4, 64]
    assert seen == {"disable_cuda_graph_padding": False, "speculative_algorithm": None,
                    "max_bs": 64}


def test_fit_to_request_pool():
    assert fit_to_request_pool([1, 2, 4, 8, 16], max_requests=10, alignment=1) == [
        1, 2, 4, 8, 10]
    assert fit_to_request_pool([1, 2, 4, 8], max_requests=100, alignment=2) == [2, 4, 8]
    with pytest.raises(ValueError):
        fit_to_request_pool([3], max_requests=100, alignment=2)


# ============================================================ with SGLang 0.5.17 (CPU only)

def _toy_configs(tmp_path: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT))
    from bench.sglang.model_configs import toy_shapes, write_eagle3_draft_config, \
        write_llama_config

    shapes = toy_shapes(vocab=256)
    target = write_llama_config(tmp_path / "target", shapes)
    draft = write_eagle3_draft_config(tmp_path / "draft", shapes)
    return target, draft


@pytest.fixture
def registered(supported_sglang):
    from dual_graph_worker.engines.sglang.plugin import register

    register()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm


def test_registration_is_idempotent_and_mirrors_eagle3(registered):
    from dual_graph_worker.engines.sglang.plugin import register
    from dual_graph_worker.engines.sglang.spec_algo import DualGraphEagle3Spec

    register()                                            # second call: no error
    algo = registered.from_string("dual_graph_eagle3")
    assert isinstance(algo, DualGraphEagle3Spec) and algo.supports_overlap
    eagle3 = registered.EAGLE3
    for name in ("is_eagle", "is_eagle3", "need_topk", "carries_draft_hidden_states",
                 "supports_grammar_overlap", "has_draft_kv", "is_standalone", "is_ngram",
                 "is_dflash_family", "supports_ragged_verify", "is_none", "is_speculative",
                 "supports_target_verify_for_draft"):
        assert getattr(algo, name)() == getattr(eagle3, name)(), name
    # Width-1 runners come from this hook: it must return the width it is given.
    assert algo.get_num_tokens_per_req_for_target_verify(1, False) == 1
    assert algo.create_worker.__func__ is not None


def test_queue_hook_annotates_the_prefill_batch_through_sglangs_own_wrapper(registered):
    """The AFTER hook on Scheduler.get_new_batch_prefill, wrapped the way HookRegistry wraps it,
    around SGLang's real method: the returned prefill batch carries the queue length."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType, _wrap_fn

    from dual_graph_worker.engines.sglang import hooks

    registered_hooks = HookRegistry._hooks.get(hooks.PREFILL_TARGET, [])
    assert (HookType.AFTER, hooks.annotate_queued_requests) in [h[:2] for h in registered_hooks]
    wrapped = _wrap_fn(Scheduler.get_new_batch_prefill, hooks.annotate_queued_requests,
                       HookType.AFTER)

    def scheduler(batch, worker=SimpleNamespace(dgw_wants_queue_hint=True)):
        return SimpleNamespace(
            prefill_delayer=None, waiting_queue=[object()] * 5, model_worker=worker,
            _get_new_batch_prefill_raw=lambda prefill_delayer_single_pass, running_batch:
            (batch, running_batch))

    batch = SimpleNamespace()
    plan = wrapped(scheduler(batch), "running")
    assert plan.batch_to_run is batch and plan.running_batch == "running"
    assert hooks.queued_requests(batch) == 5
    # Another worker (plain EAGLE-3), or no batch: untouched, no error.
    other = SimpleNamespace()
    wrapped(scheduler(other, worker=SimpleNamespace()), "running")
    assert hooks.queued_requests(other) == 0
    assert wrapped(scheduler(None), "running").batch_to_run is None
    # A scheduler whose queue cannot be read fails loudly (on every rank alike), never 0.
    broken = SimpleNamespace(prefill_delayer=None, model_worker=SimpleNamespace(
        dgw_wants_queue_hint=True), _get_new_batch_prefill_raw=lambda **kw: (batch, "r"))
    with pytest.raises(AttributeError, match="waiting_queue"):
        wrapped(broken, "r")
    assert hooks.queued_requests(SimpleNamespace(dgw_queued_requests="7")) == 0


def test_future_map_is_built_for_the_plugin(registered):
    from sglang.srt.managers.overlap_utils import FutureMap

    algo = registered.from_string("DUAL_GRAPH_EAGLE3")
    pool = SimpleNamespace(size=4, req_to_token=torch.zeros(5, 8, dtype=torch.int32))
    try:                                         # SGLang's own, for EAGLE-3, on this device
        FutureMap(torch.device("cpu"), registered.from_string("EAGLE3"), pool, False, False)
    except Exception as exc:
        pytest.skip(f"SGLang's FutureMap cannot be built on CPU here: {exc!r}")
    fm = algo.create_future_map(torch.device("cpu"), pool, needs_cpu_seq_lens=False)
    assert isinstance(fm, FutureMap) and fm.spec_algo is algo


def test_server_args_through_the_real_sglang_hook(registered, tmp_path):
    from sglang.srt.server_args import ServerArgs

    target, draft = _toy_configs(tmp_path)
    common = dict(model_path=str(target), device="cuda", load_format="dummy",
                  skip_tokenizer_init=True)
    sa = ServerArgs(**common, speculative_algorithm="DUAL_GRAPH_EAGLE3",
                    speculative_draft_model_path=str(draft), speculative_num_steps=3,
                    speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    eagle = ServerArgs(**common, speculative_algorithm="EAGLE3",
                       speculative_draft_model_path=str(draft), speculative_num_steps=3,
                       speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    plain = ServerArgs(**common)
    assert eagle.max_running_requests == 48                # what static EAGLE-3 gets
    assert sa.max_running_requests is None                 # plain-server admission
    assert sa.max_running_requests == plain.max_running_requests
    assert Settings().spec_max_bs is None            # the spec pool is EAGLE-3's list
    assert sa.cuda_graph_config.decode.bs == eagle.cuda_graph_config.decode.bs
    # The decode pool follows the plain server's list up to the same decode max.
    assert sa.cuda_graph_config.decode.max_bs == plain.cuda_graph_config.decode.max_bs
    assert plain_decode_batch_sizes(
        ServerArgs._generate_decode_cuda_graph_batch_sizes,
        max_bs=plain.cuda_graph_config.decode.max_bs,
        disable_cuda_graph_padding=False) == sorted(plain.cuda_graph_config.decode.bs)
    assert sa.speculative_num_draft_tokens == 4 and not sa.enable_mixed_chunk


def test_validator_rejects_adaptive_with_the_flag_to_drop(registered, tmp_path):
    from sglang.srt.server_args import ServerArgs

    target, draft = _toy_configs(tmp_path)
    with pytest.raises(ConfigError, match="speculative-adaptive"):
        ServerArgs(model_path=str(target), device="cuda", load_format="dummy",
                   skip_tokenizer_init=True, speculative_algorithm="DUAL_GRAPH_EAGLE3",
                   speculative_draft_model_path=str(draft), speculative_adaptive=True)


@pytest.mark.parametrize("env, value, want", [
    ("DGW_POLICY", "always", "DGW_POLICY"),
    ("DGW_CALIBRATION", "{missing}", "DGW_CALIBRATION=.*cannot read calibration table"),
    ("DGW_CAPTURE_CONFIG", "{missing}", "DGW_CAPTURE_CONFIG=.*cannot read capture config"),
])
def test_validator_rejects_bad_worker_settings_at_launch(env, value, want, registered, tmp_path,
                                                         monkeypatch):
    """Before any weight loads: a bad DGW_* value, or a file a setting names that cannot be
    read (the scheduler would read it only after the weights)."""
    from sglang.srt.server_args import ServerArgs

    target, draft = _toy_configs(tmp_path)
    monkeypatch.setenv(env, value.format(missing=tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match=want):
        ServerArgs(model_path=str(target), device="cuda", load_format="dummy",
                   skip_tokenizer_init=True, speculative_algorithm="DUAL_GRAPH_EAGLE3",
                   speculative_draft_model_path=str(draft))


def test_plugin_is_discovered_through_the_entry_point_shim(tmp_path, supported_sglang):
    """A fresh interpreter, as a spawned scheduler is: load_plugins() must find and run
    register() through the entry-point group, with the shim the GPU suite installs."""
    sys.path.insert(0, str(ROOT))
    from bench.sglang.plugin_shim import write_entry_point_shim

    shim = write_entry_point_shim(tmp_path / "shim")
    code = textwrap.dedent("""
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        algo = SpeculativeAlgorithm.from_string("DUAL_GRAPH_EAGLE3")
        print(type(algo).__name__)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), str(ROOT)]))
    env.pop("SGLANG_PLUGINS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "DualGraphEagle3Spec"


def test_decode_runner_keeps_its_own_batch_sizes(registered):
    from dual_graph_worker.engines.sglang.decode_pool import DecodeModeCudaGraphRunner

    runner = object.__new__(DecodeModeCudaGraphRunner)
    runner._decode_pool_bs = [1, 2, 4, 256]
    runner.enable_torch_compile = False
    runner.capture_bs, runner.compile_bs = [1, 2, 3], [1]      # SGLang's spec-list write
    assert runner.capture_bs == [1, 2, 4, 256] and runner.compile_bs == []
    assert runner.get_spec_info(8) is None


def test_decode_pool_swaps_both_target_slots_and_restores_them(registered):
    from dual_graph_worker.engines.sglang.decode_pool import DecodePool

    mr = SimpleNamespace(decode_cuda_graph_runner="verify", attn_backend="verify-attn")
    pool = DecodePool(runner="decode", attn_backend="decode-attn", capture_bs=(1, 2))
    with pytest.raises(RuntimeError):
        with pool.installed(mr):
            assert (mr.decode_cuda_graph_runner, mr.attn_backend) == ("decode", "decode-attn")
            raise RuntimeError("forward failed")
    assert (mr.decode_cuda_graph_runner, mr.attn_backend) == ("verify", "verify-attn")
    eager = DecodePool(runner=None, attn_backend=None, capture_bs=())
    with eager.installed(mr):
        assert mr.decode_cuda_graph_runner is None and mr.attn_backend == "verify-attn"
    assert mr.decode_cuda_graph_runner == "verify"


def test_shared_logits_buffer_is_enlarged_before_capture(registered):
    from sglang.srt.model_executor.graph_shared_output import GraphSharedOutput

    from dual_graph_worker.engines.sglang.decode_pool import ensure_shared_logits_rows

    saved = GraphSharedOutput._process_shared
    try:
        GraphSharedOutput._process_shared = None
        mr = SimpleNamespace(device="cpu", max_decode_logits_rows=lambda: 192)
        assert ensure_shared_logits_rows(mr, rows=256) == 256
        shared = GraphSharedOutput._process_shared
        assert ensure_shared_logits_rows(mr, rows=64) == 256       # never shrinks
        assert GraphSharedOutput._process_shared is shared
        # What the target's verify capture then does: reuse the larger buffer.
        assert shared.get_logits_buffer(16, rows=256).shape == (256, 16)
    finally:
        GraphSharedOutput._process_shared = saved


# ------------------------------------------------ worker glue, with SGLang but no GPU / model

def _batch(bs, mode=None):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(forward_mode=mode or ForwardMode.DECODE, is_extend_in_batch=False,
                           seq_lens=torch.zeros(bs, dtype=torch.int64),
                           req_pool_indices_cpu=torch.arange(1, bs + 1), extend_num_tokens=16)


def test_worker_routes_each_step_by_the_policy(registered, tmp_path, monkeypatch,
                                              bare_sglang_worker):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    w = bare_sglang_worker(ThresholdPolicy(threshold=4, num_draft_tokens=3))
    calls = []
    monkeypatch.setattr(EAGLEWorkerV2, "forward_batch_generation",
                        lambda self, batch, on_publish=None, grammar_barrier=None:
                        calls.append(("spec", batch.seq_lens.shape[0])) or "spec-result")
    monkeypatch.setattr(type(w), "_decode_step",
                        lambda self, batch, rows, keep_alive, on_publish, gb:
                        calls.append(("decode", len(rows))) or "decode-result")
    assert w.forward_batch_generation(_batch(2)) == "spec-result"
    assert w.forward_batch_generation(_batch(10)) == "decode-result"
    assert w.forward_batch_generation(_batch(3, ForwardMode.EXTEND)) == "spec-result"  # prefill
    assert calls == [("spec", 2), ("decode", 10), ("spec", 3)]
    assert w._ledger.in_flight == 2              # prefill is not a decode step
    assert w._clock.in_flight == 3               # every launch is timed


def test_worker_tells_the_policy_each_steps_context_from_its_own_row_lengths(
        registered, monkeypatch, bare_sglang_worker):
    """SGLang's speculative path keeps no host sequence lengths between decode steps, so the
    worker tracks each row's: its prompt at prefill, plus every step's accepted tokens."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    from dual_graph_worker.engines.sglang.step_tags import StepTag

    seen = []

    class Recording(ThresholdPolicy):
        def decide(self, inputs):
            seen.append(inputs.kv_tokens)
            return super().decide(inputs)

    w = bare_sglang_worker(Recording(threshold=4, num_draft_tokens=3))
    monkeypatch.setattr(EAGLEWorkerV2, "forward_batch_generation",
                        lambda self, batch, on_publish=None, grammar_barrier=None: "result")
    prefill = _batch(2, ForwardMode.EXTEND)
    prefill.seq_lens_cpu = torch.tensor([100, 300])
    w.forward_batch_generation(prefill)
    w.dgw_result_processed()
    step = _batch(2)                   # no seq_lens_sum, no seq_lens_cpu: as SGLang's spec path
    w.forward_batch_generation(step)
    assert w._clock.peek() == StepTag(Mode.SPEC, 2, 0, 400, 2)   # its cost is reported with it
    w.on_verify_complete_cpu([3, 1], batch_size=2)       # accepted 4 and 2 tokens
    w.forward_batch_generation(step)
    assert seen == [400, 406]


def test_a_prebuilt_batchs_result_is_no_launchs_and_its_rows_hold_new_requests(
        registered, monkeypatch, bare_sglang_worker):
    """A PD-disaggregation decode server processes prebuilt batches that never ran on the
    worker: taken for the oldest launch's result, every later cost went to the wrong batch, and
    the rows kept their previous requests' lengths and acceptance."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from dual_graph_worker.engines.sglang import hooks
    from dual_graph_worker.engines.sglang.step_tags import StepTag

    events = []

    class Recording(ThresholdPolicy):
        def observe(self, event):
            events.append(event)
            super().observe(event)

    w = bare_sglang_worker(Recording(threshold=4, num_draft_tokens=3))
    scheduler = SimpleNamespace(model_worker=w)
    w._clock.launched(StepTag(Mode.DECODE, 2, 0))
    prebuilt = _batch(2, ForwardMode.PREBUILT)
    prebuilt.seq_lens_cpu = torch.tensor([70, 90])
    hooks.note_result_processed(None, scheduler, prebuilt, None)
    assert w._clock.in_flight == 1                     # the decode step's result is still to come
    assert [(type(e).__name__, e.tokens, e.rows.tolist()) for e in events] == [
        ("Admitted", 0, [1, 2])]
    assert w._context.total(np.array([1, 2])) == 160
    hooks.note_result_processed(None, scheduler, _batch(2), None)
    assert w._clock.in_flight == 0 and type(events[-1]).__name__ == "StepTime"


def test_worker_logs_the_controllers_cost_terms_every_few_steps(registered, tmp_path,
                                                               monkeypatch, bare_sglang_worker):
    """With a step log, every ESTIMATES_EVERY completed steps one line of the controller's cost
    terms (its per-size step table left out): a run's decisions are read from them; with CUDA,
    the caching allocator's retries and reserved GiB beside them (steps that meet a retry run
    slow)."""
    import torch

    from dual_graph_worker.engines.sglang.worker import ESTIMATES_EVERY

    from dual_graph_worker.core.estimates import (AcceptanceEstimates, BatchCostEstimates,
                                                  Estimates, StepTimeEstimates)

    class WithEstimates(ThresholdPolicy):
        def estimates(self):
            return Estimates(StepTimeEstimates({"spec": {1: [0.01]}}, {"spec": 0.0}),
                             BatchCostEstimates(2.5, 1.0, 0.0, 0.0, 0.0, None, 0.0, 0.0),
                             AcceptanceEstimates(3.0, 0.0, 0.0), 64.0, 4.0, 0.0)

    w = bare_sglang_worker(WithEstimates(threshold=4, num_draft_tokens=3),
                           step_log=tmp_path / "steps.jsonl")

    def steps(n: int) -> None:
        for _ in range(n):
            w._ledger.launched(StepPlan(Mode.DECODE, 2, 2, True, Reason.THRESHOLD),
                               np.array([3, 4]))
            w.on_verify_complete_cpu([0, 0], batch_size=2)

    steps(ESTIMATES_EVERY + 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {
        "num_alloc_retries": 2, "reserved_bytes.all.current": 3 * 2**30})
    steps(ESTIMATES_EVERY)
    w._step_log.close()
    logged = [e for e in read_step_events(tmp_path / "steps.jsonl") if e["event"] == "estimates"]
    assert [e["prompt_per_output"] for e in logged] == [2.5, 2.5]
    assert "step_s" not in logged[0] and "alloc_retries" not in logged[0]
    assert (logged[1]["alloc_retries"], logged[1]["reserved_gib"]) == (2, 3.0)


def test_each_prefill_logs_what_its_draft_choice_was_priced_on(registered, tmp_path,
                                                                monkeypatch, bare_sglang_worker):
    """With a step log, each prefill that previewed the policy logs what the preview saw (the
    batch it grows to, the requests queued behind it, the prompt tokens priced, the backlog of
    the rows it joins: those the pool still holds), how it priced both modes, and whether the
    draft's prefill ran: a chunk forced to defer (its prompt's first chunk was deferred) says so
    whatever its preview said, and a prefill that could not be deferred (no preview) is logged
    too. A wave whose queue is not seen yet is priced on its first part."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    from bench.sglang.bare_worker import NoDraftWork
    from dual_graph_worker.core.policy import PolicyState
    from dual_graph_worker.engines.sglang.hooks import QUEUED_ATTR

    class Pricing(ThresholdPolicy):
        def decide(self, inputs):
            self.priced = inputs.bs
            return super().decide(inputs)

        def state(self):
            return PolicyState(3.0, 100.0 * self.priced, 50.0 * self.priced)

    class Previewing(NoDraftWork):
        defers_prefill = True
        must_defer = False
        room = True

        def pending_tokens(self, rows):
            return 10 * len(rows)

        def defers_prefill_of(self, batch, next_step_decodes):
            return self.room and (next_step_decodes() or self.must_defer)

    continuity = Previewing()
    w = bare_sglang_worker(Pricing(threshold=4, num_draft_tokens=3), continuity=continuity,
                           step_log=tmp_path / "steps.jsonl")
    # The last decode step ran rows 40 and 41; 40's request has finished since (its row freed).
    w._running_rows = np.array([40, 41])
    free = [r for r in range(1, 64) if r not in (1, 2, 41)]
    w.req_to_token_pool = SimpleNamespace(size=63, free_slots=free,
                                          available_size=lambda: len(free))
    monkeypatch.setattr(EAGLEWorkerV2, "forward_batch_generation",
                        lambda self, batch, on_publish=None, grammar_barrier=None: "drafted")
    monkeypatch.setattr(type(w), "_deferred_prefill", lambda self, batch, on_publish: "deferred")
    prefill = _batch(2, ForwardMode.EXTEND)
    prefill.extend_num_tokens = 400
    prefill.seq_lens_cpu = torch.tensor([100, 300])
    assert w.forward_batch_generation(prefill) == "drafted"             # bs 3: speculate
    setattr(prefill, QUEUED_ATTR, 6)
    assert w.forward_batch_generation(prefill) == "deferred"            # bs 9: decode
    setattr(prefill, QUEUED_ATTR, 0)
    continuity.must_defer = True
    assert w.forward_batch_generation(prefill) == "deferred"            # previewed spec
    continuity.room = False
    assert w.forward_batch_generation(prefill) == "drafted"             # could not defer
    w._step_log.close()
    logged = [e for e in read_step_events(tmp_path / "steps.jsonl")
              if e["event"] == "prefill_choice"]
    unpreviewed = logged.pop()
    assert not unpreviewed["previewed"] and unpreviewed["draft"] and "bs" not in unpreviewed
    assert all(e["previewed"] for e in logged)
    assert [(e["bs"], e["requests"], e["queued"], e["priced_tokens"], e["preview_draft"],
             e["draft"]) for e in logged] == [(3, 2, 0, 400, True, True),
                                              (9, 2, 6, 1600, False, False),
                                              (3, 2, 0, 400, True, False)]
    assert [(e["goodput_spec"], e["goodput_decode"]) for e in logged] == [
        (300.0, 150.0), (900.0, 450.0), (300.0, 150.0)]
    assert logged[1]["kv_tokens"] == 400 + 400 * 6 // 2
    assert [e["catch_up_tokens"] for e in logged] == [10, 10, 10]     # row 41's, not 40's


def test_worker_feeds_results_and_timings_to_the_policy(registered, tmp_path,
                                                       bare_sglang_worker):
    """Accept lengths reach the policy when SGLang hands them back; each launched batch's cost
    reaches it when the scheduler has processed that batch's result (hooks.py)."""
    seen = []

    class Recording(ThresholdPolicy):
        def observe(self, event):
            seen.append(event)
            super().observe(event)

    policy = Recording(threshold=4, num_draft_tokens=3)
    w = bare_sglang_worker(policy, step_log=tmp_path / "steps.jsonl")
    w._ledger.launched(StepPlan(Mode.SPEC, 2, 2, True, Reason.THRESHOLD), np.array([3, 4]))
    w._ledger.launched(StepPlan(Mode.DECODE, 2, 2, True, Reason.THRESHOLD), np.array([3, 4]))
    before = policy.state().accept_len                  # optimistic prior K + 1 = 4
    w.on_verify_complete_cpu([0, 0], batch_size=2)      # spec step that accepted nothing
    after_spec = policy.state().accept_len
    w.on_verify_complete_cpu([0, 0], batch_size=2)      # decode step: must not move the EMA
    assert after_spec < before and policy.state().accept_len == after_spec
    assert [type(e).__name__ for e in seen] == ["Accepted", "Accepted"]
    assert seen[0].rows.tolist() == [3, 4] and seen[1].mode is Mode.DECODE
    from dual_graph_worker.engines.sglang.step_tags import PrefillTag, StepTag

    w._clock.launched(PrefillTag(64, draft=False))
    w._clock.launched(StepTag(Mode.DECODE, 8, 0))
    w.dgw_result_processed()
    w.dgw_result_processed()
    kinds = [type(e).__name__ for e in seen[2:]]
    assert kinds == ["PrefillTime", "StepTime"]
    assert seen[2].tokens == 64 and not seen[2].draft and seen[3].padded_bs == 8
    w._step_log.close()
    modes = [r.mode for r, _ in read_step_log(tmp_path / "steps.jsonl")]
    assert modes == [Mode.SPEC, Mode.DECODE]
    # Overlap: the next batch is launched before this one's result is processed.
    w._step_log = None
    w._clock.launched(StepTag(Mode.DECODE, 8, 0))
    w._clock.launched(StepTag(Mode.SPEC, 8, 120))       # the switch back, with a catch-up
    w.dgw_result_processed()                             # the decode step held its launch
    w._clock.launched(StepTag(Mode.SPEC, 8, 0))
    w.dgw_result_processed()                             # the catch-up step: a spec step next
    w._clock.launched(StepTag(Mode.SPEC, 8, 0))
    w.dgw_result_processed()
    w.dgw_result_processed()                             # nothing launched after it
    steps = [e for e in seen[4:] if type(e).__name__ == "StepTime"]
    assert [(e.mode, e.catch_up_tokens, e.carries_next) for e in steps] == [
        (Mode.DECODE, 0, True), (Mode.SPEC, 120, False), (Mode.SPEC, 0, False),
        (Mode.SPEC, 0, False)]
    costs = [e for e in read_step_events(tmp_path / "steps.jsonl") if e["event"] == "cost"]
    assert [(e["kind"], e.get("mode"), e.get("padded_bs")) for e in costs] == [
        ("PrefillTime", None, None), ("StepTime", "decode", 8)]
    assert all(e["seconds"] >= 0 for e in costs) and costs[0]["tokens"] == 64


def test_decode_view_is_a_plain_decode_batch_and_leaves_the_batch_alone(registered):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    from dual_graph_worker.engines.sglang.worker import DualGraphEagleWorker

    draft = EagleDraftInput(bonus_tokens=torch.tensor([7, 9], dtype=torch.int32))
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, spec_info=draft, input_ids=None,
                            out_cache_loc=None, seq_lens=torch.tensor([5, 8]),
                            seq_lens_cpu=torch.tensor([5, 8]), seq_lens_sum=13)
    loc = torch.tensor([105, 208])
    lengths = decode_lengths(batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum)
    view = DualGraphEagleWorker._decode_view(batch, draft, loc, lengths)
    assert view.forward_mode == ForwardMode.DECODE and view.spec_info is None
    assert view.input_ids.dtype == torch.int64 and view.input_ids.tolist() == [7, 9]
    assert view.seq_lens is lengths.seq_lens and view.seq_lens.tolist() == [6, 9]
    assert view.seq_lens_sum == 15 and view.out_cache_loc is loc
    assert batch.seq_lens.tolist() == [5, 8] and batch.spec_info is draft   # untouched


def test_server_info_carries_the_workers_counters(registered, bare_sglang_worker):
    """/get_server_info carries the worker's counters, accept length over speculative steps
    only (SGLang's own counts decode-mode steps at 1)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from dual_graph_worker.engines.sglang import hooks

    assert hooks.add_internal_state in [h[1] for h in
                                        HookRegistry._hooks.get(hooks.STATE_TARGET, [])]
    w = bare_sglang_worker(ThresholdPolicy(threshold=4, num_draft_tokens=3))
    for mode, drafts in ((Mode.SPEC, [2, 2]), (Mode.DECODE, [0, 0])):
        plan = StepPlan(mode, 2, 2, True, Reason.THRESHOLD)
        w._ledger.launched(plan, np.array([1, 2]))
        w.counters.launched(plan)
        w.on_verify_complete_cpu(drafts, batch_size=2)
    result = SimpleNamespace(internal_state={"memory_usage": 1})
    hooks.add_internal_state(result, SimpleNamespace(model_worker=w), "req")
    state = result.internal_state[hooks.STATE_KEY]
    assert state["steps"] == {"spec": 1, "decode": 1} and state["switches"] == 1
    assert state["spec_accept_len"] == 3.0 and state["output_tokens"] == 8
    assert state["unpaired_steps"] == 0
    assert state["policy"] == "goodput" and result.internal_state["memory_usage"] == 1
    assert "estimates" not in state                 # a threshold has no cost model to show
    assert state["pools"] == {"spec_bs": list(w.planner.table.spec_sizes),
                              "decode_bs": list(w.planner.table.decode_sizes)}


def test_every_hook_target_exists_in_the_supported_sglang(supported_sglang):
    """A renamed method upstream would leave a hook silently unapplied."""
    import importlib

    from dual_graph_worker.engines.sglang import hooks

    for target in (hooks.PREFILL_TARGET, hooks.RESULT_TARGET, hooks.STATE_TARGET):
        module, cls, method = target.rsplit(".", 2)
        assert callable(getattr(getattr(importlib.import_module(module), cls), method)), target


def test_prometheus_series_follow_the_counters():
    from prometheus_client import CollectorRegistry

    from dual_graph_worker.core.counters import WorkerCounters
    from dual_graph_worker.core.policy import PolicyState
    from dual_graph_worker.engines.sglang.metrics import PrometheusSeries

    reg = CollectorRegistry()
    series = PrometheusSeries({"tp_rank": "0"}, registry=reg)
    c = WorkerCounters()
    for mode, reason in ((Mode.SPEC, Reason.GOODPUT), (Mode.DECODE, Reason.EXPLORE),
                         (Mode.DECODE, Reason.GOODPUT)):
        c.launched(StepPlan(mode, 4, 4, True, reason), catch_up_tokens=0)
        c.completed(mode, 4, 12 if mode is Mode.SPEC else 4)
    c.prefilled(64, deferred=True)
    series.push(c, PolicyState(3.0, spec_goodput=900.0, decode_goodput=800.0))
    series.push(c, None)                          # no change: nothing added twice

    def value(name, **labels):
        return reg.get_sample_value(name, {"tp_rank": "0", **labels})

    assert value("dgw_steps_total", mode="spec", reason="goodput") == 1
    assert value("dgw_steps_total", mode="decode", reason="explore") == 1
    assert value("dgw_switches_total") == 1 and value("dgw_output_tokens_total") == 20
    assert value("dgw_prefills_total", draft="deferred") == 1
    assert value("dgw_spec_mode") == 0.0 and value("dgw_spec_accept_length") == 3.0
    assert value("dgw_expected_goodput_tokens_per_s", mode="spec") == 900.0


def test_lazy_catch_up_checks_sglangs_default_backend_before_weights_load(
        registered, tmp_path, monkeypatch):
    """SGLang picks a backend when no --attention-backend is given (fa3 on Hopper); the
    validator must see that resolved default (declared, not yet on the field): fa3 runs, a
    default it cannot run is refused naming the flag to add."""
    from sglang.srt.server_args import ServerArgs

    target, draft = _toy_configs(tmp_path)
    args = dict(model_path=str(target), device="cuda", load_format="dummy",
                skip_tokenizer_init=True, speculative_algorithm="DUAL_GRAPH_EAGLE3",
                speculative_draft_model_path=str(draft))
    monkeypatch.setattr(ServerArgs, "_get_default_attn_backend", lambda *a, **k: "fa3")
    assert ServerArgs(**args).attention_backend == "fa3"
    monkeypatch.setattr(ServerArgs, "_get_default_attn_backend", lambda *a, **k: "torch_native")
    with pytest.raises(ConfigError, match=r"'torch_native' \(SGLang's default for this GPU\): "
                                          r"add --attention-backend triton"):
        ServerArgs(**args)
    assert ServerArgs(**args, attention_backend="triton").attention_backend == "triton"
    monkeypatch.setenv("DGW_CONTINUITY", "keep-current")
    assert ServerArgs(**args).attention_backend == "torch_native"


def _c_loops_built() -> bool:
    from dual_graph_worker.core.row_state import loops_in_c
    from dual_graph_worker.core.settings import RowLoops
    return loops_in_c(RowLoops.AUTO)


def test_the_host_cost_bytecode_count_is_the_same_every_time(supported_sglang):
    """What makes it worth having beside the timings: two counts of one path agree exactly,
    each part of the step counts its bytecodes, and a larger batch runs no more of them where
    the loops over its requests run in C (more where they run in Python)."""
    from bench.sglang.host_cost import count_opcodes

    small = count_opcodes(4, 30)
    assert small == count_opcodes(4, 30)
    assert min(v for k, v in small.items() if k.endswith("_ops")) > 0
    larger = count_opcodes(16, 30)["total_ops"]
    assert larger == small["total_ops"] if _c_loops_built() else larger > small["total_ops"]


def test_the_host_cost_a_b_reads_each_pair_of_adjacent_runs(tmp_path, capsys):
    """A version is judged by the ratios of its runs to the other's adjacent ones (a shared
    host drifts between runs), and a folder that is no checkout is named, not a traceback."""
    from bench.sglang.host_cost_ab import PARTS, main, summary

    def run(scale: float) -> list[dict]:
        return [{"bs": 1, **{p: 100.0 * scale for p in PARTS}}]

    # The host drifts 2x over the rounds; B is 0.8x of A within every pair.
    rows = summary({"a": [run(1.0), run(2.0), run(1.5)], "b": [run(0.8), run(1.6), run(1.2)]})
    total = next(r for r in rows if r["part"] == "total_us")
    assert total["ratio_median"] == pytest.approx(0.8)
    assert (total["ratio_min"], total["ratio_max"]) == (pytest.approx(0.8), pytest.approx(0.8))
    assert total["a_median"] == 150.0 and total["b_median"] == 120.0
    assert main([str(tmp_path), str(tmp_path)]) == 2
    assert "no checkout of this project" in capsys.readouterr().err
    # A checkout whose host_cost fails: one line naming the tree and its last error line.
    broken = tmp_path / "broken"
    (broken / "bench" / "sglang").mkdir(parents=True)
    for init in (broken / "bench" / "__init__.py", broken / "bench" / "sglang" / "__init__.py"):
        init.write_text("")
    (broken / "bench" / "sglang" / "host_cost.py").write_text(
        "import sys\nsys.exit('host_cost: the worker would not build')\n")
    assert main([str(broken), str(broken), "--rounds", "2", "--out", str(tmp_path / "ab")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: host_cost in") and "would not build" in err[-1]


def test_the_host_cost_bench_times_each_part_of_a_workers_step(supported_sglang, tmp_path):
    """Run as a user would (its own process: it stubs SGLang's parent methods)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "host.json"
    done = subprocess.run([sys.executable, "-m", "bench.sglang.host_cost", "--bs", "1,16",
                           "--steps", "200", "--step-log", "--opcodes", "20", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["bs"] for r in rows] == [1, 16]
    assert all(r["before_launch_us"] > 0 and r["verify_hook_us"] > 0 for r in rows)
    # The bytecode count: every part runs Python; the hook's loop over a batch's requests (its
    # acceptance, per request) runs in C where it builds.
    ops = result["opcodes"]
    assert [r["bs"] for r in ops] == [1, 16]
    assert all(r["before_launch_ops"] > 0 and r["verify_hook_ops"] > 0 for r in ops)
    if _c_loops_built():
        assert ops[1]["verify_hook_ops"] == ops[0]["verify_hook_ops"]
    bad = subprocess.run([sys.executable, "-m", "bench.sglang.host_cost", "--bs", "one"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "error: argument --bs" in bad.stderr
    assert out.with_suffix(".png").stat().st_size > 0


def test_lazy_catch_up_events_reach_the_step_log_under_their_kinds(bare_sglang_worker, tmp_path):
    """Each typed event is one step-log line named by its kind, its fields as they were (the
    readers of the log look them up by name), the running totals beside them."""
    from dual_graph_worker.engines.sglang.backlog import BacklogStats
    from dual_graph_worker.engines.sglang.lazy_sync import (CatchUpEvent, CompactionEvent,
                                                            DeferredPrefillEvent)

    w = bare_sglang_worker(PinnedPolicy(mode=Mode.SPEC), step_log=tmp_path / "steps.jsonl")
    events = [DeferredPrefillEvent(2, 96, False), CompactionEvent(40, 64),
              CatchUpEvent(False, 2, 7, 1, 4, 0, True, {"indices": 12.5})]
    for e in events:
        w._log_lazy_event(e, BacklogStats(catch_ups=3))
    w._step_log.close()
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    lazy = [line for line in lines if line.get("event") in ("deferred_prefill", "compaction",
                                                              "catch_up")]
    assert [line["event"] for line in lazy] == ["deferred_prefill", "compaction", "catch_up"]
    for line, e in zip(lazy, events):
        assert {k: line[k] for k in e._fields} == e._asdict()
        assert line["totals"]["catch_ups"] == 3
