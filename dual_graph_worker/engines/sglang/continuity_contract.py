"""What the SGLang worker and its continuity strategies agree on: the protocol the worker calls
at fixed points of a prefill, a speculative step and a decode step, the values the strategies
hand back, and the context each strategy builds itself from (continuity.py holds the table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import (Any, Callable, ClassVar, ContextManager, NamedTuple, Optional, Protocol,
                    Sequence)

import numpy as np
import torch

from dual_graph_worker.core.batch_costs import CatchUpWork
from dual_graph_worker.core.continuity import ContinuityStrategy
from dual_graph_worker.core.settings import Settings


class DecodeDraft(NamedTuple):
    next_draft_input: Any        # the EagleDraftInput the result hands the scheduler
    keep_alive: list             # tensors / batches the scheduler keeps two iterations


class RoomMade(NamedTuple):
    """What a decode step's preparation did: tensors to keep alive until its kernels ran, and
    the draft tokens a forced catch-up brought up to date first (0: none)."""

    keep_alive: Sequence[Any]
    caught_up_tokens: int = 0


NO_ROOM_NEEDED = RoomMade(())


@dataclass(frozen=True)
class ContinuityContext:
    """What a strategy's `build` reads from the worker, once every graph is captured."""

    settings: Settings
    draft_worker: Any
    target_worker: Any                    # read for .model_runner (lazy catch-up's radix hooks)
    req_to_token_pool: Any
    draft_sync_runner: Optional[Any]      # keep-current's width-1 graphs (None: eager)
    accept_ones: Optional[torch.Tensor]   # read-only int32 ones, one per request-pool row
    stage: Callable[[str], ContextManager[None]]     # the worker's stage range
    log_event: Callable[[Any, Any], None]            # (lazy event, running totals) -> step log
    tree_unclamped: Callable[[str], None]            # the radix cache cannot stay draft-valid


class SGLangContinuity(ContinuityStrategy, Protocol):
    draft_sync_graphs: ClassVar[bool]    # wants its one-token draft extend captured as graphs
    catch_up_work: Optional[CatchUpWork]     # catch-ups that fill the draft's K/V alone

    @classmethod
    def build(cls, ctx: ContinuityContext) -> "SGLangContinuity":
        """The strategy for one worker, wired to it."""

    def defers_prefill_of(self, batch: Any, next_step_decodes: Callable[[], bool]) -> bool:
        """Whether this prefill batch runs the target alone (the draft's prefill deferred)."""

    def on_prefill(self, batch: Any) -> None:
        """EAGLE's own prefill, draft included, runs for `batch`."""

    def deferred_prefill(self, batch: Any, *, aux: Optional[torch.Tensor],
                         next_token_ids: torch.Tensor) -> Any:
        """After a target-only prefill: the result's next_draft_input."""

    def before_spec_step(self, batch: Any, rows: np.ndarray) -> list:
        """Bring every row of `batch` (request-pool `rows`) up to date; returns keep-alive
        references."""

    def before_decode_step(self, batch: Any, rows: np.ndarray) -> RoomMade: ...

    def after_decode_step(self, batch: Any, rows: np.ndarray, *, target: Any,
                          out_cache_loc: torch.Tensor) -> DecodeDraft: ...

    def describe(self) -> dict: ...
