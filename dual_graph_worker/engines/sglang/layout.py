"""Tensors of a decode-mode step, in the layout SGLang's speculative scheduler expects.

Engine-agnostic (plain torch) so the arithmetic is unit-tested on CPU: stride 1, accept lengths
of one, ``new_seq_lens = seq_lens + 1``, and a next draft input of exactly spec mode's shapes and
dtypes. The contract: docs/sglang-0.5.17.md §4.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

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


def decode_step_layout(lengths: DecodeLengths,
                       ones: Optional[torch.Tensor] = None) -> DecodeStepLayout:
    """The step's result layout over the forward's own `lengths` (decode_lengths): its seq_lens are
    the new ones, handed on as they are (SGLang copies or rebinds them, never writes them in place),
    so no kernel computes them twice. `ones`: a preallocated int32 ones buffer of at least bs rows,
    sliced for accept_lens (the scheduler only copies accept_lens to the host), so the per-step path
    launches no fill kernel; None, or a buffer shorter than bs, allocates."""
    seq_lens = lengths.seq_lens
    bs = seq_lens.shape[0]
    return DecodeStepLayout(
        accept_lens=(torch.ones(bs, dtype=torch.int32, device=seq_lens.device)
                     if ones is None or ones.shape[0] < bs else ones[:bs]),
        new_seq_lens=seq_lens,
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
