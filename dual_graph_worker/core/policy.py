"""Mode policies: the contract and what they observe (the simple policies: simple_policies.py).

A policy decides each step's mode from `PolicyInputs` (all rank-common) and from what it was
told through `observe`. Rank-common facts (accept lengths, token counts, rows: every TP rank
commits the same tokens) may be used at once; anything a rank measures on its own (timings) may
feed a decision only after `exchange` has made it common. So every rank, fed the same steps,
makes the same decisions and runs the same collectives.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple, Optional, Protocol, Sequence, Union

import numpy as np

from dual_graph_worker.core.estimates import Estimates
from dual_graph_worker.core.modes import Mode


class Reason(str, enum.Enum):
    """Why a step ran in its mode (kept in each step record, exported as a metric label)."""

    PINNED = "pinned"                    # the user fixed the mode
    THRESHOLD = "threshold"              # threshold policy, outside the hysteresis band
    HYSTERESIS = "hysteresis"            # inside the band: kept the current mode
    GOODPUT = "goodput"                  # the controller picked the mode of higher goodput
    DWELL = "dwell"                      # minimum dwell not yet served: kept the current mode
    EXPLORE = "explore"                  # re-measuring the mode not chosen (bounded budget)
    NO_SPEC_GRAPH = "no_spec_graph"      # batch larger than the spec pool
    KV_PRESSURE = "kv_pressure"          # free KV slots cannot cover K+1 slots per request


# The per-step records (inputs, observations) are NamedTuples: immutable and typed as frozen
# dataclasses are, at a quarter of their cost to build (~0.4 us against ~1.7 us), which a decode
# step pays several times. Those holding arrays are never compared or hashed.


class PolicyInputs(NamedTuple):
    """One step's facts; every field is identical on every TP rank."""

    bs: int
    spec_padded_bs: Optional[int]   # None: no spec graph covers bs
    decode_padded_bs: int
    catch_up_tokens: int = 0        # draft tokens a SPEC step would catch up first
    rows: Optional[np.ndarray] = None   # request rows, if known
    kv_tokens: int = 0              # context tokens the batch attends over (sum of seq lens)
    prefill_tokens: int = 0         # prompt tokens joining in prefills: SPEC drafts them there


@dataclass(frozen=True)
class Decision:
    mode: Mode
    reason: Reason
    price: float = 0.0      # EXPLORE: the re-measurement's cost in steps, charged at commit


# Decisions are frozen values: each unpriced one is made once, not once a step (~0.6 us).
DECIDED: Mapping[tuple[Mode, Reason], Decision] = MappingProxyType(
    {(m, r): Decision(m, r) for m in Mode for r in Reason})


# ----------------------------------------------------------------------------- observations


class Accepted(NamedTuple):
    """A completed step's accepted tokens per request (rank-common). Decode steps accept 1."""

    mode: Mode
    accept_lens: list                     # [bs] tokens each request received, bonus included
    total: float                          # their sum
    rows: Optional[np.ndarray] = None     # [bs] request rows, when the engine knows them


class Admitted(NamedTuple):
    """Requests whose prompts were prefilled (rank-common): `tokens` prompt tokens computed."""

    tokens: int
    rows: Optional[np.ndarray] = None


class StepTime(NamedTuple):
    """A decode step's end-to-end seconds (rank-local); `catch_up_tokens` > 0: the step also
    caught the draft up over that many tokens first; `carries_next`: its seconds also hold the
    host launch of a next batch of another kind (a prefill, a switch, a catch-up); `kv_tokens`:
    the context tokens the batch attended over (sum of its sequence lengths); `bs`: its
    requests (0: not known)."""

    mode: Mode
    padded_bs: int
    seconds: float
    catch_up_tokens: int = 0
    carries_next: bool = False
    kv_tokens: int = 0
    bs: int = 0


class PrefillTime(NamedTuple):
    """A prefill batch's seconds over `tokens` prompt tokens (rank-local); `draft`: the draft's
    prefill ran in it (False: it was deferred)."""

    tokens: int
    seconds: float
    draft: bool


class DraftPrefills(NamedTuple):
    """From now on, prompts that join a decoding batch are prefilled with (`deferred` False)
    or without the draft (rank-common: the engine's cache decides it, as at start-up)."""

    deferred: bool


Observation = Union[Accepted, Admitted, StepTime, PrefillTime, DraftPrefills]
# Makes a vector of rank-local sums common: every rank gets the mean over ranks. Python lists
# in and out: a single rank's exchange then touches no numpy (a cold call costs 5-45 us).
Reducer = Callable[[list[float]], list[float]]


def same_rank(vec: list[float]) -> list[float]:
    """The reducer of a single rank."""
    return vec


@dataclass(frozen=True)
class PolicyState:
    """What a policy believes now: for logs and metrics."""

    accept_len: float
    spec_goodput: Optional[float] = None     # expected tokens/s at the last decided batch
    decode_goodput: Optional[float] = None


class ModePolicy(Protocol):
    # Plans between exchanges of the ranks' measurements (0: the policy measures nothing).
    @property
    def sync_every(self) -> int: ...
    def decide(self, inputs: PolicyInputs) -> Decision: ...
    def commit(self, decision: Decision) -> None: ...
    def observe(self, event: Observation) -> None: ...
    def exchange(self, reduce: Reducer) -> None: ...
    def state(self) -> PolicyState: ...
    def estimates(self) -> Optional[Estimates]: ...


@dataclass
class DwellState:
    """Current mode and how many steps it has run; advanced only by `commit`."""

    mode: Mode = Mode.SPEC
    steps_in_mode: int = 0

    @property
    def dwell_waived(self) -> bool:
        """No dwell is owed before the first committed step (the initial mode was never
        chosen)."""
        return self.steps_in_mode == 0

    def commit(self, mode: Mode) -> None:
        if mode is self.mode:
            self.steps_in_mode += 1
        else:
            self.mode, self.steps_in_mode = mode, 1

    def must_dwell(self, min_dwell_steps: int) -> bool:
        return 0 < self.steps_in_mode < min_dwell_steps


def accepted(mode: Mode, accept_lens: Sequence[float] | np.ndarray,
             rows: Optional[np.ndarray] = None, total: Optional[float] = None) -> Accepted:
    """A list of numbers passes as it is, and is never written after (the SGLang worker's,
    every step: a cold numpy call costs more than the step's whole bookkeeping at a small
    batch); anything else becomes a list of floats. `total`: their sum, where the caller has
    it already (the ledger counts a step's tokens)."""
    lens = accept_lens if type(accept_lens) is list else \
        np.asarray(accept_lens, dtype=np.float64).tolist()
    return Accepted(mode, lens, float(sum(lens)) if total is None else float(total),
                    rows if rows is None or type(rows) is np.ndarray else np.asarray(rows))
