"""The GPU suite's CPU-testable parts: configs, workloads, comparisons, reports, the plugin shim,
argument parsing and the time-budget guard (no SGLang, no GPU, no engine started)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sglang import report  # noqa: E402
from bench.sglang.model_configs import (  # noqa: E402
    llama3_8b_shapes,
    toy_shapes,
    write_eagle3_draft_config,
    write_llama_config,
)
from bench.sglang.plugin_shim import GROUP, NAME, TARGET, write_entry_point_shim  # noqa: E402
from bench.sglang.run_sglang_suite import EngineRun, Suite, not_run, parse_args, verdict  # noqa: E402
from bench.sglang.workload import (  # noqa: E402
    compare_outputs,
    greedy_chain,
    parse_decode_log,
    permutation_from_lm_head,
    shared_prefix_prompts,
    ramp_profile,
    random_prompts,
    staggered_requests,
    summarize_catch_ups,
    summarize_steps,
)
from dual_graph_worker.core.modes import Mode  # noqa: E402
from dual_graph_worker.core.policy import Reason  # noqa: E402
from dual_graph_worker.core.results import StepRecord  # noqa: E402


def test_llama3_8b_configs(tmp_path):
    s = llama3_8b_shapes()
    t = json.loads((write_llama_config(tmp_path / "t", s) / "config.json").read_text())
    d = json.loads((write_eagle3_draft_config(tmp_path / "d", s) / "config.json").read_text())
    assert t["architectures"] == ["LlamaForCausalLM"] and t["num_hidden_layers"] == 32
    assert (t["hidden_size"], t["intermediate_size"], t["vocab_size"]) == (4096, 14336, 128256)
    assert d["architectures"] == ["LlamaForCausalLMEagle3"] and d["num_hidden_layers"] == 1
    assert d["draft_vocab_size"] == d["vocab_size"] == 128256   # needed with dummy weights
    assert toy_shapes(512).hidden_size == 512 == toy_shapes(512).vocab_size


def test_constructed_target_continuation():
    perm = [2, 0, 3, 1]
    lm_head = torch.zeros(4, 4)
    for t, nxt in enumerate(perm):
        lm_head[nxt, t] = 1.0           # logits of e_t: column t, argmax row perm[t]
    assert permutation_from_lm_head(lm_head) == perm
    assert greedy_chain(perm, 0, 5) == [2, 3, 1, 0, 2]


def test_prompts_are_seeded_and_in_range():
    a = random_prompts(3, 8, 50, seed=1)
    assert a == random_prompts(3, 8, 50, seed=1) and a != random_prompts(3, 8, 50, seed=2)
    assert all(2 <= t < 50 for p in a for t in p) and [len(p) for p in a] == [8, 8, 8]


def test_compare_outputs_reports_first_mismatch():
    rep = compare_outputs([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]])
    assert not rep.ok and rep.exact == 1 and rep.matching_tokens == 4
    assert rep.first_mismatches == [(1, 1, 5, 6)]
    assert compare_outputs([[1]], [[1]]).ok
    with pytest.raises(ValueError):
        compare_outputs([[1]], [])


def _rec(step, mode, accept, bs=2, graph=True):
    return StepRecord(step, mode, bs, bs, Reason.THRESHOLD, graph, int(accept * bs), accept)


def test_summarize_steps_finds_switches_and_accept_after_switch_back():
    recs = [_rec(0, Mode.SPEC, 4.0), _rec(1, Mode.DECODE, 1.0), _rec(2, Mode.DECODE, 1.0),
            _rec(3, Mode.SPEC, 3.0), _rec(4, Mode.DECODE, 1.0, graph=False),
            _rec(5, Mode.SPEC, 4.0)]
    s = summarize_steps(reversed(recs))
    assert (s.steps, s.spec_steps, s.decode_steps, s.switches, s.eager_steps) == (6, 3, 3, 4, 1)
    assert s.switches_back == 2
    assert s.accept_after_switch_back == 3.5 and s.min_accept_after_switch_back == 3.0
    assert s.spec_mean_accept == pytest.approx(11 / 3)
    assert summarize_steps([]).accept_after_switch_back is None


def test_request_waves_restart_the_stagger_after_each_gap():
    prompts = [[i] for i in range(6)]
    reqs = staggered_requests(prompts, lengths=[4, 8], gap_s=0.1, waves=2, wave_gap_s=2.0)
    assert [round(t, 3) for t, _, _ in reqs] == [0.0, 0.1, 0.2, 2.0, 2.1, 2.2]
    assert [n for _, _, n in reqs] == [4, 8, 4, 8, 4, 8]
    assert staggered_requests(prompts, lengths=[4], gap_s=0.1) == staggered_requests(
        prompts, lengths=[4], gap_s=0.1, waves=1, wave_gap_s=9.0)


def test_staggered_requests_and_ramp_profile():
    reqs = staggered_requests([[5], [6], [7]], lengths=[10, 20], gap_s=0.5)
    assert reqs == [(0.0, [5], 10), (0.5, [6], 20), (1.0, [7], 10)]
    assert ramp_profile([1, 8, 64], 2) == [(1, 2.0), (8, 2.0), (64, 2.0), (8, 2.0), (1, 2.0)]


def test_markdown_table_marks_the_best_engine():
    engines = {"plain": {"tasks": {"sweep": {"points": [{"concurrency": 1, "tok_s": 200},
                                                        {"concurrency": 256, "tok_s": 13000}]}}},
               "dual": {"tasks": {"sweep": {"points": [{"concurrency": 1, "tok_s": 390},
                                                       {"concurrency": 256, "tok_s": 12900}]}}},
               "broken": {"error": "x"}}
    levels, table = report.throughput_rows(engines)
    md = report.markdown_throughput(levels, table, "note")
    assert levels == [1, 256] and "| dual | 390 | 12900 |" in md
    assert "| best | dual | plain |" in md and "| broken | - | - |" in md


def test_ratio_table_divides_each_dual_engine_by_the_best_baseline():
    table = {"plain": {1: 200.0, 64: 7000.0}, "eagle3": {1: 400.0, 64: 5000.0},
             "dual": {1: 392.0, 64: 6930.0}, "dual-eager-draft": {64: 6230.0}}
    ratios = report.dual_ratios([1, 64], table)
    assert set(ratios) == {"dual", "dual-eager-draft"}
    assert ratios["dual"]["vs_best"] == pytest.approx({1: 0.98, 64: 0.99})
    assert ratios["dual"]["vs_plain"] == pytest.approx({1: 1.96, 64: 0.99})
    assert ratios["dual-eager-draft"]["vs_best"] == pytest.approx({64: 0.89})
    md = report.markdown_ratios([1, 64], table)
    assert "| dual / max(plain, eagle3) | 0.980 | 0.990 |" in md
    assert "| dual-eager-draft / plain | - | 0.890 |" in md
    assert report.markdown_ratios([1], {"plain": {1: 1.0}}) == ""


def test_decode_phase_takes_the_prefill_out_and_compares_with_plain():
    def sweep(points):
        return {"tasks": {"sweep": {"output_len": 129, "points": points}}}

    engines = {
        "plain": sweep([{"concurrency": 64, "seconds": 2.0, "prefill_only_seconds": 0.72},
                        {"concurrency": 256, "seconds": 4.0, "prefill_only_seconds": 1.44}]),
        "dual": sweep([{"concurrency": 64, "seconds": 2.0256, "prefill_only_seconds": 0.72},
                       {"concurrency": 256, "seconds": 4.2}]),          # no probe at 256
        "eagle3": sweep([{"concurrency": 64, "seconds": 3.0}]),         # run without probes
    }
    ms = report.decode_phase_ms(engines)
    assert set(ms) == {"plain", "dual"}
    assert ms["plain"] == pytest.approx({64: 10.0, 256: 20.0})
    assert ms["dual"] == pytest.approx({64: 10.2})
    md = report.markdown_decode_phase(engines)
    assert "| dual / plain | 1.020 | - |" in md and "| plain | 10.00 | 20.00 |" in md
    assert report.markdown_decode_phase({"eagle3": engines["eagle3"]}) == ""


def test_sweep_probe_times_a_one_token_batch_on_fresh_prompts():
    from bench.sglang import engine_child

    calls = []

    class FakeEngine:
        def generate(self, input_ids, sampling_params):
            calls.append((input_ids, sampling_params["max_new_tokens"]))
            return [{"output_ids": [0] * sampling_params["max_new_tokens"]} for _ in input_ids]

    task = {"concurrency": [4], "input_len": 8, "output_len": 16, "vocab": 100,
            "warmup": False, "prefill_probe": True}
    res = engine_child.run_sweep(FakeEngine(), task, emit=lambda r: None)
    (point,) = res["points"]
    assert point["output_tokens"] == 64 and point["prefill_only_seconds"] >= 0
    # the probe first: both runs start from the state the previous point left
    (probe, n_probe), (main, n_main) = calls
    assert (n_main, n_probe) == (16, 1) and len(probe) == 4
    assert probe != main                     # no radix-cache hit on the probe's prefill
    calls.clear()
    res = engine_child.run_sweep(FakeEngine(), dict(task, prefill_probe=False), lambda r: None)
    assert len(calls) == 1 and "prefill_only_seconds" not in res["points"][0]


def test_shape_warm_up_runs_every_batch_shape_on_fresh_prompts_before_timing():
    from bench.sglang import engine_child
    from bench.sglang.policy_matrix import Workload, tasks_for

    calls = []

    class FakeEngine:
        def generate(self, input_ids, sampling_params):
            calls.append((tuple(map(tuple, input_ids)), sampling_params["max_new_tokens"]))
            return [{"output_ids": [0] * sampling_params["max_new_tokens"]} for _ in input_ids]

    task = {"concurrency": [1, 4], "input_len": 8, "output_len": 64, "vocab": 100,
            "warmup": False, "warm_shapes": True}
    res = engine_child.run_sweep(FakeEngine(), task, emit=lambda r: None)
    assert [(len(p), n) for p, n in calls] == [(1, 16), (4, 16), (1, 64), (4, 64)]
    assert not set(calls[1][0]) & set(calls[3][0])       # the timed prompts are fresh
    assert isinstance(res["warm_shapes_seconds"], float) and len(res["points"]) == 2
    # Only each engine's first phase warms, and every engine's alike.
    w = [Workload.parse("8x64@1,4")]
    for kind in ("plain", "eagle3", "dual"):
        sweeps = [t for t in tasks_for(kind, [1.5, 3.0], w, 100) if t["kind"] == "sweep"]
        assert [t["warm_shapes"] for t in sweeps] == [True] + [False] * (len(sweeps) - 1)


def test_a_sweep_freezes_the_collectors_once_warm_and_records_each_cells_pauses():
    """With freeze_gc the engine's collectors freeze after the warm-up and the shape warm-up,
    before the first timed batch; every cell holds this process's collection pauses."""
    import gc

    from bench.sglang import engine_child

    calls = []

    class FakeEngine:
        def generate(self, input_ids, sampling_params):
            calls.append(("generate", sampling_params["max_new_tokens"]))
            gc.collect()                        # a collection while the cell's batch runs
            return [{"output_ids": [0] * sampling_params["max_new_tokens"]} for _ in input_ids]

        def freeze_gc(self):
            calls.append(("freeze", None))

    task = {"concurrency": [1, 4], "input_len": 8, "output_len": 32, "vocab": 100,
            "warmup": True, "warm_shapes": True, "freeze_gc": True}
    res = engine_child.run_sweep(FakeEngine(), task, emit=lambda r: None)
    assert calls == [("generate", engine_child.WARMUP_TOKENS), ("generate", 16),
                     ("generate", 16), ("freeze", None), ("generate", 32), ("generate", 32)]
    assert res["gc_frozen"]
    for point in res["points"]:
        assert point["machine"]["bench_gc_ms"]["gen2"][0] == 1      # its own batch's, alone
    calls.clear()
    del task["freeze_gc"]
    engine_child.run_sweep(FakeEngine(), task, emit=lambda r: None)
    assert ("freeze", None) not in calls


