"""Keeping the draft model's state valid while speculation is off: the strategies' contract.

- KEEP_CURRENT: every decode-mode step also runs a one-token draft extend, so a switch back to
  speculation is free and every step pays the draft.
- LAZY_CATCH_UP: decode-mode steps only stash the target's EAGLE-3 features; before the next
  speculative step one draft extend catches each request up. Prompts admitted while decoding
  may skip the draft's prefill the same way.

Each engine implements both behind its own protocol (a subclass of `ContinuityStrategy` whose
call points take that engine's batch): the worker calls them at fixed points (prefill, before a
speculative step, around a decode step) and never asks which one it holds. The draft never
drafts from a stale state: a speculative step first catches up every row that is behind.
"""

from __future__ import annotations

import enum
from typing import Protocol

import numpy as np


class Continuity(str, enum.Enum):
    KEEP_CURRENT = "keep-current"
    LAZY_CATCH_UP = "lazy-catch-up"


class ContinuityStrategy(Protocol):
    kind: Continuity
    # Decode-mode prefills skip the draft's prefill: only speculation pays the draft per prompt
    # token (the controller's cost model reads this).
    defers_prefill: bool

    def pending_tokens(self, rows: np.ndarray) -> int:
        """Draft tokens a speculative step over `rows` would catch up first (rank-common)."""
