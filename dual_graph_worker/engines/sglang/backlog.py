"""Lazy catch-up, host side: who is behind, by how much, and where the stash has room.

Engine-agnostic (numpy only, no SGLang, no torch), so it is unit-tested on CPU. Part of the
``lazy-catch-up`` continuity strategy, which is NOT YET RUN ON A GPU (see lazy_sync.py).

State per request-pool row (SGLang's ``req_pool_idx``): ``count[row]`` = how many tokens the
draft has not seen. A decode-mode step at pre-step length L for a row leaves position L behind
(the target wrote its KV; the draft did not), so after k decode steps since the row was last
current, the draft is missing exactly positions ``[seq_len - k, seq_len)`` where ``seq_len`` is
the row's committed length at the next step. Counts are all the host needs: positions follow
from the device-side ``seq_lens`` of whichever batch runs the catch-up, so no device->host copy
is ever needed here.

The stash those positions' features live in is a bump-allocated arena of ``arena_cells`` rows
(catch_up.StashArena): a decode step of ``bs`` requests takes cells ``[cursor, cursor + bs)``.
Cells are reclaimed all at once: a catch-up covers every row of its batch that is behind, and
SGLang runs every decoding request in one batch (the running batch), so after it nothing that is
still alive is behind, and the arena restarts at cell 0. Rows that are behind but absent from
that batch are requests that finished, were aborted or were retracted (their pool row is freed
and reused; a re-admitted request is prefilled again, which resets its row): their backlog is
dropped and counted as ``orphans_dropped``. If that assumption were ever wrong for a live
request, its draft would draft from a stale state until its next prefill; acceptance would drop,
the emitted tokens would not change (the target verifies every draft at T=0).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np


class Behind(NamedTuple):
    """Rows of a batch whose draft is behind."""

    positions: np.ndarray     # [m] indices into the batch (its order), int64
    counts: np.ndarray        # [m] tokens each is behind, int64, all >= 1


@dataclass
class BacklogStats:
    decode_steps: int = 0
    stashed_tokens: int = 0
    catch_ups: int = 0
    forced_catch_ups: int = 0        # the arena was full: caught up during decode mode
    caught_up_tokens: int = 0
    max_backlog: int = 0             # longest single-request backlog caught up
    orphans_dropped: int = 0

    def to_json(self) -> dict:
        return asdict(self)


class CatchUpDone(NamedTuple):
    tokens: int
    orphans: int


class LazyBacklog:
    """Per-row backlog counts and the stash arena's cursor."""

    def __init__(self, num_rows: int, arena_cells: int) -> None:
        if num_rows < 1:
            raise ValueError(f"num_rows must be >= 1, got {num_rows}")
        if arena_cells < num_rows:
            # A decode step writes one cell per request and a batch holds at most num_rows
            # requests, so a smaller arena could not take even one step after a catch-up.
            raise ValueError(f"the stash arena needs at least one cell per request-pool row: "
                             f"{arena_cells} cells < {num_rows} rows")
        self.count = np.zeros(num_rows, dtype=np.int64)
        self.arena_cells = int(arena_cells)
        self.cursor = 0
        self.stats = BacklogStats()

    @staticmethod
    def _rows(rows) -> np.ndarray:
        return np.asarray(rows, dtype=np.int64).reshape(-1)

    def reset(self, rows) -> None:
        """These rows now hold newly admitted requests (prefill): their draft is current."""
        self.count[self._rows(rows)] = 0

    def room_for(self, bs: int) -> bool:
        """Whether a decode step of `bs` requests can stash without a catch-up first."""
        return self.cursor + int(bs) <= self.arena_cells

    def note_decode_step(self, rows) -> int:
        """Record a lazy decode step over `rows` (unique request-pool rows, batch order) and
        return the first arena cell of its ``len(rows)`` consecutive cells."""
        r = self._rows(rows)
        if not self.room_for(r.size):
            raise RuntimeError(f"stash arena full ({self.cursor} + {r.size} > "
                               f"{self.arena_cells} cells): catch up before stashing")
        base = self.cursor
        self.cursor += int(r.size)
        self.count[r] += 1
        self.stats.decode_steps += 1
        self.stats.stashed_tokens += int(r.size)
        return base

    def behind(self, rows) -> Behind:
        r = self._rows(rows)
        counts = self.count[r]
        pos = np.flatnonzero(counts > 0).astype(np.int64)
        return Behind(pos, counts[pos])

    def caught_up(self, rows, *, forced: bool) -> CatchUpDone:
        """A catch-up ran for `rows` (every row of the batch that was behind). Clears them,
        drops every other backlog (orphans, see the module docstring) and empties the arena.
        With no rows it only drops orphans (an arena filled by requests that are gone)."""
        r = self._rows(rows)
        tokens = int(self.count[r].sum())
        longest = int(self.count[r].max()) if r.size else 0
        self.count[r] = 0
        orphans = int(np.count_nonzero(self.count))
        if orphans:
            self.count[:] = 0
        self.cursor = 0
        s = self.stats
        if r.size:
            s.catch_ups += 1
            s.forced_catch_ups += int(forced)
        s.caught_up_tokens += tokens
        s.max_backlog = max(s.max_backlog, longest)
        s.orphans_dropped += orphans
        return CatchUpDone(tokens, orphans)


def arena_cells_for_budget(budget_bytes: int, *, aux_width: int, aux_elem_bytes: int,
                           token_bytes: int = 8) -> int:
    """How many stash cells fit `budget_bytes`: a target feature row each, plus `token_bytes`
    of per-cell bookkeeping (the token id, and the cell id the arena keeps)."""
    per_cell = int(aux_width) * int(aux_elem_bytes) + int(token_bytes)
    if per_cell <= 0:
        raise ValueError(f"bad stash cell size {per_cell}")
    return int(budget_bytes) // per_cell
