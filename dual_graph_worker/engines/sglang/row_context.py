"""Each request-pool row's context on the host, as the controller prices a batch: its rows,
their lengths from each prefill, advanced by each step's accepted tokens."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch


def rows_of(batch: Any) -> np.ndarray:
    """The batch's request-pool rows on the host, in batch order (no device copy)."""
    cpu = getattr(batch, "req_pool_indices_cpu", None)
    rows = (cpu.numpy() if isinstance(cpu, torch.Tensor) else
            np.asarray([r.req_pool_idx for r in batch.reqs] if cpu is None else cpu))
    rows = rows.astype(np.int64, copy=False).reshape(-1)
    if rows.shape[0] != batch.seq_lens.shape[0]:
        raise RuntimeError(f"batch has {batch.seq_lens.shape[0]} requests but "
                           f"{rows.shape[0]} host request-pool rows")
    return rows


def prefill_lengths(batch, n: int) -> np.ndarray:
    """A prefill batch's `n` sequence lengths after it (prefix and this chunk): its host
    seq_lens, else prefix_lens + extend_lens, else zeros (a row never keeps a previous
    request's length)."""
    lens = getattr(batch, "seq_lens_cpu", None)
    if lens is not None:
        return np.asarray(lens, dtype=np.int64).reshape(-1)
    prefix, extend = getattr(batch, "prefix_lens", None), getattr(batch, "extend_lens", None)
    if prefix is not None and extend is not None and len(prefix) == len(extend) == n:
        return np.asarray(prefix, dtype=np.int64) + np.asarray(extend, dtype=np.int64)
    return np.zeros(n, dtype=np.int64)


class RowContext:
    """Each request-pool row's context length on the host: set when its prompt is prefilled,
    advanced by each step's accepted tokens. SGLang's speculative path keeps no host lengths
    between decode steps (seq_lens_sum and seq_lens_cpu are None there).

    `of(batch)` memoises the batch's rows and their total on its host row tensor: SGLang
    replaces that tensor whenever the batch's requests change and never writes it, so while the
    same tensor comes back only advanced() moves the total, and the rows' own lengths take that
    batch's steps in one numpy call every _FLUSH_STEPS (a cold numpy call costs ~10-50 us a
    step on a busy host)."""

    _FLUSH_STEPS = 64

    def __init__(self, rows: int) -> None:
        self._len = np.zeros(rows, dtype=np.int64)
        self._src: object = None
        self._rows = np.zeros(0, dtype=np.int64)
        self._total = 0
        self._pending: list[Sequence[float]] = []     # steps of self._rows not in _len yet

    def of(self, batch) -> tuple[np.ndarray, int]:
        """The batch's request-pool rows (read-only) and their context tokens."""
        src = getattr(batch, "req_pool_indices_cpu", None)
        if src is None or src is not self._src:
            self._flush()
            rows = rows_of(batch).copy()       # owned and read-only: acceptance trusts it unchanged
            rows.flags.writeable = False
            self._src, self._rows, self._total = src, rows, int(self._len[rows].sum())
        return self._rows, self._total

    def total(self, rows: np.ndarray) -> int:
        """Context tokens of request-pool `rows` (any rows, not only the memoised batch's)."""
        self._flush()
        return int(self._len[rows].sum())

    def admitted(self, rows: np.ndarray, lengths: np.ndarray) -> None:
        self._flush()
        self._len[rows] = lengths
        self._src = None

    def advanced(self, rows: np.ndarray, accepted: Sequence[float], tokens: int) -> None:
        """`tokens`: accepted's sum."""
        if rows is self._rows:
            self._total += tokens
            self._pending.append(accepted)
            if len(self._pending) >= self._FLUSH_STEPS:
                self._flush()
        else:
            self._len[rows] += np.asarray(accepted, dtype=np.int64)
            self._src = None

    def _flush(self) -> None:
        if self._pending:
            self._len[self._rows] += np.asarray(self._pending, dtype=np.int64).sum(axis=0)
            self._pending.clear()
