"""Lazy catch-up: sizing the stash at start-up, and what the sizes leave off.

`plan_stash` is a function of the sizes LazyCatchUp reads off SGLang's runners, so CPU tests
check its numbers and refusals (tests/test_sglang_stash_plan.py). Its one collective makes every
TP rank take the smallest rank's cell count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from dual_graph_worker.core.batch_costs import passes_too_short
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.engines.sglang.catch_up import StashArena
from dual_graph_worker.engines.sglang.kv_fill import KV_ONLY_MIN_TOKENS
from dual_graph_worker.engines.sglang.radix import BACKEND as RADIX_BACKEND
from dual_graph_worker.engines.sglang.worker_startup import tp_min

MiB = 1 << 20
DEFAULT_MAX_PASS_TOKENS = 8192
# DGW_LAZY_STASH_MB=0 (auto): this share of the GPU memory free after every capture. The rest
# stays for SGLang's activations (a prefill chunk's MLP and the FULL aux capture of its tokens).
AUTO_STASH_SHARE = 0.4


@dataclass(frozen=True)
class StashPlan:
    cells: int                          # stash cells (stashed tokens), the same on every rank
    need_bytes: int                     # the cells and the KV-slot -> cell map
    max_pass_tokens: int                # a catch-up pass's tokens (chunked_prefill_size)
    defer_prefill_off: Optional[str]    # why prefills are not deferred; None: they are
    kv_only_off: Optional[str]          # why K/V-only catch-ups are off; None: on

    @property
    def prefill_reserve(self) -> int:
        """Cells kept free for the next deferred prefill: one pass's worth while deferring."""
        return 0 if self.defer_prefill_off else self.max_pass_tokens

    @property
    def kv_only_min_tokens(self) -> int:
        """A pass is split (its K/V filled alone) from this many tokens."""
        return KV_ONLY_MIN_TOKENS


def plan_stash(*, stash_mb: int, free_bytes: Optional[int], rows: int, slots: int,
               aux_width: int, aux_dtype: torch.dtype, server_args: Any, draft_hidden: tuple,
               defer_prefill: bool, kv_only: bool, kv_fill_blocker: Optional[str],
               tp_group: Any = None) -> StashPlan:
    """The stash of DGW_LAZY_STASH_MB `stash_mb` for `rows` request-pool rows and `slots` KV
    slots (`free_bytes` free on the GPU, None without one), and what it leaves on:
    `kv_fill_blocker` is why the draft's K/V cannot be filled alone (kv_fill_unavailable)."""
    cells, need_bytes = _cells(stash_mb, free_bytes, rows=rows, slots=slots, aux_width=aux_width,
                               aux_dtype=aux_dtype, tp_group=tp_group)
    chunk = getattr(server_args, "chunked_prefill_size", None)
    max_pass_tokens = int(chunk) if chunk and int(chunk) > 0 else DEFAULT_MAX_PASS_TOKENS
    defer_off = _why_not_defer_prefills(defer_prefill, server_args, cells=cells, rows=rows,
                                        reserve=max_pass_tokens, draft_hidden=draft_hidden)
    kv_only_off = (kv_fill_blocker or _passes_too_short(
        max_pass_tokens, KV_ONLY_MIN_TOKENS)) if kv_only else "off"
    return StashPlan(cells, need_bytes, max_pass_tokens, defer_off, kv_only_off)


def _cells(stash_mb: int, free: Optional[int], *, rows: int, slots: int, aux_width: int,
           aux_dtype: torch.dtype, tp_group: Any) -> tuple[int, int]:
    """The stash's cells and the bytes they and the slot map take; ConfigError if too few
    for one decode step or too many for the memory free."""
    per_cell = StashArena.cell_bytes(aux_width, aux_dtype)
    slot_map_bytes = slots * StashArena.SLOT_BYTES
    cells = _stash_budget(stash_mb, free, slot_map_bytes=slot_map_bytes) // per_cell
    cells = min(cells, slots)           # more cells than KV slots are never in use
    cells = _same_on_every_rank(cells, tp_group)
    if cells < rows:
        need = -(-rows * per_cell // MiB)
        raise ConfigError(f"DGW_LAZY_STASH_MB={stash_mb} holds {cells} stashed tokens of "
                          f"{aux_width} x {aux_dtype} features, fewer than the "
                          f"{rows} request-pool rows one decode step may need; set "
                          f"DGW_LAZY_STASH_MB >= {need}")
    need_bytes = cells * per_cell + slot_map_bytes
    if free is not None and need_bytes > free // 2:
        raise ConfigError(f"the lazy-catch-up stash needs {need_bytes / MiB:.0f} MiB "
                          f"but only {free / MiB:.0f} MiB are free after start-up; "
                          "lower DGW_LAZY_STASH_MB or --mem-fraction-static, or use "
                          "DGW_CONTINUITY=keep-current")
    return cells, need_bytes


def _stash_budget(stash_mb: int, free_bytes: Optional[int], *, slot_map_bytes: int) -> int:
    """Bytes for the stash's cells: DGW_LAZY_STASH_MB, or (0) AUTO_STASH_SHARE of the memory
    free now, less the KV-slot map; 1 GiB where there is no GPU to ask."""
    if stash_mb > 0:
        return int(stash_mb) * MiB
    if free_bytes is None:
        return 1024 * MiB
    return max(int(free_bytes * AUTO_STASH_SHARE) - int(slot_map_bytes), 0)


def _same_on_every_rank(cells: int, tp_group: Any) -> int:
    """The smallest TP rank's stash size, on every rank. The auto size follows each rank's free
    memory, but every rank must make the same room / deferral / catch-up decisions: a catch-up
    is a draft forward with collectives, and a rank that skipped it would hang the others."""
    return tp_min(tp_group, cells)


def _why_not_defer_prefills(enabled: bool, server_args: Any, *, cells: int, rows: int,
                            reserve: int, draft_hidden) -> Optional[str]:
    """None when prefills may be deferred, else why not (logged at start-up)."""
    if not enabled:
        return "off (DGW_DEFER_DRAFT_PREFILL=0)"
    if not getattr(server_args, "disable_radix_cache", False) and \
            getattr(server_args, "radix_cache_backend", None) != RADIX_BACKEND:
        return (f"off: the radix cache backend {server_args.radix_cache_backend!r} may cache "
                "prefixes without draft KV; leave --radix-cache-backend unset (the worker then "
                f"uses {RADIX_BACKEND!r}) or pass --disable-radix-cache")
    if draft_hidden[0] is None:
        return "off: the draft carries no hidden state (STANDALONE)"
    if cells < rows + reserve:
        return (f"off: the stash ({cells} tokens) cannot hold a decode step of {rows} rows "
                f"plus one prefill chunk of {reserve}; raise DGW_LAZY_STASH_MB")
    return None


def _passes_too_short(max_pass_tokens: int, split_from: int) -> Optional[str]:
    why = passes_too_short(max_pass_tokens, split_from)
    return None if why is None else f"{why} (SGLang's chunked_prefill_size)"
