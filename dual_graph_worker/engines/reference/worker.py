"""The reference engine's dual-graph worker: one step = plan (core.planner) -> slots -> fill
static inputs -> run (graph replay, or eager where no graph exists) -> accept -> commit.

It owns the static buffers, the KV slot planner, the continuity strategy and the host request
table; the engine supplies the stage functions (captured once into one graph pool) and the eager
prefill / catch-up. Steps run synchronously, so each one's wall time is its measured cost.
"""

from __future__ import annotations

import itertools
import numbers
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from dual_graph_worker.core import nvtx_names as names
from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.nvtx import Annotator
from dual_graph_worker.core.planner import StepPlan, StepPlanner
from dual_graph_worker.core.policy import (Admitted, ModePolicy, PrefillTime, Reason, StepTime,
                                           accepted)
from dual_graph_worker.core.results import StepRecord
from dual_graph_worker.core.settings import read_setting
from dual_graph_worker.engines.reference.buffers import BufferSizes, StaticInputs
from dual_graph_worker.engines.reference.continuity import make_continuity
from dual_graph_worker.engines.reference.engine_api import Engine, PrefillMode
from dual_graph_worker.engines.reference.kv_slots import KVSlotPlanner, SlotAllocator, SlotPlan
from dual_graph_worker.engines.reference.requests import FinishedRequest, RequestTable
from dual_graph_worker.engines.reference.results import PrefillResult, StepResult
from dual_graph_worker.engines.reference.runners import (CaptureReport, CudaGraphRunner, EagerRunner,
                                                         StageRunner)


@dataclass(frozen=True)
class WorkerConfig:
    spec_bs: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_bs: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256)
    use_cuda_graphs: bool = False       # False: the eager runner at the same padded sizes
    allow_eager: bool = True            # batches beyond every pool run eagerly (else: error)
    max_running: int = 0                # 0: the decode pool's top
    # None: no draft state at all (a plain server), so the spec pool must be empty.
    continuity: Optional[Continuity] = Continuity.KEEP_CURRENT
    eos_token_id: Optional[int] = None
    # Lazy catch-up: prompts joining a batch that will decode skip the draft's prefill.
    defer_prefill: bool = True

    def __post_init__(self) -> None:
        if not self.decode_bs and not self.spec_bs:
            raise ConfigError("both pools are empty: give decode_bs and/or spec_bs batch sizes")
        if self.continuity is None and self.spec_bs:
            raise ConfigError("continuity None keeps no draft state, so the spec pool must be "
                              "empty (spec_bs=()); use keep-current or lazy-catch-up to speculate")


# Step records are metrics, not state: keep the recent ones only, so a server that runs for
# weeks does not grow without bound.
MAX_STEP_RECORDS = 100_000


@dataclass
class WorkerStats:
    records: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=MAX_STEP_RECORDS))
    switches: int = 0
    catch_up_tokens: int = 0


