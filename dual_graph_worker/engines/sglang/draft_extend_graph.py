"""Keep-current's one-token draft extend, replayed from CUDA graphs of width 1.

EAGLE-3's own draft-extend graphs are captured at width K+1 and refuse any other width, so this
composes SGLang's ``EAGLEDraftExtendCudaGraphRunner`` with a pinned width of 1 and the decode
pool's batch sizes, a private draft-extend backend built while the width reads 1, and SGLang's
own ``execute`` for replay. Captured last, into the shared graph pool. docs/sglang-0.5.17.md §7.
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
