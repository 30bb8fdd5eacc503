"""How many requests are still queued when the worker runs a prefill.

The worker defers a prefill's draft prefill when the running batch the prefill joins will
decode (worker._next_step_decodes). It sees the rows in use, but not the scheduler's waiting
queue. A burst arrives as several prefill batches (one per chunk budget), so the first batch
of a 64-request burst looks like a 32-request batch, and the policy, still speculating at bs 32,
lets it take EAGLE's draft prefill (bench/results/sglang/README.md, bench9 and bench11 at c = 64).

SGLang's plugin hooks (srt/plugins/hook_registry.py; HookRegistry.apply_hooks runs in every
scheduler process, after the plugins registered) carry the missing number: an AFTER hook on
``Scheduler.get_new_batch_prefill`` writes ``len(waiting_queue)`` onto the prefill batch it
returns, after the admitted requests left the queue. It writes only for this worker's
algorithm, never raises into the scheduler, and the worker reads it as 0 when absent. Every TP
rank's scheduler holds the same queue, so every rank sees the same count.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
QUEUED_ATTR = "dgw_queued_requests"


def annotate_queued_requests(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook (``fn(result, *args, **kwargs)``): returns None, so SGLang keeps `result`."""
    try:
        batch = getattr(result, "batch_to_run", None)
        if batch is None or not _is_dual_graph(getattr(batch, "spec_algorithm", None)):
            return None
        setattr(batch, QUEUED_ATTR, len(scheduler.waiting_queue))
    except Exception:       # a hint for the worker; it must never stop the scheduler
        logger.debug("dual-graph: queued-request hint not written", exc_info=True)
    return None


def queued_requests(batch: Any) -> int:
    """The hint `annotate_queued_requests` left on `batch`, 0 when there is none."""
    value = getattr(batch, QUEUED_ATTR, 0)
    return value if isinstance(value, int) and value > 0 else 0


def register_queue_hook() -> None:
    """Register the hook with SGLang's HookRegistry; load_plugins applies it once every plugin
    has registered (plugin.register calls this once a process)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, annotate_queued_requests, HookType.AFTER)


def _is_dual_graph(spec_algorithm: Any) -> bool:
    from dual_graph_worker.engines.sglang.spec_algo import DualGraphEagle3Spec

    return isinstance(spec_algorithm, DualGraphEagle3Spec)
