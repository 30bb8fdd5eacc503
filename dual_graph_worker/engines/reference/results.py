"""What the reference worker hands back: a step's tokens in the speculative layout, a prefill's
first tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dual_graph_worker.core.results import StepRecord


@dataclass(frozen=True)
class StepResult:
    """The speculative layout, whatever mode ran: request i's tokens are
    `token_ids[i * stride : i * stride + accept_lens[i]]`, stride = K + 1 in both modes.
    A decode-mode step reports accept length 1 (only column 0 is meaningful)."""

    token_ids: torch.Tensor     # [bs * stride] int64, on the host
    accept_lens: torch.Tensor   # [bs] int32, on the host
    stride: int
    rids: tuple[int, ...]
    finished: tuple[int, ...]   # rids that finished in this step (EOS or max tokens)
    record: StepRecord

    def tokens_for(self, i: int) -> list[int]:
        n = int(self.accept_lens[i])
        return self.token_ids[i * self.stride: i * self.stride + n].tolist()

    def per_request(self) -> dict[int, list[int]]:
        return {rid: self.tokens_for(i) for i, rid in enumerate(self.rids)}


@dataclass(frozen=True)
class PrefillResult:
    rids: tuple[int, ...]
    first_tokens: tuple[int, ...]
    finished: tuple[int, ...]
