"""Host-side request table: vectorised bookkeeping of every running request.

Row r of each array belongs to one request (row 0 is the padding row). Keeping lengths, tokens
and the host mirror of the request->slot table in numpy arrays lets a step commit every request
with a few array ops instead of a Python loop over requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from dual_graph_worker.core.errors import ContextOverflow, DualGraphError


class RequestPoolFull(DualGraphError):
    """All request-table rows are in use: admit fewer requests at once."""


@dataclass(frozen=True)
class FinishedRequest:
    rid: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    reason: str             # "length", "eos" or "abort"


class RequestTable:
    def __init__(self, max_rows: int, max_context: int, num_draft_tokens: int) -> None:
        self.max_context = max_context
        self.k = num_draft_tokens
        # tokens[r, p] = x_p; a spec step may write up to K+1 past L, hence the extra columns.
        self.tokens = np.zeros((max_rows, max_context + num_draft_tokens + 2), dtype=np.int64)
        self.slots = np.zeros((max_rows, max_context + num_draft_tokens + 1), dtype=np.int64)
        self.seq_lens = np.zeros(max_rows, dtype=np.int64)     # L: positions in KV
        self.prompt_lens = np.zeros(max_rows, dtype=np.int64)
        self.max_new = np.zeros(max_rows, dtype=np.int64)
        self.rid_of_row = np.full(max_rows, -1, dtype=np.int64)
        self.row_of_rid: dict[int, int] = {}
        self._free_rows = list(range(max_rows - 1, 0, -1))
        self.running = np.zeros(0, dtype=np.int64)               # rows, admission order

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len < 1:
            raise ValueError("a prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        # A spec step near the end writes K+1 positions past L: reserve them.
        need = prompt_len + max_new_tokens + self.k
        if need > self.max_context:
            raise ContextOverflow(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} + "
                f"{self.k} speculative positions = {need} > max context {self.max_context}; "
                "shorten the prompt, lower max_new_tokens, or raise max_context")

    def admit(self, rid: int, prompt: np.ndarray, max_new_tokens: int) -> int:
        if rid in self.row_of_rid:
            raise ValueError(f"request id {rid} is already running")
        self.check_fits(len(prompt), max_new_tokens)
        if not self._free_rows:
            raise RequestPoolFull(f"all {len(self.rid_of_row) - 1} request rows are in use; "
                                  "finish or abort requests first, or raise max_requests")
        row = self._free_rows.pop()
        n = len(prompt)
        self.tokens[row, :n] = prompt
        self.seq_lens[row] = 0
        self.prompt_lens[row] = n
        self.max_new[row] = max_new_tokens
        self.rid_of_row[row] = rid
        self.row_of_rid[rid] = row
        return row

    def start_running(self, rows: np.ndarray) -> None:
        self.running = np.concatenate([self.running, rows])

    def generated(self, rows: np.ndarray) -> np.ndarray:
        # tokens x_0..x_L exist; the prompt is x_0..x_{P-1}
        return self.seq_lens[rows] + 1 - self.prompt_lens[rows]

    def release(self, row: int, reason: str, out_len: int) -> tuple[FinishedRequest, np.ndarray]:
        """Drop a request; returns its record (first `out_len` generated tokens) and the KV
        slots it held (positions [0, L))."""
        rid = int(self.rid_of_row[row])
        p = int(self.prompt_lens[row])
        done = FinishedRequest(rid, tuple(int(t) for t in self.tokens[row, :p]),
                               tuple(int(t) for t in self.tokens[row, p: p + max(out_len, 0)]), reason)
        held = self.slots[row, : self.seq_lens[row]].copy()
        self.rid_of_row[row] = -1
        del self.row_of_rid[rid]
        self._free_rows.append(row)
        self.running = self.running[self.running != row]
        self.seq_lens[row] = 0
        return done, held

    def row(self, rid: int) -> Optional[int]:
        return self.row_of_rid.get(rid)
