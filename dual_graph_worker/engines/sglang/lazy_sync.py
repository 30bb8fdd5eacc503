"""Lazy catch-up of the draft (``DGW_CONTINUITY=lazy-catch-up``, the default continuity).

A decode-mode step only stashes the target's EAGLE-3 features of its token; before the next
speculative step one eager draft extend (DRAFT_EXTEND_V2, triton) catches every row that is
behind up and installs its proposal. A prompt joining a batch that will decode may skip the
draft's prefill the same way (deferred prefill); with the radix cache on, only under the
``dual_graph`` radix backend (radix.py). Design: docs/design.md, "Draft state across switches";
the SGLang contracts relied on: docs/sglang-0.5.17.md §6 and §8.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple, Optional, Union

import numpy as np
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.eagle_utils import (
    _eagle_prefill_tail_tokens,
    get_draft_input_from_target_hidden_dim,
    get_draft_recurrent_hidden_state_spec,
)
from sglang.srt.speculative.spec_utils import spec_stage_span

from dual_graph_worker.core.batch_costs import CatchUpWork
from dual_graph_worker.engines.sglang.backlog import Behind, LazyBacklog, RoomAction
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
from dual_graph_worker.engines.sglang import catch_up_pass, stash_room
from dual_graph_worker.engines.sglang.continuity_contract import (ContinuityContext, DecodeDraft,
                                                                  RoomMade)
from dual_graph_worker.engines.sglang.draft_context import in_draft
from dual_graph_worker.engines.sglang.kv_fill import kv_fill_unavailable, kv_share
from dual_graph_worker.engines.sglang.row_context import rows_of
from dual_graph_worker.engines.sglang.radix import BEHIND_ATTR, UNCLAMPED_ATTR
from dual_graph_worker.engines.sglang.server_args_hook import (catch_up_backend_classes,
                                                               catch_up_backend_refusal)
from dual_graph_worker.engines.sglang.stash_plan import MiB as _MiB
from dual_graph_worker.engines.sglang.stash_plan import plan_stash

logger = logging.getLogger(__name__)


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
                 kv_check: bool = False) -> None:
        dr = draft_worker.draft_runner
        _check_draft_backend(dr)
        self.dw = draft_worker
        self.req_to_token = req_to_token_pool.req_to_token
        device = self.req_to_token.device
        num_rows = int(self.req_to_token.shape[0])
        kv = target_runner.token_to_kv_pool
        num_slots = int(kv.size) + int(getattr(kv, "page_size", 1) or 1)
        aux_width = int(get_draft_input_from_target_hidden_dim(dr))
        aux_dtype = dr.model_config.dtype
        self.draft_hidden = get_draft_recurrent_hidden_state_spec(dr)
        plan = plan_stash(
            stash_mb=stash_mb,
            free_bytes=torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None,
            rows=num_rows, slots=num_slots, aux_width=aux_width, aux_dtype=aux_dtype,
            server_args=dr.server_args, draft_hidden=self.draft_hidden,
            defer_prefill=defer_prefill, kv_only=kv_only,
            kv_fill_blocker=kv_fill_unavailable(dr) if kv_only else None,
            tp_group=getattr(target_runner, "tp_group", None))
        self.arena = StashArena.allocate(plan.cells, aux_width, aux_dtype, num_slots, device)
        self.backlog = LazyBacklog(num_rows, plan.cells)
        self.max_pass_tokens = plan.max_pass_tokens
        self.defer_prefill_off = plan.defer_prefill_off
        # Kept free for the next deferred prefill when a compaction can provide it.
        self.prefill_reserve = plan.prefill_reserve
        # Why the draft's K/V cannot be filled alone (DGW_CATCH_UP_KV_ONLY); None: they are.
        self.kv_only_min_tokens = plan.kv_only_min_tokens
        self.kv_only_off = plan.kv_only_off
        self.kv_check = kv_check
        if kv_only and self.kv_only_off:
            logger.warning("dual-graph: DGW_CATCH_UP_KV_ONLY ignored: %s; catch-ups run the "
                           "draft's whole layer", self.kv_only_off)
        # Each event for the step log, named by its kind.
        self.on_event: Optional[Callable[[LazyEvent], None]] = None     # build wires it
        logger.info("dual-graph: lazy catch-up stash: %d tokens x %d %s features (%.0f MiB), "
                    "%d KV slots, catch-up passes of <= %d tokens; deferred draft prefill: %s; "
                    "K/V-only catch-up: %s", plan.cells, aux_width, aux_dtype,
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
        at = _rows_behind(batch, rows, behind, device)
        passes = plan_passes(behind.counts, self.max_pass_tokens)
        out = _Collected(want_proposals)
        laps = self._run_passes(batch, behind, at, passes, out)
        done = self.backlog.caught_up(at.rows, forced=forced)
        # Cells of chunked prompts between their chunks move to the front.
        out.keep += stash_room.front_pending(self.arena, self.backlog, self.req_to_token, rows,
                                             device)
        laps.lap("bookkeeping")
        event = CatchUpEvent(forced, int(behind.positions.size), done.tokens, len(passes),
                             int(behind.counts.max()), done.orphans, at.ends_cpu is not None,
                             laps.us(), out.kv_error)
        if done.orphans:
            # Expected for every request that finished, was aborted or retracted while behind;
            # counted in the step log's catch_up events ("orphans").
            logger.debug("dual-graph lazy catch-up: dropped the backlog of %d request rows "
                         "not in the running batch", done.orphans)
        self._emit(event)
        return out.result(event)

    def _run_passes(self, batch: Any, behind: Behind, at: "_RowsBehind", passes: list,
                    out: "_Collected") -> catch_up_pass.Laps:
        """Every pass, in the draft's TP and MoE contexts; their host time by phase."""
        with in_draft(self.dw), spec_stage_span("draft_extend"):
            laps = catch_up_pass.Laps()
            for segments in passes:
                idx = build_catch_up_indices(
                    segments, counts=behind.counts, batch_positions=behind.positions,
                    req_to_token=self.req_to_token, req_pool_indices=at.req_pool_indices,
                    ends=at.ends, rows_cpu=None if at.ends_cpu is None else at.rows,
                    ends_cpu=at.ends_cpu)
                laps.lap("indices")
                self._one_pass(batch, idx, laps, out)
            if out.last_rows:             # one forward over every filled pass's last rows
                self._forward(batch, join_passes(out.last_rows), laps, out)
        return laps

    def _one_pass(self, batch: Any, idx: CatchUpIndices, laps: catch_up_pass.Laps,
                  out: "_Collected") -> None:
        """One pass: its K/V filled from the stash alone (its rows that end a backlog then wait
        for the joined forward), or the draft's whole layer, after the fill under
        DGW_CATCH_UP_KV_CHECK, which compares the two."""
        if not self._fills(idx):
            self._forward(batch, idx, laps, out)
            return
        dr = self.dw.draft_runner
        inputs = catch_up_pass.fill_kv(dr, self.arena, idx)
        out.keep.append(inputs)
        laps.lap("kv")
        if self.kv_check:
            kv = catch_up_pass.draft_kv(dr, idx.slots, clear=True)
            self._forward(batch, idx, laps, out, _Filled(inputs, kv))
        elif out.want_proposals:
            last = final_rows(idx)
            if last is not None:
                out.last_rows.append(last)

    def _forward(self, batch: Any, idx: CatchUpIndices, laps: catch_up_pass.Laps,
                 out: "_Collected", filled: Optional["_Filled"] = None) -> None:
        """The draft's whole layer over `idx` (on the stash's inputs where it `filled` the
        pass, its K/V then compared with the fill's), and the proposals it makes."""
        dr = self.dw.draft_runner
        forward_batch, logits_output = catch_up_pass.run_pass(
            dr, self.arena, batch, idx, laps, None if filled is None else filled.inputs)
        out.keep.append(forward_batch)
        if filled is not None:
            out.checked(catch_up_pass.relative_error(filled.kv,
                                                     catch_up_pass.draft_kv(dr, idx.slots)))
        self._take_proposals(batch, idx, logits_output, out)
        laps.lap("proposals")

    def _fills(self, idx: CatchUpIndices) -> bool:
        """Whether this pass's K/V are filled alone (DGW_CATCH_UP_KV_ONLY, a pass of
        kv_only_min_tokens and more) rather than by the draft's whole layer."""
        return not self.kv_only_off and idx.num_tokens >= self.kv_only_min_tokens

    def _take_proposals(self, batch: Any, idx: CatchUpIndices, logits_output: Any,
                        out: "_Collected") -> None:
        """The proposals of a pass's rows that end a backlog, and their batch positions."""
        final = [j for j, f in enumerate(idx.final) if f] if out.want_proposals else []
        if final:
            out.props.append(catch_up_pass.proposals(batch, idx, logits_output, final,
                                                     self.dw.topk))
            out.positions.extend(idx.batch_positions[j] for j in final)


