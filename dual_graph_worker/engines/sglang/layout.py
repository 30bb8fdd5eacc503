"""Tensors of a decode-mode step, in the layout SGLang's speculative scheduler expects.

Engine-agnostic (plain torch) so the arithmetic is unit-tested on CPU: stride 1, accept lengths
of one, ``new_seq_lens = seq_lens + 1``, and a next draft input of exactly spec mode's shapes and
dtypes. The contract: docs/sglang-0.5.17.md §4.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import torch

DECODE_STRIDE = 1


class DecodeStepLayout(NamedTuple):
    accept_lens: torch.Tensor     # [bs] int32 ones
    new_seq_lens: torch.Tensor    # [bs], dtype of seq_lens
    stride: int                   # speculative_num_draft_tokens reported for this step


class DecodeLengths(NamedTuple):
    """Lengths of the DECODE forward: DECODE positions are seq_lens - 1 (SGLang's
    clamp_position), and the new token sits at position seq_lens, so the forward sees +1."""

    seq_lens: torch.Tensor
    seq_lens_cpu: Optional[torch.Tensor]
    seq_lens_sum: Optional[int]


class DraftHandoff(NamedTuple):
    """The four tensors a speculative step hands to the next one through the FutureMap."""

    bonus_tokens: torch.Tensor
    topk_p: torch.Tensor
    topk_index: torch.Tensor
    hidden_states: Optional[torch.Tensor]


def decode_step_layout(seq_lens: torch.Tensor,
                       ones: Optional[torch.Tensor] = None) -> DecodeStepLayout:
    """`ones`: a preallocated int32 ones buffer of at least bs rows, sliced for accept_lens
    (the scheduler only copies accept_lens to the host), so the per-step path launches no
    fill kernel; None allocates."""
    bs = seq_lens.shape[0]
    return DecodeStepLayout(
        accept_lens=(torch.ones(bs, dtype=torch.int32, device=seq_lens.device)
                     if ones is None or ones.shape[0] < bs else ones[:bs]),
        new_seq_lens=seq_lens + 1,
        stride=DECODE_STRIDE,
    )


def decode_lengths(seq_lens: torch.Tensor, seq_lens_cpu: Optional[torch.Tensor],
                   seq_lens_sum: Optional[int]) -> DecodeLengths:
    bs = seq_lens.shape[0]
    return DecodeLengths(
        seq_lens=seq_lens + 1,
        seq_lens_cpu=None if seq_lens_cpu is None else seq_lens_cpu + 1,
        seq_lens_sum=None if seq_lens_sum is None else int(seq_lens_sum) + bs,
    )


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
        self._pending: list[list[float]] = []     # steps of self._rows not in _len yet

    def of(self, batch) -> tuple[np.ndarray, int]:
        """The batch's request-pool rows (read-only) and their context tokens."""
        src = getattr(batch, "req_pool_indices_cpu", None)
        if src is None or src is not self._src:
            self._flush()
            rows = rows_of(batch).copy()       # its own: nobody can write it (acceptance.py)
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


def decode_out_cache_loc(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: torch.Tensor) -> torch.Tensor:
    """KV slot of the one token a decode step writes: ``req_to_token[rpi, seq_lens]``.

    The scheduler already allocated it (spec v2 keeps ``committed + 2*alloc_len`` slots per
    request, eagle_utils.eagle_prepare_for_decode), so the worker only reads slot ids.
    """
    # No bounds check here: it would cost a device->host sync every step, and the scheduler
    # never schedules a request past its context length (the row width).
    return req_to_token[req_pool_indices.to(torch.int64), seq_lens.to(torch.int64)].to(
        torch.int64)


def per_request_logprobs(next_token_logprobs: torch.Tensor) -> torch.Tensor:
    """The sampler's [bs] logprobs as [bs, 1]: spec results hold one row per request with
    one entry per accepted token (batch_result_processor._apply_decode_logprobs)."""
    return next_token_logprobs.reshape(-1, 1)


def check_handoff(h: DraftHandoff, *, bs: int, topk: int, hidden_width: Optional[int],
                  hidden_dtype: Optional[torch.dtype]) -> None:
    """Raise if a decode step's draft handoff would not match what spec mode stashes."""
    problems = []
    if tuple(h.bonus_tokens.shape) != (bs,):
        problems.append(f"bonus_tokens {tuple(h.bonus_tokens.shape)} != ({bs},)")
    if tuple(h.topk_p.shape) != (bs, topk) or h.topk_p.dtype != torch.float32:
        problems.append(f"topk_p {tuple(h.topk_p.shape)} {h.topk_p.dtype} != "
                        f"({bs}, {topk}) float32")
    if tuple(h.topk_index.shape) != (bs, topk) or h.topk_index.dtype != torch.int64:
        problems.append(f"topk_index {tuple(h.topk_index.shape)} {h.topk_index.dtype} != "
                        f"({bs}, {topk}) int64")
    if hidden_width is not None:
        hs = h.hidden_states
        if hs is None or tuple(hs.shape) != (bs, hidden_width) or (
                hidden_dtype is not None and hs.dtype != hidden_dtype):
            got = None if hs is None else (tuple(hs.shape), hs.dtype)
            problems.append(f"hidden_states {got} != (({bs}, {hidden_width}), {hidden_dtype})")
    if problems:
        raise ValueError("decode-step draft handoff does not match the speculative layout: "
                         + "; ".join(problems))