def test_a_short_cell_runs_again_on_fresh_prompts_and_reads_the_median(monkeypatch):
    from bench.sglang import engine_child
    from bench.sglang.policy_matrix import Repeats, Workload, sweep_task, tasks_for

    clock = [0.0]
    seconds = iter([0.5, 0.4, 0.8, 3.0])       # C=1: three runs (the first < 2 s); C=4: one
    calls = []

    class FakeEngine:
        def generate(self, input_ids, sampling_params):
            calls.append(tuple(map(tuple, input_ids)))
            clock[0] += next(seconds)
            return [{"output_ids": [0] * sampling_params["max_new_tokens"]} for _ in input_ids]

    monkeypatch.setattr(engine_child.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(engine_child, "probe_ms", lambda: 0.0)
    (task,) = [t for t in tasks_for("dual", [2.0], [Workload.parse("8x40@1,4")], 100,
                                    Repeats(2.0, 3)) if t["kind"] == "sweep"]
    task["warmup"] = task["warm_shapes"] = False
    one, four = engine_child.run_sweep(FakeEngine(), task, emit=lambda r: None)["points"]
    assert one["runs_tok_s"] == [80.0, 100.0, 50.0] and one["tok_s"] == 80.0
    # the median run's own seconds and tokens; every run's in the totals
    assert (one["seconds"], one["output_tokens"]) == (0.5, 40)
    assert one["output_tokens_total"] == 120 and one["seconds_total"] == pytest.approx(1.7)
    assert len(set(calls[:3])) == 3                      # fresh prompts each run
    assert four["tok_s"] == pytest.approx(160 / 3) and "runs_tok_s" not in four
    # The matrix repeats short cells by default; a bare sweep task (capture_compare's) does not.
    (matrix,) = [t for t in tasks_for("dual", [2.0], [Workload.parse("8x40@1")], 100)
                 if t["kind"] == "sweep"]
    assert (matrix["short_cell_s"], matrix["short_cell_runs"]) == (2.0, 3)
    bare = sweep_task(Workload.parse("8x40@1"), "w", 100, warm_shapes=False, seed=1)
    assert (bare["short_cell_s"], bare["short_cell_runs"]) == (0.0, 1)
    # Repeats draw fresh prompts only below the seed stride: a larger C is refused.
    big = dict(task, concurrency=[engine_child.REPEAT_SEED_STRIDE])
    with pytest.raises(ValueError, match="short-cell repeats and rounds need C"):
        engine_child.run_sweep(FakeEngine(), big, emit=lambda r: None)


def test_repeat_seeds_never_meet_each_other_the_probe_or_the_warm_up():
    from bench.sglang.engine_child import MAX_RUNS, REPEAT_SEED_STRIDE

    offsets = {(c, "run", r): c + REPEAT_SEED_STRIDE * r
               for c in range(1, REPEAT_SEED_STRIDE) for r in range(MAX_RUNS)}
    used = list(offsets.values())
    assert len(set(used)) == len(used) and max(used) < 4000       # probe +4000, warm-up +7000


def test_decode_step_time_flag_asks_the_sweep_for_prefill_probes(tmp_path, monkeypatch):
    for argv, want in (([], False), (["--decode-step-time"], True)):
        suite, ran = _recording_suite(tmp_path, argv + ["--no-adaptive"], monkeypatch)
        suite.bench(with_ramp=False)
        assert {er.tasks[0]["prefill_probe"] for er in ran} == {want}


def _bench_envs(tmp_path, monkeypatch, *flags):
    """{engine: env} of a recorded bench with `flags`, and the suite."""
    suite, ran = _recording_suite(tmp_path, [*flags, "--no-adaptive"], monkeypatch)
    suite.bench(with_ramp=False)
    return {er.name: er.env for er in ran}, suite


def test_with_eager_draft_adds_the_eager_keep_current_engine(tmp_path, monkeypatch):
    envs, _ = _bench_envs(tmp_path, monkeypatch, "--with-eager-draft")
    assert list(envs) == ["plain", "eagle3", "dual", "dual-eager-draft"]
    assert envs["dual-eager-draft"]["DGW_DRAFT_EXTEND_GRAPHS"] == "0"
    assert "DGW_DRAFT_EXTEND_GRAPHS" not in envs["dual"]       # graphs: the default


def test_with_no_defer_adds_the_engine_without_deferred_prefill(tmp_path, monkeypatch):
    envs, suite = _bench_envs(tmp_path, monkeypatch, "--with-no-defer")
    assert list(envs) == ["plain", "eagle3", "dual", "dual-no-defer"]
    assert envs["dual-no-defer"]["DGW_DEFER_DRAFT_PREFILL"] == "0"
    assert "DGW_DEFER_DRAFT_PREFILL" not in envs["dual"]      # deferral: the default
    assert "dual-no-defer" in suite.notes["bench"]


def test_the_bench_says_what_is_forced_before_its_first_engine_and_in_its_summary(
        tmp_path, monkeypatch):
    suite, ran = _recording_suite(tmp_path, ["--no-adaptive"], monkeypatch)
    notes_at_run = []
    recorded = suite.run

    def run(er):
        notes_at_run.append(suite.notes.get("bench", ""))
        return recorded(er)

    monkeypatch.setattr(suite, "run", run)
    suite.bench(with_ramp=False)
    assert notes_at_run and all("accept length FORCED" in n and "DUMMY weights" in n
                                for n in notes_at_run)
    summary = suite.final_summary()
    assert "FORCED" in summary and "DUMMY" in summary


def test_with_radix_cache_adds_sglangs_default_server_pair(tmp_path, monkeypatch):
    suite, ran = _recording_suite(tmp_path, ["--with-radix-cache", "--no-adaptive",
                                             "--decode-log-interval", "20"], monkeypatch)
    suite.bench(with_ramp=False)
    kwargs = {er.name: er.engine_kwargs for er in ran}
    assert list(kwargs) == ["plain", "eagle3", "dual", "plain-radix", "dual-radix"]
    assert [kwargs[n]["disable_radix_cache"] for n in kwargs] == [True, True, True, False,
                                                                   False]
    # the pair differs from the others in the radix cache only
    for n in ("plain", "dual"):
        assert {k: v for k, v in kwargs[n + "-radix"].items() if k != "disable_radix_cache"} \
            == {k: v for k, v in kwargs[n].items() if k != "disable_radix_cache"}
    assert "plain-radix, dual-radix: the radix cache on" in suite.notes["bench"]


def test_every_engine_runs_the_attention_backend_asked_for(tmp_path, monkeypatch):
    for argv, want in (([], "triton"), (["--attention-backend", "flashinfer"], "flashinfer"),
                       (["--attention-backend", "default"], None)):      # SGLang picks
        suite, ran = _recording_suite(tmp_path, ["--no-adaptive"] + argv, monkeypatch)
        suite.bench(with_ramp=False)
        assert {er.engine_kwargs["attention_backend"] for er in ran} == {want}


def test_with_radix_cache_adds_a_toy_check_on_shared_prefixes(tmp_path, monkeypatch):
    from bench.sglang import run_sglang_suite as suite_mod

    suite, ran = _recording_suite(tmp_path, ["--with-radix-cache", "--exact-requests", "6"],
                                  monkeypatch)
    monkeypatch.setattr(suite, "toy_checkpoints", lambda: tmp_path / "toy")
    monkeypatch.setattr(suite_mod, "load_toy_permutation", lambda d: list(range(1, 500)) + [0])
    suite.correctness()
    toy = {er.name: er for er in ran if er.name.startswith("dual-toy")}
    assert list(toy) == ["dual-toy", "dual-toy-radix", "dual-toy-dummy"]
    assert toy["dual-toy"].engine_kwargs["disable_radix_cache"] is True
    assert toy["dual-toy-radix"].engine_kwargs["disable_radix_cache"] is False
    prompts = [r[1] for r in toy["dual-toy-radix"].tasks[0]["requests"]]
    assert len({tuple(p[:12]) for p in prompts}) == 1 and len({p[-1] for p in prompts}) > 1
    assert "constructed toy: dual, radix cache on == known greedy" in suite.checks


def test_shared_prefix_prompts_keep_each_prompts_tail():
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    assert shared_prefix_prompts(prompts, 3) == [[5, 6, 7, 8], [5, 6, 7, 12]]
    assert shared_prefix_prompts(prompts, 0) == prompts
    with pytest.raises(ValueError, match="last token"):
        shared_prefix_prompts(prompts, 4)


def test_ratios_of_a_setting_variant_use_that_settings_baselines():
    table = {"plain": {64: 7000.0}, "eagle3": {64: 5000.0}, "dual": {64: 6930.0},
             "plain-radix": {64: 6800.0}, "dual-radix": {64: 6664.0}}
    ratios = report.dual_ratios([64], table)
    assert ratios["dual-radix"]["vs_plain"] == pytest.approx({64: 0.98})
    assert ratios["dual-radix"]["vs_best"] == pytest.approx({64: 0.98})
    assert ratios["dual"]["vs_plain"] == pytest.approx({64: 0.99})
    md = report.markdown_ratios([64], table)
    assert "| dual-radix / max(plain-radix, eagle3) | 0.980 |" in md
    assert "| dual-radix / plain-radix | 0.980 |" in md
    phase = report._markdown_phase("t", {"plain": {64: 2.0}, "plain-radix": {64: 2.5},
                                         "dual-radix": {64: 2.55}, "dual": {64: 2.1}}, ".2f")
    assert "| dual-radix / plain-radix | 1.020 |" in phase
    assert "| plain-radix / plain | 1.250 |" in phase
    assert "| dual / plain | 1.050 |" in phase
    # without its own baseline a variant falls back to the default one
    assert report.baseline("dual-radix", "plain", {"plain": {}}) == "plain"


def test_prefill_phase_table_is_the_probe_and_its_ratio_to_plain():
    def res(pre):
        return {"tasks": {"sweep": {"output_len": 8, "points": [
            {"concurrency": 4, "seconds": 1.0, "prefill_only_seconds": pre}]}}}

    md = report.markdown_prefill_phase({"plain": res(0.5), "dual": res(0.55)})
    assert "| plain | 0.500 |" in md and "| dual / plain | 1.100 |" in md
    assert report.markdown_prefill_phase({"plain": {}}) == ""


def test_parse_decode_log_keeps_decode_mode_windows():
    lines = [
        "[2026-11-29 14:00:00] Decode batch, #running-req: 64, #token: 9000, token usage: 0.01, "
        "cuda graph: True, gen throughput (token/s): 9800.50, #queue-req: 0",
        "[2026-11-29 14:00:01 TP0] Decode batch, #running-req: 64, #token: 9100, token usage: "
        "0.01, accept len: 1.00, accept rate: 0.00, cuda graph: True, gen throughput (token/s): "
        "9700.00, #queue-req: 0",
        "[2026-11-29 14:00:02] Decode batch, #running-req: 8, #token: 900, token usage: 0.00, "
        "accept len: 3.00, accept rate: 0.67, cuda graph: True, gen throughput (token/s): "
        "2500.00, #queue-req: 0",                       # speculative window: left out
        "[2026-11-29 14:00:03] Prefill batch, #new-seq: 4, #new-token: 1024",
    ]
    assert parse_decode_log(lines) == {64: [9800.5, 9700.0]}


def test_decode_log_table_compares_step_times_at_one_batch_size():
    plain = {"decode_log": {64: [10000.0, 9000.0, 10000.0], 128: [12800.0]}}
    dual = {"decode_log": {"64": [9900.0, 9800.0]}}       # JSON keys are strings
    ms = report.decode_log_step_ms({"plain": plain, "dual": dual})
    assert ms["plain"] == {64: 6.4} and 128 not in ms["plain"]      # one window: left out
    assert abs(ms["dual"][64] - 1000.0 * 64 / 9850.0) < 1e-9
    md = report.markdown_decode_log({"plain": plain, "dual": dual})
    assert "| dual / plain |" in md and "| plain | 6.40 |" in md


def test_engines_flag_runs_only_the_named_engines(tmp_path, monkeypatch):
    suite = Suite(parse_args(["--out", str(tmp_path), "--engines", "plain,dual"]))
    monkeypatch.setattr("subprocess.run", lambda *a, **k: pytest.fail("started an engine"))
    res = suite.run(EngineRun("eagle3", "bench", {}, {}, [], est_s=1))
    assert res["skipped"] == "not in --engines" and "eagle3" not in suite.runs
    suite, ran = _recording_suite(tmp_path, ["--no-adaptive", "--decode-log-interval", "20"],
                                  monkeypatch)
    suite.bench(with_ramp=False)
    assert all(er.engine_kwargs["decode_log_interval"] == 20
               and er.engine_kwargs["log_level"] == "info" for er in ran)


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    levels, table = [1, 4], {"plain": {1: 1.0, 4: 3.0}}
    assert report.plot_throughput(levels, table, tmp_path / "t.png", "t").exists()
    steps = [(10.0, 1, "spec"), (10.5, 16, "decode"), (11.0, 2, "spec")]
    phases = [{"phase": 1, "t_start": 10.0, "t_end": 10.4},
              {"phase": 16, "t_start": 10.4, "t_end": 11.0}]
    assert report.plot_ramp(steps, phases, tmp_path / "r.png", "ramp").exists()


def test_entry_point_shim_is_visible_to_a_fresh_interpreter(tmp_path):
    shim = write_entry_point_shim(tmp_path / "shim")
    code = textwrap.dedent(f"""
        import importlib.metadata as md
        eps = [e for e in md.entry_points(group={GROUP!r}) if e.name == {NAME!r}]
        assert eps and eps[0].value == {TARGET!r}, eps
        print(eps[0].load().__name__)
    """)
    env = {"PYTHONPATH": f"{shim}:{ROOT}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "register"


def test_suite_args_and_budget_guard(tmp_path):
    args = parse_args(["--out", str(tmp_path), "--phases", "bench,ramp", "--budget-s", "1",
                       "--concurrency", "1,4"])
    assert args.phases == ["bench", "ramp"] and args.concurrency == [1, 4]
    with pytest.raises(SystemExit):
        parse_args(["--out", str(tmp_path), "--phases", "bogus"])
    suite = Suite(args)
    res = suite.run(EngineRun("plain", "bench", {}, {}, [], est_s=60))
    assert "budget" in res["skipped"]            # no engine process was started
    suite.write()
    data = json.loads((tmp_path / "suite.json").read_text())
    assert data["engines"]["plain"]["skipped"].startswith("budget")
    assert (tmp_path / "report.md").exists()
    assert "elapsed" in suite.final_summary()


def test_a_check_that_never_ran_reads_not_run_and_an_engine_error_reads_fail(tmp_path):
    assert verdict(not_run(None, "budget: needs ~85 s, 7 s left")) == "NOT RUN"
    assert verdict(not_run("engine exited 1", "budget")) == "FAIL"
    assert verdict(not_run(None, None)) == "FAIL"
    suite = Suite(parse_args(["--out", str(tmp_path)]))
    suite.checks["dummy weights: dual == plain SGLang"] = not_run(None, "budget: 7 s left")
    suite.checks["constructed toy: dual == known greedy"] = {"ok": True}
    suite.write()
    md = (tmp_path / "report.md").read_text()
    assert "dual == plain SGLang: NOT RUN" in md and "known greedy: PASS" in md
    assert "NOT RUN budget: 7 s left" in suite.final_summary()


def test_summarize_catch_ups():
    events = [{"event": "ready"},
              {"event": "catch_up", "forced": False, "requests": 3, "tokens": 30, "passes": 1,
               "max_backlog": 12, "orphans": 0},
              {"event": "catch_up", "forced": True, "requests": 2, "tokens": 8, "passes": 2,
               "max_backlog": 5, "orphans": 1,
               "totals": {"deferred_prefills": 1, "deferred_prefill_tokens": 9}},
              {"event": "compaction", "live_cells": 4,
               "totals": {"deferred_prefills": 2, "deferred_prefill_tokens": 20,
                          "compactions": 1, "chunk_restarts": 0}}]
    assert summarize_catch_ups(events) == {"catch_ups": 2, "deferred_prefills": 2,
                                           "deferred_prefill_tokens": 20, "compactions": 1,
                                           "chunk_restarts": 0, "forced": 1, "tokens": 38,
                                           "requests": 5, "passes": 3, "max_backlog": 12,
                                           "orphans": 1}
    assert summarize_catch_ups([])["catch_ups"] == 0


def _recording_suite(tmp_path, argv, monkeypatch):
    args = parse_args(["--out", str(tmp_path)] + argv)
    suite = Suite(args)
    ran = []

    def fake_run(er):
        ran.append(er)
        suite.runs[er.name] = er
        return {}

    monkeypatch.setattr(suite, "run", fake_run)
    monkeypatch.setattr(suite, "toy_checkpoints", lambda: None)
    return suite, ran


@pytest.mark.parametrize("extra", [[], ["--with-lazy"], ["--with-continuity", "keep-current"]])
def test_continuity_variants_add_dual_engines_next_to_the_default(tmp_path, monkeypatch, extra):
    suite, ran = _recording_suite(tmp_path, extra, monkeypatch)
    suite.correctness()
    suite.bench(with_ramp=False)
    names = [er.name for er in ran]
    envs = {er.name: er.env for er in ran}
    # The default engines run what a user gets: no DGW_CONTINUITY (lazy catch-up today).
    for name in ("dual-toy-dummy", "dual"):
        assert "DGW_CONTINUITY" not in envs[name] and "DGW_STEP_LOG" in envs[name]
    assert "continuity lazy-catch-up (the worker's default)" in suite.notes["bench"]
    if extra == ["--with-continuity", "keep-current"]:
        assert names == ["plain-toy-dummy", "dual-toy-dummy", "dual-toy-dummy-keep-current",
                         "plain", "eagle3", "dual", "dual-keep-current", "eagle3-adaptive"]
        for name in ("dual-toy-dummy-keep-current", "dual-keep-current"):
            assert envs[name]["DGW_CONTINUITY"] == "keep-current"
            assert envs[name]["DGW_STEP_LOG"] != envs[name.replace("-keep-current", "")][
                "DGW_STEP_LOG"]
        assert envs["dual-keep-current"]["SGLANG_SIMULATE_ACC_LEN"] == envs["dual"][
            "SGLANG_SIMULATE_ACC_LEN"]
        assert set(suite.checks) == {"dummy weights: dual == plain SGLang",
                                     "dummy weights: dual keep-current == plain SGLang"}
    else:
        # --with-lazy asks for the default itself: nothing is added.
        assert names == ["plain-toy-dummy", "dual-toy-dummy", "plain", "eagle3", "dual",
                         "eagle3-adaptive"]
        assert set(suite.checks) == {"dummy weights: dual == plain SGLang"}


def test_bench_engines_can_run_without_the_step_log(tmp_path, monkeypatch):
    suite, ran = _recording_suite(tmp_path, ["--no-bench-step-log", "--no-adaptive"],
                                  monkeypatch)
    suite.correctness()
    suite.bench(with_ramp=False)
    envs = {er.name: er.env for er in ran}
    assert "DGW_STEP_LOG" not in envs["dual"]
    assert "DGW_STEP_LOG" in envs["dual-toy-dummy"]        # correctness needs its steps


def test_lazy_check_requires_catch_ups(tmp_path):
    suite = Suite(parse_args(["--out", str(tmp_path), "--with-lazy"]))
    log = tmp_path / "steps.jsonl"
    log.write_text(json.dumps({"event": "ready", "t": 0}) + "\n")
    check = {"ok": True}
    suite.check_catch_ups(check, "keep-current", str(log))
    assert check == {"ok": True}
    suite.check_catch_ups(check, "lazy-catch-up", str(log))
    assert check["ok"] is False and check["catch_ups"]["catch_ups"] == 0
    check = {"ok": True}
    suite.check_catch_ups(check, "default", str(log))      # the default engine runs lazy
    assert check["ok"] is False
    with open(log, "a") as fh:
        fh.write(json.dumps({"event": "catch_up", "t": 1, "tokens": 4, "requests": 1}) + "\n")
    check = {"ok": True}
    suite.check_catch_ups(check, "lazy-catch-up", str(log))
    assert check["ok"] is True and check["catch_ups"]["tokens"] == 4


def test_stall_trace_flag_gives_every_dual_engine_a_stall_file(tmp_path, monkeypatch):
    envs, suite = _bench_envs(tmp_path, monkeypatch, "--stall-trace-s", "1.5", "--with-no-defer")
    for name in ("dual", "dual-no-defer"):
        assert envs[name]["DGW_STALL_TRACE_S"] == "1.5"
        assert envs[name]["DGW_STALL_TRACE"].endswith(f"stall-{name}-bench.jsonl")
    assert "DGW_STALL_TRACE" not in envs["plain"] and "DGW_STALL_TRACE" not in envs["eagle3"]
    envs, _ = _bench_envs(tmp_path, monkeypatch)
    assert "DGW_STALL_TRACE" not in envs["dual"]                 # off unless asked for


def test_gap_summary_names_the_longest_gaps_after_start_up(tmp_path):
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(d) + "\n" for d in [
        {"event": "ready", "t": 0.0},
        {"step": 0, "mode": "spec", "bs": 1, "t": 50.0},
        {"event": "deferred_prefill", "t": 50.1},
        {"step": 1, "mode": "decode", "bs": 128, "t": 58.8},
        {"step": 2, "mode": "decode", "bs": 128, "t": 58.9}]))
    gaps = Suite.gap_summary(str(log), top=2)
    assert gaps == [{"gap_s": 8.7, "between": "deferred_prefill -> decode"},
                    {"gap_s": 0.1, "between": "spec -> deferred_prefill"}]
    assert Suite.gap_summary(None) == []


