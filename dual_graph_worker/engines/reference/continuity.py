"""The reference engine's continuity strategies (core.continuity): what the worker calls before
a speculative step, after a decode step and when a request leaves.

The engine's decode graph carries each strategy's per-step draft work through `in_decode_graph`
(keep-current: a draft forward; lazy: a feature stash); the rest is the host side.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import numpy as np

from dual_graph_worker.core.continuity import Continuity, ContinuityStrategy
from dual_graph_worker.engines.reference.engine_api import (DecodeOutput, Engine, PrefillMode,
                                                          StageContinuity)
from dual_graph_worker.engines.reference.requests import RequestTable

NO_BACKLOG = -1


class ReferenceContinuity(ContinuityStrategy, StageContinuity, Protocol):
    kind: Optional[Continuity]      # None: no draft state at all (the plain baseline)

    def prefill_mode(self, next_step_decodes: Callable[[], bool]) -> PrefillMode:
        """How a prompt joining the running batch is prefilled; `next_step_decodes` previews
        the policy (called only by a strategy that may defer)."""

    def after_prefill(self, rows: np.ndarray, mode: PrefillMode) -> None: ...

    def before_spec_step(self, rows: np.ndarray) -> int:
        """Bring the draft up to date over `rows`; returns the draft tokens it caught up."""

    def after_decode_step(self, rows: np.ndarray, seq_lens_before: np.ndarray) -> None: ...

    def release(self, rows: np.ndarray) -> None: ...


class NoDraft:
    """A plain server: no draft state, so a speculative step can never run."""

    kind = None
    defers_prefill = False

    def prefill_mode(self, next_step_decodes: Callable[[], bool]) -> PrefillMode:
        return PrefillMode.TARGET_ONLY

    def after_prefill(self, rows: np.ndarray, mode: PrefillMode) -> None:
        pass

    def pending_tokens(self, rows: np.ndarray) -> int:
        return 0

    def before_spec_step(self, rows: np.ndarray) -> int:
        raise RuntimeError("a worker without draft state cannot speculate (continuity None)")

    def in_decode_graph(self, engine: Engine, out: DecodeOutput) -> None:
        pass

    def after_decode_step(self, rows: np.ndarray, seq_lens_before: np.ndarray) -> None:
        pass

    def release(self, rows: np.ndarray) -> None:
        pass


class KeepCurrent(NoDraft):
    """The decode graph runs the draft on every new token: nothing is ever behind."""

    kind = Continuity.KEEP_CURRENT

    def prefill_mode(self, next_step_decodes: Callable[[], bool]) -> PrefillMode:
        return PrefillMode.WITH_DRAFT

    def in_decode_graph(self, engine: Engine, out: DecodeOutput) -> None:
        engine.draft_decoded(out)

    def before_spec_step(self, rows: np.ndarray) -> int:
        return 0


class LazyCatchUp:
    """Per request row, the first position the draft has not seen; one draft extend over each
    row's backlog before it speculates again. `defers_prefill`: a prompt that joins a decoding
    batch leaves the draft behind from position 0 (its prefill is the first catch-up)."""

    kind = Continuity.LAZY_CATCH_UP

    def __init__(self, engine: Engine, table: RequestTable, defers_prefill: bool) -> None:
        self.engine, self.table = engine, table
        self.defers_prefill = defers_prefill
        self.start = np.full(engine.limits.max_requests, NO_BACKLOG, dtype=np.int64)
        engine.ensure_stash()           # its decode steps keep the target's features

    def prefill_mode(self, next_step_decodes: Callable[[], bool]) -> PrefillMode:
        return PrefillMode.DEFERRED if self.defers_prefill and next_step_decodes() \
            else PrefillMode.WITH_DRAFT

    def after_prefill(self, rows: np.ndarray, mode: PrefillMode) -> None:
        if mode is PrefillMode.DEFERRED:
            self.start[rows] = 0

    def pending_tokens(self, rows: np.ndarray) -> int:
        s = self.start[rows]
        behind = s != NO_BACKLOG
        return int((self.table.seq_lens[rows][behind] - s[behind]).sum())

    def before_spec_step(self, rows: np.ndarray) -> int:
        behind = rows[self.start[rows] != NO_BACKLOG]
        if behind.size == 0:
            return 0
        starts, ends = self.start[behind], self.table.seq_lens[behind]
        self.engine.catch_up(behind, starts, ends, self.table.tokens[behind],
                             self.table.slots[behind])
        self.start[behind] = NO_BACKLOG
        return int((ends - starts).sum())

    def in_decode_graph(self, engine: Engine, out: DecodeOutput) -> None:
        engine.stash_features(out)

    def after_decode_step(self, rows: np.ndarray, seq_lens_before: np.ndarray) -> None:
        current = self.start[rows] == NO_BACKLOG
        self.start[rows[current]] = seq_lens_before[current]

    def release(self, rows: np.ndarray) -> None:
        self.start[rows] = NO_BACKLOG


def make_continuity(kind: Optional[Continuity], engine: Engine, table: RequestTable,
                    defer_prefill: bool) -> ReferenceContinuity:
    if kind is None:
        return NoDraft()
    if kind is Continuity.KEEP_CURRENT:
        return KeepCurrent()
    return LazyCatchUp(engine, table, defer_prefill)
