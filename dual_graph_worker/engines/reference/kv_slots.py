"""KV slot accounting: a free list of token slots and the per-step planner.

Slots are token-granular (page size 1, like SGLang's default). Target and draft KV pools are
indexed by the same slot ids, so one allocation covers both caches. Slot 0 is the dummy slot that
padding rows write to: it is never handed out, so padding can never clobber a real request.

A step allocates what it may write and returns what it did not keep:
- spec mode: K+1 slots a request (verify writes positions L..L+K); after acceptance of n draft
  tokens the first n+1 stay with the request and K-n go back to the free list;
- decode mode: 1 slot a request, always kept.
Nothing is reserved across steps, so a mode switch in either direction neither frees nor reserves
anything: there is nothing to leak.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dual_graph_worker.core.errors import ConfigError, KVPoolExhausted
from dual_graph_worker.core.modes import Mode

DUMMY_SLOT = 0


class SlotAccountingError(AssertionError):
    """A double free or a free of a slot that was never allocated: a bug, never user error."""


class SlotAllocator:
    """LIFO free list over slots 1..num_slots-1 with an ownership bitmap for double-free checks."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ConfigError(f"KV pool needs at least 2 slots (one is the padding slot), got {num_slots}")
        self.num_slots = num_slots
        self._free = np.arange(num_slots - 1, 0, -1, dtype=np.int64)  # stack; top = end
        self._top = num_slots - 1
        self._allocated = np.zeros(num_slots, dtype=bool)

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_allocated(self) -> int:
        return int(self._allocated.sum())

    def alloc(self, n: int) -> np.ndarray:
        if n > self._top:
            raise KVPoolExhausted(f"asked for {n} KV slots but only {self._top} are free")
        out = self._free[self._top - n:self._top][::-1].copy()
        self._top -= n
        self._allocated[out] = True
        return out

    def free(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64).ravel()
        if slots.size == 0:
            return
        bad = (slots <= DUMMY_SLOT) | (slots >= self.num_slots)
        if bad.any():
            raise SlotAccountingError(f"freeing out-of-range slots {slots[bad][:8]}")
        if not self._allocated[slots].all() or np.unique(slots).size != slots.size:
            raise SlotAccountingError(f"double free of KV slots {slots[~self._allocated[slots]][:8]}")
        self._allocated[slots] = False
        self._free[self._top:self._top + slots.size] = slots
        self._top += slots.size

    def check(self) -> None:
        """Invariant: every slot but the dummy is either free or allocated, never both."""
        free = self._free[:self._top]
        if np.unique(free).size != free.size:
            raise SlotAccountingError("a slot appears twice in the free list")
        if self._allocated[free].any():
            raise SlotAccountingError("a free slot is marked allocated")
        if self._top + self.num_allocated != self.num_slots - 1:
            raise SlotAccountingError(
                f"{self._top} free + {self.num_allocated} allocated != {self.num_slots - 1} slots")


@dataclass(frozen=True)
class SlotPlan:
    """Slots one step writes: `slots[i, j]` holds position seq_lens[i] + j of request i."""

    mode: Mode
    slots: np.ndarray        # [bs, width] int64
    width: int


class KVSlotPlanner:
    """How many slots each mode needs, and the allocation/commit of one step."""

    def __init__(self, allocator: SlotAllocator, num_draft_tokens: int) -> None:
        self.allocator = allocator
        self.num_draft_tokens = num_draft_tokens

    def slots_needed(self, mode: Mode, bs: int) -> int:
        return bs * mode.tokens_per_request(self.num_draft_tokens)

    def can_run(self, mode: Mode, bs: int) -> bool:
        return self.allocator.num_free >= self.slots_needed(mode, bs)

    def require(self, mode: Mode, bs: int) -> None:
        """KVPoolExhausted unless a `mode` step of `bs` requests fits the free slots."""
        if not self.can_run(mode, bs):
            raise KVPoolExhausted(
                f"{mode.value} step for {bs} requests needs {self.slots_needed(mode, bs)} KV "
                f"slots but {self.allocator.num_free} are free; admit fewer requests (max "
                "running requests) or give the KV pool more memory")

    def plan(self, mode: Mode, bs: int) -> SlotPlan:
        width = mode.tokens_per_request(self.num_draft_tokens)
        self.require(mode, bs)
        return SlotPlan(mode, self.allocator.alloc(bs * width).reshape(bs, width), width)

    def commit(self, plan: SlotPlan, accept_lens: np.ndarray) -> np.ndarray:
        """Free the slots past each request's accepted length; return the kept mask [bs, width]."""
        keep = np.arange(plan.width)[None, :] < np.asarray(accept_lens)[:, None]
        self.allocator.free(plan.slots[~keep])
        return keep

    def cancel(self, plan: SlotPlan) -> None:
        """Return every slot of a plan whose step did not run (error before replay)."""
        self.allocator.free(plan.slots)
