"""The decode pool: a second target CUDA-graph runner in plain DECODE mode, width 1.

Captured after the EAGLE-3 graphs into the same process-wide graph memory pool, with its own
attention backend, and swapped into the target ModelRunner's runner slot for one forward.
docs/sglang-0.5.17.md §3 gives the SGLang contracts (width, mode, batch list, shared logits
buffer, dispatch).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, TypeVar

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.model_executor.graph_shared_output import GraphSharedOutput
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import (
    get_available_gpu_memory,
    get_cuda_graph_batch_size_alignment,
    get_cuda_graph_max_batch_size,
)

from dual_graph_worker.engines.sglang.pinned_attr import Pinned
from dual_graph_worker.engines.sglang.server_args_hook import (
    fit_to_request_pool,
    plain_decode_batch_sizes,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


def plan_decode_batch_sizes(model_runner: Any, decode_max_bs: Optional[int],
                            sizes: Optional[Sequence[int]] = None) -> list[int]:
    """The decode capture list fitted to the request pool: `sizes` (a tuned capture config's
    list) or, by default, the plain server's list up to the decode max."""
    sa = model_runner.server_args
    if sizes is None:
        max_bs = decode_max_bs or sa.cuda_graph_config.decode.max_bs
        sizes = plain_decode_batch_sizes(ServerArgs._generate_decode_cuda_graph_batch_sizes,
                                         max_bs=max_bs,
                                         disable_cuda_graph_padding=sa.disable_cuda_graph_padding)
    return fit_to_server_request_pool(model_runner, sizes)


def fit_to_server_request_pool(model_runner: Any, sizes: Sequence[int]) -> list[int]:
    """`sizes` clamped to this server's request pool and attention-TP alignment, as SGLang's
    get_batch_sizes_to_capture clamps its own lists."""
    sa = model_runner.server_args
    return fit_to_request_pool(
        sizes,
        max_requests=get_cuda_graph_max_batch_size(sa, model_runner.req_to_token_pool.size),
        alignment=get_cuda_graph_batch_size_alignment(sa))


def ensure_shared_logits_rows(model_runner: Any, rows: int) -> int:
    """Make the process-wide logits buffer hold `rows` rows before any runner captures, and
    return the rows installed: it is sized for the verify graphs alone, and one replaced after
    their capture would strand them (docs/sglang-0.5.17.md §3, shared logits buffer)."""
    need = max(int(rows), int(model_runner.max_decode_logits_rows()))
    import torch

    device = torch.device(model_runner.device)
    current = GraphSharedOutput._process_shared
    if current is None or current.device != device or current.max_rows < need:
        # No public setter exists in 0.5.17; this is the singleton create_for_model_runner reads.
        GraphSharedOutput._process_shared = GraphSharedOutput(device=device, max_rows=need)
    return GraphSharedOutput._process_shared.max_rows


class DecodeModeCudaGraphRunner(DecodeCudaGraphRunner):
    """DecodeCudaGraphRunner capturing plain DECODE graphs (width 1) for the decode pool."""

    def __init__(self, model_runner: Any, *, attn_backend: Any,
                 capture_bs: Sequence[int]) -> None:
        self._decode_pool_bs = sorted(set(int(b) for b in capture_bs))
        super().__init__(model_runner, attn_backend=attn_backend,
                         speculative_num_draft_tokens=1)

    # DecodeCudaGraphRunner.__init__ assigns ``self.capture_bs, self.compile_bs`` from the
    # speculative list (get_batch_sizes_to_capture reads cuda_graph_config.decode.bs) and
    # captures inside __init__, so the pool's own list is pinned (pinned_attr.py). Everything
    # downstream (max_bs, buffer sizes, init_cuda_graph_state, the capture loop, _pad_to_bucket)
    # then sees the decode list.
    capture_bs = Pinned(lambda self: self._decode_pool_bs)
    compile_bs = Pinned(lambda self: self._compile_bs())

    def _compile_bs(self) -> list[int]:
        if not getattr(self, "enable_torch_compile", False):
            return []
        cap = self.model_runner.server_args.torch_compile_max_bs
        return [b for b in self._decode_pool_bs if b <= cap]

    def capture(self) -> None:
        self.capture_forward_mode = ForwardMode.DECODE
        self.capture_hidden_mode = max(self.capture_hidden_mode, CaptureHiddenMode.FULL)
        super().capture()

    def get_spec_info(self, num_tokens: int):
        return None


