"""DualGraphEagleWorker: EAGLEWorkerV2 plus a plain-decode graph pool, chosen per step.

Start-up captures EAGLE-3's graphs, then the decode pool into the same graph memory pool, then
(keep-current) width-1 draft-extend graphs; nothing is captured or allocated afterwards, so a
mode switch is a table lookup. Per decode step the planner picks the mode: SPEC runs EAGLE-3's
own step once the continuity strategy brought the draft up to date; DECODE replays the plain
decode graph and hands the draft's side to the strategy. docs/sglang-0.5.17.md lists the SGLang
contracts this relies on; docs/design.md the design.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from typing import Any, Optional, Sequence

import numpy as np
import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.runtime_context import get_parallel
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

from dual_graph_worker.core import nvtx_names as names
from dual_graph_worker.core.calibration import (CalibrationTable, measure_calibration,
                                                wall_clock_timer)
from dual_graph_worker.core.counters import WorkerCounters
from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.ledger import StepLedger
from dual_graph_worker.core.planner import StepPlanner
from dual_graph_worker.core.policies import PolicyContext, build_policy, needs_prior
from dual_graph_worker.core.policy import Admitted, DraftPrefills, ModePolicy, accepted
from dual_graph_worker.core.settings import MEASURE, Settings, open_output
from dual_graph_worker.core.stall_watch import StallWatch
from dual_graph_worker.core.gc_pauses import GcPauses
from dual_graph_worker.core.step_log import StepLogWriter
from dual_graph_worker.core.timing import ResultClock
from dual_graph_worker.engines.sglang import nvtx_spans
from dual_graph_worker.engines.sglang.backlog import BacklogStats
from dual_graph_worker.engines.sglang.continuity import STRATEGIES
from dual_graph_worker.engines.sglang.continuity_contract import (ContinuityContext,
                                                                  SGLangContinuity)
from dual_graph_worker.engines.sglang.decode_pool import (
    DecodePool,
    build_decode_pool,
    eager_decode_pool,
    ensure_shared_logits_rows,
    graph_replay,
    plan_decode_batch_sizes,
)
from dual_graph_worker.engines.sglang.decode_warmup import warm_decode_positions
from dual_graph_worker.engines.sglang.draft_context import in_draft
from dual_graph_worker.engines.sglang.draft_extend_graph import (
    DraftSyncGraphs,
    build_draft_sync_graphs,
)
from dual_graph_worker.engines.sglang.hooks import (expected_batch_size, held_rows,
                                                    queued_requests)
from dual_graph_worker.engines.sglang.layout import (
    DecodeLengths,
    decode_lengths,
    decode_out_cache_loc,
    decode_step_layout,
    per_request_logprobs,
)
from dual_graph_worker.engines.sglang.lazy_sync import LazyEvent
from dual_graph_worker.engines.sglang.row_context import RowContext, prefill_lengths, rows_of
from dual_graph_worker.engines.sglang.metrics import PUSH_EVERY, PrometheusSeries
from dual_graph_worker.engines.sglang.step_tags import PrefillPreview, PrefillTag, StepTag
from dual_graph_worker.engines.sglang.worker_startup import (allocator_stats,
                                                             apply_capture_config,
                                                             close_capture_probe,
                                                             common_draft_share, model_shape,
                                                             start_stall_watch, tp_mean)

logger = logging.getLogger(__name__)

# Completed steps between the step log's lines of the controller's cost terms.
ESTIMATES_EVERY = 64


class DualGraphEagleWorker(EAGLEWorkerV2):
    # Set in init_cuda_graphs; None before (prefills during start-up take EAGLE's path).
    continuity: Optional[SGLangContinuity] = None
    planner: Optional[StepPlanner] = None
    # Set in init_cuda_graphs: read-only int32 ones, one per request-pool row, that every
    # decode step's accept_lens slices (layout.decode_step_layout).
    _accept_ones: Optional[torch.Tensor] = None
    # Set in init_cuda_graphs: each row's context length, the controller's context input.
    _context: Optional[RowContext] = None
    # The running batch's rows at its latest step and those prefilled since: what a prefill joins.
    _running_rows: np.ndarray = np.zeros(0, dtype=np.int64)
    # Set in __init__ when DGW_STALL_TRACE names a file (rank 0): the diagnostic stall sampler.
    _stall_watch: Optional[StallWatch] = None
    # Read by hooks.py: this worker wants the waiting queue's length on prefill batches.
    dgw_wants_queue_hint = True
    # With a step log: the interpreter's collection pauses.
    _gc: Optional[GcPauses] = None

    def __init__(self, server_args, gpu_id, ps, nccl_port, target_worker) -> None:
        super().__init__(server_args, gpu_id, ps, nccl_port, target_worker)
        self.settings = Settings.from_env(os.environ)
        self._graphs_enabled = not check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED)
        self._decode_bs: tuple[int, ...] = ()
        self._decode_pool: DecodePool = eager_decode_pool()
        self._draft_sync = DraftSyncGraphs(runner=None)
        # NVTX step ranges and the profiling window of this scheduler process (one per TP rank).
        self._spans = nvtx_spans.StepSpans.from_settings(self.settings)
        # Under overlap a result finds its own launch and the next one pending, else its own.
        depth = 1 if getattr(server_args, "disable_overlap_schedule", False) else 2
        self._ledger = StepLedger(depth=depth)
        self._clock: ResultClock = ResultClock(depth=depth)
        self.counters = WorkerCounters()
        self._metrics: Optional[PrometheusSeries] = (
            PrometheusSeries({"tp_rank": str(get_parallel().tp_rank)})
            if getattr(server_args, "enable_metrics", False) else None)
        self._completed = 0
        self._is_rank0 = get_parallel().tp_rank == 0
        self._step_log: Optional[StepLogWriter] = (
            StepLogWriter(self.settings.step_log, open_output("step_log", self.settings.step_log))
            if self.settings.step_log and self._is_rank0 else None)
        self._stall_watch = start_stall_watch(self.settings) if self._is_rank0 else None
        self._gc = GcPauses().start() if self._step_log is not None else None
        if self._draft_worker.seed_dsa_topk_from_draft_extend:
            raise ConfigError("DUAL_GRAPH_EAGLE3 does not support drafts with DSA index "
                              "sharing (index_share_for_mtp_iteration); use EAGLE3")

    # ----------------------------------------------------------------------------- start-up

    def init_attention_backends(self) -> None:
        mr = self._target_worker.model_runner
        # First, so a stale or broken capture config stops the server before any allocation.
        tuned_decode_bs = self._apply_capture_config(mr)
        super().init_attention_backends()
        if self._graphs_enabled:
            self._decode_bs = tuple(plan_decode_batch_sizes(mr, self.settings.decode_max_bs,
                                                            tuned_decode_bs))
            rows = ensure_shared_logits_rows(mr, rows=max(self._decode_bs))
            logger.info("dual-graph: decode pool will capture bs=%s; shared logits buffer "
                        "holds %d rows", list(self._decode_bs), rows)

    def _apply_capture_config(self, mr) -> Optional[tuple[int, ...]]:
        """DGW_CAPTURE_CONFIG applied (worker_startup.apply_capture_config): its settings taken,
        its decode list returned (None without a config)."""
        plan = apply_capture_config(self.settings, mr, lambda: self._model_shape(mr),
                                    is_rank0=self._is_rank0, graphs_enabled=self._graphs_enabled)
        if plan is None:
            return None
        self.settings = plan.config
        return plan.decode_bs

    def init_cuda_graphs(self) -> None:
        super().init_cuda_graphs()
        mr = self._target_worker.model_runner
        # Before the graphs: a kernel SGLang JIT-builds on a decode step's first call
        # (decode_warmup.py) would otherwise be built under load, at the first switch.
        warm_decode_positions(mr.device)
        if self._graphs_enabled:
            self._decode_pool = build_decode_pool(mr, self._decode_bs)
            self._additional_graph_memory_usage["decode_pool"] = self._decode_pool.memory_gb
            self._additional_graph_time_usage["decode_pool"] = self._decode_pool.capture_time_s
            if self.settings.draft_extend_graphs and self._strategy.draft_sync_graphs:
                self._draft_sync = self._capture_draft_sync_graphs()
        spec_bs = tuple(getattr(mr.decode_cuda_graph_runner, "capture_bs", None) or ())
        table = DispatchTable.build(spec_bs if self._graphs_enabled else (),
                                    self._decode_pool.capture_bs)
        r2t = self.req_to_token_pool.req_to_token
        self._accept_ones = torch.ones(r2t.shape[0], dtype=torch.int32, device=r2t.device)
        self._context = RowContext(r2t.shape[0])
        # After every capture, so the graphs (and their pool) are those of keep-current.
        self.continuity = self._strategy.build(self._continuity_context())
        prior = self._calibration(spec_bs) if needs_prior(self.settings) else None
        reduce = tp_mean(mr.tp_group)
        share = common_draft_share(mr.model, self._draft_worker.draft_runner.model, reduce)
        work = self.continuity.catch_up_work
        if work is not None:            # averaged over TP ranks like the draft share
            work = dataclasses.replace(work, kv_share=float(reduce([work.kv_share])[0]))
        policy = build_policy(self.settings, PolicyContext(
            self.speculative_num_steps, table.step_sizes(int(r2t.shape[0]) - 1), prior,
            defers_prefill=self.continuity.defers_prefill, max_rows=int(r2t.shape[0]),
            draft_share=share, catch_up_work=work))
        self.planner = StepPlanner(table, policy, graphs_enabled=self._graphs_enabled,
                                   reduce=reduce)
        summary = dict(policy=type(policy).__name__, config=self.settings.to_json(),
                       spec_bs=list(spec_bs), decode_bs=list(self._decode_pool.capture_bs),
                       draft_sync_bs=list(self._draft_sync.capture_bs),
                       num_steps=self.speculative_num_steps, topk=self.topk, draft_share=share,
                       catch_up_work=None if work is None else dataclasses.asdict(work),
                       calibration=None if prior is None else prior.to_json(),
                       continuity=self.continuity.describe())
        logger.info("dual-graph: ready: %s", summary)
        if self.settings.capture_probe:
            close_capture_probe(lambda: self._model_shape(mr), spec_bs,
                                self._decode_pool.capture_bs, is_rank0=self._is_rank0)
        if self._step_log is not None:
            self._step_log.write_event("ready", time.time(), **summary)

    def _model_shape(self, mr) -> dict:
        """This server's capture fingerprint shape (worker_startup.model_shape)."""
        return model_shape(mr, self._draft_worker.draft_runner.model_config,
                           num_steps=self.speculative_num_steps, topk=self.topk)

    @property
    def _strategy(self) -> type[SGLangContinuity]:
        """The continuity strategy's class, as DGW_CONTINUITY names it."""
        return STRATEGIES[self.settings.continuity]

    def _continuity_context(self) -> ContinuityContext:
        """What the continuity strategy builds itself from, once every graph is captured."""
        return ContinuityContext(
            settings=self.settings, draft_worker=self._draft_worker,
            target_worker=self._target_worker, req_to_token_pool=self.req_to_token_pool,
            draft_sync_runner=self._draft_sync.runner, accept_ones=self._accept_ones,
            stage=self._spans.stage, log_event=self._log_lazy_event,
            tree_unclamped=self._tree_unclamped)

    def _tree_unclamped(self, cache_name: str) -> None:
        """SGLang built a radix cache lazy catch-up cannot keep draft-valid (after the policy):
        prompts are prefilled with the draft from now on, and decode mode is priced so."""
        self.continuity.tree_unclamped(cache_name)
        if self.planner is not None:
            self.planner.policy.observe(DraftPrefills(deferred=self.continuity.defers_prefill))

    def _capture_draft_sync_graphs(self) -> DraftSyncGraphs:
        """Keep-current's one-token draft extend as width-1 graphs, last into the shared pool."""
        dw = self._draft_worker
        with in_draft(dw):
            graphs = build_draft_sync_graphs(dw, dw.server_args, self._decode_pool.capture_bs)
        self._additional_graph_memory_usage["draft_sync"] = graphs.memory_gb
        self._additional_graph_time_usage["draft_sync"] = graphs.capture_time_s
        return graphs

    def _calibration(self, spec_bs: tuple[int, ...]) -> Optional[CalibrationTable]:
        """The controller's prior: replays of each pool's graphs, a table from a file, or None
        with CUDA graphs off."""
        cfg = self.settings
        if cfg.calibration != MEASURE:
            return CalibrationTable.load(cfg.calibration, self.speculative_num_steps)
        if not self._graphs_enabled:
            return None
        mr = self._target_worker.model_runner
        dw = self._draft_worker
        decode_steps = {bs: [f] for bs in self._decode_pool.capture_bs
                        if (f := graph_replay(self._decode_pool.runner, bs)) is not None}
        spec_steps = {}
        for bs in spec_bs:
            verify = graph_replay(mr.decode_cuda_graph_runner, bs)
            if verify is None:
                continue
            stages = [graph_replay(dw.cuda_graph_runner, bs), verify,
                      graph_replay(dw.cuda_graph_runner_for_draft_extend, bs)]
            spec_steps[bs] = [f for f in stages if f is not None]
        # Every TP rank replays (the graphs hold collectives); rank 0's numbers are broadcast
        # so all ranks start from one prior.
        table = measure_calibration(decode_steps, spec_steps,
                                    num_draft_tokens=self.speculative_num_steps,
                                    timer=wall_clock_timer(time.perf_counter,
                                                           torch.cuda.synchronize),
                                    iters=cfg.calibrate_iters)
        data = mr.tp_group.broadcast_object(table.to_json() if self._is_rank0 else None, src=0)
        return CalibrationTable.from_json(data)

    @property
    def spec_v2_attn_backends(self) -> tuple:
        # Read by decide_needs_cpu_seq_lens (scheduler.init_overlap): the decode backend is
        # touched by decode steps, so it votes on whether seq_lens_cpu is published.
        return super().spec_v2_attn_backends + (self._decode_pool.attn_backend,)

    # -------------------------------------------------------------------------- per step

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None):
        if self._stall_watch is not None:
            self._stall_watch.beat()
        # Not batch.is_extend_in_batch: SGLang also sets it on a prefill under MLP sync (MoE
        # all-to-all), whose prompts the worker must admit; DP attention is refused.
        if self.planner is None or batch.forward_mode.is_idle():
            self._clock.launched(None)
            return super().forward_batch_generation(batch, on_publish=on_publish,
                                                    grammar_barrier=grammar_barrier)
        if batch.forward_mode.is_extend():
            return self._prefill(batch, on_publish, grammar_barrier)
        t0 = time.perf_counter()
        rows, kv_tokens = self._context.of(batch)
        self._running_rows = rows
        continuity = self.continuity
        pending = continuity.pending_tokens(rows)
        plan = self.planner.plan(len(rows), rows=rows, catch_up_tokens=pending,
                                 kv_tokens=kv_tokens)
        # NVTX step range, switch mark, profiling window (nvtx_spans); free without a profiler.
        # Spec steps' draft/verify/draft_extend stage ranges come from SGLang's own stage hooks.
        with self._spans.step(plan, self):
            if plan.mode is Mode.SPEC:
                # Its own NVTX stage: the checker reports this eager draft extend as the
                # deferred draft work, apart from glue and switch cost (profiling.engines).
                with self._spans.stage(names.CATCH_UP):
                    keep_alive = continuity.before_spec_step(batch, rows)
                plan_s = time.perf_counter() - t0
                result = super().forward_batch_generation(batch, on_publish=on_publish,
                                                          grammar_barrier=grammar_barrier)
                if keep_alive:
                    result.extra_keep_alive_refs = (list(result.extra_keep_alive_refs or [])
                                                    + keep_alive)
            else:
                # A full stash forces a catch-up first: the step's cost and the counters say so.
                with self._spans.stage(names.CATCH_UP):
                    room = continuity.before_decode_step(batch, rows)
                pending = room.caught_up_tokens
                plan_s = time.perf_counter() - t0
                result = self._decode_step(batch, rows, room.keep_alive, on_publish,
                                           grammar_barrier)
        # SGLang's own host time launching the step: a slow spell of the steps that this does
        # not share lies on the device.
        launch_s = time.perf_counter() - t0 - plan_s
        self._ledger.launched(plan, rows, plan_s, launch_s)
        self._clock.launched(StepTag(plan.mode, plan.padded_bs, pending, kv_tokens,
                                      plan.bs))
        self.counters.launched(plan, pending)
        return result

    def _prefill(self, batch, on_publish, grammar_barrier):
        tokens = int(batch.extend_num_tokens)
        rows = rows_of(batch)
        lengths = prefill_lengths(batch, len(rows))
        self.planner.policy.observe(Admitted(tokens, rows))
        self._context.admitted(rows, lengths)
        # The last decode step's rows, less those whose requests have finished since.
        running = held_rows(self.req_to_token_pool, self._running_rows)
        self._running_rows = np.union1d(running, rows)
        preview: Optional[PrefillPreview] = None

        def next_step_decodes() -> bool:
            nonlocal preview
            preview = self._preview_prefill(batch, lengths, tokens,
                                            joins=np.setdiff1d(running, rows))
            if preview is None:
                return self.planner.last_mode is Mode.DECODE
            return not preview.preview_draft

        deferred = self.continuity.defers_prefill_of(batch, next_step_decodes)
        self._log_prefill_choice(preview, drafted=not deferred)
        if deferred:
            result = self._deferred_prefill(batch, on_publish)
            self._clock.launched(PrefillTag(tokens, draft=False))
            self.counters.prefilled(tokens, deferred=True)
            return result
        self.continuity.on_prefill(batch)
        result = super().forward_batch_generation(batch, on_publish=on_publish,
                                                  grammar_barrier=grammar_barrier)
        # Stamped once launched, as a deferred prefill and a decode step are: the two kinds'
        # costs differ by the draft's work, not by where their host launch fell.
        self._clock.launched(PrefillTag(tokens, draft=True))
        self.counters.prefilled(tokens, deferred=False)
        return result

    def _preview_prefill(self, batch, lengths: np.ndarray, tokens: int,
                         joins: np.ndarray) -> Optional[PrefillPreview]:
        """The policy's choice, previewed and not committed, for the running batch this prefill
        joins (`joins`: its rows), grown to the rows in use plus the requests still queued
        behind it (hooks.py), capped at the request pool. Priced with what the draft owes that
        batch and a draft prefill of this prefill's `tokens` and of the queued requests that
        fit (a wave of long prompts arrives in chunks: each alone looks cheap). None for a pool
        that cannot say its size."""
        pool = self.req_to_token_pool
        bs = expected_batch_size(pool, queued_requests(batch))
        if bs is None:
            return None
        # The grown batch's context: the running requests' own, this prefill's, and the queued
        # prompts that fit at this prefill's mean length (the rows held now include this
        # prefill's).
        n = max(len(lengths), 1)
        queued_fit = bs - expected_batch_size(pool)
        prompts = int(lengths.sum())
        kv_tokens = self._context.total(joins) + prompts + prompts * queued_fit // n
        fresh = tokens * (n + queued_fit) // n
        owed = self.continuity.pending_tokens(joins)
        mode = self.planner.preview(bs, kv_tokens=kv_tokens, prefill_tokens=fresh,
                                    catch_up_tokens=owed)
        state = self.planner.policy.state()
        return PrefillPreview(bs, n, queued_fit, tokens, fresh, kv_tokens, owed,
                              mode is not Mode.DECODE, state.spec_goodput, state.decode_goodput)

    def _log_prefill_choice(self, preview: Optional[PrefillPreview], drafted: bool) -> None:
        """Where the draft's prefill may be deferred at all, whether this prefill's ran, with what
        the preview its choice read saw (none where the prefill could not be deferred, e.g. no
        room in the stash): a later chunk of a prompt whose first was deferred is deferred
        whatever its preview says."""
        if self._step_log is not None and self.continuity.defers_prefill:
            seen = {} if preview is None else preview._asdict()
            self._step_log.write_event("prefill_choice", time.time(), **seen,
                                       previewed=preview is not None, draft=drafted)

    def _deferred_prefill(self, batch, on_publish):
        """EAGLE's prefill without its draft extend: the same target forward (FULL hidden
        capture), the prompt's features handed to the continuity strategy."""
        out = self._target_worker.forward_batch_generation(
            batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        out.new_seq_lens = batch.seq_lens      # spec v2: the length before this iter's tokens
        if on_publish is not None:
            on_publish(out.new_seq_lens)
        out.next_draft_input = self.continuity.deferred_prefill(
            batch, aux=out.logits_output.hidden_states, next_token_ids=out.next_token_ids)
        return out

    def _decode_step(self, batch, rows: np.ndarray, room_keep_alive: Sequence[Any], on_publish,
                     grammar_barrier):
        draft_input = batch.spec_info
        if not isinstance(draft_input, EagleDraftInput) or draft_input.bonus_tokens is None:
            raise RuntimeError("dual-graph decode step needs the previous step's bonus tokens "
                               f"in batch.spec_info (got {type(draft_input).__name__})")
        mr = self._target_worker.model_runner
        out_cache_loc = decode_out_cache_loc(self.req_to_token_pool.req_to_token,
                                             batch.req_pool_indices, batch.seq_lens)
        lengths = decode_lengths(batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum)
        view = self._decode_view(batch, draft_input, out_cache_loc, lengths)
        if batch.has_grammar and grammar_barrier is not None:
            # Spec mode advances the grammar FSM over the previous result inside verify; the
            # sampler's vocab mask here needs the same up-to-date FSM.
            grammar_barrier()
        with self._spans.stage("decode"), self._decode_pool.installed(mr):
            forward_batch = ForwardBatch.init_new(view, mr,
                                                  capture_hidden_mode=CaptureHiddenMode.FULL,
                                                  return_hidden_states_before_norm=False)
            target = self._target_worker.forward_batch_generation(
                batch=None, forward_batch=forward_batch)
        logits_output = target.logits_output
        layout = decode_step_layout(lengths, self._accept_ones)
        if on_publish is not None:
            on_publish(layout.new_seq_lens)     # once, at target-end, as the spec path does
        draft = self.continuity.after_decode_step(batch, rows, target=target,
                                                  out_cache_loc=out_cache_loc)
        if batch.return_logprob and logits_output.next_token_logprobs is not None:
            logits_output.next_token_logprobs = per_request_logprobs(
                logits_output.next_token_logprobs)
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=target.next_token_ids,
            can_run_cuda_graph=target.can_run_cuda_graph,
            speculative_num_draft_tokens=layout.stride,
            next_draft_input=draft.next_draft_input,
            accept_lens=layout.accept_lens,
            new_seq_lens=layout.new_seq_lens,
            routed_experts_output=target.routed_experts_output,
            indexer_topk_output=target.indexer_topk_output,
            extra_keep_alive_refs=[forward_batch, *room_keep_alive, *draft.keep_alive],
        )

    @staticmethod
    def _decode_view(batch, draft_input: EagleDraftInput, out_cache_loc: torch.Tensor,
                     lengths: DecodeLengths):
        """A shallow copy of the ScheduleBatch shaped as a plain DECODE batch.

        A copy, not in-place edits: the draft extend after the target forward needs the batch's
        own (pre-step) seq_lens. ForwardBatch.init_new reads only attributes, so rebinding them
        on a shallow copy is enough; tensors are shared, never written.
        """
        view = copy.copy(batch)
        view.forward_mode = ForwardMode.DECODE
        view.spec_info = None             # triton asserts a decode batch has none
        view.input_ids = draft_input.bonus_tokens.to(torch.int64)
        view.out_cache_loc = out_cache_loc
        view.seq_lens = lengths.seq_lens   # DECODE positions are seq_lens - 1
        view.seq_lens_cpu = lengths.seq_lens_cpu
        view.seq_lens_sum = lengths.seq_lens_sum
        return view

    # ------------------------------------------------------------------------- accounting

    def dgw_prebuilt_joined(self, batch) -> None:
        """hooks.py: a PD-disaggregation decode server's prebuilt batch joined; its requests
        were prefilled on another server, so they hold their rows with no prompt cost here."""
        if self.planner is None or self._context is None:
            return
        rows = rows_of(batch)
        self.planner.policy.observe(Admitted(0, rows))
        self._context.admitted(rows, prefill_lengths(batch, len(rows)))

    def dgw_result_processed(self) -> None:
        """hooks.py: the scheduler processed the oldest launched batch's result."""
        done = self._clock.processed()
        if done is None or done.tag is None or self.planner is None:
            return
        tag, seconds = done
        # Overlap launched the next batch before this result was processed: its host launch is
        # in this batch's cost, which the controller must not take for a plain step's.
        carries = self._clock.in_flight > 0 and not tag.continued_by(self._clock.peek())
        event = tag.observation(seconds, carries)
        self.planner.policy.observe(event)
        if self._step_log is not None:
            # Each batch's measured cost, as the controller saw it: what its estimates came from.
            self._step_log.write_cost(event, time.time())

    def _log_lazy_event(self, event: LazyEvent, totals: BacklogStats) -> None:
        """Lazy catch-up's catch_up / compaction / deferred_prefill events, with the running
        totals (backlog.BacklogStats), into the step log."""
        logger.debug("dual-graph lazy %s: %s", event.kind, event)
        if self._step_log is not None:
            self._step_log.write_event(event.kind, time.time(), **event._asdict(),
                                       totals=totals.to_json())

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
        super().on_verify_complete_cpu(num_correct_drafts_per_req, batch_size)
        t0 = time.perf_counter()
        done = self._ledger.completed(num_correct_drafts_per_req, batch_size)
        if done is None or self.planner is None:
            return
        rec = done.record
        self.counters.completed(rec.mode, rec.bs, rec.tokens)
        policy = self.planner.policy
        policy.observe(accepted(rec.mode, done.accept_lens, done.rows, total=rec.tokens))
        if done.rows is not None:
            self._context.advanced(done.rows, done.accept_lens, rec.tokens)
        self._completed += 1
        if self._metrics is not None and self._completed % PUSH_EVERY == 0:
            self._metrics.push(self.counters, policy.state())
        if self._step_log is not None:
            self._step_log.write_step(done, policy.state(), time.perf_counter() - t0)
            if self._completed % ESTIMATES_EVERY == 0:
                self._log_estimates(policy)

    def _log_estimates(self, policy: ModePolicy) -> None:
        """The controller's cost terms but its per-size step table (prompt share, draft prefill,
        catch-up, switch, a new request's acceptance, exploration accounts): what a run's
        decisions are read from, beside each step's expected goodputs."""
        estimates = policy.estimates()
        if estimates is not None:
            gc = self._gc.take() if self._gc is not None else None
            self._step_log.write_event("estimates", time.time(), gc=gc, **allocator_stats(),
                                       **{k: v for k, v in estimates.to_json().items()
                                          if k != "step_s"})

    def dgw_internal_state(self) -> dict:
        """hooks.py: the worker's counters and the policy's beliefs, for /get_server_info."""
        # Steps whose accepted tokens never reached the controller (a lost or mismatched result).
        state = self.counters.to_json() | {"unpaired_steps": self._ledger.mismatches}
        if self.planner is not None:
            p, table = self.planner.policy.state(), self.planner.table
            state |= {"policy": self.settings.policy.value,
                      "pools": {"spec_bs": list(table.spec_sizes),
                                "decode_bs": list(table.decode_sizes)},
                      "accept_len_estimate": p.accept_len,
                      "expected_goodput_spec": p.spec_goodput,
                      "expected_goodput_decode": p.decode_goodput}
            if (estimates := self.planner.policy.estimates()) is not None:
                state["estimates"] = estimates.to_json()
        return state
