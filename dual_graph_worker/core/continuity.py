"""Keeping the draft model's state valid while speculation is off: the strategies' contract.

KEEP_CURRENT runs a one-token draft extend in every decode-mode step; LAZY_CATCH_UP stashes the
target's features and catches the draft up before the next speculative step. Each engine
implements both behind its own subclass of `ContinuityStrategy`, called at fixed points; the
worker never asks which it holds. docs/design.md, "Draft state across switches".
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
