"""Keep-current's one-token draft extend, replayed from CUDA graphs of width 1.

The first GPU run ran the decode-mode draft extend eagerly (draft_sync.py) and lost ~11% of
decode-mode throughput to plain SGLang at bs >= 64: one draft layer is little GPU work, but its
eager launches are not. EAGLE-3's own draft-extend graphs cannot serve a decode step: they are
captured at width K+1 (num_draft_tokens rows a request) and ``can_run_graph`` refuses a batch of
another width (eagle_draft_extend_cuda_graph_runner.py:280-292). So this module captures a second
set of DRAFT_EXTEND_V2 graphs at width 1, for the decode pool's batch sizes, into the same
process-wide graph memory pool (FullCudaGraphBackend takes the global pool), after every other
capture. It composes SGLang's runner rather than copying it:

- ``captured_req_width`` and ``capture_bs`` are pinned (pinned_attr.py): the values
  ``EAGLEDraftExtendCudaGraphRunner.__init__`` derives are ignored (num_draft_tokens from the pristine
  server_args, and the speculative batch list), so its buffers, backend state and capture loop
  are all sized for width 1 and the decode pool's list (the decode pool's trick, decode_pool.py);
- a private draft-extend attention backend from SGLang's own DraftBackendFactory, built while
  ``speculative_num_draft_tokens`` reads 1 (backends read the width once at init, e.g.
  triton_backend.py:171, and use it for the graph's qo layout, :540-570 and :1137-1150).
  Calling ``init_cuda_graph_state`` on EAGLE-3's draft-extend backend instead would replace the
  buffers its width-K+1 graphs captured (map trap 7). The width is restored before any step runs.

Replay goes through the runner's own ``execute`` (it pads the batch, refreshes the static inputs
and the backend's metadata outside the graph, publishes the WAR read-done event), so the decode
step calls it exactly as ``_draft_extend_for_decode`` calls EAGLE-3's runner
(eagle_worker_v2.py:900-932).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

from sglang.srt.runtime_context import get_context, get_spec
from sglang.srt.speculative.draft_utils import DraftBackendFactory
from sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner import (
    EAGLEDraftExtendCudaGraphRunner,
)
from dual_graph_worker.engines.sglang.decode_pool import measured_capture
from dual_graph_worker.engines.sglang.pinned_attr import Pinned

logger = logging.getLogger(__name__)

DECODE_WIDTH = 1     # one token a request: the token the decode step just committed


class OneTokenDraftExtendRunner(EAGLEDraftExtendCudaGraphRunner):
    """EAGLE-3's draft-extend graph runner, captured at width 1 for the decode pool's sizes."""

    def __init__(self, draft_worker: Any, *, attn_backend: Any,
                 capture_bs: Sequence[int]) -> None:
        self._pool_bs = sorted(set(int(b) for b in capture_bs))
        super().__init__(draft_worker, draft_extend_attn_backend=attn_backend)

    captured_req_width = Pinned(lambda self: DECODE_WIDTH)
    capture_bs = Pinned(lambda self: self._pool_bs)


@dataclass
class DraftSyncGraphs:
    """The width-1 draft-extend graphs (runner None: not captured; the draft extend runs
    eagerly, as with DGW_DRAFT_EXTEND_GRAPHS=0 or when graphs are disabled)."""

    runner: Optional[OneTokenDraftExtendRunner]
    capture_bs: tuple[int, ...] = ()
    capture_time_s: float = 0.0
    memory_gb: float = 0.0


@contextlib.contextmanager
def draft_width(width: int) -> Iterator[None]:
    """``speculative_num_draft_tokens`` reads `width` inside, its own value again after.

    RuntimeContext.override writes the config bag SGLang's components read (get_spec()), the
    same primitive EAGLE's adaptive capture uses (eagle_worker_v2.py:1424-1490).
    """
    saved = get_spec().speculative_num_draft_tokens
    get_context().override("dual-graph.draft_sync_capture", speculative_num_draft_tokens=width)
    try:
        yield
    finally:
        get_context().override("dual-graph.draft_sync_restore",
                               speculative_num_draft_tokens=saved)


def build_draft_sync_graphs(draft_worker: Any, server_args: Any,
                            capture_bs: Sequence[int]) -> DraftSyncGraphs:
    """Capture the width-1 draft-extend graphs (call after every other capture, inside the
    draft worker's TP/MoE contexts)."""
    dw = draft_worker

    def capture() -> OneTokenDraftExtendRunner:
        with draft_width(DECODE_WIDTH):
            factory = DraftBackendFactory(server_args, dw.draft_runner, dw.topk,
                                          dw.speculative_num_steps,
                                          seed_dsa_topk_from_draft_extend=False)
            return OneTokenDraftExtendRunner(dw, attn_backend=factory.create_draft_extend_backend(),
                                             capture_bs=capture_bs)

    runner, cost = measured_capture(dw.draft_runner, capture)
    logger.info("dual-graph: captured one-token draft-extend graphs bs=%s in %.2f s, %.3f GB",
                runner.capture_bs, cost.seconds, cost.memory_gb)
    return DraftSyncGraphs(runner, tuple(runner.capture_bs), cost.seconds, cost.memory_gb)
