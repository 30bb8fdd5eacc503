"""Lazy catch-up of the draft (``DGW_CONTINUITY=lazy-catch-up``, the default continuity).

A decode-mode step only stashes the target's EAGLE-3 features of its token; before the next
speculative step one eager draft extend (DRAFT_EXTEND_V2, triton) catches every row that is
behind up and installs its proposal. A prompt joining a batch that will decode may skip the
draft's prefill the same way (deferred prefill); with the radix cache on, only under the
``dual_graph`` radix backend (radix.py). Design: docs/design.md, "Draft state across switches";
the SGLang contracts relied on: docs/sglang-0.5.17.md §6 and §8.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Callable, NamedTuple, Optional, Union

import numpy as np
import torch
from sglang.srt.layers.moe.utils import (
    speculative_moe_a2a_backend_context,
    speculative_moe_backend_context,
)
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.speculative.eagle_info import EagleDraftExtendInput, EagleDraftInput
from sglang.srt.speculative.eagle_utils import (
    _eagle_prefill_tail_tokens,
    get_draft_input_from_target_hidden_dim,
    get_draft_recurrent_hidden_state_spec,
)
from sglang.srt.speculative.spec_utils import spec_stage_span

from dual_graph_worker.core.batch_costs import CatchUpWork, passes_too_short
from dual_graph_worker.engines.sglang.backlog import (
    Behind,
    LazyBacklog,
    RoomAction,
    arena_cells_for_budget,
)
from dual_graph_worker.engines.sglang.catch_up import (
    CatchUpIndices,
    StashArena,
    build_catch_up_indices,
    final_rows,
    join_passes,
    plan_passes,
    shifted_prompt_tokens,
)
from dual_graph_worker.engines.sglang.catch_up import to_device as _to_device
from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.engines.sglang import stash_room
from dual_graph_worker.engines.sglang.continuity_contract import (ContinuityContext, DecodeDraft,
                                                                  RoomMade)
from dual_graph_worker.engines.sglang.draft_sync import draft_proposals
from dual_graph_worker.engines.sglang.kv_fill import (KV_ONLY_MIN_TOKENS, fill_draft_kv,
                                                       kv_fill_unavailable, kv_share)
from dual_graph_worker.engines.sglang.row_context import rows_of
from dual_graph_worker.engines.sglang.radix import BACKEND as RADIX_BACKEND
from dual_graph_worker.engines.sglang.radix import BEHIND_ATTR, UNCLAMPED_ATTR
from dual_graph_worker.engines.sglang.server_args_hook import (CATCH_UP_BACKENDS, CATCH_UP_FLAG,
                                                               catch_up_backend_classes)

logger = logging.getLogger(__name__)

_MiB = 1 << 20
DEFAULT_MAX_PASS_TOKENS = 8192
# DGW_LAZY_STASH_MB=0 (auto): this share of the GPU memory free after every capture. The rest
# stays for SGLang's activations (a prefill chunk's MLP and the FULL aux capture of its tokens).
AUTO_STASH_SHARE = 0.4


class CatchUpEvent(NamedTuple):
    """A catch-up, for the step log."""

    kind = "catch_up"         # not a field: the step log's event name
    forced: bool              # the arena was full: caught up before a decode step, not a spec one
    requests: int
    tokens: int
    passes: int
    max_backlog: int
    orphans: int              # rows behind whose request left the batch (their backlog dropped)
    host_indices: bool        # indices computed on the host (the batch had host lengths)
    host_us: dict             # host microseconds by phase
    # DGW_CATCH_UP_KV_CHECK: the largest |filled - whole layer's| over |whole layer's| of the
    # K and V of its split passes (None: none checked).
    kv_error: Optional[float] = None


class CompactionEvent(NamedTuple):
    """The arena's live cells moved to its front."""

    kind = "compaction"
    live_cells: int
    arena_cells: int


class DeferredPrefillEvent(NamedTuple):
    """A prefill that ran the target alone."""

    kind = "deferred_prefill"
    requests: int
    tokens: int
    chunked: bool


LazyEvent = Union[CatchUpEvent, CompactionEvent, DeferredPrefillEvent]