def test_step_costs_tell_a_runs_first_steps_from_its_steady_ones(tmp_path):
    """The cost events a worker's step log carries, grouped by place in the run since a switch."""
    from bench.sglang import step_costs
    from dual_graph_worker.core.step_log import StepLogWriter, read_step_events

    log = StepLogWriter(tmp_path / "steps.jsonl")
    seq = [("spec", 0.007, 0, False)] * 6 + [("decode", 0.012, 0, False),
                                             ("decode", 0.009, 0, False)] + \
        [("decode", 0.005, 0, False)] * 10 + [("decode", 0.019, 0, True),
                                              ("spec", 0.020, 300, False)]   # catch-up: out
    for mode, seconds, caught, carries in seq:
        log.write_event("cost", 0.0, kind="StepTime", mode=mode, padded_bs=1, seconds=seconds,
                        catch_up_tokens=caught, carries_next=carries)
    log.write_event("cost", 0.0, kind="PrefillTime", tokens=64, seconds=0.01, draft=True)
    log.close()
    groups = step_costs.group_costs(read_step_events(tmp_path / "steps.jsonl"))
    assert groups[("decode", 1, "1st")] == [0.012]
    assert groups[("decode", 1, "2nd-4th")] == [0.009, 0.005, 0.005]
    assert len(groups[("decode", 1, "5th+")]) == 8 and ("spec", 1, "1st") in groups
    assert sum(len(v) for k, v in groups.items() if k[0] == "spec") == 6
    text = step_costs.report(groups)
    assert groups[("decode", 1, "carries next")] == [0.019]
    assert "| decode | 1 | 12.00 (1) | 5.00 (3) | 5.00 (8) | 19.00 (1) |" in text
    assert step_costs.main([str(tmp_path / "steps.jsonl"), "--out", str(tmp_path / "c.md")]) == 0
    saved = json.loads((tmp_path / "c.json").read_text())
    assert {"mode": "decode", "padded_bs": 1, "place": "1st", "steps": 1,
            "median_ms": pytest.approx(12.0)} in saved
    assert (tmp_path / "c.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        step_costs.main([str(tmp_path / "missing.jsonl")])


def test_step_costs_report_the_kv_only_fills_checked_error():
    """DGW_CATCH_UP_KV_CHECK's catch-ups (kv_error set) get a line: count, tokens, the errors'
    median and max; a log without them gets none."""
    from bench.sglang import step_costs

    log = [{"event": "catch_up", "tokens": 9000, "kv_error": 2e-3},
           {"event": "catch_up", "tokens": 3000, "kv_error": 4e-3},
           {"event": "catch_up", "tokens": 40, "kv_error": None}]
    line = step_costs.kv_check_report(log)
    assert "2 catch-ups, 12000 tokens" in line and "median 3.00e-03" in line \
        and "max 4.00e-03" in line
    assert step_costs.kv_check_report(log[2:]) == ""


def test_step_costs_write_the_replay_trace_of_a_workers_log(tmp_path, capsys):
    """--trace: every batch cost in order with the worker's graph lists, prior and draft share,
    the form tests/test_controller_h200_trace.py replays; a log without its 'ready' line is
    refused."""
    import gzip
    import json

    from bench.sglang import step_costs
    from dual_graph_worker.core.step_log import StepLogWriter

    log = StepLogWriter(tmp_path / "steps.jsonl")
    log.write_event("ready", 0.0, num_steps=3, spec_bs=[1, 2], decode_bs=[1, 2, 4],
                    calibration={"num_draft_tokens": 3, "latency_s": []}, draft_share=0.04)
    log.write_event("cost", 0.1, kind="PrefillTime", tokens=64, seconds=0.01, draft=True)
    log.write_event("cost", 0.2, kind="StepTime", mode="spec", padded_bs=2, seconds=0.007,
                    catch_up_tokens=0, carries_next=False, kv_tokens=130, bs=2)
    log.write_event("cost", 0.3, kind="StepTime", mode="decode", padded_bs=1, seconds=0.005,
                    catch_up_tokens=0, carries_next=True, kv_tokens=66, bs=1)
    log.close()
    out = tmp_path / "t.json.gz"
    assert step_costs.main([str(tmp_path / "steps.jsonl"), "--trace", str(out),
                            "--source", "a test"]) == 0
    t = json.loads(gzip.open(out, "rt").read())
    assert t["costs"] == [["p", 64, 0.01, 1], ["s", 2, 0.007, 0, 0, 130, 2],
                          ["d", 1, 0.005, 0, 1, 66, 1]]
    assert (t["source"], t["spec_bs"], t["num_steps"], t["draft_share"]) == \
        ("a test", [1, 2], 3, 0.04)
    # With --out as well, the report is written too (not dropped for the trace).
    report = tmp_path / "costs.md"
    assert step_costs.main([str(tmp_path / "steps.jsonl"), "--trace", str(out),
                            "--out", str(report)]) == 0
    assert report.is_file() and report.with_suffix(".json").is_file()
    (tmp_path / "bare.jsonl").write_text((tmp_path / "steps.jsonl").read_text().split("\n", 1)[1])
    with pytest.raises(SystemExit):
        step_costs.main([str(tmp_path / "bare.jsonl"), "--trace", str(out)])
    assert "no 'ready' line" in capsys.readouterr().err


def test_step_costs_list_stretches_of_slow_steps_with_what_came_before():
    """A few slow steps in a row at a context met too rarely to hold its own median are set
    against the nearest shorter context's, and listed with the catch-up before them; a slow
    step alone, steps with a catch-up in them, or steps barely over are not."""
    from bench.sglang import step_costs

    def step(t, seconds, kv, mode="spec", **extra):
        return {"event": "cost", "kind": "StepTime", "mode": mode, "padded_bs": 1,
                "seconds": seconds, "kv_tokens": kv, "t": t} | extra

    log = [step(0.01 * i, 0.008, 500) for i in range(40)]
    log += [step(0.5, 0.012, 600), step(0.51, 0.008, 600)]            # one slow step alone
    log += [{"event": "catch_up", "t": 0.6, "tokens": 2048, "host_us": {"kv": 10.0}}]
    log += [step(0.61, 0.012, 2050, catch_up_tokens=2048)]            # the catch-up's own step
    log += [step(0.62 + 0.01 * i, 0.010, 2051 + i) for i in range(4)]  # 1.25x: a stretch
    log += [step(0.7 + 0.01 * i, 0.0088, 2060 + i) for i in range(5)]  # 1.1x: none
    rows = step_costs.slow_stretches(log)
    assert [(r["mode"], r["kv_tokens"], r["steps"], r["ratio"]) for r in rows] == \
        [("spec", 2051, 4, 1.25)]
    assert rows[0]["after"] == "catch-up of 2048 (K/V only), 0.02 s before"
    text = step_costs.stretches_report(log)
    assert "| 0.6 | - | s1 | 2051 | 4 | 1.25 | catch-up of 2048 (K/V only)" in text
    assert step_costs.slow_stretches(log[:40]) == [] and step_costs.stretches_report([]) == ""


def test_step_costs_show_the_controllers_cost_terms_over_time(tmp_path):
    """The step log's "estimates" lines become a table; a log without them adds nothing."""
    from bench.sglang import step_costs
    from dual_graph_worker.core.jsonl import json_lines
    from dual_graph_worker.core.step_log import StepLogWriter

    log = StepLogWriter(tmp_path / "steps.jsonl")
    log.write_event("cost", 0.0, kind="StepTime", mode="spec", padded_bs=1, seconds=0.007)
    plain = step_costs.full_report([{"event": "cost", "kind": "StepTime", "mode": "spec",
                                     "padded_bs": 1, "seconds": 0.007}])
    for t, share, kv in ((5.0, 13.1, None), (5.5, 7.0, 0.5e-6), (6.0, 1.0, None)):
        log.write_event("estimates", t, prompt_per_output=share, replaced=0.5,
                        draft_prefill_s_per_token=1e-6, catch_up_fixed_s=0.004,
                        catch_up_s_per_token=2e-6, switch_s=0.0002, fresh_accept=1.0,
                        own_accept_weight=0.25, run_len=26.6, explore_allowance_steps=4.0,
                        explore_debt_steps=0.0, kv_catch_up_fixed_s=kv and 0.003,
                        kv_catch_up_s_per_token=kv,
                        **({"alloc_retries": 3, "reserved_gib": 70.25} if kv else {}))
    log.close()
    text = step_costs.full_report(list(json_lines(tmp_path / "steps.jsonl")))
    assert text.startswith(plain) and "(3 of 3 lines)" in text
    assert ("| 0.5 | 7.00 | 0.50 | 1.00 | 4.000 | 2.00 | 3.000 | 0.50 | 0.200 | 1.00 | 0.25 "
            "| 26.6 | 4.00 | 0.00 | 3 | 70.2 |") in text
    assert "| 1.0 | 1.00 | 0.50 | 1.00 | 4.000 | 2.00 | - | - | 0.200 |" in text
    assert step_costs.estimates_report([]) == ""


def test_step_costs_per_cell_say_where_each_cells_time_went(tmp_path, capsys):
    """--cells: the step log cut by the cells' wall-clock windows of the engine's JSON."""
    import json

    from bench.sglang import step_costs
    from dual_graph_worker.core.modes import Mode
    from dual_graph_worker.core.policy import Reason
    from dual_graph_worker.core.results import StepRecord
    from dual_graph_worker.core.step_log import StepLogWriter

    log = StepLogWriter(tmp_path / "steps.jsonl")
    for i, (t, mode, seconds, caught) in enumerate(
            [(10.1, "spec", 0.020, 0), (10.2, "spec", 0.021, 0), (10.3, "spec", 0.022, 0),
             (20.1, "decode", 0.005, 0), (20.2, "decode", 0.005, 0), (20.3, "decode", 0.006, 0),
             (20.4, "spec", 0.030, 512)]):
        log.write(StepRecord(i, Mode(mode), 16, 16, Reason.GOODPUT, True, 16, 1.0), t)
        log.write_event("cost", t, kind="StepTime", mode=mode, padded_bs=16, seconds=seconds,
                        catch_up_tokens=caught, carries_next=False)
    log.write_event("cost", 20.0, kind="PrefillTime", tokens=64, seconds=0.25, draft=False)
    log.close()
    engine = {"tasks": {
        "set-a3": {"accept_len": 3.0},
        "a3-256x256": {"input_len": 256, "output_len": 256, "points": [
            {"concurrency": 16, "tok_s": 2000.0, "seconds": 2.0, "t_start": 20.0, "t_end": 21},
            {"concurrency": 1, "tok_s": 400.0, "seconds": 0.6, "t_start": 10.0, "t_end": 11}]}}}
    (tmp_path / "dual.json").write_text(json.dumps(engine))
    assert step_costs.main([str(tmp_path / "steps.jsonl"), "--cells",
                            str(tmp_path / "dual.json")]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| a3 ")]
    # The decoding cell's one spec step (30 ms for a token a request) over a 5 ms decode step.
    # The last column: the longest stretch of the cell's runs with no step and no prefill.
    assert rows == [
        "| a3 256x256 C=1 | 400 | 0.60 | spec/goodput 3 | s16 21.00 (3) | - | - | 0.000 | - "
        "| - | 700 (tail) |",
        "| a3 256x256 C=16 | 2000 | 2.00 | decode/goodput 3, spec/goodput 1 | d16 5.00 (3) "
        "| - | 1, 512, 30.0 | 0.250 | - | 25 (1.2%) | 600 (tail) |"]
    # With SGLang's launch times: each cell's spec steps over their size's median in the log.
    log = [{"step": i, "t": t, "mode": "spec", "padded_bs": 16, "reason": "goodput",
            "launch_us": us} for i, (t, us) in enumerate(
                [(10.1, 4000.0), (10.2, 4000.0), (20.4, 6000.0), (20.5, 2000.0), (20.6, 5000.0)])]
    assert step_costs.cell_report(log, engine).splitlines()[2].endswith("| 1.00 | - | - |")
    assert step_costs.cell_report(log, engine).splitlines()[3].endswith("| 1.25 | - | - |")
    # Each mode's ms per output token from the cell's own steps, spec at the forced length.
    own = {"s16": [0.021, 0.020, 0.022], "d16": [0.005] * 3, "d8": [0.004] * 2}
    assert step_costs.own_choice(own, 16, 3.0) == "0.438 / 0.312: d"
    assert step_costs.own_choice(own, 16, 4.5) == "0.292 / 0.312: s"
    assert step_costs.own_choice(own, 16, None) == "-"


def test_a_cells_longest_idle_stretch_is_found_in_any_of_its_runs():
    """Head, gap or tail, whichever is longest over every run; None without a timed step."""
    from bench.sglang.step_costs import longest_idle

    def cost(t: float, seconds: float, kind: str = "StepTime") -> dict:
        return {"event": "cost", "kind": kind, "t": t, "seconds": seconds}

    first = [cost(1.2, 0.1, "PrefillTime"), cost(1.25, 0.05), cost(1.3, 0.05)]
    second = [cost(2.1, 0.1, "PrefillTime"), cost(2.15, 0.05), cost(2.6, 0.05), cost(2.7, 0.1)]
    assert longest_idle(first, [[1.0, 1.35]]) == pytest.approx((0.1, "head"))
    assert longest_idle(first + second, [[1.0, 1.35], [2.0, 2.75]]) == \
        pytest.approx((0.4, "gap"))                 # 2.15 to 2.55: the second run's stall
    assert longest_idle(first, [[1.0, 1.9]]) == pytest.approx((0.6, "tail"))
    assert longest_idle([], [[1.0, 2.0]]) is None
    # A run with nothing of the worker in it is one stretch; a step past a rounded span's edge
    # leaves no negative stretch.
    assert longest_idle(first, [[1.0, 1.35], [5.0, 5.5]]) == pytest.approx((0.5, "run"))
    assert longest_idle([cost(1.3, 0.35)], [[1.0, 1.3]]) == (0.0, "tail")


def test_a_cells_prefill_choices_count_the_drafted_and_show_the_first_preview():
    from bench.sglang.step_costs import prefill_choices

    def choice(draft: bool, queued: int, spec=None, decode=None) -> dict:
        return {"event": "prefill_choice", "bs": 64, "queued": queued, "priced_tokens": 131072,
                "draft": draft, "goodput_spec": spec, "goodput_decode": decode}

    unpreviewed = {"event": "prefill_choice", "previewed": False, "draft": True}
    inside = [unpreviewed, choice(False, 60, 4810.4, 5077.9), {"event": "cost"}, choice(True, 56)]
    assert prefill_choices(inside) == \
        "2 / 3, 2 previewed; bs 64, 60 queued, 131072 tokens, 4810 / 5078"
    assert prefill_choices([choice(True, 0)]).endswith("131072 tokens, -")
    assert prefill_choices([unpreviewed]) == "1 / 1, 0 previewed"
    assert prefill_choices([{"event": "cost"}]) is None


def test_speculation_over_decoding_prices_a_decoding_cells_re_measurement():
    """Its spec steps and the decode step that held the switch into them, less the decode steps
    their tokens stand for; nothing where the cell mostly speculated."""
    from bench.sglang.step_costs import speculation_over_decoding

    def step(mode: str, bs: int, tokens: int) -> dict:
        return {"step": 0, "mode": mode, "bs": bs, "padded_bs": bs, "tokens": tokens}

    def cost(mode: str, seconds: float, carries: bool = False) -> dict:
        return {"event": "cost", "kind": "StepTime", "mode": mode, "padded_bs": 16,
                "seconds": seconds,
                "carries_next": carries, "catch_up_tokens": 0}

    prefill = {"event": "cost", "kind": "PrefillTime", "tokens": 64, "seconds": 0.2}
    inside = [step("decode", 16, 16)] * 6 + [step("spec", 16, 24), step("spec", 16, 32)] + [
        cost("decode", 0.010), cost("decode", 0.010), cost("decode", 0.011),
        cost("decode", 0.040, carries=True), cost("spec", 0.020), cost("spec", 0.020),
        cost("decode", 0.010, carries=True), prefill, cost("spec", 0.020),
        cost("decode", 0.010)]
    # 0.040 + 3 x 0.020 spent; one carrier (0.010) and 1.5 + 2 tokens a request (0.035) stand
    # for them. The last carrier held a prefill's launch, not a switch into speculation.
    assert speculation_over_decoding(inside) == pytest.approx(0.100 - 0.045)
    assert speculation_over_decoding([step("spec", 16, 48)] * 2 + inside[6:]) is None
    assert speculation_over_decoding(inside[:8] + inside[11:-1]) is None   # no clean decode step
    # A spec step's tokens stand for steps of the decode size its batch ran at (here 16, where
    # spec padded to 24).
    padded = [dict(e, padded_bs=24) if e.get("mode") == "spec" else e for e in inside]
    assert speculation_over_decoding(padded) == pytest.approx(0.100 - 0.045)


def test_step_costs_report_the_workers_host_time_per_step_and_slow_log_writes():
    from bench.sglang import step_costs

    log = [{"step": i, "mode": "spec", "padded_bs": 4, "plan_us": 100.0 + i, "hook_us": 90.0,
            "launch_us": 2000.0} for i in range(101)]
    log += [{"step": 0, "mode": "decode", "padded_bs": 1}]            # an older log's line
    log += [{"step": 1, "mode": "spec", "padded_bs": 8, "plan_us": 1.0, "hook_us": 2.0}]
    log += [{"event": "log_writes", "lines": 4096, "slow": 2, "max_ms": 3.5},
            {"event": "log_writes", "lines": 8192, "slow": 3, "max_ms": 26.7}]
    text = step_costs.host_report(log)
    assert "| spec | 4 | 101 | 150 / 199 | 90 / 90 | 2000 / 2000 |" in text
    assert "| spec | 8 | 1 | 1 / 1 | 2 / 2 | - |" in text       # a log from before launch_us
    assert "decode" not in text
    assert "5 of 8192, the slowest 26.7 ms" in text
    assert step_costs.host_report([{"step": 0, "mode": "spec", "padded_bs": 1}]) == ""


def test_the_ratio_to_both_baselines_needs_both():
    """Where EAGLE-3 did not run, "/ max(plain, eagle3)" would be the ratio to plain alone."""
    table = {"plain": {1: 200.0, 64: 7000.0}, "eagle3": {1: 400.0}, "dual": {1: 392.0, 64: 6930.0}}
    ratios = report.dual_ratios([1, 64], table)
    assert ratios["dual"]["vs_best"] == pytest.approx({1: 0.98})
    assert ratios["dual"]["vs_plain"] == pytest.approx({1: 1.96, 64: 0.99})
    md = report.markdown_ratios([1, 64], table)
    assert "| dual / max(plain, eagle3) | 0.980 | - |" in md
    no_eagle = report.dual_ratios([64], {"plain": {64: 7000.0}, "dual": {64: 6930.0}})
    assert no_eagle["dual"]["vs_best"] == {}


def test_the_suites_eagle3_baseline_is_the_matrixs_and_serve_benchs(tmp_path, monkeypatch):
    """Every bench lifts EAGLE-3's cap of 48 running requests alike (one builder)."""
    from bench.sglang import policy_matrix as pm
    from bench.sglang import serve_bench as sb
    from bench.sglang.model_configs import EAGLE3_MAX_RUNNING_REQUESTS

    suite, ran = _recording_suite(tmp_path, ["--no-adaptive"], monkeypatch)
    suite.bench(with_ramp=False)
    kwargs = {er.name: er.engine_kwargs for er in ran}
    draft = Path(kwargs["eagle3"]["speculative_draft_model_path"])
    spec = {k: v for k, v in pm.engine_kwargs("eagle3", tmp_path, draft, False, "warning").items()
            if k.startswith("speculative") or k == "max_running_requests"}
    assert spec["max_running_requests"] == EAGLE3_MAX_RUNNING_REQUESTS
    assert {k: kwargs["eagle3"][k] for k in spec} == spec
    assert "max_running_requests" not in kwargs["dual"]
    cmd = sb.server_command("eagle3", sb.ServeBenchConfig(out=tmp_path), "T", str(draft))
    assert cmd[cmd.index("--max-running-requests") + 1] == str(EAGLE3_MAX_RUNNING_REQUESTS)
    assert f"cap lifted to {EAGLE3_MAX_RUNNING_REQUESTS}" in suite.notes["bench"]


def _suite_main(tmp_path, monkeypatch, result):
    from bench.sglang import run_sglang_suite as suite_mod

    names = []

    def fake_child(folder, spec, **kwargs):
        names.append(spec["name"])
        return result(spec["name"])

    monkeypatch.setattr(suite_mod, "run_child", fake_child)
    rc = suite_mod.main(["--out", str(tmp_path), "--phases", "bench", "--no-adaptive",
                         "--concurrency", "1", "--no-bench-step-log"])
    return rc, names


def test_a_bench_phase_whose_engines_failed_exits_non_zero(tmp_path, monkeypatch, capsys):
    """--phases bench has no checks: all([]) passed a run whose every engine failed."""
    def points(name):
        return {"name": name, "returncode": 0,
                "tasks": {"sweep": {"points": [{"concurrency": 1, "tok_s": 100.0}]}}}

    rc, names = _suite_main(tmp_path / "ok", monkeypatch, points)
    assert rc == 0 and names == ["plain", "eagle3", "dual"]
    for result, says in ((lambda n: {"name": n, "returncode": 1}, "child exited 1"),
                         (lambda n: {"name": n, "returncode": 0, "tasks": {}},
                          "measured no point"),
                         (lambda n: points(n) if n != "dual" else
                          points(n) | {"returncode": 3}, "FAILED dual")):
        capsys.readouterr()
        assert _suite_main(tmp_path / says, monkeypatch, result)[0] == 1
        assert says in capsys.readouterr().err


def test_an_accept_length_sglang_would_not_force_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--out", str(tmp_path), "--simulate-acc-len", "4.5"])
    assert exc.value.code == 2 and "must be in 1..4" in capsys.readouterr().err
