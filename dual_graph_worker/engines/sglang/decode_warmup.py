"""Build, at start-up, the kernels SGLang compiles on the first plain decode step.

SGLang 0.5.17 compiles some small CUDA kernels at their first call (``sglang.kernels.jit``:
tvm-ffi ``load_inline``, ninja + nvcc) and caches the result on disk (~/.cache/tvm-ffi). Its
capture and warm-up build the ones a server's own path needs, but a decode step calls one that
no speculative step does: ``ForwardBatch.init_new`` computes a DECODE batch's positions with
``clamp_position`` (forward_batch_info.py:902-904), while TARGET_VERIFY takes them from
spec_info. A plain server builds it on its warm-up request; this worker's warm-up request
speculates, so its first decode-mode step built it under load: on a fresh H200 the scheduler
stood still for 8.4 s inside that build, with 128 requests waiting
(results/sglang/stall15: the stall watch's stack and the tvm-ffi cache's timestamps).

So the worker calls it once while it starts, on the dtype a decode step passes (ScheduleBatch
holds seq_lens as int64, schedule_batch.py:2215; the decode view keeps that dtype). On a machine
whose cache already holds the kernel this is one small launch.
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
