"""Attention backends as a config chooses them: each checks that the device and the models'
head widths suit it, then makes the backend. The Triton kernel is imported only when chosen, so
a machine without Triton (or without a GPU) can still name and refuse it."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Protocol, Sequence

import torch

from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.engines.reference.attention import AttentionBackend, TorchPagedAttention


class AttentionChoice(Protocol):
    def build(self, device: torch.device, head_dims: Sequence[int]) -> AttentionBackend:
        """The backend for models of `head_dims` on `device`, or ConfigError saying what fits."""


@dataclass(frozen=True)
class TorchAttention:
    def build(self, device: torch.device, head_dims: Sequence[int]) -> AttentionBackend:
        return TorchPagedAttention()


@dataclass(frozen=True)
class TritonAttention:
    def build(self, device: torch.device, head_dims: Sequence[int]) -> AttentionBackend:
        if device.type != "cuda":
            raise ConfigError("attention backend 'triton' needs a CUDA device; use 'torch' on CPU")
        # tl.arange over the head and tl.dot need a power of two of at least 16.
        odd = sorted({d for d in head_dims if d < 16 or d & (d - 1)})
        if odd:
            raise ConfigError(f"the triton attention needs head widths that are powers of two "
                              f">= 16, got {odd}; for the toy model pick --hidden 64, 128 or 256 "
                              "(head width hidden / 4), or run on --device cpu")
        from dual_graph_worker.engines.reference.attention_triton import TritonPagedAttention
        return TritonPagedAttention()


# The attention backends EngineSpec.attention may name.
ATTENTION_BACKENDS: Mapping[str, AttentionChoice] = MappingProxyType(
    {"torch": TorchAttention(), "triton": TritonAttention()})


def default_attention(device: str) -> str:
    """The backend a device runs best: Triton on CUDA, torch elsewhere."""
    return "triton" if device.startswith("cuda") else "torch"
