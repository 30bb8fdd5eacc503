"""Keeping the draft model's state valid across periods with speculation off.

While the worker runs in decode mode the draft model's KV cache would fall behind by every token
generated. DESIGN.md names two ways out, both implemented behind this one interface so they can be
measured against each other:

- KEEP_CURRENT: the decode graph also runs one draft forward on the new token (a width-1 draft
  extend at the same position and KV slot). Costs one draft layer every decode step; a switch back
  to speculation is free.
- LAZY_CATCH_UP: the decode graph only stashes the target's EAGLE-3 features of each new token
  (indexed by its KV slot). When speculation returns, one eager draft extend runs over each
  request's backlog. Costs nothing per decode step; a switch back pays one draft extend.

The worker never drafts from a stale state: before every spec step, requests with a backlog are
caught up first.
"""

from __future__ import annotations

import enum

import numpy as np

NO_BACKLOG = -1


class Continuity(str, enum.Enum):
    KEEP_CURRENT = "keep-current"
    LAZY_CATCH_UP = "lazy-catch-up"
    # A plain server: no draft state at all, so speculation must never run (the plain baseline).
    NONE = "none"


class DraftBacklog:
    """Per request row: the first position the draft has not seen (NO_BACKLOG when current)."""

    def __init__(self, max_rows: int) -> None:
        self.start = np.full(max_rows, NO_BACKLOG, dtype=np.int64)

    def note_decode_step(self, rows: np.ndarray, seq_lens_before: np.ndarray) -> None:
        """Lazy mode: a decode step at position L leaves the draft behind from L on."""
        behind = self.start[rows] == NO_BACKLOG
        self.start[rows[behind]] = seq_lens_before[behind]

    def rows_behind(self, rows: np.ndarray) -> np.ndarray:
        return rows[self.start[rows] != NO_BACKLOG]

    def clear(self, rows: np.ndarray) -> None:
        self.start[rows] = NO_BACKLOG
