"""The SGLang worker's continuity strategies, one table: Continuity -> the class that builds
itself from the worker's context (continuity_contract.py). Their launch needs, read before any
worker exists, are continuity_launch.py's.

`KeepCurrent` is here; `LazyCatchUp` is lazy_sync.py.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, ContextManager, Mapping, Optional

import numpy as np
import torch

from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.core.nvtx import NULL_CONTEXT
from dual_graph_worker.engines.sglang.continuity_contract import (NO_ROOM_NEEDED,
                                                                  ContinuityContext, DecodeDraft,
                                                                  RoomMade, SGLangContinuity)
from dual_graph_worker.engines.sglang.draft_sync import run_one_token_draft_extend
from dual_graph_worker.engines.sglang.lazy_sync import LazyCatchUp


class KeepCurrent:
    """A one-token draft extend in every decode-mode step (draft_sync.py), replayed from width-1
    graphs when they were captured (draft_extend_graph.py)."""

    kind = Continuity.KEEP_CURRENT
    defers_prefill = False
    draft_sync_graphs = True       # its one-token draft extend, captured beside the decode pool
    catch_up_work = None           # no catch-ups

    def __init__(self, draft_worker: Any, graph_runner: Optional[Any],
                 ones: Optional[torch.Tensor] = None,
                 stage: Callable[[str], ContextManager[None]] = lambda name: NULL_CONTEXT
                 ) -> None:
        """`stage`: the worker's stage range (nvtx_spans.StepSpans.stage)."""
        self.dw, self.graph_runner, self._stage = draft_worker, graph_runner, stage
        # Each step's accept counts (0 drafts, 1 token), sliced from tensors made once.
        self._counts = None if ones is None else (torch.zeros_like(ones), ones)

    @classmethod
    def build(cls, ctx: ContinuityContext) -> "KeepCurrent":
        return cls(ctx.draft_worker, ctx.draft_sync_runner, ctx.accept_ones, ctx.stage)

    def pending_tokens(self, rows: np.ndarray) -> int:
        return 0

    def defers_prefill_of(self, batch: Any, next_step_decodes: Callable[[], bool]) -> bool:
        return False

    def on_prefill(self, batch: Any) -> None:
        pass

    def deferred_prefill(self, batch: Any, *, aux: Optional[torch.Tensor],
                         next_token_ids: torch.Tensor) -> Any:
        raise RuntimeError("keep-current never defers a prefill")

    def before_spec_step(self, batch: Any, rows: np.ndarray) -> list:
        return []

    def before_decode_step(self, batch: Any, rows: np.ndarray) -> RoomMade:
        return NO_ROOM_NEEDED

    def after_decode_step(self, batch: Any, rows: np.ndarray, *, target: Any,
                          out_cache_loc: torch.Tensor) -> DecodeDraft:
        with self._stage("draft_extend"):
            draft = run_one_token_draft_extend(self.dw, batch,
                                               target_hidden=target.logits_output.hidden_states,
                                               sampled=target.next_token_ids,
                                               out_cache_loc=out_cache_loc,
                                               graph_runner=self.graph_runner,
                                               counts=self._counts)
        return DecodeDraft(draft.next_draft_input, [draft.forward_batch])

    def describe(self) -> dict:
        return {"continuity": self.kind.value, "draft_sync_graphs": self.graph_runner is not None}


STRATEGIES: Mapping[Continuity, type[SGLangContinuity]] = MappingProxyType({
    Continuity.KEEP_CURRENT: KeepCurrent,
    Continuity.LAZY_CATCH_UP: LazyCatchUp,
})
