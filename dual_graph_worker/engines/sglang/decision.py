"""Engine-agnostic step planning: batch size -> (mode, padded bs, graph?, reason) -> StepRecord.

Nothing here imports SGLang. The worker calls `ModeSelector.plan(bs)` once per decode step, runs
the chosen path, and `StepLedger` pairs each launched step with its accept counts when the
scheduler hands them back (one step late under overlap scheduling) to produce a `StepRecord`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Optional, Sequence

from dual_graph_worker.dispatch import DispatchTable
from dual_graph_worker.modes import Mode
from dual_graph_worker.policy import Decision, ModePolicy, PolicyInputs, Reason
from dual_graph_worker.results import StepRecord


@dataclass(frozen=True)
class StepPlan:
    """What one decode step will run, decided before anything is launched."""

    mode: Mode
    bs: int
    padded_bs: int
    graph: bool          # False: no captured graph covers bs in this mode, runs eagerly
    reason: Reason


def policy_inputs(table: DispatchTable, bs: int, graphs_enabled: bool = True) -> PolicyInputs:
    """PolicyInputs for a batch of `bs` requests from the dispatch table built at capture.

    With CUDA graphs disabled there is no spec pool to fall out of: both modes run eagerly at
    `bs`, and the policy decides on batch size alone.
    """
    if bs < 1:
        raise ValueError(f"batch size must be >= 1, got {bs}")
    if not graphs_enabled:
        return PolicyInputs(bs=bs, spec_padded_bs=bs, decode_padded_bs=bs)
    spec = table.padded_bs(Mode.SPEC, bs) if table.has_graph(Mode.SPEC, bs) else None
    return PolicyInputs(bs=bs, spec_padded_bs=spec,
                        decode_padded_bs=table.padded_bs(Mode.DECODE, bs))


class ModeSelector:
    """Owns the dispatch table and the policy; one `plan` per decode step.

    `plan` also commits the decision to the policy (dwell/hysteresis state): the worker runs
    every plan it asks for, so decision and commit are one call and cannot drift apart.
    """

    def __init__(self, table: DispatchTable, policy: ModePolicy,
                 graphs_enabled: bool = True) -> None:
        self.table = table
        self.policy = policy
        self.graphs_enabled = graphs_enabled
        self.last_mode: Optional[Mode] = None    # the mode of the latest plan (None: no step yet)

    def _decide(self, bs: int) -> tuple[PolicyInputs, Decision]:
        inputs = policy_inputs(self.table, bs, self.graphs_enabled)
        return inputs, self.policy.decide(inputs)

    def plan(self, bs: int) -> StepPlan:
        inputs, decision = self._decide(bs)
        self.policy.commit(decision.mode)
        padded = (inputs.spec_padded_bs if decision.mode is Mode.SPEC
                  else inputs.decode_padded_bs) or bs
        graph = self.graphs_enabled and self.table.has_graph(decision.mode, bs)
        self.last_mode = decision.mode
        return StepPlan(decision.mode, bs, padded, graph, decision.reason)

    def preview(self, bs: int) -> Mode:
        """The mode `plan(bs)` would choose now, committing nothing: what the running batch
        will run once it has `bs` requests. Safe between plans because a policy's `commit`
        applies the latest `decide` (GoodputPolicy's probe flag), and every `plan` decides
        again right before it commits."""
        return self._decide(max(bs, 1))[1].mode


def expected_batch_size(req_to_token_pool: object, queued: int = 0) -> Optional[int]:
    """The size the running batch grows to once a prefill and the `queued` requests behind it
    have joined: the request rows held in SGLang's ReqToTokenPool (``size - available_size()``)
    plus `queued`, capped at the pool's size (a server's max running requests); None for a pool
    without that interface. The scheduler allocates a prefill's rows before it calls the worker
    and frees a finished request's row when it processes that request's result, so at a prefill
    the rows held are the running batch plus the new requests (plus any request that finished
    in the step still in flight under overlap scheduling, or a chunked prompt between chunks)."""
    size = getattr(req_to_token_pool, "size", None)
    available = getattr(req_to_token_pool, "available_size", None)
    if not isinstance(size, int) or not callable(available):
        return None
    return min(max(size - int(available()), 0) + max(int(queued), 0), size)


@dataclass(frozen=True)
class _Launched:
    step: int
    plan: StepPlan
    wall_time: float


@dataclass(frozen=True)
class CompletedStep:
    record: StepRecord
    wall_time: float     # time.time() at launch, to line the log up with a client's clock


class StepLedger:
    """FIFO of launched decode steps, completed in launch order by their accept counts.

    SGLang reports accept counts per processed decode result, in launch order, through
    `on_verify_complete_cpu(num_correct_drafts_per_req, batch_size)`; decode-mode steps report
    zeros (accept length 1). A result whose batch size does not match the oldest launch means
    the pairing is lost: the ledger drops that entry rather than mislabel the step.
    """

    def __init__(self, clock: Callable[[], float] = time.time, max_in_flight: int = 8) -> None:
        self._clock = clock
        self._pending: Deque[_Launched] = deque()
        self._max_in_flight = max_in_flight
        self._next_step = 0
        self.mismatches = 0

    def launched(self, plan: StepPlan) -> int:
        step = self._next_step
        self._next_step += 1
        self._pending.append(_Launched(step, plan, self._clock()))
        # Overlap scheduling keeps at most two results in flight; anything older was never
        # reported (e.g. a result the scheduler dropped) and would shift every later pairing.
        while len(self._pending) > self._max_in_flight:
            self._pending.popleft()
            self.mismatches += 1
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
        tokens = sum(int(x) for x in num_correct_drafts_per_req) + n
        record = StepRecord(step=entry.step, mode=entry.plan.mode, bs=entry.plan.bs,
                            padded_bs=entry.plan.padded_bs, reason=entry.plan.reason,
                            graph=entry.plan.graph, tokens=tokens,
                            mean_accept_len=tokens / n if n else 1.0)
        return CompletedStep(record, entry.wall_time)

    @property
    def in_flight(self) -> int:
        return len(self._pending)