def _check_draft_backend(dr: Any) -> None:
    if not isinstance(dr.attn_backend, catch_up_backend_classes()):
        raise ConfigError(catch_up_backend_refusal("the draft's extend backend",
                                                   type(dr.attn_backend).__name__))


class _Filled(NamedTuple):
    """A pass the stash filled under DGW_CATCH_UP_KV_CHECK: the inputs it gathered and the
    K/V it wrote, which the draft's whole layer then writes again."""

    inputs: catch_up_pass.StashedInputs
    kv: catch_up_pass.KV


class _RowsBehind(NamedTuple):
    """The request-pool rows behind, in batch order, and their committed lengths: on the host
    when the batch has host lengths (the passes' indices are then built there), else on the
    device with their rows."""

    rows: np.ndarray
    req_pool_indices: Optional[torch.Tensor]
    ends: Optional[torch.Tensor]
    ends_cpu: Optional[np.ndarray]


def _rows_behind(batch: Any, rows: np.ndarray, behind: Behind, device) -> _RowsBehind:
    rpi = ends = ends_cpu = None
    if getattr(batch, "seq_lens_cpu", None) is not None:
        ends_cpu = np.asarray(batch.seq_lens_cpu, dtype=np.int64)[behind.positions]
    elif behind.positions.size == rows.shape[0]:
        rpi, ends = batch.req_pool_indices, batch.seq_lens
    else:
        sel = _to_device(behind.positions, device)
        rpi, ends = batch.req_pool_indices[sel], batch.seq_lens[sel]
    return _RowsBehind(rows[behind.positions], rpi, ends, ends_cpu)