class CatchUpResult(NamedTuple):
    batch_positions: list[int]            # rows of the batch whose proposal is below, in order
    topk_p: Optional[torch.Tensor]        # [m, topk] fp32 (None: proposals not wanted)
    topk_index: Optional[torch.Tensor]    # [m, topk] int64
    hidden_states: Optional[torch.Tensor]  # [m, draft hidden]
    keep_alive: list                      # forward batches / index tensors of the passes
    event: CatchUpEvent                   # for the step log


class LazyCatchUp:
    """Stash + backlog + catch-up for one DualGraphEagleWorker (one per TP rank; every rank
    makes the same host decisions, from batch sizes and counts alone)."""

    def __init__(self, draft_worker: Any, target_runner: Any, req_to_token_pool: Any, *,
                 stash_mb: int, defer_prefill: bool = True, kv_only: bool = False,
                 kv_check: bool = False,
                 on_event: Optional[Callable[[LazyEvent], None]] = None) -> None:
        dr = draft_worker.draft_runner
        if not isinstance(dr.attn_backend, catch_up_backend_classes()):
            raise ConfigError("DGW_CONTINUITY=lazy-catch-up has only been checked against the "
                              f"{' and '.join(CATCH_UP_BACKENDS)} attention backend (draft "
                              "extend with per-request lengths); the draft-extend backend here "
                              f"is {type(dr.attn_backend).__name__}. Use {CATCH_UP_FLAG} or "
                              "DGW_CONTINUITY=keep-current")
        self.dw = draft_worker
        self.req_to_token = req_to_token_pool.req_to_token
        device = self.req_to_token.device
        num_rows = int(self.req_to_token.shape[0])
        kv = target_runner.token_to_kv_pool
        num_slots = int(kv.size) + int(getattr(kv, "page_size", 1) or 1)
        aux_width = int(get_draft_input_from_target_hidden_dim(dr))
        aux_dtype = dr.model_config.dtype
        elem = torch.empty((), dtype=aux_dtype).element_size()
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        budget = _stash_budget(stash_mb, free, slot_map_bytes=num_slots * 8)
        # Per cell: the feature row, its int64 token id and its int64 cell id (the arange a
        # step slices): StashArena.allocate's tensors.
        bookkeeping = 8 + 8
        per_cell = aux_width * elem + bookkeeping
        cells = arena_cells_for_budget(budget, aux_width=aux_width,
                                       aux_elem_bytes=elem, token_bytes=bookkeeping)
        cells = min(cells, num_slots)           # more cells than KV slots are never in use
        cells = _same_on_every_rank(cells, getattr(target_runner, "tp_group", None))
        if cells < num_rows:
            need = -(-num_rows * per_cell // _MiB)
            raise ConfigError(f"DGW_LAZY_STASH_MB={stash_mb} holds {cells} stashed tokens of "
                              f"{aux_width} x {aux_dtype} features, fewer than the "
                              f"{num_rows} request-pool rows one decode step may need; set "
                              f"DGW_LAZY_STASH_MB >= {need}")
        need_bytes = cells * per_cell + num_slots * 8
        if free is not None and need_bytes > free // 2:
            raise ConfigError(f"the lazy-catch-up stash needs {need_bytes / _MiB:.0f} MiB "
                              f"but only {free / _MiB:.0f} MiB are free after start-up; "
                              "lower DGW_LAZY_STASH_MB or --mem-fraction-static, or use "
                              "DGW_CONTINUITY=keep-current")
        self.arena = StashArena.allocate(cells, aux_width, aux_dtype, num_slots, device)
        self.backlog = LazyBacklog(num_rows, cells)
        chunk = getattr(dr.server_args, "chunked_prefill_size", None)
        self.max_pass_tokens = int(chunk) if chunk and int(chunk) > 0 else DEFAULT_MAX_PASS_TOKENS
        self.draft_hidden = get_draft_recurrent_hidden_state_spec(dr)
        self.defer_prefill_off = _why_not_defer_prefills(
            defer_prefill, dr.server_args, cells=cells, rows=num_rows,
            reserve=self.max_pass_tokens, draft_hidden=self.draft_hidden)
        # Kept free for the next deferred prefill when a compaction can provide it.
        self.prefill_reserve = 0 if self.defer_prefill_off else self.max_pass_tokens
        # Why the draft's K/V cannot be filled alone (DGW_CATCH_UP_KV_ONLY); None: they are.
        self.kv_only_min_tokens = KV_ONLY_MIN_TOKENS
        self.kv_only_off = (kv_fill_unavailable(dr) or _passes_too_short(
            self.max_pass_tokens, self.kv_only_min_tokens)) if kv_only else "off"
        self.kv_check = kv_check
        if kv_only and self.kv_only_off:
            logger.warning("dual-graph: DGW_CATCH_UP_KV_ONLY ignored: %s; catch-ups run the "
                           "draft's whole layer", self.kv_only_off)
        # Each event for the step log, named by its kind.
        self.on_event = on_event
        logger.info("dual-graph: lazy catch-up stash: %d tokens x %d %s features (%.0f MiB), "
                    "%d KV slots, catch-up passes of <= %d tokens; deferred draft prefill: %s; "
                    "K/V-only catch-up: %s", cells, aux_width, aux_dtype,
                    self.arena.nbytes / _MiB, num_slots, self.max_pass_tokens,
                    self.defer_prefill_off or "on",
                    self.kv_only_off or f"passes of >= {self.kv_only_min_tokens} tokens")

    kind = Continuity.LAZY_CATCH_UP
    draft_sync_graphs = False      # the draft catches up when speculation resumes

    @classmethod
    def build(cls, ctx: ContinuityContext) -> "LazyCatchUp":
        """The worker's strategy, its events in the step log and the radix cache's hooks on
        the target worker, where the cache's factory (built after the workers) finds them."""
        cfg = ctx.settings
        lazy = cls(ctx.draft_worker, ctx.target_worker.model_runner, ctx.req_to_token_pool,
                   stash_mb=cfg.lazy_stash_mb, defer_prefill=cfg.defer_draft_prefill,
                   kv_only=cfg.catch_up_kv_only, kv_check=cfg.catch_up_kv_check)
        lazy.on_event = lambda event: ctx.log_event(event, lazy.backlog.stats)
        setattr(ctx.target_worker, BEHIND_ATTR, lazy.behind)
        setattr(ctx.target_worker, UNCLAMPED_ATTR, ctx.tree_unclamped)
        return lazy

    @property
    def defers_prefill(self) -> bool:
        return self.defer_prefill_off is None

    @property
    def catch_up_work(self) -> Optional[CatchUpWork]:
        """What K/V-only passes save, for the controller's catch-up price; None while checked
        (each split pass then also runs the whole layer)."""
        if self.kv_only_off or self.kv_check:
            return None
        return CatchUpWork(self.kv_only_min_tokens, kv_share(self.dw.draft_runner),
                           self.max_pass_tokens)

    def pending_tokens(self, rows: np.ndarray) -> int:
        return self.backlog.pending_tokens(rows)

    def tree_unclamped(self, cache_name: str) -> None:
        """The radix cache SGLang built cannot be kept draft-valid (radix.py): a deferred
        prompt's prefix would become matchable without draft KV, so stop deferring."""
        if self.defer_prefill_off is None:
            self.defer_prefill_off = (f"off: the radix cache is {cache_name}, which the worker "
                                      "cannot keep draft-valid; --disable-radix-cache defers")
            self.prefill_reserve = 0
            logger.warning("dual-graph: deferred draft prefill %s", self.defer_prefill_off)

    def behind(self, row: int) -> int:
        """Draft tokens request-pool row `row` is behind (the radix cache's clamp, radix.py)."""
        return int(self.backlog.count[row])

    def defers_prefill_of(self, batch: Any, next_step_decodes: Callable[[], bool]) -> bool:
        """Defer when the running batch this prefill joins will decode (a request admitted now
        may finish before the worker speculates again), and always for the next chunk of a
        prompt whose earlier chunks were deferred. A wrong guess costs one catch-up at the next
        speculative step: the same draft extend, later. `can_defer` (host-only) comes first, so
        a server that cannot defer previews no policy."""
        return self.can_defer(batch) and (next_step_decodes() or self.must_defer(batch))

    def before_decode_step(self, batch: Any, rows: np.ndarray) -> RoomMade:
        """Before a lazy decode step over the running batch: reclaim orphans' cells by a
        compaction, or, if the live backlog itself does not fit, a forced catch-up."""
        room = stash_room.make_room(
            self.arena, self.backlog, self.req_to_token, rows, reserve=self.prefill_reserve,
            req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
            catch_up=lambda behind: self._catch_up(batch, rows, behind, forced=True,
                                                   want_proposals=False).keep_alive)
        if room.action is RoomAction.COMPACT:
            self._emit(CompactionEvent(self.backlog.cursor, self.arena.cells))
        return RoomMade(room.keep_alive, room.caught_up_tokens)

    def after_decode_step(self, batch: Any, rows: np.ndarray, *, target: Any,
                          out_cache_loc: torch.Tensor) -> DecodeDraft:
        self.stash(rows, aux=target.logits_output.hidden_states, sampled=target.next_token_ids,
                   out_cache_loc=out_cache_loc)
        return DecodeDraft(self.carried_draft_input(batch.spec_info, target.next_token_ids,
                                                    self.dw.topk), [])

    def deferred_prefill(self, batch: Any, *, aux: Optional[torch.Tensor],
                         next_token_ids: torch.Tensor) -> EagleDraftInput:
        return self.defer_prefill(batch, aux=aux, next_token_ids=next_token_ids)

    def describe(self) -> dict:
        return {"continuity": self.kind.value, "stash_tokens": self.arena.cells,
                "stash_mib": round(self.arena.nbytes / _MiB, 1),
                "aux_width": int(self.arena.aux.shape[1]),
                "max_pass_tokens": self.max_pass_tokens,
                "deferred_prefill": self.defer_prefill_off or "on",
                "kv_only_catch_up": self.kv_only_off or "on"}

    # ----------------------------------------------------------------------- hooks

    def on_prefill(self, batch: Any) -> None:
        """EAGLE's own prefill (with its draft extend) runs for `batch`."""
        rows = rows_of(batch)
        self.backlog.drop_abandoned_pending(rows)
        self.backlog.reset(rows, prefix_lens=getattr(batch, "prefix_lens", None))

    def must_defer(self, batch: Any) -> bool:
        """The batch continues a chunked prompt whose earlier chunks were deferred: EAGLE's
        prefill extend of it would attend to draft KV those chunks never wrote."""
        prefix = getattr(batch, "prefix_lens", None)
        return prefix is not None and self.backlog.continues_deferred_chunk(rows_of(batch),
                                                                            prefix)

    def can_defer(self, batch: Any) -> bool:
        """Whether this prefill batch's draft extend may be deferred (docs/sglang-0.5.17.md §6)."""
        if self.defer_prefill_off or batch.forward_mode != ForwardMode.EXTEND:
            return False
        if any(m is not None for m in (getattr(batch, "multimodal_inputs", None) or ())):
            return False
        chunked = batch.chunked_req
        if chunked is None:
            return self.backlog.can_defer(int(batch.extend_num_tokens))
        return self.backlog.can_defer(int(batch.extend_num_tokens), reserve=self.prefill_reserve,
                                      chunked_prompt=len(chunked.origin_input_ids))

    def defer_prefill(self, batch: Any, *, aux: Optional[torch.Tensor],
                      next_token_ids: torch.Tensor) -> EagleDraftInput:
        """After the target prefill of `batch`: stash its features instead of EAGLE's draft
        extend, and return placeholder proposals of spec mode's shapes (docs/sglang-0.5.17.md
        §4, §6)."""
        rows = rows_of(batch)
        self.backlog.drop_abandoned_pending(rows)
        ext, prefix = list(batch.extend_lens), list(batch.prefix_lens)
        num_tokens = int(batch.input_ids.shape[0])
        if aux is None or aux.shape[0] != num_tokens or aux.shape[1:] != self.arena.aux.shape[1:]:
            raise RuntimeError(f"deferred prefill: target aux hidden states "
                               f"{None if aux is None else tuple(aux.shape)} do not match the "
                               f"batch's {num_tokens} tokens x {self.arena.aux.shape[1]} stash "
                               "width (the target prefill must run with FULL hidden capture)")
        tokens = shifted_prompt_tokens(batch.input_ids, ext,
                                       _eagle_prefill_tail_tokens(batch, next_token_ids))
        chunked = -1 if batch.chunked_req is None else next(
            (i for i, r in enumerate(batch.reqs) if r is batch.chunked_req), -1)
        base = self.backlog.note_prefill(rows, prefix, ext, chunked=chunked)
        self.arena.write(base, aux, tokens, batch.out_cache_loc)
        self._emit(DeferredPrefillEvent(int(rows.shape[0]), num_tokens, chunked >= 0))
        bs, topk = rows.shape[0], self.dw.topk
        hidden_size, hidden_dtype = self.draft_hidden
        device = next_token_ids.device
        return EagleDraftInput(
            topk_p=torch.ones(bs, topk, dtype=torch.float32, device=device),
            topk_index=torch.zeros(bs, topk, dtype=torch.int64, device=device),
            hidden_states=torch.zeros(bs, hidden_size, dtype=hidden_dtype, device=device),
            bonus_tokens=next_token_ids, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1)

    def _emit(self, event: LazyEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def stash(self, rows: np.ndarray, *, aux: Optional[torch.Tensor], sampled: torch.Tensor,
              out_cache_loc: torch.Tensor) -> None:
        if aux is None:
            raise RuntimeError("the decode pool returned no hidden states; lazy catch-up needs "
                               "the target's EAGLE-3 aux hidden states (FULL capture)")
        # Validate before the host counts move, so a failure leaves the bookkeeping consistent.
        if aux.shape[0] != rows.shape[0] or aux.shape[1:] != self.arena.aux.shape[1:]:
            raise RuntimeError(f"target aux hidden states {tuple(aux.shape)} do not match the "
                               f"stash ({rows.shape[0]}, {self.arena.aux.shape[1]})")
        base = self.backlog.note_decode_step(rows)
        self.arena.write(base, aux, sampled, out_cache_loc)

    @staticmethod
    def carried_draft_input(draft_input: EagleDraftInput, sampled: torch.Tensor,
                            topk: int) -> EagleDraftInput:
        bs = sampled.shape[0]
        for name, want in (("topk_p", (bs, topk)), ("topk_index", (bs, topk))):
            t = getattr(draft_input, name)
            if t is None or tuple(t.shape) != want:
                raise RuntimeError(f"lazy decode step: batch.spec_info.{name} is "
                                   f"{None if t is None else tuple(t.shape)}, expected {want}")
        hs = draft_input.hidden_states
        if hs is None or hs.shape[0] != bs:
            raise RuntimeError("lazy decode step: batch.spec_info.hidden_states is "
                               f"{None if hs is None else tuple(hs.shape)}, expected {bs} rows")
        return EagleDraftInput(topk_p=draft_input.topk_p, topk_index=draft_input.topk_index,
                               hidden_states=hs, bonus_tokens=sampled.to(torch.int32))

    def before_spec_step(self, batch: Any, rows: np.ndarray) -> list:
        """Catch up every row of `batch` (request-pool `rows`) that is behind and install its
        proposal."""
        behind = self.backlog.behind(rows)
        if behind.positions.size == 0:
            return []
        draft_input = batch.spec_info
        if not isinstance(draft_input, EagleDraftInput):
            raise RuntimeError("lazy catch-up needs the batch's EagleDraftInput to install "
                               f"proposals into (got {type(draft_input).__name__})")
        res = self._catch_up(batch, rows, behind, forced=False, want_proposals=True)
        bs = rows.shape[0]
        if res.batch_positions == list(range(bs)):
            where = None
        else:
            where = _to_device(res.batch_positions, batch.seq_lens.device)
        draft_input.topk_p = _merge(draft_input.topk_p, where, res.topk_p)
        draft_input.topk_index = _merge(draft_input.topk_index, where, res.topk_index)
        draft_input.hidden_states = _merge(draft_input.hidden_states, where, res.hidden_states)
        return res.keep_alive + ([] if where is None else [where])

    # -------------------------------------------------------------------- catch-up

    def _catch_up(self, batch: Any, rows: np.ndarray, behind: Behind, *, forced: bool,
                  want_proposals: bool) -> CatchUpResult:
        device = batch.seq_lens.device
        rpi = ends = ends_cpu = None
        if getattr(batch, "seq_lens_cpu", None) is not None:
            ends_cpu = np.asarray(batch.seq_lens_cpu, dtype=np.int64)[behind.positions]
        elif behind.positions.size == rows.shape[0]:
            rpi, ends = batch.req_pool_indices, batch.seq_lens
        else:
            sel = _to_device(behind.positions, device)
            rpi, ends = batch.req_pool_indices[sel], batch.seq_lens[sel]
        passes = plan_passes(behind.counts, self.max_pass_tokens)
        positions: list[int] = []
        props: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        keep: list = []
        dw = self.dw
        rows_behind = rows[behind.positions]
        with (dw.draft_tp_context(dw.draft_runner.tp_group), speculative_moe_backend_context(),
              speculative_moe_a2a_backend_context(), spec_stage_span("draft_extend")):
            laps = _Laps()
            kv_error: Optional[float] = None
            last_rows: list[CatchUpIndices] = []
            for segments in passes:
                idx = build_catch_up_indices(
                    segments, counts=behind.counts, batch_positions=behind.positions,
                    req_to_token=self.req_to_token, req_pool_indices=rpi, ends=ends,
                    rows_cpu=None if ends_cpu is None else rows_behind, ends_cpu=ends_cpu)
                laps.lap("indices")
                filled = inputs = None
                if self._fills(idx):
                    inputs = self._fill_kv(idx)
                    keep.append(inputs)
                    laps.lap("kv")
                    if not self.kv_check:
                        last = final_rows(idx) if want_proposals else None
                        if last is not None:
                            last_rows.append(last)
                        continue
                    filled = self._draft_kv(idx.slots, clear=True)
                forward_batch, logits_output = self._run_pass(batch, idx, laps, inputs)
                keep.append(forward_batch)
                if filled is not None:
                    err = _relative_error(filled, self._draft_kv(idx.slots))
                    kv_error = err if kv_error is None else max(kv_error, err)
                self._take_proposals(batch, idx, logits_output, want_proposals, props, positions)
                laps.lap("proposals")
            if last_rows:             # one forward over every filled pass's last rows
                idx = join_passes(last_rows)
                forward_batch, logits_output = self._run_pass(batch, idx, laps)
                keep.append(forward_batch)
                self._take_proposals(batch, idx, logits_output, want_proposals, props, positions)
                laps.lap("proposals")
        done = self.backlog.caught_up(rows_behind, forced=forced)
        # Cells of chunked prompts between their chunks move to the front.
        keep += stash_room.front_pending(self.arena, self.backlog, self.req_to_token, rows,
                                         device)
        laps.lap("bookkeeping")
        event = CatchUpEvent(forced, int(behind.positions.size), done.tokens, len(passes),
                             int(behind.counts.max()), done.orphans, ends_cpu is not None,
                             laps.us(), kv_error)
        if done.orphans:
            # Expected for every request that finished, was aborted or retracted while behind;
            # counted in the step log's catch_up events ("orphans").
            logger.debug("dual-graph lazy catch-up: dropped the backlog of %d request rows "
                         "not in the running batch", done.orphans)
        self._emit(event)
        if not want_proposals:
            return CatchUpResult([], None, None, None, keep, event)
        if len(props) == 1:
            topk_p, topk_index, hidden = props[0]
        else:
            topk_p, topk_index, hidden = (torch.cat(x) for x in zip(*props))
        return CatchUpResult(positions, topk_p, topk_index, hidden, keep, event)

    def _fills(self, idx: CatchUpIndices) -> bool:
        """Whether this pass's K/V are filled alone (DGW_CATCH_UP_KV_ONLY, a pass of
        kv_only_min_tokens and more) rather than by the draft's whole layer."""
        return not self.kv_only_off and idx.num_tokens >= self.kv_only_min_tokens

    def _take_proposals(self, batch: Any, idx: CatchUpIndices, logits_output: Any,
                        want_proposals: bool, props: list, positions: list) -> None:
        """The proposals of a pass's rows that end a backlog, and their batch positions."""
        final = [j for j, f in enumerate(idx.final) if f] if want_proposals else []
        if final:
            props.append(self._proposals(batch, idx, logits_output, final))
            positions.extend(idx.batch_positions[j] for j in final)

    def _fill_kv(self, idx: CatchUpIndices) -> tuple:
        """The draft's K/V at every position of a pass, from the stash; its inputs, kept
        alive as the forward batches are."""
        aux, token_ids = self.arena.gather(idx.slots)
        fill_draft_kv(self.dw.draft_runner, aux, token_ids, idx.positions, idx.slots)
        return aux, token_ids

    def _draft_kv(self, slots: torch.Tensor, clear: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the draft layer's K and V at `slots` (DGW_CATCH_UP_KV_CHECK), zeroed
        there if `clear`: a layer that then failed to write them cannot pass the check."""
        dr = self.dw.draft_runner
        layer_id = dr.model.model.layers[0].self_attn.attn.layer_id
        pool = dr.token_to_kv_pool
        copies = []
        for buffer in (pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)):
            copies.append(buffer[slots].clone())
            if clear:
                buffer[slots] = 0
        return copies[0], copies[1]

    def _run_pass(self, batch: Any, idx: CatchUpIndices, laps: "_Laps",
                  inputs: Optional[tuple] = None):
        """The draft's layer over `idx`, its stashed inputs gathered unless given (a checked
        pass reuses the fill's, so they are held once)."""
        dr = self.dw.draft_runner
        aux, token_ids = self.arena.gather(idx.slots) if inputs is None else inputs
        view = copy.copy(batch)             # EAGLE's step still needs the batch as it is
        view.forward_mode = ForwardMode.DRAFT_EXTEND_V2
        view.spec_info = EagleDraftExtendInput(
            hidden_states=aux,
            # Only read by DP padding and the draft-extend graph runner, neither of which runs
            # here; an upper bound of the per-request width.
            num_tokens_per_req=max(idx.extend_lens_cpu),
            num_tokens_for_logprob_per_req=1,
            select_index=idx.last_rows,
        )
        view.input_ids = token_ids
        view.out_cache_loc = idx.slots
        view.req_pool_indices = idx.req_pool_indices
        view.seq_lens = idx.seq_lens            # post-write lengths, as the draft extend uses
        view.seq_lens_cpu = idx.seq_lens_cpu
        view.seq_lens_sum = (None if idx.seq_lens_cpu is None
                             else int(idx.seq_lens_cpu.sum()))
        view.orig_seq_lens = None
        if idx.prefix_lens_cpu is not None:
            view.prefix_lens, view.extend_lens = idx.prefix_lens_cpu, idx.extend_lens_cpu
        else:
            view.prefix_lens, view.extend_lens = idx.prefix_lens, idx.extend_lens
        view.extend_num_tokens = idx.num_tokens
        view.extend_logprob_start_lens = None
        view.return_logprob = False
        forward_batch = ForwardBatch.init_new(view, dr,
                                              capture_hidden_mode=CaptureHiddenMode.FULL,
                                              return_hidden_states_before_norm=False)
        forward_batch.return_logprob = False
        if idx.prefix_lens_cpu is None:
            forward_batch.extend_seq_lens_cpu = idx.extend_lens_cpu
        laps.lap("batch")
        dr.attn_backend.init_forward_metadata(forward_batch)
        forward_batch.mark_forward_metadata_ready()
        laps.lap("metadata")
        logits_output = dr.forward(forward_batch).logits_output
        laps.lap("forward")
        return forward_batch, logits_output

    def _proposals(self, batch: Any, idx: CatchUpIndices, logits_output: Any,
                   final: list[int]):
        logits = logits_output.next_token_logits          # one row per segment (select_index)
        hidden = logits_output.hidden_states
        if hidden.shape[0] == idx.num_tokens:
            hidden = hidden[idx.last_rows]
        elif hidden.shape[0] != len(idx.final):
            raise RuntimeError(f"draft extend returned {hidden.shape[0]} hidden rows for "
                               f"{idx.num_tokens} tokens / {len(idx.final)} requests")
        if len(final) != len(idx.final):
            keep = _to_device(final, logits.device)
            logits, hidden = logits[keep], hidden[keep]
        topk_p, topk_index = draft_proposals(logits, batch.sampling_info, self.dw.topk)
        return topk_p, topk_index, hidden


class _Laps:
    """Host time of a catch-up's passes by phase, summed over them, and of the bookkeeping after
    (the step log's ``host_us``): a phase that waits on the device shows as milliseconds where
    launching takes tens of us."""

    def __init__(self) -> None:
        self._t = time.perf_counter()
        self._us: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self._us[phase] = self._us.get(phase, 0.0) + (now - self._t) * 1e6
        self._t = now

    def us(self) -> dict[str, float]:
        return {k: round(v, 1) for k, v in self._us.items()}


def _passes_too_short(max_pass_tokens: int, split_from: int) -> Optional[str]:
    why = passes_too_short(max_pass_tokens, split_from)
    return None if why is None else f"{why} (SGLang's chunked_prefill_size)"


def _relative_error(got: tuple, want: tuple) -> float:
    """The largest |got - want| over the largest |want|, of K and V alike."""
    return max(float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30))
               for g, w in zip(got, want))


def _stash_budget(stash_mb: int, free_bytes: Optional[int], *, slot_map_bytes: int) -> int:
    """Bytes for the stash's cells: DGW_LAZY_STASH_MB, or (0) AUTO_STASH_SHARE of the memory
    free now, less the KV-slot map; 1 GiB where there is no GPU to ask."""
    if stash_mb > 0:
        return int(stash_mb) * _MiB
    if free_bytes is None:
        return 1024 * _MiB
    return max(int(free_bytes * AUTO_STASH_SHARE) - int(slot_map_bytes), 0)


def _same_on_every_rank(cells: int, tp_group: Any) -> int:
    """The smallest TP rank's stash size, on every rank. The auto size follows each rank's free
    memory, but every rank must make the same room / deferral / catch-up decisions: a catch-up
    is a draft forward with collectives, and a rank that skipped it would hang the others."""
    if tp_group is None or int(getattr(tp_group, "world_size", 1)) <= 1:
        return cells
    import torch.distributed as dist

    t = torch.tensor([int(cells)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp_group.cpu_group)
    return int(t.item())


def _why_not_defer_prefills(enabled: bool, server_args: Any, *, cells: int, rows: int,
                            reserve: int, draft_hidden) -> Optional[str]:
    """None when prefills may be deferred, else why not (logged at start-up)."""
    if not enabled:
        return "off (DGW_DEFER_DRAFT_PREFILL=0)"
    if not getattr(server_args, "disable_radix_cache", False) and \
            getattr(server_args, "radix_cache_backend", None) != RADIX_BACKEND:
        return (f"off: the radix cache backend {server_args.radix_cache_backend!r} may cache "
                "prefixes without draft KV; leave --radix-cache-backend unset (the worker then "
                f"uses {RADIX_BACKEND!r}) or pass --disable-radix-cache")
    if draft_hidden[0] is None:
        return "off: the draft carries no hidden state (STANDALONE)"
    if cells < rows + reserve:
        return (f"off: the stash ({cells} tokens) cannot hold a decode step of {rows} rows "
                f"plus one prefill chunk of {reserve}; raise DGW_LAZY_STASH_MB")
    return None


def _merge(old: Optional[torch.Tensor], where: Optional[torch.Tensor],
           new: torch.Tensor) -> torch.Tensor:
    """`old` with rows `where` replaced by `new` (all rows, in order, when `where` is None);
    always a new tensor, never an in-place write into one the FutureMap or a result holds."""
    if where is None:
        return new if old is None else new.to(old.dtype)
    if old is None:
        raise RuntimeError("cannot install catch-up proposals into a missing spec_info field")
    return old.index_copy(0, where, new.to(old.dtype))
