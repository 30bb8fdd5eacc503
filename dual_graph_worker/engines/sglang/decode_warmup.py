"""Build, at start-up, the kernels SGLang compiles on the first plain decode step.

SGLang JIT-builds ``clamp_position`` (DECODE positions) on first call; a plain server does so on
its warm-up request, but this worker's warm-up speculates, so its first decode-mode step would
build it under load with the scheduler stalled. docs/sglang-0.5.17.md §12.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

# The dtype of ScheduleBatch.seq_lens, hence of a decode step's positions input.
DECODE_SEQ_LENS_DTYPE = torch.int64


def warm_decode_positions(device: torch.device | str,
                          clamp_position: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                          ) -> torch.Tensor:
    """Run the decode path's ``clamp_position`` once on `device` (building it if SGLang JITs it)
    and return its output for [1, 2]: [0, 1]."""
    if clamp_position is None:
        from sglang.srt.model_executor import forward_batch_info
        clamp_position = forward_batch_info.clamp_position
    seq_lens = torch.tensor([1, 2], dtype=DECODE_SEQ_LENS_DTYPE, device=device)
    return clamp_position(seq_lens)
