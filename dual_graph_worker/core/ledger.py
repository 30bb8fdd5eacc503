"""The ledger that pairs a launched decode step with its accepted tokens, which come back one
result later under overlap scheduling."""

from __future__ import annotations

import itertools
import operator
import time
from collections import deque
from typing import Callable, Deque, NamedTuple, Optional, Sequence

import numpy as np

from dual_graph_worker.core.planner import StepPlan
from dual_graph_worker.core.results import StepRecord


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
    overlap scheduling); decode-mode steps report zeros (accept length 1). A result finds at
    most `depth` launches pending (its own, and under overlap the next one); any older ones
    lost their results and are dropped, so one lost result never leaves every later step
    paired one off. A result whose batch size does not match its launch means the pairing is
    lost: the ledger drops both rather than mislabel the step. `mismatches` counts the steps
    so left unpaired.
    """

    def __init__(self, clock: Callable[[], float] = time.time, max_in_flight: int = 8,
                 depth: int = 2) -> None:
        self._clock = clock
        self._depth = depth
        self._pending: Deque[_Launched] = deque(maxlen=max_in_flight)
        self._next_step = 0
        self.mismatches = 0

    def launched(self, plan: StepPlan, rows: Optional[np.ndarray] = None,
                 host_s: float = 0.0, launch_s: float = 0.0) -> int:
        step = self._next_step
        self._next_step += 1
        # Bounded even if no result ever comes back (completed trims to `depth` as one does).
        if len(self._pending) == self._pending.maxlen:
            self.mismatches += 1
        self._pending.append(_Launched(step, plan, self._clock(), rows, host_s, launch_s))
        return step

    def completed(self, num_correct_drafts_per_req: Sequence[int],
                  batch_size: int) -> Optional[CompletedStep]:
        if not self._pending:
            return None
        while len(self._pending) > self._depth:       # launches whose results were lost
            self._pending.popleft()
            self.mismatches += 1
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