@dataclass
class DecodePool:
    """The decode pool's runner and attention backend (runner None: CUDA graphs disabled, decode
    steps run eagerly on the verify backend)."""

    runner: Optional[DecodeModeCudaGraphRunner]
    attn_backend: Any
    capture_bs: tuple[int, ...]
    capture_time_s: float = 0.0
    memory_gb: float = 0.0

    @contextlib.contextmanager
    def installed(self, model_runner: Any) -> Iterator[None]:
        """Install this pool in the target ModelRunner's runner and attention-backend slots
        for one forward: SGLang replays whatever runner sits there without comparing modes.
        What was there on entry is restored, a runner SGLang re-captured meanwhile included
        (docs/sglang-0.5.17.md §3, dispatch)."""
        saved = (model_runner.decode_cuda_graph_runner, model_runner.attn_backend)
        model_runner.decode_cuda_graph_runner = self.runner
        if self.attn_backend is not None:
            model_runner.attn_backend = self.attn_backend
        try:
            yield
        finally:
            model_runner.decode_cuda_graph_runner, model_runner.attn_backend = saved


def build_decode_pool(model_runner: Any, capture_bs: Sequence[int]) -> DecodePool:
    """Capture the decode pool (call after the EAGLE-3 graphs exist)."""
    backup = model_runner.init_new_workspace
    try:
        backend = model_runner._get_attention_backend(init_new_workspace=True)
    finally:
        model_runner.init_new_workspace = backup
    runner, cost = measured_capture(
        model_runner, lambda: DecodeModeCudaGraphRunner(model_runner, attn_backend=backend,
                                                        capture_bs=capture_bs))
    logger.info("dual-graph: captured decode pool bs=%s in %.2f s, %.3f GB",
                runner.capture_bs, cost.seconds, cost.memory_gb)
    return DecodePool(runner, backend, tuple(runner.capture_bs), cost.seconds, cost.memory_gb)


class CaptureCost(NamedTuple):
    seconds: float
    memory_gb: float      # device memory the capture took (SGLang's own before/after measure)


def measured_capture(model_runner: Any, capture: Callable[[], T]) -> tuple[T, CaptureCost]:
    """Run `capture` (a graph runner's constructor, which captures) and what it cost, measured
    the way SGLang reports its own graph pools (free device memory before and after)."""
    before = get_available_gpu_memory(model_runner.device, model_runner.gpu_id)
    tic = time.perf_counter()
    value = capture()
    elapsed = time.perf_counter() - tic
    return value, CaptureCost(
        elapsed, before - get_available_gpu_memory(model_runner.device, model_runner.gpu_id))


def eager_decode_pool() -> DecodePool:
    """No decode graphs: decode steps run eagerly (runner slot emptied for the forward)."""
    return DecodePool(runner=None, attn_backend=None, capture_bs=())


def graph_replay(runner: Any, bs: int) -> Optional[Callable[[], None]]:
    """A zero-argument replay of `runner`'s captured graph for `bs` (for calibration), or None.

    FullCudaGraphBackend.replay ignores the forward batch and replays with whatever the static
    buffers hold: at start-up that is capture-time content (in-range indices, seq_len fill
    values), which is what capture's own warm-up forwards ran on.
    """
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import (
        FullCudaGraphBackend,
    )

    backend = getattr(runner, "backend", None)
    if not isinstance(backend, FullCudaGraphBackend):
        return None
    key = runner._make_graph_key(bs)
    if not backend.can_run(None, key):
        return None
    return lambda: backend.replay(key, None)
