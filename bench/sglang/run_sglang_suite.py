"""The SGLang GPU suite for the dual-graph worker: correctness, throughput, load ramp, start-up.

    python -m bench.sglang.run_sglang_suite --out OUT [--phases correctness,bench,ramp,startup]

Each engine runs once, in its own process (engine_child.py), and serves every task of its
phase; results are written as they arrive (OUT/engines/*.json, OUT/suite.json, OUT/report.md,
PNGs), so a run killed at a time limit keeps what it finished. ``--budget-s`` skips engines
that would not finish in time (recorded as skipped).

Phases
- correctness: (1) the dual worker on the constructed toy pair (docs/design.md; written by
  dual_graph_worker.engines.reference.toy.write_toy_checkpoints, or --toy-dir) under a low
  threshold and staggered, mixed-length requests, so the running batch crosses the threshold
  many times while requests are in flight (``--exact-waves N``: in N bursts); T=0 tokens must
  equal the known greedy continuation, at least one decode->spec switch must happen (a draft
  that lived through decode mode is used again), and spec steps right after it must keep the
  full accept length (the catch-up ran over the right inputs; the toy draft's attention is
  zero, so its K/V are not checked); (2) plain SGLang vs the dual worker with dummy
  weights, same requests, same switch requirement.
- bench: plain, EAGLE-3 and the dual worker on a Llama-3-8B-shaped dummy target, concurrency
  1..256, 256 in / 256 out, accept length forced by SGLANG_SIMULATE_ACC_LEN (stated in the
  output; it changes tokens, so no exactness here); then SGLang's speculative_adaptive is tried
  and its failure, if any, recorded.
- multiturn: the radix cache on, conversations resending each answer as the next prompt's
  prefix, the cycle policy switching every few steps; tokens, cache hits, accept length 4.0.
- ramp: on the bench's dual engine, closed-loop clients up and down a concurrency profile;
  the step log (DGW_STEP_LOG) gives the mode of every step over time.
- startup: start-up time and memory of the dual engine vs EAGLE-3 (from the bench engines).

Draft continuity. The ``dual`` engines run the worker's default (``Settings().continuity``;
no DGW_CONTINUITY in their env). ``--with-continuity NAME`` (repeatable; ``--with-lazy`` is
``--with-continuity lazy-catch-up``) adds, next to every dual engine of the correctness and bench
phases, the same engine with DGW_CONTINUITY=NAME (names suffixed ``-lazy`` / ``-keep-current``),
so one run measures the strategies side by side. An engine that runs lazy catch-up must also
show catch-ups (``catch_up`` events in its step log) for its correctness checks to pass.

Phase split of the bench. ``--decode-step-time`` also times each sweep batch at one output
token, right before the batch itself (so the dual worker's deferral decisions start from the same
policy state in both): the report
gives the prefill phase (that time) and the decode phase per token, each as a ratio to plain. ``--decode-log-interval N`` has every bench engine log SGLang's own "Decode
batch" line every N decode steps; the report turns the decode-mode windows into a step time per
running batch, the direct form of "decode step within 2% of plain at the same batch size".
``--engines a,b`` runs only the named engines (device time is scarce).

Stalls. Each dual bench engine's summary lists the longest gaps between its step-log lines (a
scheduler that stood still shows there). ``--stall-trace-s S`` also has every dual engine sample
its scheduler thread's stack while no step starts for S seconds (OUT/stall-NAME.jsonl);
``python -m profiling.stall_report OUT`` reads both.

Radix cache. Every engine runs ``--disable-radix-cache`` (random prompts share nothing; the dual
worker's deferred draft prefill needs it) unless ``--with-radix-cache`` adds SGLang's default
server: bench engines ``plain-radix`` and ``dual-radix`` (compared with each other: report.
baseline), and a correctness engine ``dual-toy-radix`` whose prompts share their first
``--radix-prefix-len`` ids, so later requests run from cached prefixes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.sglang import report  # noqa: E402
from bench.sglang.engine_child import run_child  # noqa: E402
from bench.sglang.model_configs import (  # noqa: E402
    EAGLE3_MAX_RUNNING_REQUESTS,
    accept_problem,
    engine_attention_backend,
    llama3_8b_shapes,
    server_kwargs,
    spec_kwargs,
    toy_shapes,
    write_dummy_pair,
)
from bench.sglang.workload import (  # noqa: E402
    compare_outputs,
    greedy_chain,
    load_toy_permutation,
    ramp_profile,
    random_prompts,
    shared_prefix_prompts,
    staggered_requests,
    parse_decode_log,
    summarize_catch_ups,
    summarize_steps,
)
from dual_graph_worker.core.argtypes import OneLineParser, int_list  # noqa: E402
from dual_graph_worker.core.settings import settings_env  # noqa: E402
from dual_graph_worker.core.step_log import (  # noqa: E402
    read_step_events,
    read_step_log,
)
from profiling.stall_report import longest_gaps, read_log  # noqa: E402

PHASES = ("correctness", "multiturn", "bench", "ramp", "startup")
LAZY = "lazy-catch-up"
KEEP_CURRENT = "keep-current"
DEFAULT = "default"          # the worker's own default continuity: no DGW_CONTINUITY set
SUFFIX = {DEFAULT: "", LAZY: "-lazy", KEEP_CURRENT: "-keep-current"}
RADIX = report.RADIX  # engines run with the radix cache on


@dataclass
class EngineRun:
    name: str
    phase: str
    engine_kwargs: dict
    env: dict
    tasks: list
    est_s: float
    step_log: Optional[str] = None
    result: dict = field(default_factory=dict)
    # Its bench step log read once (Suite.log_summary): the log is complete once it has run.
    log_summary: Optional[dict] = None


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        (self.out / "engines").mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.first_start = True
        self.runs: dict[str, EngineRun] = {}
        self.notes: dict[str, str] = {}
        self.checks: dict[str, dict] = {}

    # ---------------------------------------------------------------- engine processes

    def remaining(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def run(self, er: EngineRun) -> dict:
        if self.args.engines and er.name not in self.args.engines:
            # Not run and not reported: a later phase may still ask for its result.
            er.result = {"name": er.name, "ok": False, "skipped": "not in --engines"}
            return er.result
        need = er.est_s + (self.args.cold_start_s if self.first_start else self.args.start_s)
        if self.remaining() < need:
            er.result = {"name": er.name, "ok": False,
                         "skipped": f"budget: needs ~{need:.0f} s, {self.remaining():.0f} s left"}
            print(f"[suite] skip {er.name}: {er.result['skipped']}", flush=True)
            self.runs[er.name] = er
            self.write()
            return er.result
        timeout = max(30.0, self.remaining() - 5)
        print(f"[suite] start {er.name} ({self.remaining():.0f} s left)", flush=True)
        spec = dict(name=er.name, engine_kwargs=er.engine_kwargs, env=er.env, tasks=er.tasks)
        er.result = run_child(self.out / "engines", spec, shim_dir=self.out / "plugin_shim",
                              timeout=timeout, python=self.args.python)
        rc = er.result["returncode"]
        self.first_start = False
        if er.phase == "bench" and self.args.decode_log_interval:
            with open(self.out / "engines" / f"{er.name}.log", errors="replace") as f:
                er.result["decode_log"] = parse_decode_log(f)
        if rc != 0 and "error" not in er.result:
            er.result["error"] = f"child exited {rc}; see engines/{er.name}.log"
        print(f"[suite] done {er.name}: rc={rc} startup={er.result.get('startup_s')}",
              flush=True)
        self.runs[er.name] = er
        self.write()
        return er.result

    # -------------------------------------------------------------------- engine configs

    def common(self, model: Path, load_format: str, max_bs: int,
               radix_cache: bool = False) -> dict:
        return server_kwargs(model, load_format, max_bs, log_level=self.args.log_level,
                             radix_cache=radix_cache,
                             attention_backend=engine_attention_backend(
                                 self.args.attention_backend))

    def dual_env(self, name: str, **dgw: object) -> tuple[dict, Optional[str]]:
        """The dual worker's environment: `dgw` (registry keys, e.g. min_dwell_steps=0) and
        the diagnostic outputs this run asks for."""
        env = settings_env(**dgw)
        if self.args.stall_trace_s:
            # Diagnostic: the scheduler thread's stack whenever no step starts for that long.
            trace = self.out / f"stall-{name}.jsonl"
            trace.unlink(missing_ok=True)       # the worker appends
            env |= settings_env(stall_trace=trace, stall_trace_s=self.args.stall_trace_s)
        if name.endswith("-bench") and not self.args.bench_step_log:
            # What a user runs: no per-step JSON line (the log costs host time every step).
            return env, None
        log = self.out / f"steps-{name}.jsonl"
        log.unlink(missing_ok=True)             # the worker appends
        return settings_env(step_log=log) | env, str(log)

    # ----------------------------------------------------------------------- phases

    def correctness(self) -> None:
        a = self.args
        toy = self.toy_checkpoints()
        if toy is not None:
            perm = load_toy_permutation(toy / "target")
            prompts = random_prompts(a.exact_requests, 16, len(perm), seed=7)
            requests = self.exact_requests(prompts)
            expected = [greedy_chain(perm, p[-1], n) for _, p, n in requests]
            for continuity in self.continuities():
                self.toy_check(toy, requests, expected, continuity)
            if a.with_radix_cache:
                # SGLang's default server: the radix cache on, so no deferred prefill. The
                # prompts share a prefix, so later requests reuse cached KV (target and draft).
                requests = self.exact_requests(shared_prefix_prompts(prompts,
                                                                     a.radix_prefix_len))
                expected = [greedy_chain(perm, p[-1], n) for _, p, n in requests]
                self.toy_check(toy, requests, expected, DEFAULT, radix_cache=True)

        # Dummy weights: plain SGLang is the reference.
        shapes = toy_shapes()
        target, draft = write_dummy_pair(self.out / "models" / "toy-dummy", shapes)
        prompts = random_prompts(a.exact_requests, 16, shapes.vocab_size, seed=11)
        task = [{"name": "exact", "kind": "exact", "requests": self.exact_requests(prompts)}]
        plain = self.run(EngineRun("plain-toy-dummy", "correctness",
                                   self.common(target, "dummy", 32), {}, task, est_s=25))
        want = (plain.get("tasks", {}).get("exact") or {}).get("outputs")
        for continuity in self.continuities():
            name = "dual-toy-dummy" + SUFFIX[continuity]
            env, log = self.correctness_env(name, continuity)
            dual = self.run(EngineRun(name, "correctness",
                                      self.common(target, "dummy", 32)
                                      | spec_kwargs("dual", draft), env, task, est_s=30,
                                      step_log=log))
            got = (dual.get("tasks", {}).get("exact") or {}).get("outputs")
            check = {"expected": "plain SGLang, same dummy weights (seeded), same requests"}
            if want is not None and got is not None:
                self.judge(check, want, got, log, continuity)
            else:
                check |= not_run(dual.get("error") or plain.get("error"),
                                 dual.get("skipped") or plain.get("skipped"))
            self.checks[f"dummy weights: {self.dual_label(continuity)} == plain SGLang"] = check
            self.write()

    def multiturn(self) -> None:
        """The radix cache on, conversations that resend each answer as the next prompt's
        prefix, a policy that switches every few steps (cycle) so answers end in decode mode:
        tokens equal the known chain, later turns hit the cache, and with the 100% draft
        every speculative step accepts K+1 = 4 (a prefix whose catch-up was skipped would not;
        the toy draft's attention is zero, so stale draft KV alone would)."""
        a = self.args
        toy = self.toy_checkpoints()
        if toy is None:
            return
        perm = load_toy_permutation(toy / "target")
        convs, turns = a.multiturn_conversations, a.multiturn_turns
        prompts = random_prompts(convs, 16, len(perm), seed=21)
        users = [random_prompts(convs, 4, len(perm), seed=100 + k) for k in range(turns)]
        task = {"name": "multiturn", "kind": "multiturn", "prompts": prompts,
                "user_messages": users, "output_len": a.multiturn_output_len}
        name = "dual-toy-multiturn" + RADIX
        env, log = self.dual_env(name, policy="cycle", min_dwell_steps=a.multiturn_hold)
        er = EngineRun(name, "multiturn",
                       self.common(toy / "target", "auto", 32, radix_cache=True)
                       | {"dtype": a.toy_dtype} | spec_kwargs("dual", toy / "draft-f100"),
                       env, [task], est_s=40, step_log=log)
        res = self.run(er)
        got = (res.get("tasks", {}).get("multiturn") or {}).get("turns")
        check = {"server": "radix cache on (SGLang's default), DGW_POLICY=cycle "
                           f"(hold {a.multiturn_hold}), {convs} conversations x {turns} turns"}
        if not got:
            check |= not_run(res.get("error"), res.get("skipped"))
        else:
            want = [[greedy_chain(perm, pr[-1], len(out)) for pr, out in
                     zip(t["prompts"], t["outputs"])] for t in got]
            equal = sum(w == t_out for tw, t in zip(want, got)
                        for w, t_out in zip(tw, t["outputs"]))
            steps = self.step_summary(log)
            check |= {"tokens_equal": f"{equal}/{convs * len(got)} answers",
                      "cached_tokens_per_turn": [sum(t["cached_tokens"]) for t in got],
                      "steps": steps}
            check["ok"] = bool(equal == convs * len(got) and steps.get("switches_back", 0) >= 1
                               and (steps.get("min_accept_after_switch_back") or 0) >= 3.5
                               and (steps.get("spec_mean_accept") or 0) >= 3.5
                               and sum(got[-1]["cached_tokens"]) > 0)
            self.check_catch_ups(check, DEFAULT, log)
        self.checks["multi-turn, radix cache on: tokens, cache hits, accept 4.0"] = check
        self.write()

    def correctness_env(self, name: str, continuity: str) -> tuple[dict, Optional[str]]:
        """A correctness engine's worker env: the threshold policy at --toy-threshold with no
        band and no dwell, so the running batch crosses it many times."""
        return self.dual_env(name, policy="threshold", threshold=self.args.toy_threshold,
                             band=0, min_dwell_steps=0, **self.continuity_env(continuity))

    def judge(self, check: dict, want: list, got: list, log: Optional[str],
              continuity: str) -> None:
        """The tokens equal, at least one decode -> spec switch happened, and a lazy engine
        caught up: the verdict every correctness check shares."""
        check["exactness"] = compare_outputs(want, got).to_json()
        check["steps"] = self.step_summary(log)
        check["ok"] = bool(check["exactness"]["ok"]
                           and check["steps"].get("switches_back", 0) >= 1)
        self.check_catch_ups(check, continuity, log)

    def exact_requests(self, prompts: list) -> list:
        """The correctness requests: `prompts` staggered in waves (--exact-* flags)."""
        a = self.args
        return staggered_requests(prompts, lengths=a.exact_lengths, gap_s=a.exact_gap_s,
                                  waves=a.exact_waves, wave_gap_s=a.wave_gap_s)

    def toy_check(self, toy: Path, requests: list, expected: list, continuity: str,
                  radix_cache: bool = False) -> None:
        """One dual engine on the constructed toy checkpoints against their known greedy
        continuation, under the threshold policy at --toy-threshold (many switches)."""
        a = self.args
        setting = RADIX if radix_cache else ""
        name = "dual-toy" + SUFFIX[continuity] + setting
        env, log = self.correctness_env(name, continuity)
        er = EngineRun(name, "correctness",
                       self.common(toy / "target", "auto", 32, radix_cache=radix_cache)
                       | {"dtype": a.toy_dtype}
                       | spec_kwargs("dual", toy / f"draft-{a.toy_draft}"),
                       env, [{"name": "exact", "kind": "exact", "requests": requests}],
                       est_s=30, step_log=log)
        res = self.run(er)
        got = (res.get("tasks", {}).get("exact") or {}).get("outputs")
        check = {"expected": "known greedy continuation of the constructed target"}
        if radix_cache:
            check["server"] = ("radix cache on (SGLang's default; no deferred prefill), "
                               f"prompts sharing their first {a.radix_prefix_len} tokens")
        if got is not None:
            self.judge(check, expected, got, log, continuity)
            k1 = 4.0
            back = check["steps"].get("min_accept_after_switch_back")
            check["draft_current_after_switch"] = (
                None if back is None or a.toy_draft != "f100" else back >= k1 - 0.5)
            check["ok"] = check["ok"] and check["draft_current_after_switch"] is not False
        else:
            check |= not_run(res.get("error"), res.get("skipped"))
        label = self.dual_label(continuity) + (", radix cache on" if radix_cache else "")
        self.checks[f"constructed toy: {label} == known greedy"] = check
        self.write()

    def bench(self, with_ramp: bool) -> None:
        a = self.args
        shapes = llama3_8b_shapes()
        target, draft = write_dummy_pair(self.out / "models", shapes, "llama3-8b-shape",
                                         "llama3-8b-shape-eagle3")
        sweep = {"name": "sweep", "kind": "sweep", "concurrency": a.concurrency,
                 "input_len": a.input_len, "output_len": a.output_len,
                 "vocab": shapes.vocab_size, "prefill_probe": a.decode_step_time}
        sim = {"SGLANG_SIMULATE_ACC_LEN": str(a.simulate_acc_len)}
        # Set before the first engine runs: a run cut short still reports what its figures are.
        self.notes["bench"] = self.bench_note()
        base = self.common(target, "dummy", 256)
        if a.decode_log_interval:
            # SGLang's own per-window decode throughput (INFO lines, report.decode_log_step_ms).
            base |= {"log_level": "info", "decode_log_interval": a.decode_log_interval}
        est = 10 + 0.05 * sum(a.concurrency) * a.output_len / 256
        self.run(EngineRun("plain", "bench", base, {}, [sweep], est_s=est))
        self.run(EngineRun("eagle3", "bench", base | spec_kwargs("eagle3", draft), sim,
                           [sweep], est_s=est * 1.5))
        env, log = self.dual_env("dual-bench", policy=a.dual_policy)
        tasks = [sweep]
        if with_ramp:
            tasks.append({"name": "ramp", "kind": "ramp", "vocab": shapes.vocab_size,
                          "profile": ramp_profile(a.ramp_levels, a.ramp_hold_s),
                          "input_len": 128, "output_lens": [64, 128, 256]})
        ramp_s = (2 * len(a.ramp_levels) - 1) * a.ramp_hold_s + 10 if with_ramp else 0
        self.run(EngineRun("dual", "bench", base | spec_kwargs("dual", draft), sim | env,
                           tasks, est_s=est * 1.5 + ramp_s, step_log=log))
        if with_ramp:
            self.plot_ramp(self.runs.get("dual"))
        def run_dual_variant(name: str, server: dict = base, **dgw: object) -> None:
            env, log = self.dual_env(name + "-bench", policy=a.dual_policy, **dgw)
            self.run(EngineRun(name, "bench", server | spec_kwargs("dual", draft), sim | env,
                               [sweep], est_s=est * 1.5, step_log=log))

        if a.with_eager_draft:
            # The graphs switch only matters to keep-current's decode steps: name it, since
            # the worker's default (lazy catch-up) runs no draft extend in decode mode.
            run_dual_variant("dual-eager-draft", draft_extend_graphs=0,
                             **self.continuity_env(KEEP_CURRENT))
        if a.with_radix_cache:
            # SGLang's default server (radix cache on): the dual worker defers no draft
            # prefill there, so this pair shows what a user who keeps the default gets.
            radix = base | {"disable_radix_cache": False}
            self.run(EngineRun("plain" + RADIX, "bench", radix, {}, [sweep], est_s=est))
            run_dual_variant("dual" + RADIX, server=radix)
        if a.with_no_defer:
            # The default worker less its deferred draft prefill: what the deferral buys.
            run_dual_variant("dual-no-defer", defer_draft_prefill=0)
        for continuity in self.continuities()[1:]:
            run_dual_variant("dual" + SUFFIX[continuity], **self.continuity_env(continuity))
        if a.try_adaptive:
            adaptive_sweep = dict(sweep, concurrency=[1, 32])
            self.run(EngineRun("eagle3-adaptive", "bench",
                               base | spec_kwargs("eagle3", draft)
                               | {"speculative_adaptive": True}, sim, [adaptive_sweep],
                               est_s=20))
    # -------------------------------------------------------------------- helpers

    def bench_headline(self) -> str:
        """What every bench figure is of: the plot's title, the note's head."""
        a = self.args
        return (f"accept length FORCED to {a.simulate_acc_len} (SGLANG_SIMULATE_ACC_LEN, "
                f"eagle3 and dual), DUMMY weights (Llama-3-8B shapes), {a.input_len} in / "
                f"{a.output_len} out")

    def bench_note(self) -> str:
        """What the bench's figures are: the headline, then the workload and every variant's
        settings (in the report and the summary)."""
        a = self.args
        variants = [f"dual{SUFFIX[c]}: DGW_CONTINUITY={c}" for c in self.continuities()[1:]]
        if a.with_eager_draft:
            variants.append("dual-eager-draft: DGW_CONTINUITY=keep-current with "
                            "DGW_DRAFT_EXTEND_GRAPHS=0 (its one-token draft extend run eagerly, "
                            "not from width-1 graphs)")
        if a.with_radix_cache:
            variants.append("plain-radix, dual-radix: the radix cache on (SGLang's default; the "
                            "others run --disable-radix-cache; fresh random prompts, so no prefix "
                            "is reused), which turns the dual worker's deferred draft prefill off")
        if a.with_no_defer:
            variants.append("dual-no-defer: DGW_DEFER_DRAFT_PREFILL=0 (EAGLE's draft prefill "
                            "runs for every prompt)")
        return "; ".join([self.bench_headline(),
                          "random token ids, ignore_eos, T=0; EAGLE-3 at SGLang's defaults but "
                          f"its running-request cap lifted to {EAGLE3_MAX_RUNNING_REQUESTS}",
                          f"{a.attention_backend} attention, 3 steps, topk 1",
                          f"dual policy={a.dual_policy}; dual: continuity "
                          f"{worker_default_continuity()} (the worker's default)", *variants])

    def continuities(self) -> list[str]:
        """The dual worker's draft-continuity strategies to run: the worker's default always,
        then each --with-continuity (--with-lazy) that is not the default."""
        extra = list(self.args.with_continuity or []) + ([LAZY] if self.args.with_lazy else [])
        default = worker_default_continuity()
        return [DEFAULT] + [c for c in dict.fromkeys(extra) if c != default]

    @staticmethod
    def dual_label(continuity: str) -> str:
        return "dual" if continuity == DEFAULT else f"dual {continuity}"

    @staticmethod
    def continuity_env(continuity: str) -> dict:
        # The default engines get no DGW_CONTINUITY: they run what a user gets.
        return {} if continuity == DEFAULT else {"continuity": continuity}

    @staticmethod
    def catch_up_summary(log: Optional[str]) -> dict:
        if not log or not os.path.exists(log):
            return {"error": "no step log"}
        return summarize_catch_ups(read_step_events(log))

    def check_catch_ups(self, check: dict, continuity: str, log: Optional[str]) -> None:
        """A lazy engine must actually have caught up (else the lazy path never ran)."""
        effective = worker_default_continuity() if continuity == DEFAULT else continuity
        if effective != LAZY:
            return
        check["catch_ups"] = self.catch_up_summary(log)
        check["ok"] = bool(check["ok"] and check["catch_ups"].get("catch_ups", 0) >= 1)

    def toy_checkpoints(self) -> Optional[Path]:
        if self.args.toy_dir:
            return Path(self.args.toy_dir)
        toy = self.out / "toy"
        if (toy / "target").exists():
            return toy
        try:
            from dual_graph_worker.engines.reference.toy import write_toy_checkpoints
        except ImportError as exc:
            self.notes["toy"] = (f"constructed toy check skipped: {exc}; pass --toy-dir from "
                                 "`dgw make-toy-checkpoints DIR`")
            return None
        heads = max(1, self.args.toy_hidden // 128)
        write_toy_checkpoints(toy, hidden=self.args.toy_hidden, heads=heads,
                              kv_heads=max(1, heads // 2))
        return toy

    @staticmethod
    def gap_summary(log: Optional[str], top: int = 3) -> list[dict]:
        """The longest gaps between consecutive step-log lines after start-up: a stall (a lazy
        kernel build, a sync) shows here even without the stall watch."""
        if not log or not os.path.exists(log):
            return []
        _, lines = read_log(Path(log))
        return [{"gap_s": round(g.gap_s, 3), "between": f"{g.before} -> {g.after}"}
                for g in longest_gaps(lines, top)]

    @staticmethod
    def step_summary(log: Optional[str]) -> dict:
        if not log or not os.path.exists(log):
            return {"error": "no step log"}
        return summarize_steps(r for r, _ in read_step_log(log)).to_json()

    def startup(self) -> dict:
        out = {}
        for name in ("eagle3", *("dual" + suffix for suffix in SUFFIX.values()),
                     "dual-eager-draft", "plain"):
            r = self.runs.get(name)
            if r is None or "startup_s" not in r.result:
                continue
            info = r.result.get("server_info") or {}
            mem = info.get("memory_usage") or {}
            used = r.result.get("gpu_used_mib") or {}
            out[name] = {"startup_s": round(r.result["startup_s"], 1),
                         "gpu_used_mib_after_start": used.get("after_start"),
                         "graph_memory_gb": mem.get("graph") if isinstance(mem, dict) else None,
                         "memory_usage": mem,
                         "max_running_requests": info.get("effective_max_running_requests")}
        return out

    def write(self) -> None:
        bench_results = {n: r.result for n, r in self.runs.items() if r.phase == "bench"}
        levels, table = report.throughput_rows(bench_results)
        data = {"elapsed_s": round(time.monotonic() - self.t0, 1), "notes": self.notes,
                "checks": self.checks,
                "throughput": {n: {str(c): v for c, v in t.items()} for n, t in table.items()},
                "startup": self.startup(),
                "engines": {n: {k: v for k, v in r.result.items() if k not in ("tasks",)}
                            for n, r in self.runs.items()}}
        # Per dual bench engine: its steps, catch-ups (lazy catch-up engines log them) and gaps.
        data["dual_bench"] = {
            n: self.log_summary(r) for n, r in self.runs.items()
            if r.phase == "bench" and n.startswith("dual") and r.step_log}
        (self.out / "suite.json").write_text(json.dumps(data, indent=1, default=str))
        md = ["# SGLang dual-graph suite", ""]
        if table and any(table.values()):
            md.append(report.markdown_throughput(levels, table, self.notes.get("bench", "")))
            md.append(report.markdown_ratios(levels, table))
            md.append(report.markdown_decode_phase(bench_results))
            md.append(report.markdown_prefill_phase(bench_results))
            md.append(report.markdown_decode_log(bench_results))
            report.plot_throughput(levels, table, self.out / "throughput.png",
                                   self.bench_headline())
        for name, chk in self.checks.items():
            md.append(f"- {name}: {verdict(chk)} "
                      f"{json.dumps({k: v for k, v in chk.items() if k != 'ok'})[:600]}")
        for n, info in data["dual_bench"].items():
            md.append(f"\n## {n} in the bench\n- steps: {json.dumps(info['steps'])}\n"
                      f"- catch-ups: {json.dumps(info['catch_ups'])}\n"
                      f"- longest gaps between step-log lines: "
                      f"{json.dumps(info['longest_gaps'])}")
        if data["startup"]:
            md.append("\n## start-up\n```\n" + json.dumps(data["startup"], indent=1) + "\n```")
        adaptive = self.runs.get("eagle3-adaptive")
        if adaptive:
            r = adaptive.result
            md.append("\n## speculative_adaptive (EAGLE3)\n"
                      + str(r.get("error") or r.get("skipped") or "started and ran"))
        (self.out / "report.md").write_text("\n".join(md) + "\n")

    def bench_failures(self) -> dict[str, str]:
        """Each bench engine that ran and failed: its error (a non-zero exit included), or no
        point measured. eagle3-adaptive is left out: it is tried to record whether it fails."""
        out = {}
        for name, r in self.runs.items():
            if r.phase != "bench" or name == "eagle3-adaptive":
                continue
            res = r.result
            if res.get("error") or res.get("skipped"):      # run() names a non-zero exit
                out[name] = str(res.get("error") or res.get("skipped"))
            elif not report.throughput_rows({name: res}).table[name]:
                out[name] = "measured no point"
        return out

    def log_summary(self, r: EngineRun) -> dict:
        """Steps, catch-ups and longest gaps of a finished engine's step log, read once."""
        if r.log_summary is None:
            r.log_summary = {"steps": self.step_summary(r.step_log),
                             "catch_ups": self.catch_up_summary(r.step_log),
                             "longest_gaps": self.gap_summary(r.step_log)}
        return r.log_summary

    def plot_ramp(self, dual: Optional[EngineRun]) -> None:
        """ramp.png: the dual engine's mode per step over its load ramp."""
        if not (dual and dual.step_log and os.path.exists(dual.step_log)):
            return
        ramp = (dual.result.get("tasks", {}).get("ramp") or {}).get("events", [])
        phases = [e for e in ramp if "phase" in e]
        if phases:
            lo, hi = phases[0]["t_start"], phases[-1]["t_end"]
            steps = [(t, r.bs, r.mode.value) for r, t in read_step_log(dual.step_log)
                     if lo <= t <= hi]
            report.plot_ramp(steps, phases, self.out / "ramp.png",
                             "dual worker: mode per step over a load ramp")

    def final_summary(self) -> str:
        rows = {}
        for name, chk in self.checks.items():
            rows[name] = f"{verdict(chk)} {chk.get('error') or chk.get('skipped') or ''}".strip()
        levels, table = report.throughput_rows(
            {n: r.result for n, r in self.runs.items() if r.phase == "bench"})
        if table:
            rows["tok/s are of"] = self.notes.get("bench", "")
        for n, vals in table.items():
            rows[f"tok/s {n}"] = "  ".join(f"{c}:{vals[c]:.0f}" for c in levels if c in vals) \
                or (self.runs[n].result.get("error") or self.runs[n].result.get("skipped")
                    or "-")
        for n, s in self.startup().items():
            rows[f"startup {n}"] = f"{s['startup_s']} s, gpu used {s['gpu_used_mib_after_start']} MiB"
        rows["elapsed"] = f"{time.monotonic() - self.t0:.0f} s; results in {self.out}"
        return report.summary_lines(rows)


def not_run(error: Optional[str], skipped: Optional[str]) -> dict:
    """A check whose engine gave no outputs: it failed (error) or never ran (skipped)."""
    if error or not skipped:
        return {"ok": False, "error": error or "no outputs"}
    return {"ok": False, "skipped": skipped}


def verdict(check: dict) -> str:
    """PASS, FAIL, or NOT RUN for a check skipped (budget, --engines): no failure of the worker,
    though the suite still exits non-zero (what it did not check has not passed)."""
    return "PASS" if check.get("ok") else "NOT RUN" if check.get("skipped") else "FAIL"


def worker_default_continuity() -> str:
    """What a dual engine without DGW_CONTINUITY runs (the worker's config default)."""
    from dual_graph_worker.core.settings import Settings

    return Settings().continuity.value


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma list of {PHASES}")
    p.add_argument("--budget-s", type=float, default=510.0,
                   help="skip engines that would not finish within this many seconds")
    p.add_argument("--cold-start-s", type=float, default=110.0,
                   help="start-up the --budget-s guard reserves for the first engine (kernels "
                        "compile)")
    p.add_argument("--start-s", type=float, default=55.0,
                   help="start-up the --budget-s guard reserves for each later engine")
    p.add_argument("--python", default=sys.executable,
                   help="the Python that runs each engine process (default: this one)")
    p.add_argument("--log-level", default="warning",
                   help="SGLang's log level in each engine's log")
    p.add_argument("--attention-backend", default="triton",
                   help="every engine's; lazy catch-up runs only on the backends in "
                        "server_args_hook.CATCH_UP_BACKENDS (a correctness run checks another)")
    p.add_argument("--toy-dir", default=None)
    p.add_argument("--toy-draft", default="f100", choices=["f100", "f50", "f0"])
    p.add_argument("--toy-hidden", type=int, default=1024,
                   help="vocab == hidden of the constructed pair (docs/design.md used 1024)")
    p.add_argument("--toy-dtype", default="auto",
                   help="engine dtype for the constructed pair (checkpoints are float32)")
    p.add_argument("--toy-threshold", type=int, default=4)
    p.add_argument("--exact-requests", type=int, default=24)
    p.add_argument("--exact-lengths", type=int_list, default=[24, 48, 96, 160])
    p.add_argument("--exact-gap-s", type=float, default=0.01)
    p.add_argument("--exact-waves", type=int, default=1,
                   help="correctness requests arrive in this many bursts (more switches)")
    p.add_argument("--wave-gap-s", type=float, default=2.0)
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 32, 64, 128, 256])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--simulate-acc-len", type=float, default=3.0)
    p.add_argument("--dual-policy", default="threshold",
                   choices=["threshold", "goodput", "spec", "decode"])
    p.add_argument("--ramp-levels", type=int_list, default=[1, 8, 32, 128])
    p.add_argument("--ramp-hold-s", type=float, default=4.0)
    p.add_argument("--no-adaptive", dest="try_adaptive", action="store_false")
    p.add_argument("--decode-step-time", action="store_true",
                   help="also time each sweep batch generating one token, and report the "
                        "decode phase alone: (T(out=N) - T(out=1)) / (N - 1) per engine and "
                        "its ratio to plain (the step time at bs = concurrency for one-token "
                        "steps)")
    p.add_argument("--no-bench-step-log", dest="bench_step_log", action="store_false",
                   help="bench engines run without DGW_STEP_LOG (as users run them); the "
                        "bench then reports no per-engine step summary")
    p.add_argument("--with-eager-draft", action="store_true",
                   help="also bench the keep-current dual worker with its decode-mode draft "
                        "extend run eagerly (DGW_DRAFT_EXTEND_GRAPHS=0), engine "
                        "'dual-eager-draft'")
    p.add_argument("--decode-log-interval", type=int, default=0,
                   help="bench engines log SGLang's 'Decode batch' line every N decode steps "
                        "(log level info); the report turns the decode-mode windows into a "
                        "step time per running batch and its ratio to plain (0: off)")
    p.add_argument("--engines", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   default=None,
                   help="run only these engines (names as in the report, e.g. plain,dual); "
                        "the others are not run and not reported")
    p.add_argument("--stall-trace-s", type=float, default=0.0,
                   help="diagnostic: every dual engine samples its scheduler thread's stack "
                        "while no step starts for this many seconds (DGW_STALL_TRACE; "
                        "OUT/stall-NAME.jsonl)")
    p.add_argument("--with-no-defer", action="store_true",
                   help="also bench the dual worker with DGW_DEFER_DRAFT_PREFILL=0, engine "
                        "'dual-no-defer' (EAGLE's draft prefill for every prompt)")
    p.add_argument("--with-radix-cache", action="store_true",
                   help="also run with the radix cache on (SGLang's default, which turns the "
                        "dual worker's deferred draft prefill off): bench engines "
                        "'plain-radix' and 'dual-radix', and a correctness engine "
                        "'dual-toy-radix' whose prompts share a prefix")
    p.add_argument("--radix-prefix-len", type=int, default=12,
                   help="with --with-radix-cache: ids the correctness prompts share (of 16)")
    p.add_argument("--multiturn-conversations", type=int, default=16)
    p.add_argument("--multiturn-turns", type=int, default=4)
    p.add_argument("--multiturn-output-len", type=int, default=40)
    p.add_argument("--multiturn-hold", type=int, default=6,
                   help="cycle policy: steps each mode holds before alternating")
    p.add_argument("--with-continuity", action="append", choices=[LAZY, KEEP_CURRENT],
                   help="also run every dual engine with DGW_CONTINUITY=NAME (repeatable)")
    p.add_argument("--with-lazy", action="store_true",
                   help="= --with-continuity lazy-catch-up (engines named *-lazy)")
    args = p.parse_args(argv)
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = set(args.phases) - set(PHASES)
    if unknown:
        p.error(f"unknown phases {sorted(unknown)}; choose from {PHASES}")
    if err := accept_problem("--simulate-acc-len", [args.simulate_acc_len]):
        p.error(err)
    if args.toy_dir and not (Path(args.toy_dir) / "target").is_dir():
        p.error(f"--toy-dir {args.toy_dir} holds no target/ checkpoint; make one with "
                "`dgw make-toy-checkpoints DIR`")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    suite = Suite(args)
    if "correctness" in args.phases:
        suite.correctness()
    if "multiturn" in args.phases:
        suite.multiturn()
    if "bench" in args.phases or "ramp" in args.phases or "startup" in args.phases:
        suite.bench(with_ramp="ramp" in args.phases)
    suite.write()
    print("\n" + suite.final_summary(), flush=True)
    failed = suite.bench_failures()
    for name, why in failed.items():
        print(f"[suite] FAILED {name}: {why}", file=sys.stderr, flush=True)
    ok = all(c.get("ok") for c in suite.checks.values()) and not failed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