class _Collected:
    """What a catch-up's passes leave: the proposals and their batch positions, the tensors to
    keep alive, the K/V check's largest error, and the filled passes' rows that end a backlog
    (one forward over them all comes last)."""

    def __init__(self, want_proposals: bool) -> None:
        self.want_proposals = want_proposals
        self.positions: list[int] = []
        self.props: list[catch_up_pass.Proposals] = []
        self.keep: list = []
        self.kv_error: Optional[float] = None
        self.last_rows: list[CatchUpIndices] = []

    def checked(self, err: float) -> None:
        self.kv_error = err if self.kv_error is None else max(self.kv_error, err)

    def result(self, event: CatchUpEvent) -> CatchUpResult:
        if not self.want_proposals:
            return CatchUpResult([], None, None, None, self.keep, event)
        if len(self.props) == 1:
            topk_p, topk_index, hidden = self.props[0]
        else:
            topk_p, topk_index, hidden = (torch.cat(x) for x in zip(*self.props))
        return CatchUpResult(self.positions, topk_p, topk_index, hidden, self.keep, event)


def _merge(old: Optional[torch.Tensor], where: Optional[torch.Tensor],
           new: torch.Tensor) -> torch.Tensor:
    """`old` with rows `where` replaced by `new` (all rows, in order, when `where` is None);
    always a new tensor, never an in-place write into one the FutureMap or a result holds."""
    if where is None:
        return new if old is None else new.to(old.dtype)
    if old is None:
        raise RuntimeError("cannot install catch-up proposals into a missing spec_info field")
    return old.index_copy(0, where, new.to(old.dtype))
