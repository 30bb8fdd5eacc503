"""Lazy catch-up, host side: who is behind, by how much, and where the stash has room.

Engine-agnostic (numpy only), so it is unit-tested on CPU. ``count[row]`` is how many of the
row's last committed positions the draft has not seen; ``pending_end[row]`` marks a chunked
prompt between deferred chunks, whose backlog survives the running batch's catch-ups and
compactions. The invariants and why the arena is reclaimed all at once: docs/sglang-0.5.17.md
§6 ("The stash and its room", "Chunked prompts keep their row").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple, Optional

import enum

import numpy as np


class Behind(NamedTuple):
    """Rows of a batch whose draft is behind."""

    positions: np.ndarray     # [m] indices into the batch (its order), int64
    counts: np.ndarray        # [m] tokens each is behind, int64, all >= 1


def _read_only_empty() -> np.ndarray:
    a = np.zeros(0, dtype=np.int64)
    a.flags.writeable = False
    return a


_NONE_BEHIND = Behind(_read_only_empty(), _read_only_empty())


@dataclass
class BacklogStats:
    decode_steps: int = 0
    stashed_tokens: int = 0
    catch_ups: int = 0
    forced_catch_ups: int = 0        # the arena was full: caught up during decode mode
    caught_up_tokens: int = 0
    max_backlog: int = 0             # longest single-request backlog caught up
    orphans_dropped: int = 0
    deferred_prefills: int = 0       # prefill batches whose draft extend was deferred
    deferred_prefill_tokens: int = 0
    compactions: int = 0             # orphans reclaimed by moving live cells, no draft work
    compacted_cells: int = 0         # live cells moved by those compactions
    chunk_restarts: int = 0          # a deferred chunked prompt continued on EAGLE's path

    def to_json(self) -> dict:
        return asdict(self)


class CatchUpDone(NamedTuple):
    tokens: int
    orphans: int


class RoomAction(enum.Enum):
    NONE = "none"            # the arena has room
    COMPACT = "compact"      # dropping the orphans' cells makes room; no draft work
    CATCH_UP = "catch-up"    # the live backlog itself is too large: catch the batch up


class PendingRows(NamedTuple):
    """Rows in the middle of a deferred chunked prefill, with their committed lengths."""

    rows: np.ndarray         # int64
    ends: np.ndarray         # int64
    counts: np.ndarray       # int64, all >= 1


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
        # -1: none; else the committed length of a deferred chunked prompt between its chunks.
        self.pending_end = np.full(num_rows, -1, dtype=np.int64)
        self.arena_cells = int(arena_cells)
        self.cursor = 0
        self.stats = BacklogStats()

    @staticmethod
    def _int64s(values) -> np.ndarray:
        return np.asarray(values, dtype=np.int64).reshape(-1)

    def reset(self, rows, prefix_lens=None) -> None:
        """These rows were prefilled on EAGLE's path (its draft extend ran): their draft is
        current. With `prefix_lens`, a row that continues a deferred chunked prompt is counted
        in ``chunk_restarts``: EAGLE's extend of this chunk attended to draft KV the deferred
        chunks never wrote, so that request drafts from a partly stale state (acceptance only;
        the target verifies every token). The worker avoids it by deferring such batches."""
        r = self._int64s(rows)
        if prefix_lens is not None:
            self.stats.chunk_restarts += int(np.count_nonzero(
                self._continues(r, self._int64s(prefix_lens))))
        self.count[r] = 0
        self.pending_end[r] = -1

    def _continues(self, rows: np.ndarray, prefix_lens: np.ndarray) -> np.ndarray:
        """Which rows continue a deferred chunked prompt exactly where its last chunk ended."""
        return (self.pending_end[rows] >= 0) & (self.pending_end[rows] == prefix_lens)

    def continues_deferred_chunk(self, rows, prefix_lens) -> bool:
        return bool(self._continues(self._int64s(rows),
                                    self._int64s(prefix_lens)).any())

    def note_prefill(self, rows, prefix_lens, extend_lens, chunked: int = -1) -> int:
        """Record a deferred prefill of `rows` (batch order) and return the first arena cell of
        its ``sum(extend_lens)`` consecutive cells (batch token order). `chunked` is the batch
        position of the request whose prompt continues in a later batch (-1: none)."""
        r = self._int64s(rows)
        prefix = self._int64s(prefix_lens)
        ext = self._int64s(extend_lens)
        if not (r.size == prefix.size == ext.size) or (ext < 1).any():
            raise ValueError(f"deferred prefill: {r.size} rows, {prefix.size} prefix lengths, "
                             f"{ext.size} extend lengths (each >= 1)")
        tokens = int(ext.sum())
        if not self.room_for(tokens):
            raise RuntimeError(f"stash arena full ({self.cursor} + {tokens} > "
                               f"{self.arena_cells} cells): do not defer this prefill")
        keep = np.where(self._continues(r, prefix), self.count[r], 0)
        self.count[r] = keep + ext
        self.pending_end[r] = -1
        if chunked >= 0:
            self.pending_end[r[chunked]] = prefix[chunked] + ext[chunked]
        base = self.cursor
        self.cursor += tokens
        self.stats.deferred_prefills += 1
        self.stats.deferred_prefill_tokens += tokens
        self.stats.stashed_tokens += tokens
        return base

    def pending(self, exclude=()) -> PendingRows:
        """Rows between the chunks of a deferred prompt, except `exclude` (a batch's rows)."""
        mask = (self.pending_end >= 0) & (self.count > 0)
        ex = self._int64s(exclude)
        if ex.size:
            mask[ex] = False
        rows = np.flatnonzero(mask).astype(np.int64)
        return PendingRows(rows, self.pending_end[rows], self.count[rows])

    def room_for(self, bs: int) -> bool:
        """Whether a decode step of `bs` requests can stash without a catch-up first."""
        return self.cursor + int(bs) <= self.arena_cells

    def drop_abandoned_pending(self, batch_rows) -> int:
        """A prefill batch arrived: SGLang puts a chunked prompt's next chunk first into the
        next prefill batch, so a pending row absent from `batch_rows` was aborted (or retracted)
        between its chunks. Forget it; its cells go at the next compaction. Returns how many."""
        gone = self.pending_end >= 0
        gone[self._int64s(batch_rows)] = False
        n = int(np.count_nonzero(gone))
        if n:
            self.count[gone] = 0
            self.pending_end[gone] = -1
            self.stats.orphans_dropped += n
        return n

    def pending_cells(self) -> int:
        """Cells held by prompts between their chunks: no catch-up can free them."""
        return int(self.count[self.pending_end >= 0].sum())

    def can_defer(self, tokens: int, *, reserve: int = 0,
                  chunked_prompt: Optional[int] = None) -> bool:
        """Whether a prefill of `tokens` may stash instead of running the draft. A prompt that
        continues in later chunks (`chunked_prompt`: its whole length) stays pending until its
        last chunk, and pending cells cannot be caught up: the arena must hold every pending
        prompt whole plus one decode step of every row, or a decode step between the chunks
        would find no room (a catch-up frees all but the pending cells)."""
        if not self.room_for(int(tokens) + int(reserve)):
            return False
        if chunked_prompt is None:
            return True
        return self.pending_cells() + int(chunked_prompt) + self.count.shape[0] \
            <= self.arena_cells

    def note_decode_step(self, rows) -> int:
        """Record a lazy decode step over `rows` (unique request-pool rows, batch order) and
        return the first arena cell of its ``len(rows)`` consecutive cells."""
        r = self._int64s(rows)
        if not self.room_for(r.size):
            raise RuntimeError(f"stash arena full ({self.cursor} + {r.size} > "
                               f"{self.arena_cells} cells): catch up before stashing")
        base = self.cursor
        self.cursor += int(r.size)
        self.count[r] += 1
        self.stats.decode_steps += 1
        self.stats.stashed_tokens += int(r.size)
        return base

    def pending_tokens(self, rows) -> int:
        """Draft tokens a catch-up of `rows` would run."""
        if not self.cursor:          # every token behind holds a cell: none is (a spec run)
            return 0
        return int(self.count[self._int64s(rows)].sum())

    def behind(self, rows) -> Behind:
        if not self.cursor:
            return _NONE_BEHIND
        r = self._int64s(rows)
        counts = self.count[r]
        pos = np.flatnonzero(counts > 0).astype(np.int64)
        return Behind(pos, counts[pos])

    def caught_up(self, rows, *, forced: bool) -> CatchUpDone:
        """A catch-up ran for `rows` (every row of the batch that was behind). Clears them,
        drops every other backlog (orphans: requests gone while behind) but the pending rows',
        and restarts the arena after the pending cells (the caller moves those to the front).
        With no rows it only drops orphans (an arena filled by requests that are gone)."""
        r = self._int64s(rows)
        tokens = int(self.count[r].sum())
        longest = int(self.count[r].max()) if r.size else 0
        self.count[r] = 0
        self.pending_end[r] = -1
        orphans = self._drop_orphans(keep=r[:0])
        self.cursor = self.pending_cells()
        s = self.stats
        if r.size:
            s.catch_ups += 1
            s.forced_catch_ups += int(forced)
        s.caught_up_tokens += tokens
        s.max_backlog = max(s.max_backlog, longest)
        s.orphans_dropped += orphans
        return CatchUpDone(tokens, orphans)

    def _drop_orphans(self, keep: np.ndarray) -> int:
        """Zero every backlog except `keep`'s and the pending rows'; how many were dropped."""
        live = self.pending_end >= 0
        live[keep] = True
        orphan = (self.count > 0) & ~live
        n = int(np.count_nonzero(orphan))
        self.count[orphan] = 0
        return n

    def live_after_reclaim(self, batch_rows) -> int:
        """Cells still needed once orphans go: the backlogs of `batch_rows` and pending rows."""
        r = self._int64s(batch_rows)
        mask = self.pending_end >= 0
        mask[r] = True
        return int(self.count[mask].sum())

    def plan_room(self, batch_rows, need: int, reserve: int = 0) -> RoomAction:
        """What a decode step over `batch_rows` (the whole running batch) must do first: `need`
        cells must fit (its own), `reserve` more are wanted free for the next prefill.

        The reserve alone never forces draft work, and a compaction for its sake is done only
        when it frees at least a quarter of the arena, so a nearly full live backlog does not
        compact every step."""
        if self.room_for(int(need) + int(reserve)):
            return RoomAction.NONE
        live = self.live_after_reclaim(batch_rows)
        cells = self.arena_cells
        if live + int(need) + int(reserve) + cells // 4 <= cells:
            return RoomAction.COMPACT
        if self.room_for(need):
            return RoomAction.NONE
        if live + int(need) <= cells:
            return RoomAction.COMPACT
        return RoomAction.CATCH_UP

    def compacted(self, batch_rows) -> int:
        """The live cells (`batch_rows`' backlogs, then pending rows') were moved to the front;
        drop every other backlog. Returns the new cursor (= live cells)."""
        r = self._int64s(batch_rows)
        orphans = self._drop_orphans(keep=r)
        self.cursor = self.live_after_reclaim(r)
        self.stats.compactions += 1
        self.stats.compacted_cells += self.cursor
        self.stats.orphans_dropped += orphans
        return self.cursor