class DualGraphWorker:
    def __init__(self, engine: Engine, config: WorkerConfig, policy: ModePolicy,
                 nvtx: Optional[Annotator] = None) -> None:
        """`nvtx`: where its ranges go (default: as the environment says, DGW_NVTX)."""
        lim = engine.limits
        self.nvtx = nvtx if nvtx is not None else Annotator.switched(read_setting("nvtx"))
        self.engine, self.config = engine, config
        self.k = lim.num_draft_tokens
        self.dispatch = DispatchTable.build(config.spec_bs, config.decode_bs, config.allow_eager)
        self.planner = StepPlanner(self.dispatch, policy, graphs_enabled=True)
        top = max(self.dispatch.max_decode_bs, self.dispatch.max_spec_bs)
        max_running = config.max_running or top
        if max_running > lim.max_requests - 1:
            raise ConfigError(f"max_running={max_running} exceeds the engine's request table "
                              f"({lim.max_requests - 1} rows); raise max_requests")
        if not config.allow_eager and max_running > top:
            raise ConfigError(f"max_running={max_running} > largest captured batch {top} with "
                              "eager fallback disabled; capture larger sizes or lower max_running")
        self.max_running = max_running
        self.bufs = StaticInputs.allocate(
            BufferSizes.for_pools(self.dispatch.max_spec_bs, self.dispatch.max_decode_bs, self.k,
                                  max_running), engine.device)
        self.kv = KVSlotPlanner(SlotAllocator(lim.num_slots), self.k)
        self.table = RequestTable(lim.max_requests, lim.max_context, self.k)
        self.continuity = make_continuity(config.continuity, engine, self.table,
                                          config.defer_prefill)
        stage_fns = engine.bind(self.bufs, self.continuity, self.dispatch.max_spec_bs)
        self.runner: StageRunner
        if config.use_cuda_graphs:
            self.runner = CudaGraphRunner(stage_fns, self.k, self.nvtx, self.dispatch)
        else:
            self.runner = EagerRunner(stage_fns, self.k, self.nvtx)
        self._vocab = engine.vocab_size
        self.stats = WorkerStats()
        self.finished: list[FinishedRequest] = []   # drained by the caller (take_finished)
        self._step = 0
        self._last_mode: Optional[Mode] = None
        self._rids = itertools.count()

    # ------------------------------------------------------------------ lifecycle
    def capture(self, progress: bool = True) -> Optional[CaptureReport]:
        """Mark the engine config in NVTX, then capture both pools: the CaptureReport, or None
        under the eager runner. Call once at start-up."""
        d = self.engine.describe()
        self.nvtx.mark_config(names.CONFIG_ENGINE, d.engine)
        self.nvtx.mark_config(names.CONFIG_ATTENTION_BACKEND, d.attention_backend)
        self.nvtx.mark_config(names.CONFIG_NUM_DRAFT_TOKENS, self.k)
        if not isinstance(self.runner, CudaGraphRunner):
            return None
        # The caller marks steady state (worker.nvtx.mark_steady_state) once its own
        # warm-up (first prefills, first steps) is over: capture alone is not the end of it.
        return self.runner.capture(progress=progress)

    def take_finished(self) -> list[FinishedRequest]:
        out, self.finished = self.finished, []
        return out

    @property
    def num_running(self) -> int:
        return len(self.table.running)

    @property
    def policy(self) -> ModePolicy:
        return self.planner.policy

    @policy.setter
    def policy(self, policy: ModePolicy) -> None:
        self.planner = StepPlanner(self.dispatch, policy)

    def add_requests(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]
                     ) -> PrefillResult:
        """Admit and prefill requests (eager extend); their first token comes back here."""
        arrays, max_new_tokens = _checked_requests(prompts, max_new_tokens)
        if self.num_running + len(prompts) > self.max_running:
            raise ConfigError(f"admitting {len(prompts)} requests would run "
                              f"{self.num_running + len(prompts)} > max_running={self.max_running}")
        vocab = self._vocab
        for a, n in zip(arrays, max_new_tokens):
            self.table.check_fits(len(a), n)
            if a.size and (a.min() < 0 or a.max() >= vocab):
                raise ValueError(f"prompt token ids must be in [0, {vocab}), got "
                                 f"min {a.min()} max {a.max()}")
        need = sum(len(a) for a in arrays)
        plan_slots = self.kv.allocator.alloc(need)    # raises KVPoolExhausted, nothing admitted
        rows, slot_lists, off = [], [], 0
        for a, n in zip(arrays, max_new_tokens):
            row = self.table.admit(next(self._rids), a, n)
            s = plan_slots[off: off + len(a)]
            off += len(a)
            self.table.slots[row, : len(a)] = s
            rows.append(row)
            slot_lists.append(s)
        rows_np = np.asarray(rows, dtype=np.int64)
        lens = np.asarray([len(a) for a in arrays])
        try:
            # Admitted first: a reused row's acceptance estimate is reset before the preview.
            self.policy.observe(Admitted(need, rows_np))
            mode = self.continuity.prefill_mode(lambda: self._next_step_decodes(rows_np, need))
            t0 = time.perf_counter()
            first = self.engine.prefill(rows_np, arrays, slot_lists, mode)
        except BaseException:
            # Nothing was admitted: give back the rows and the prompt slots, then re-raise.
            for row in rows:
                self.table.release(row, "abort", 0)
            self.kv.allocator.free(plan_slots)
            raise
        # The engine's prefill returns host tokens, so it has finished: its wall time is its cost.
        self.policy.observe(PrefillTime(need, time.perf_counter() - t0,
                                        draft=mode is PrefillMode.WITH_DRAFT))
        self.continuity.after_prefill(rows_np, mode)
        self.table.tokens[rows_np, lens] = first
        self.table.seq_lens[rows_np] = lens
        self.table.start_running(rows_np)
        rids = tuple(self.table.rid_of_row[rows_np].tolist())
        ones = np.ones(len(rows_np), dtype=np.int64)
        _, finished = self._finish_done(rows_np, first[:, None], ones, ones * 0)
        return PrefillResult(rids, tuple(int(t) for t in first), tuple(f.rid for f in finished))

    def _next_step_decodes(self, rows: np.ndarray, prompt_tokens: int) -> bool:
        """Whether the running batch, grown by `rows`, will decode next: the policy's choice
        previewed as `plan` would ask it (backlog, KV room), these prompts' draft prefill priced,
        committing nothing."""
        running = self.table.running
        grown = np.concatenate([running, rows])
        if not self.kv.can_run(Mode.SPEC, len(grown)):
            return True
        kv_tokens = int(self.table.seq_lens[running].sum()) + prompt_tokens
        return self.planner.preview(len(grown), rows=grown, kv_tokens=kv_tokens,
                                    catch_up_tokens=self.continuity.pending_tokens(running),
                                    prefill_tokens=prompt_tokens) is Mode.DECODE

    def abort(self, rid: int) -> FinishedRequest:
        """Stop a request; what it already produced comes back in the record."""
        row = self.table.row(rid)
        if row is None:
            raise KeyError(f"request {rid} is not running")
        done, held = self.table.release(row, "abort", int(self.table.generated(np.asarray([row]))[0]))
        self.kv.allocator.free(held)
        self.continuity.release(np.asarray([row]))
        return done

    # ------------------------------------------------------------------ one step
    def plan(self, rows: np.ndarray, kv_tokens: int) -> StepPlan:
        """The planner's choice for the running `rows` over `kv_tokens` context tokens; the spec
        pool's buffers cannot take a spec step beyond it, and free KV slots must cover K+1
        slots a request."""
        bs = len(rows)
        return self.planner.plan(bs, rows=rows,
                                 catch_up_tokens=self.continuity.pending_tokens(rows),
                                 kv_tokens=kv_tokens, spec_fits_kv=self.kv.can_run(Mode.SPEC, bs))

    def step(self) -> StepResult:
        rows = self.table.running.copy()
        bs = len(rows)
        if bs == 0:
            raise RuntimeError("step() with no running requests: add_requests first")
        self.kv.require(Mode.DECODE, bs)        # no mode fits: raised before the policy commits
        t0 = time.perf_counter()
        kv_tokens = int(self.table.seq_lens[rows].sum())
        step_plan = self.plan(rows, kv_tokens)
        mode, reason, padded = step_plan.mode, step_plan.reason, step_plan.padded_bs
        use_graph = step_plan.graph and self.config.use_cuda_graphs
        if self._last_mode is not None and mode is not self._last_mode:
            self.nvtx.mark_switch(self._last_mode.value, mode.value)
            self.stats.switches += 1
        caught_up = 0
        with self.nvtx.step_range(mode.value, padded, use_graph):
            if mode is Mode.SPEC:
                caught_up = self.continuity.before_spec_step(rows)
                self.stats.catch_up_tokens += caught_up
            plan = self.kv.plan(mode, bs)
            seq_before = self.table.seq_lens[rows]            # fancy indexing: a copy
            saved_rows = None
            try:
                self.bufs.stage(rows, seq_before, plan.slots, padded)
                self.bufs.upload()
                rows_dev = self.bufs.req_pool_indices[:bs]    # the rows, on the device already
                self.engine.save_rows(rows_dev)
                saved_rows = rows_dev                         # only once their state is saved
                self.runner.run(mode, padded, use_graph)
                with self.nvtx.stage_range("accept"):
                    staged_tokens, staged_accept = self.bufs.download()
                    # Out of the staging buffer (the next step reuses it) straight into the
                    # speculative layout [bs, K+1]: columns past this mode's width stay zero.
                    tokens = np.zeros((bs, self.k + 1), dtype=np.int64)
                    tokens[:, : plan.width] = staged_tokens[:bs, : plan.width]
                    accept = staged_accept[:bs].copy()
            except BaseException:
                # Nothing committed: no slot leaks, and the rows' tokens and draft state are as
                # before the step, so their requests go on exactly.
                self.kv.cancel(plan)
                if saved_rows is not None:
                    self.engine.restore_rows(saved_rows)
                raise
            with self.nvtx.stage_range("commit"):
                result = self._commit(rows, seq_before, plan, tokens, accept, mode, reason,
                                      padded, use_graph)
        # download() waited for the device, so the wall time is the step's whole cost.
        self.policy.observe(StepTime(mode, padded, time.perf_counter() - t0, caught_up,
                                     kv_tokens=kv_tokens))
        self._last_mode = mode
        return result

    def _commit(self, rows, seq_before, plan: SlotPlan, layout, accept, mode: Mode,
                reason: Reason, padded: int, use_graph: bool) -> StepResult:
        """`layout` is [bs, K+1] (the speculative layout); this mode wrote its first `width`
        columns."""
        bs, width = len(rows), plan.width
        tokens = layout[:, :width]
        rids = tuple(self.table.rid_of_row[rows].tolist())
        keep = self.kv.commit(plan, accept)
        # Host mirror of the slot table and the token history, for every request at once.
        rows2d = np.broadcast_to(rows[:, None], (bs, width))
        cols = seq_before[:, None] + np.arange(width)[None, :]
        self.table.slots[rows2d[keep], cols[keep]] = plan.slots[keep]
        self.table.tokens[rows2d[keep], cols[keep] + 1] = tokens[keep]
        generated_before = self.table.generated(rows)
        self.table.seq_lens[rows] = seq_before + accept
        if mode is Mode.DECODE:
            self.continuity.after_decode_step(rows, seq_before)
        self.policy.observe(accepted(mode, accept, rows))
        emitted, finished = self._finish_done(rows, tokens, accept, generated_before)
        record = StepRecord(self._step, mode, bs, padded, reason, use_graph, int(emitted.sum()),
                            float(accept.mean()))
        self.stats.records.append(record)
        self._step += 1
        return StepResult(torch.from_numpy(layout.reshape(-1)),
                          torch.from_numpy(emitted.astype(np.int32)), self.k + 1, rids,
                          tuple(f.rid for f in finished), record)

    def _finish_done(self, rows: np.ndarray, tokens: np.ndarray, accept: np.ndarray,
                     generated_before: np.ndarray) -> tuple[np.ndarray, list[FinishedRequest]]:
        """Tokens each request receives this step (cut at max_new_tokens and at the first EOS),
        and the requests that finished; their KV slots go back to the pool."""
        max_new = self.table.max_new[rows]
        limit = max_new - generated_before
        emitted = np.minimum(accept, limit)
        eos = self.config.eos_token_id
        hit_eos = np.zeros(len(rows), dtype=bool)
        if eos is not None:
            hit = (tokens == eos) & (np.arange(tokens.shape[1])[None, :] < emitted[:, None])
            hit_eos = hit.any(1)
            emitted = np.where(hit_eos, hit.argmax(1) + 1, emitted)
        done = hit_eos | (generated_before + emitted >= max_new)
        finished = []
        for row, by_eos, out_len in zip(rows[done], hit_eos[done], (generated_before + emitted)[done]):
            record, held = self.table.release(int(row), "eos" if by_eos else "length", int(out_len))
            self.kv.allocator.free(held)
            finished.append(record)
        self.continuity.release(rows[done])
        self.finished.extend(finished)
        return emitted, finished


def _checked_requests(prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]
                      ) -> tuple[list[np.ndarray], list[int]]:
    """Each prompt as int64 token ids and its max_new_tokens, or ValueError naming what is
    wrong: no prompts, one a list of lists or of non-integers, a count per prompt that is not
    one per prompt."""
    if not len(prompts):
        raise ValueError("add_requests needs at least one prompt")
    max_new_tokens = [max_new_tokens] * len(prompts) \
        if isinstance(max_new_tokens, numbers.Integral) else list(max_new_tokens)
    if len(max_new_tokens) != len(prompts):
        raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {len(prompts)} "
                         "prompts: give one per prompt, or one int for all")
    if not all(isinstance(n, numbers.Integral) for n in max_new_tokens):
        raise ValueError(f"max_new_tokens must be integers, got {max_new_tokens}")
    arrays = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise ValueError(f"prompt {i} must be a flat list of integer token ids, got "
                             f"{a.dtype} of shape {a.shape}")
        arrays.append(a.astype(np.int64))
    return arrays, [int(n) for n in max_new_tokens]
