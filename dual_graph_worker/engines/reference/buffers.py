"""Static inputs and outputs shared by every graph of both pools.

Allocated once, sized for the larger of the two shapes (spec: B_spec x (K+1) tokens; decode:
B_max x 1), so a graph of either pool reads the same storage and a mode switch moves no data.
The three per-step inputs (request rows, sequence lengths, out_cache_loc) live in ONE packed
device tensor filled from ONE pinned host staging tensor: a step costs one H2D copy. The outputs
(tokens in the speculative layout, accept lengths) likewise come back in one D2H copy.
Padding rows point at request row 0, length 0 and KV slot 0, which no real request owns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dual_graph_worker.engines.reference.kv_slots import DUMMY_SLOT

DUMMY_ROW = 0


@dataclass(frozen=True)
class BufferSizes:
    max_bs: int          # rows: max over both pools and the eager batch limit
    max_tokens: int      # tokens: max(B_spec * (K+1), max_bs)
    stride: int          # K + 1: the speculative layout's stride, in both modes

    @classmethod
    def for_pools(cls, max_spec_bs: int, max_decode_bs: int, num_draft_tokens: int,
                  max_eager_bs: int = 0) -> "BufferSizes":
        stride = num_draft_tokens + 1
        max_bs = max(max_spec_bs, max_decode_bs, max_eager_bs, 1)
        return cls(max_bs, max(max_spec_bs * stride, max_bs), stride)


@dataclass
class StaticInputs:
    sizes: BufferSizes
    packed_in: torch.Tensor        # device [2*max_bs + max_tokens] int64
    staging_in: torch.Tensor       # host (pinned on CUDA), same shape
    packed_out: torch.Tensor       # device [max_bs*stride + max_bs] int64
    staging_out: torch.Tensor      # host (pinned on CUDA), same shape
    input_ids: torch.Tensor        # device [max_tokens] int64, written inside the graphs
    positions: torch.Tensor        # device [max_tokens] int64, written inside the graphs

    @classmethod
    def allocate(cls, sizes: BufferSizes, device: torch.device) -> "StaticInputs":
        pin = device.type == "cuda"
        n_in = 2 * sizes.max_bs + sizes.max_tokens
        n_out = sizes.max_bs * sizes.stride + sizes.max_bs
        z = lambda n, dev, pinned=False: torch.zeros(n, dtype=torch.int64, device=dev,
                                                     pin_memory=pinned)
        return cls(sizes, z(n_in, device), z(n_in, "cpu", pin), z(n_out, device),
                   z(n_out, "cpu", pin), z(sizes.max_tokens, device), z(sizes.max_tokens, device))

    # ---- device views the graphs read (fixed storage: graphs capture these addresses)
    @property
    def req_pool_indices(self) -> torch.Tensor:
        return self.packed_in[: self.sizes.max_bs]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.packed_in[self.sizes.max_bs: 2 * self.sizes.max_bs]

    @property
    def out_cache_loc(self) -> torch.Tensor:
        return self.packed_in[2 * self.sizes.max_bs:]

    @property
    def out_tokens(self) -> torch.Tensor:
        s = self.sizes
        return self.packed_out[: s.max_bs * s.stride].view(s.max_bs, s.stride)

    @property
    def accept_lens(self) -> torch.Tensor:
        s = self.sizes
        return self.packed_out[s.max_bs * s.stride:]

    # ---- host side
    def stage(self, rows: np.ndarray, seq_lens: np.ndarray, slots: np.ndarray, padded_bs: int) -> None:
        """Write one step's inputs into the host staging tensor; rows past len(rows) are padding."""
        s, bs, width = self.sizes, len(rows), slots.shape[1]
        host = self.staging_in.numpy()
        host[:bs] = rows
        host[bs:padded_bs] = DUMMY_ROW
        host[s.max_bs: s.max_bs + bs] = seq_lens
        host[s.max_bs + bs: s.max_bs + padded_bs] = 0
        loc = host[2 * s.max_bs:]
        loc[: bs * width] = slots.reshape(-1)
        loc[bs * width: padded_bs * width] = DUMMY_SLOT

    def upload(self) -> None:
        self.packed_in.copy_(self.staging_in, non_blocking=True)

    def download(self) -> tuple[np.ndarray, np.ndarray]:
        """Copy outputs back and wait for them: (tokens [max_bs, stride], accept_lens [max_bs])."""
        self.staging_out.copy_(self.packed_out, non_blocking=True)
        if self.packed_out.is_cuda:
            torch.cuda.current_stream().synchronize()
        s, host = self.sizes, self.staging_out.numpy()
        return host[: s.max_bs * s.stride].reshape(s.max_bs, s.stride), host[s.max_bs * s.stride:]
