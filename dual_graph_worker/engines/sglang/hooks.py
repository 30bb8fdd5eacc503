"""Scheduler facts the worker cannot see from its own calls, through SGLang's HookRegistry.

AFTER hooks on the scheduler: the waiting queue's length at a prefill (the deferral preview),
when each batch's result has been processed (a batch's cost, core/timing.py), and the worker's
counters in ``/get_server_info``. Each acts only for a worker with the matching ``dgw_*`` attribute
and swallows no error, so a failure is loud on every TP rank. docs/sglang-0.5.17.md §1. Beside
them, the request-pool readings the preview combines with the queue's length (expected_batch_size,
held_rows).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

PREFILL_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
RESULT_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
STATE_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"
STATE_KEY = "dual_graph"
QUEUED_ATTR = "dgw_queued_requests"


def _worker_attr(scheduler: Any, name: str) -> Any:
    return getattr(getattr(scheduler, "model_worker", None), name, None)


def annotate_queued_requests(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook: returns None, so SGLang keeps `result`."""
    batch = getattr(result, "batch_to_run", None)
    if batch is not None and _worker_attr(scheduler, "dgw_wants_queue_hint"):
        setattr(batch, QUEUED_ATTR, len(scheduler.waiting_queue))
    return None


def note_result_processed(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook: a batch's result was processed. A PD-disaggregation decode server's prebuilt
    batch never ran on the worker: it is no launch's result, only new requests."""
    batch = args[0] if args else kwargs.get("batch")
    mode = getattr(batch, "forward_mode", None)
    if mode is not None and mode.is_prebuilt():
        joined = _worker_attr(scheduler, "dgw_prebuilt_joined")
        if joined is not None:
            joined(batch)
        return None
    notify = _worker_attr(scheduler, "dgw_result_processed")
    if notify is not None:
        notify()
    return None


def add_internal_state(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook: the worker's counters and controller state in /get_server_info."""
    state = _worker_attr(scheduler, "dgw_internal_state")
    if state is not None and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state[STATE_KEY] = state()
    return None


def expected_batch_size(req_to_token_pool: object, queued: int = 0) -> Optional[int]:
    """The size the running batch grows to once a prefill and the `queued` requests behind it
    have joined: the request rows held (``size - available_size()``) plus `queued`, capped at
    the pool's size (a server's max running requests); None for a pool without that interface.
    A prefill's rows are allocated before the worker runs it, and a finished request's row is
    freed when its result is processed."""
    size = getattr(req_to_token_pool, "size", None)
    available = getattr(req_to_token_pool, "available_size", None)
    if not isinstance(size, int) or not callable(available):
        return None
    return min(max(size - int(available()), 0) + max(int(queued), 0), size)


def held_rows(req_to_token_pool: object, rows: np.ndarray) -> np.ndarray:
    """Those of `rows` the request pool still holds (not in its ``free_slots``): a finished
    request's row is freed when its result is processed, with no decode step since to drop it
    from the running batch the worker last saw. All of `rows` for a pool without that list."""
    free = getattr(req_to_token_pool, "free_slots", None)
    if not isinstance(free, list) or not len(rows):
        return rows
    return rows[~np.isin(rows, free)]


def queued_requests(batch: Any) -> int:
    """The hint `annotate_queued_requests` left on `batch`, 0 when there is none."""
    value = getattr(batch, QUEUED_ATTR, 0)
    return value if isinstance(value, int) and value > 0 else 0


def register_hooks() -> None:
    """Register with SGLang's HookRegistry; load_plugins applies them once every plugin has
    registered (plugin.register calls this once a process)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(PREFILL_TARGET, annotate_queued_requests, HookType.AFTER)
    HookRegistry.register(RESULT_TARGET, note_result_processed, HookType.AFTER)
    HookRegistry.register(STATE_TARGET, add_internal_state, HookType.AFTER)
