"""Lazy catch-up: one pass of the draft over a catch-up's indices (catch_up.CatchUpIndices).

The eager DRAFT_EXTEND_V2 forward on SGLang's draft ModelRunner, the K/V-only fill from the
stash (DGW_CATCH_UP_KV_ONLY), the K/V copies DGW_CATCH_UP_KV_CHECK compares, and the proposals
of the rows that end a backlog. lazy_sync.LazyCatchUp decides which passes run and how.
"""

from __future__ import annotations

import copy
import time
from typing import Any, NamedTuple, Optional

import torch
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

from dual_graph_worker.engines.sglang.catch_up import CatchUpIndices, StashArena
from dual_graph_worker.engines.sglang.catch_up import to_device as _to_device
from dual_graph_worker.engines.sglang.draft_sync import draft_proposals
from dual_graph_worker.engines.sglang.kv_fill import fill_draft_kv


class StashedInputs(NamedTuple):
    """A pass's draft inputs gathered from the stash: the target's hidden states and tokens."""

    aux: torch.Tensor
    token_ids: torch.Tensor


class KV(NamedTuple):
    """Copies of the draft layer's K and V at a pass's slots."""

    k: torch.Tensor
    v: torch.Tensor


class Proposals(NamedTuple):
    """The draft's proposals for a pass's final rows."""

    topk_p: torch.Tensor
    topk_index: torch.Tensor
    hidden: torch.Tensor


class Laps:
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


def fill_kv(runner: Any, arena: StashArena, idx: CatchUpIndices) -> StashedInputs:
    """The draft's K/V at every position of a pass, from the stash; its inputs, kept
    alive as the forward batches are."""
    aux, token_ids = arena.gather(idx.slots)
    fill_draft_kv(runner, aux, token_ids, idx.positions, idx.slots)
    return StashedInputs(aux, token_ids)


def draft_kv(runner: Any, slots: torch.Tensor, clear: bool = False) -> KV:
    """Copies of the draft layer's K and V at `slots` (DGW_CATCH_UP_KV_CHECK), zeroed
    there if `clear`: a layer that then failed to write them cannot pass the check."""
    layer_id = runner.model.model.layers[0].self_attn.attn.layer_id
    pool = runner.token_to_kv_pool
    copies = []
    for buffer in (pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)):
        copies.append(buffer[slots].clone())
        if clear:
            buffer[slots] = 0
    return KV(copies[0], copies[1])


class PassOutput(NamedTuple):
    """A catch-up pass's forward batch (kept alive while the step runs) and its logits."""

    forward_batch: ForwardBatch
    logits_output: Any                  # SGLang's LogitsProcessorOutput


def run_pass(runner: Any, arena: StashArena, batch: Any, idx: CatchUpIndices, laps: Laps,
             inputs: Optional[StashedInputs] = None) -> PassOutput:
    """The layer of the draft ModelRunner `runner` over `idx`, its stashed inputs gathered
    unless given (a checked pass reuses the fill's, so they are held once)."""
    aux, token_ids = arena.gather(idx.slots) if inputs is None else inputs
    view = _draft_extend_view(batch, idx, aux, token_ids)
    forward_batch = ForwardBatch.init_new(view, runner,
                                          capture_hidden_mode=CaptureHiddenMode.FULL,
                                          return_hidden_states_before_norm=False)
    forward_batch.return_logprob = False
    if idx.prefix_lens_cpu is None:
        forward_batch.extend_seq_lens_cpu = idx.extend_lens_cpu
    laps.lap("batch")
    runner.attn_backend.init_forward_metadata(forward_batch)
    forward_batch.mark_forward_metadata_ready()
    laps.lap("metadata")
    logits_output = runner.forward(forward_batch).logits_output
    laps.lap("forward")
    return PassOutput(forward_batch, logits_output)


def _draft_extend_view(batch: Any, idx: CatchUpIndices, aux: torch.Tensor,
                       token_ids: torch.Tensor) -> Any:
    """A shallow copy of `batch` as the DRAFT_EXTEND_V2 batch of pass `idx`."""
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
    return view


def proposals(batch: Any, idx: CatchUpIndices, logits_output: Any, final: list[int],
              topk: int) -> Proposals:
    """The proposals of a pass's rows `final` (positions in `idx.final`): top-k p, index and
    the draft's hidden state."""
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
    topk_p, topk_index = draft_proposals(logits, batch.sampling_info, topk)
    return Proposals(topk_p, topk_index, hidden)


def relative_error(got: KV, want: KV) -> float:
    """The largest |got - want| over the largest |want|, of K and V alike."""
    return max(float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30))
               for g, w in zip(got, want))
