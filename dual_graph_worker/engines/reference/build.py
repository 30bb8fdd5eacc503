"""Constructing a reference engine from dummy weights, toy checkpoints or HF folders."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Optional

import torch

from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.engines.reference.attention_choice import (ATTENTION_BACKENDS,
                                                                  AttentionChoice)
from dual_graph_worker.engines.reference.config import ModelPair
from dual_graph_worker.engines.reference.engine import ReferenceEngine
from dual_graph_worker.engines.reference.weights import dummy_weights, load_draft, load_target

DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
     "float16": torch.float16})


@dataclass(frozen=True)
class EngineSpec:
    """Cache sizes, device, dtype, attention backend and dummy-weight seed of one engine."""

    num_draft_tokens: int = 3
    max_requests: int = 64
    max_context: int = 512
    num_slots: int = 0               # 0: enough for max_requests full contexts
    device: str = "cpu"
    dtype: str = "float32"
    attention: str = "torch"
    seed: int = 0
    forced_accept_len: Optional[int] = None   # benchmarks on dummy weights only

    def torch_dtype(self):
        return DTYPES[self.dtype]

    def attention_choice(self) -> AttentionChoice:
        if self.attention not in ATTENTION_BACKENDS:
            raise ConfigError(f"unknown attention backend '{self.attention}'; choose "
                              + " or ".join(f"'{name}'" for name in ATTENTION_BACKENDS))
        return ATTENTION_BACKENDS[self.attention]

    def slots(self) -> int:
        return self.num_slots or self.max_requests * self.max_context + 1


def engine_from_dummy(pair: ModelPair, spec: EngineSpec) -> ReferenceEngine:
    tw, dw = dummy_weights(pair, spec.seed, spec.torch_dtype(), spec.device)
    return _engine(pair, tw, dw, spec, f"dummy-random (seed {spec.seed})")


def engine_from_checkpoints(target_dir: str | Path, draft_dir: str | Path,
                            spec: EngineSpec, note: Optional[str] = None) -> ReferenceEngine:
    tcfg, tw = load_target(target_dir, spec.torch_dtype(), spec.device)
    dcfg, dw = load_draft(draft_dir, spec.torch_dtype(), spec.device)
    pair = ModelPair(tcfg, dcfg)         # raises ConfigError on a mismatched pair
    return _engine(pair, tw, dw, spec, note or f"checkpoint {target_dir} + {draft_dir}")


def _engine(pair, tw, dw, spec: EngineSpec, note: str) -> ReferenceEngine:
    return ReferenceEngine(pair, tw, dw, num_draft_tokens=spec.num_draft_tokens,
                           max_requests=spec.max_requests, max_context=spec.max_context,
                           num_slots=spec.slots(), device=spec.device, dtype=spec.torch_dtype(),
                           attention=spec.attention_choice(), weights_note=note,
                           forced_accept_len=spec.forced_accept_len)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
