"""Lazy catch-up: making room in the stash without draft work (compactions).

Engine-agnostic (torch and numpy, no SGLang), so the CPU simulation in tests/test_sglang_lazy.py
drives exactly this code. backlog.py decides (plan_room); this moves the cells: the live ones,
a running batch's backlogs and the pending chunked prompts', go to the arena's front in their
order (catch_up.StashArena.compact), and the host cursor restarts after them.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from dual_graph_worker.engines.sglang.backlog import Behind, LazyBacklog, RoomAction
from dual_graph_worker.engines.sglang.catch_up import StashArena, backlog_slots, to_device


def pending_slots(backlog: LazyBacklog, req_to_token: torch.Tensor, rows: np.ndarray,
                  device) -> Optional[torch.Tensor]:
    """KV slots of the pending chunked prompts' backlogs (rows outside `rows`), or None."""
    pend = backlog.pending(exclude=rows)
    if pend.rows.size == 0:
        return None
    rows_d, ends_d = to_device(np.stack([pend.rows, pend.ends]), device).unbind(0)
    return backlog_slots(req_pool_indices=rows_d, ends=ends_d, counts=pend.counts,
                         req_to_token=req_to_token)


def compact(arena: StashArena, backlog: LazyBacklog, req_to_token: torch.Tensor,
            rows: np.ndarray, behind: Behind, *, req_pool_indices: torch.Tensor,
            seq_lens: torch.Tensor) -> list:
    """Keep the running batch's backlogs (`rows` in batch order, `behind` of them, on the
    device `req_pool_indices` / committed `seq_lens`) and the pending prompts'; drop the rest.
    Returns the index tensors to keep alive until the step's kernels ran."""
    device = seq_lens.device
    parts = []
    if behind.positions.size:
        sel = to_device(behind.positions, device)
        parts.append(backlog_slots(req_pool_indices=req_pool_indices[sel],
                                   ends=seq_lens[sel], counts=behind.counts,
                                   req_to_token=req_to_token))
    pend = pending_slots(backlog, req_to_token, rows, device)
    if pend is not None:
        parts.append(pend)
    live = torch.cat(parts) if parts else None
    moved = 0 if live is None else arena.compact(live)
    cursor = backlog.compacted(rows)
    if moved != cursor:
        raise RuntimeError(f"stash compaction moved {moved} cells, the backlog counts {cursor}")
    return [] if live is None else [live]


def front_pending(arena: StashArena, backlog: LazyBacklog, req_to_token: torch.Tensor,
                  rows: np.ndarray, device) -> list:
    """After a catch-up of `rows` (backlog.caught_up restarted the cursor after the pending
    cells): move those cells to the front, where the cursor assumes them."""
    slots = pending_slots(backlog, req_to_token, rows, device)
    if slots is None:
        return []
    moved = arena.compact(slots)
    if moved != backlog.cursor:
        raise RuntimeError(f"pending chunked prompts hold {moved} stash cells, the backlog "
                           f"counts {backlog.cursor}")
    return [slots]


class Room(NamedTuple):
    """What make_room did, and the tensors to keep alive until the step's kernels ran."""

    action: RoomAction
    keep_alive: list
    caught_up_tokens: int = 0        # a forced catch-up's draft tokens


def make_room(arena: StashArena, backlog: LazyBacklog, req_to_token: torch.Tensor,
              rows: np.ndarray, *, reserve: int, req_pool_indices: torch.Tensor,
              seq_lens: torch.Tensor, catch_up: Callable[[Behind], list]) -> Room:
    """Before a lazy decode step over the running batch (`rows`, device `req_pool_indices` and
    committed `seq_lens`): nothing, a compaction, or (the live backlog does not fit) the
    caller's forced `catch_up` of the batch rows that are behind."""
    action = backlog.plan_room(rows, rows.shape[0], reserve=reserve)
    if action is RoomAction.NONE:
        return Room(action, [])
    behind = backlog.behind(rows)
    if action is RoomAction.COMPACT or behind.positions.size == 0:
        return Room(RoomAction.COMPACT,
                    compact(arena, backlog, req_to_token, rows, behind,
                            req_pool_indices=req_pool_indices, seq_lens=seq_lens))
    return Room(action, catch_up(behind), int(behind.counts.sum()))
