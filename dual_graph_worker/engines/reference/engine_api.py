"""What the engine-agnostic worker needs from an engine (the reference engine implements it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence

import numpy as np
import torch

from dual_graph_worker.engines.reference.attention import AttnBatch
from dual_graph_worker.engines.reference.buffers import StaticInputs
from dual_graph_worker.core.modes import Stage

# One stage at a padded batch size: reads the static inputs, writes static outputs and the
# engine's per-request state. Only device ops on static storage, so it can be captured.
StageFn = Callable[[int], None]


class PrefillMode(enum.Enum):
    WITH_DRAFT = "with-draft"       # target, then the draft's extend over the prompt
    DEFERRED = "deferred"           # target alone, its features stashed for a catch-up from 0
    TARGET_ONLY = "target-only"     # target alone: a worker that keeps no draft state


@dataclass(frozen=True)
class EngineLimits:
    num_slots: int          # KV token slots (slot 0 is padding)
    max_requests: int       # request-table rows (row 0 is padding)
    max_context: int        # positions per request
    num_draft_tokens: int   # K


@dataclass(frozen=True)
class EngineDescription:
    """What an engine is, for NVTX config marks, reports and capture configs."""

    engine: str
    attention_backend: str
    dtype: str
    device: str
    weights: str
    num_draft_tokens: int
    acceptance: str
    model: Mapping[str, Any]


class DecodeOutput(NamedTuple):
    """What a decode stage hands its continuity strategy: the emitted tokens and the target's
    features at their positions. Device tensors only: the strategy's share is captured too."""

    rows: torch.Tensor        # [P] request-table rows
    tokens: torch.Tensor      # [P] the token each row emitted
    features: torch.Tensor    # [P, aux] the target's captured-layer features
    positions: torch.Tensor   # [P]
    slots: torch.Tensor       # [P] the KV slots the target wrote
    batch: AttnBatch


class StageContinuity(Protocol):
    """A continuity strategy's part in the engine's graph stages (bound once, before capture)."""

    def in_decode_graph(self, engine: Engine, out: DecodeOutput) -> None:
        """The draft work a decode step carries, inside its graph."""


class Engine(Protocol):
    limits: EngineLimits
    device: torch.device
    vocab_size: int         # the target's: token ids a request may hold lie below it

    def bind(self, bufs: StaticInputs, continuity: StageContinuity,
             max_spec_bs: int) -> Mapping[Stage, StageFn]:
        """Build the stage functions over `bufs` (called once, before capture)."""

    def draft_decoded(self, out: DecodeOutput) -> None:
        """Keep-current: the draft's one-token extend over a decode step's tokens."""

    def ensure_stash(self) -> None:
        """Lazy: the slot-indexed feature stash stash_features fills, made once."""

    def stash_features(self, out: DecodeOutput) -> None:
        """Lazy: keep a decode step's target features by KV slot, for catch_up."""

    def prefill(self, rows: np.ndarray, prompts: Sequence[np.ndarray],
                slots: Sequence[np.ndarray], mode: PrefillMode) -> np.ndarray:
        """Eager extend of whole prompts; returns the first token of each."""

    def catch_up(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                 tokens: np.ndarray, slots: np.ndarray) -> None:
        """Lazy continuity: draft extend over positions [start, end) of each row, from stashed
        target features. tokens/slots are the host mirrors [rows, ...] of those requests."""

    def save_rows(self, rows: torch.Tensor) -> None:
        """Keep a copy of device `rows`' per-request state (what a step moves on)."""

    def restore_rows(self, rows: torch.Tensor) -> None:
        """Put back what save_rows kept."""

    def fill_synthetic_context(self, rows: np.ndarray, context_len: int,
                               slots: np.ndarray) -> None:
        """Calibration: give `rows` a context of `context_len` tokens in `slots`."""

    def describe(self) -> EngineDescription: ...
