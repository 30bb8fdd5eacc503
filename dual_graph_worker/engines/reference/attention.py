"""Paged attention over the request->slot table, in plain torch (CPU and GPU reference).

Every forward here has a uniform query width W per request (1 for decode and each draft-chain step,
K+1 for verify and draft extend, the padded span for prefill and lazy catch-up); query j of request
i sits at position prefix_lens[i] + j and attends causally to positions [0, prefix_lens[i] + j]. The
K/V of the new tokens are written to the pool before attention reads it (write-then-read, as in
SGLang).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AttnBatch:
    """How a forward's queries map onto requests. Device tensors only: capturable."""

    req_rows: torch.Tensor      # [B] request-table rows
    prefix_lens: torch.Tensor   # [B] positions before the first query
    width: int                  # W: queries per request (padded)
    kv_bound: int               # static upper bound on prefix_lens + W (the table width)


class AttentionBackend(Protocol):
    name: str

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               req_to_token: torch.Tensor, batch: AttnBatch, scale: float) -> torch.Tensor:
        """q [B*W, h, d]; pools [slots, kvh, d] -> [B*W, h*d]."""


class TorchPagedAttention:
    """Gathers every request's KV up to `kv_bound` and masks: simple, exact, O(B * kv_bound)."""

    name = "torch"

    def attend(self, q, k_pool, v_pool, req_to_token, batch: AttnBatch, scale: float):
        B, W, C = batch.req_rows.numel(), batch.width, batch.kv_bound
        h, d = q.shape[1], q.shape[2]
        kvh = k_pool.shape[1]
        slots = req_to_token[batch.req_rows, :C]                          # [B, C]
        k = k_pool[slots].float()                                         # [B, C, kvh, d]
        v = v_pool[slots].float()
        qf = q.view(B, W, kvh, h // kvh, d).float()
        scores = torch.einsum("bwgqd,bcgd->bgqwc", qf, k) * scale         # [B, kvh, q/kv, W, C]
        q_pos = batch.prefix_lens[:, None] + torch.arange(W, device=q.device)[None, :]
        allowed = torch.arange(C, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [B,W,C]
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
        out = torch.einsum("bgqwc,bcgd->bwgqd", scores.softmax(-1), v)
        return out.reshape(B * W, h * d).to(q.dtype)
