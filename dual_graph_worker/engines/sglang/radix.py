"""A radix cache that never makes stale draft KV matchable.

Under lazy catch-up a request's last positions can have target KV but no draft KV yet; this
cache inserts only the prefix whose draft KV is valid and lets SGLang free the rest as an
unaligned tail, so deferral is safe with the radix cache on. ``cache_finished_req`` and
``cache_unfinished_req`` are SGLang 0.5.17's (mem_cache/radix_cache.py:434-553) with one added
line each, the key clamp. docs/sglang-0.5.17.md §8.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

BACKEND = "dual_graph"
# What the worker publishes on its target TpModelWorker (the factory's only handle): row -> draft
# tokens that row is behind, and whom to tell when the tree SGLang builds cannot be clamped.
BEHIND_ATTR = "dgw_draft_behind"
UNCLAMPED_ATTR = "dgw_tree_unclamped"


def draft_valid_slots(tokens: int, behind: int) -> int:
    """Slots [0, n) of a request of `tokens` committed tokens whose draft KV is written: the
    last `behind` positions are waiting for a catch-up."""
    return max(int(tokens) - max(int(behind), 0), 0)


class DraftValidRadixCache(RadixCache):
    def __init__(self, params: Any, behind: Callable[[int], int]) -> None:
        super().__init__(params)
        self._behind = behind

    @classmethod
    def adopt(cls, cache: RadixCache, behind: Callable[[int], int]) -> "DraftValidRadixCache":
        """SGLang's own tree, made draft-valid in place: a second construction would register
        the tree's Prometheus series twice (--enable-metrics fails at start-up)."""
        cache.__class__ = cls
        cache._behind = behind
        return cache

    def _clamp(self, req: Any, key: RadixKey, tokens: int) -> RadixKey:
        """`key` cut to the slots with valid draft KV, page-floored, never below what the tree
        already holds for this request (those slots are tree-owned)."""
        valid = draft_valid_slots(tokens, self._behind(req.req_pool_idx))
        if valid >= len(key):
            return key
        keep = valid - valid % self.page_size
        return key[:max(req.cache_protected_len, keep)]

    def cache_finished_req(self, req: Any, is_insert: bool = True, *, kv_len_to_handle: int):
        if self.disable_finished_insert:
            is_insert = False
        if self.disable:
            kv_indices = self.req_to_token_pool.req_to_token[
                req.req_pool_idx, req.cache_protected_len:kv_len_to_handle]
            self.token_to_kv_pool_allocator.free_segment(kv_indices,
                                                         start_pos=req.cache_protected_len)
            return
        token_ids = (req.origin_input_ids + req.output_ids)[:kv_len_to_handle]
        kv_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, :len(token_ids)]
        radix_key = RadixKey(token_ids, req.extra_key,
                             is_bigram=self.is_eagle).page_aligned(self.page_size)
        radix_key = self._clamp(req, radix_key, len(token_ids))
        key_len = len(radix_key)
        values = kv_indices[:key_len].to(dtype=torch.int64, copy=True)
        if is_insert:
            priority = getattr(req, "priority", 0) or 0
            result = self.insert(InsertParams(key=radix_key, value=values, priority=priority))
            freed_end = result.prefix_len
        else:
            freed_end = key_len
        self.token_to_kv_pool_allocator.free_segments([
            (kv_indices[req.cache_protected_len:freed_end], req.cache_protected_len),
            (kv_indices[key_len:], key_len),
        ])
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: Any, chunked: bool = False):
        if self.disable:
            return
        token_ids = req.get_fill_ids()
        kv_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, :len(token_ids)]
        radix_key = RadixKey(token_ids, req.extra_key,
                             is_bigram=self.is_eagle).page_aligned(self.page_size)
        radix_key = self._clamp(req, radix_key, len(token_ids))
        values = kv_indices[:len(radix_key)].to(dtype=torch.int64, copy=True)
        result = self.insert(InsertParams(key=radix_key, value=values, chunked=chunked,
                                          priority=getattr(req, "priority", 0) or 0))
        new_prefix_len = result.prefix_len
        self.token_to_kv_pool_allocator.free_segment(
            kv_indices[req.cache_protected_len:new_prefix_len], start_pos=req.cache_protected_len)
        match_result = self.match_prefix(MatchPrefixParams(key=radix_key))
        new_indices, new_last_node = match_result.device_indices, match_result.last_device_node
        assert len(new_indices) == len(radix_key), f"{len(new_indices)=}, {len(radix_key)=}"
        self.req_to_token_pool.write(
            (req.req_pool_idx, slice(req.cache_protected_len, len(new_indices))),
            new_indices[req.cache_protected_len:])
        req.cache_protected_len = len(new_indices)
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_last_node)
        # The row keeps its own slots past the tree's: the next chunk starts after them.
        if len(new_indices) < len(kv_indices):
            req.prefix_indices = torch.cat([new_indices, kv_indices[len(new_indices):]])
        else:
            req.prefix_indices = new_indices
        req.last_node = new_last_node


def tree_cache_factory(ctx: Any):
    """The registered backend: SGLang's own choice, made draft-valid when it is the plain
    RadixCache and the worker publishes how far behind each row is (lazy catch-up). Any other
    tree that matches prefixes (HiCache, SWA, C++, unified) is reported to the worker, which
    then stops deferring draft prefills."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    cache = default_radix_cache_factory(ctx)
    behind: Optional[Callable[[int], int]] = getattr(ctx.tp_worker, BEHIND_ATTR, None)
    if behind is None:
        return cache
    if type(cache) is RadixCache:
        return DraftValidRadixCache.adopt(cache, behind)
    if _matches_prefixes(cache):
        getattr(ctx.tp_worker, UNCLAMPED_ATTR)(type(cache).__name__)
    return cache


def _matches_prefixes(cache: Any) -> bool:
    from sglang.srt.mem_cache.chunk_cache import ChunkCache

    return not isinstance(cache, ChunkCache) and not getattr(cache, "disable", False)


def register_backend() -> None:
    from sglang.srt.mem_cache.registry import (get_radix_cache_factory,
                                               register_radix_cache_backend)

    if get_radix_cache_factory(BACKEND) is None:
        register_radix_cache_backend(BACKEND, tree_cache_factory)
