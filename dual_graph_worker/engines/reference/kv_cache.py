"""Paged KV storage, SGLang-style: a request -> token-slot table plus per-layer K/V pools.

Slot ids come from dual_graph_worker.engines.reference.kv_slots; the target and draft pools share them. Row 0 of
the request table and slot 0 of each pool belong to padding rows and are never real.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVPool:
    k: torch.Tensor        # [layers, slots, kv_heads, head_dim]
    v: torch.Tensor

    @classmethod
    def allocate(cls, layers: int, slots: int, kv_heads: int, head_dim: int, dtype,
                 device) -> "KVPool":
        shape = (layers, slots, kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, loc, k)
        self.v[layer].index_copy_(0, loc, v)


class ReqToTokenTable:
    """[max_requests, max_context] slot ids; row r, column p = slot of request r's position p."""

    def __init__(self, max_requests: int, max_context: int, device) -> None:
        self.table = torch.zeros(max_requests, max_context, dtype=torch.int64, device=device)

    def write(self, req_rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Scatter `slots` at (req_rows, positions), the three broadcast together (rows [P, 1]
        against positions [P, W]); capturable (no host sync)."""
        self.table.index_put_((req_rows, positions), slots)
