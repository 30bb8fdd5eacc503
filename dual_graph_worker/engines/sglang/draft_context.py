"""The contexts every draft forward runs in: the draft's TP group and SGLang's speculative MoE
backends (EAGLE's own draft steps enter the same three)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from sglang.srt.layers.moe.utils import (
    speculative_moe_a2a_backend_context,
    speculative_moe_backend_context,
)


@contextmanager
def in_draft(dw: Any) -> Iterator[None]:
    """Runs the block as draft worker `dw`'s forward: its TP group, the speculative MoE backends."""
    with (dw.draft_tp_context(dw.draft_runner.tp_group), speculative_moe_backend_context(),
          speculative_moe_a2a_backend_context()):
        yield
