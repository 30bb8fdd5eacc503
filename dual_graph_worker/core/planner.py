"""One decode step's plan, the same for every engine: batch size -> (mode, padded bs, graph?,
reason), and the ledger that pairs a launched step with its accepted tokens.

Both engines call `StepPlanner.plan` once per decode step and run every plan they ask for, so
deciding and committing are one call. Every `policy.sync_every` plans the planner first makes
the ranks' measurements common (`policy.exchange`), at the same step on every rank.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections import deque
from typing import Callable, Deque, NamedTuple, Optional, Sequence

import numpy as np

from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.core.modes import OTHER, Mode
from dual_graph_worker.core.policy import (Decision, ModePolicy, PolicyInputs, Reason, Reducer,
                                           same_rank)
from dual_graph_worker.core.results import StepRecord


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
        self.sync_every = int(getattr(policy, "sync_every", 0) or 0)
        self.steps = 0
        self.last_mode: Optional[Mode] = None    # the mode of the latest plan (None: no step yet)
        # Per batch size, the table's (spec padded bs or None, decode padded bs): read per step.
        self._pads: dict[int, tuple[Optional[int], int]] = {}

    def inputs(self, bs: int, rows: Optional[np.ndarray] = None, catch_up_tokens: int = 0,
               kv_tokens: int = 0, prefill_tokens: int = 0) -> PolicyInputs:
        """PolicyInputs for a batch of `bs` requests. With CUDA graphs disabled there is no spec
        pool to fall out of: both modes run eagerly at `bs`."""
        if bs < 1:
            raise ValueError(f"batch size must be >= 1, got {bs}")
        if not self.graphs_enabled:
            return PolicyInputs(bs, bs, bs, catch_up_tokens, rows, kv_tokens, prefill_tokens)
        try:
            spec, decode = self._pads[bs]
        except KeyError:
            t = self.table
            spec = t.padded_bs(Mode.SPEC, bs) if t.has_graph(Mode.SPEC, bs) else None
            decode = t.padded_bs(Mode.DECODE, bs)
            self._pads[bs] = spec, decode
        return PolicyInputs(bs, spec, decode, catch_up_tokens, rows, kv_tokens, prefill_tokens)

    def plan(self, bs: int, *, rows: Optional[np.ndarray] = None, catch_up_tokens: int = 0,
             kv_tokens: int = 0, spec_fits_kv: bool = True) -> StepPlan:
        if self.sync_every and self.steps % self.sync_every == 0 and self.steps:
            self.policy.exchange(self.reduce)
        inputs = self.inputs(bs, rows, catch_up_tokens, kv_tokens)
        decision = self.policy.decide(inputs)
        spec = decision.mode is Mode.SPEC
        if spec and inputs.spec_padded_bs is None:
            # The spec pool's buffers cannot hold this batch, whatever a policy asks for.
            decision, spec = Decision(Mode.DECODE, Reason.NO_SPEC_GRAPH), False
        elif spec and not spec_fits_kv:
            decision, spec = Decision(Mode.DECODE, Reason.KV_PRESSURE), False
        self.policy.commit(decision)
        self.steps += 1
        padded = (inputs.spec_padded_bs if spec else inputs.decode_padded_bs) or bs
        graph = self.graphs_enabled and self.table.has_graph(decision.mode, bs)
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


def expected_batch_size(req_to_token_pool: object, queued: int = 0) -> Optional[int]:
    """The size the running batch grows to once a prefill and the `queued` requests behind it
    have joined: the request rows held (``size - available_size()``) plus `queued`, capped at
    the pool's size (a server's max running requests); None for a pool without that interface.
    A prefill's rows are allocated before the worker runs it, and a finished request's row is
    freed when its result is processed."""
    size = getattr(req_to_token_pool, "size", None)
    available = getattr(req_to_token_pool, "available_size", None)
    if not isinstance(size, int) or not callable(available):
        return None
    return min(max(size - int(available()), 0) + max(int(queued), 0), size)


# NamedTuples, not frozen dataclasses, on the per-step path: a frozen dataclass sets each field
# through object.__setattr__, ~3x the construction cost.
class _Launched(NamedTuple):
    step: int
    plan: StepPlan
    wall_time: float
    rows: Optional[np.ndarray]
    host_s: float
    launch_s: float


class CompletedStep(NamedTuple):
    record: StepRecord
    wall_time: float     # time.time() at launch, to line the log up with a client's clock
    accept_lens: list[float]    # tokens each request received, bonus included (never written)
    rows: Optional[np.ndarray]
    host_s: float = 0.0  # the worker's host time before this step's launch
    launch_s: float = 0.0  # the engine's host time launching it (no device wait in either)


class StepLedger:
    """FIFO of launched decode steps, completed in launch order by their accept counts.

    Accept counts come back per processed decode result, in launch order (one step late under
    overlap scheduling); decode-mode steps report zeros (accept length 1). A result whose batch
    size does not match the oldest launch means the pairing is lost: the ledger drops that
    entry rather than mislabel the step.
    """

    def __init__(self, clock: Callable[[], float] = time.time, max_in_flight: int = 8) -> None:
        self._clock = clock
        self._pending: Deque[_Launched] = deque(maxlen=max_in_flight)
        self._next_step = 0
        self.mismatches = 0

    def launched(self, plan: StepPlan, rows: Optional[np.ndarray] = None,
                 host_s: float = 0.0, launch_s: float = 0.0) -> int:
        step = self._next_step
        self._next_step += 1
        # Overlap scheduling keeps at most two results in flight; anything older was never
        # reported (e.g. a result the scheduler dropped) and would shift every later pairing.
        if len(self._pending) == self._pending.maxlen:
            self.mismatches += 1
        self._pending.append(_Launched(step, plan, self._clock(), rows, host_s, launch_s))
        return step

    def completed(self, num_correct_drafts_per_req: Sequence[int],
                  batch_size: int) -> Optional[CompletedStep]:
        if not self._pending:
            return None
        entry = self._pending.popleft()
        n = len(num_correct_drafts_per_req)
        if n != entry.plan.bs or (batch_size and batch_size != entry.plan.bs):
            self.mismatches += 1
            return None
        # Each request's tokens, the bonus one included: mapped in C over SGLang's list.
        counts = num_correct_drafts_per_req
        if type(counts) is not list:
            counts = np.asarray(counts).tolist()
        accept = list(map(operator.add, counts, itertools.repeat(1.0, n)))
        tokens = int(sum(accept))
        record = StepRecord(step=entry.step, mode=entry.plan.mode, bs=entry.plan.bs,
                            padded_bs=entry.plan.padded_bs, reason=entry.plan.reason,
                            graph=entry.plan.graph, tokens=tokens,
                            mean_accept_len=tokens / n if n else 1.0)
        return CompletedStep(record, entry.wall_time, accept, entry.rows, entry.host_s,
                             entry.launch_s)

    @property
    def in_flight(self) -> int:
        return len(self._pending)
