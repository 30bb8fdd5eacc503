"""One decode step's plan, the same for every engine: batch size -> (mode, padded bs, graph?,
reason).

Both engines call `StepPlanner.plan` once per decode step and run every plan they ask for, so
deciding and committing are one call. Every `policy.sync_every` plans the planner first makes
the ranks' measurements common (`policy.exchange`), at the same step on every rank.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.core.modes import OTHER, Mode
from dual_graph_worker.core.policy import (DECIDED, ModePolicy, PolicyInputs, Reason, Reducer,
                                           same_rank)


def exchanges_before(plan: int, sync_every: int) -> bool:
    """Whether the planner exchanges as it makes its `plan`-th plan (0-based): every
    sync_every-th, never the first. The step ahead of it is not timed yet (its end is this
    launch), so the first exchange holds sync_every - 1 step times."""
    return plan > 0 and plan % sync_every == 0


class StepPlan(NamedTuple):
    """What one decode step will run, decided before anything is launched."""

    mode: Mode
    bs: int
    padded_bs: int
    graph: bool          # False: no captured graph covers bs in this mode, runs eagerly
    reason: Reason


class StepPlanner:
    """Owns the dispatch table and the policy; one `plan` per decode step."""

    def __init__(self, table: DispatchTable, policy: ModePolicy, *, graphs_enabled: bool = True,
                 reduce: Reducer = same_rank) -> None:
        self.table = table
        self.policy = policy
        self.graphs_enabled = graphs_enabled
        self.reduce = reduce
        self.sync_every = policy.sync_every
        self.steps = 0
        self.last_mode: Optional[Mode] = None    # the mode of the latest plan (None: no step yet)
        # Per batch size, the table's spec padded bs (None: no spec graph), decode padded bs and
        # whether a decode graph covers it: read per step.
        self._pads: dict[int, tuple[Optional[int], int, bool]] = {}

    def inputs(self, bs: int, rows: Optional[np.ndarray] = None, catch_up_tokens: int = 0,
               kv_tokens: int = 0, prefill_tokens: int = 0) -> PolicyInputs:
        """PolicyInputs for a batch of `bs` requests. With CUDA graphs disabled there is no spec
        pool to fall out of: both modes run eagerly at `bs`."""
        if bs < 1:
            raise ValueError(f"batch size must be >= 1, got {bs}")
        if not self.graphs_enabled:
            return PolicyInputs(bs, bs, bs, catch_up_tokens, rows, kv_tokens, prefill_tokens)
        spec, decode, _ = self._pads.get(bs) or self._pad(bs)
        return PolicyInputs(bs, spec, decode, catch_up_tokens, rows, kv_tokens, prefill_tokens)

    def _pad(self, bs: int) -> tuple[Optional[int], int, bool]:
        """The table's answers for a batch of `bs`, kept (_pads)."""
        t = self.table
        spec = t.padded_bs(Mode.SPEC, bs) if t.has_graph(Mode.SPEC, bs) else None
        pads = self._pads[bs] = spec, t.padded_bs(Mode.DECODE, bs), t.has_graph(Mode.DECODE, bs)
        return pads

    def plan(self, bs: int, *, rows: Optional[np.ndarray] = None, catch_up_tokens: int = 0,
             kv_tokens: int = 0, spec_fits_kv: bool = True) -> StepPlan:
        if self.sync_every and exchanges_before(self.steps, self.sync_every):
            self.policy.exchange(self.reduce)
        inputs = self.inputs(bs, rows, catch_up_tokens, kv_tokens)
        decision = self.policy.decide(inputs)
        spec = decision.mode is Mode.SPEC
        if spec and inputs.spec_padded_bs is None:
            # The spec pool's buffers cannot hold this batch, whatever a policy asks for.
            decision, spec = DECIDED[Mode.DECODE, Reason.NO_SPEC_GRAPH], False
        elif spec and not spec_fits_kv:
            decision, spec = DECIDED[Mode.DECODE, Reason.KV_PRESSURE], False
        padded = inputs.spec_padded_bs if spec else inputs.decode_padded_bs
        # A spec step runs only where a spec graph covers the batch.
        graph = self.graphs_enabled and (spec or self._pads[bs][2])
        if self.graphs_enabled and not graph and not self.table.allow_eager:
            self.table.lookup(decision.mode, bs)     # NoGraphForBatch before the policy commits
        self.policy.commit(decision)
        self.steps += 1
        self.last_mode = decision.mode
        return StepPlan(decision.mode, bs, padded, graph, decision.reason)

    def preview(self, bs: int, *, rows: Optional[np.ndarray] = None, catch_up_tokens: int = 0,
                kv_tokens: int = 0, prefill_tokens: int = 0) -> Mode:
        """The mode the running batch will run once it has `bs` requests, committing nothing (a
        policy's state() may describe the previewed batch until the next plan); `prefill_tokens`:
        the prompt tokens of the requests joining it (the prefill asking, and those queued).
        A re-measurement of the other mode is not foreseen: it is priced at its own step with the
        catch-up it needs, so a prefill never pays the draft's work for one."""
        decision = self.policy.decide(self.inputs(max(bs, 1), rows, catch_up_tokens, kv_tokens,
                                                  prefill_tokens))
        if decision.reason is Reason.EXPLORE and decision.price > 0:      # a new one
            return OTHER[decision.mode]
        return decision.mode
