"""Keep the draft current through decode-mode steps: a one-token draft extend per step.

Each decode step runs the DRAFT_EXTEND_V2 that an accept-1 speculative step would leave behind
(draft KV at ``seq_lens`` from the emitted token and the target's aux state there, plus the
row's next proposal), so when speculation returns the draft is never stale. Composed from
SGLang's own pieces; replayed from width-1 graphs (draft_extend_graph.py) when they cover the
batch, else eager. docs/sglang-0.5.17.md §7.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from sglang.srt.speculative.eagle_info import EagleDraftExtendInput, EagleDraftInput
from sglang.srt.speculative.eagle_worker_common import prepare_for_draft_extend
from sglang.srt.speculative.spec_utils import renorm_draft_probs, spec_stage_span
from sglang.srt.utils.common import fast_topk, is_hip

from dual_graph_worker.engines.sglang.draft_context import in_draft

_is_hip = is_hip()


class DraftSyncOutput(NamedTuple):
    next_draft_input: EagleDraftInput
    forward_batch: Any          # kept alive two iterations by the scheduler
    graphed: bool               # replayed from a width-1 draft-extend graph


def run_one_token_draft_extend(draft_worker: Any, batch: Any, *, target_hidden: torch.Tensor,
                               sampled: torch.Tensor,
                               out_cache_loc: torch.Tensor,
                               graph_runner: Optional[Any] = None,
                               counts: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                               ) -> DraftSyncOutput:
    """Draft-extend one token per request at position ``batch.seq_lens``.

    `batch` is the ScheduleBatch of the step (seq_lens at the pre-step length); it is edited in
    place the way SGLang's own draft extend edits it, and the scheduler's _forward_isolation
    restores it afterwards. `target_hidden` is the target's packed aux hidden states [bs, 3H],
    `sampled` the token the step emitted [bs], `out_cache_loc` the step's KV slot [bs],
    `graph_runner` the width-1 draft-extend graphs (or None: eager), `counts` preallocated int32
    (zeros, ones) of at least bs rows, read only (None: made here).
    """
    bs = batch.seq_lens.shape[0]
    if counts is None:
        device = batch.seq_lens.device
        counts = (torch.zeros(bs, dtype=torch.int32, device=device),
                  torch.ones(bs, dtype=torch.int32, device=device))
    extend_input = EagleDraftExtendInput(
        hidden_states=target_hidden,
        num_correct_drafts=counts[0][:bs],
        num_accept_tokens=counts[1][:bs],
        num_tokens_per_req=1,
        num_tokens_for_logprob_per_req=1,
    )
    # The draft KV of this token goes to the slot the target just wrote (same index space,
    # separate draft pool), exactly as the speculative draft extend reuses the verify slots.
    batch.out_cache_loc = out_cache_loc
    dw = draft_worker
    with in_draft(dw), spec_stage_span("draft_extend"):
        forward_batch = prepare_for_draft_extend(
            extend_input, batch, sampled.to(torch.int64), 1, dw.draft_runner, graph_runner,
            return_hidden_states_before_norm=False)
        # prepare_for_draft_extend planned eager metadata only if the graph cannot run.
        graphed = graph_runner is not None and graph_runner.can_run_graph(forward_batch)
        if graphed:
            logits_output = graph_runner.execute(forward_batch)
            # A view of the graph's static output, in the shared pool where graphs captured
            # earlier keep their scratch: own it before any other replay, as EAGLE's
            # select_index gather does for its own draft extend.
            logits_output.hidden_states = logits_output.hidden_states.clone()
        else:
            logits_output = dw.draft_runner.forward(forward_batch).logits_output
        topk_p, topk_index = draft_proposals(logits_output.next_token_logits,
                                             batch.sampling_info, dw.topk)
    next_draft_input = EagleDraftInput(
        topk_p=topk_p,
        topk_index=topk_index,
        hidden_states=logits_output.hidden_states,
        # Same dtype as the verify path's bonus tokens (eagle_worker_common.py:612).
        bonus_tokens=sampled.to(torch.int32),
    )
    return DraftSyncOutput(next_draft_input, forward_batch, graphed)


def draft_proposals(logits: torch.Tensor, sampling_info: Any, topk: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The next step's proposals from the draft's logits (topk_p, topk_index), as EAGLE's own
    draft extend makes them (eagle_worker_v2.py:973-989): topk 1 is an argmax of probability 1."""
    if topk == 1 and not _is_hip:
        topk_index = torch.argmax(logits, dim=-1, keepdim=True)
        return torch.ones_like(topk_index, dtype=torch.float32), topk_index
    probs = renorm_draft_probs(logits, sampling_info, False)
    return fast_topk(probs, topk, dim=-1)
