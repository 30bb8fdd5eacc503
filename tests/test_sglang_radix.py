"""The draft-valid radix cache (engines/sglang/radix.py) through SGLang 0.5.17's own RadixCache,
tree and request-to-token pool, on CPU: a prefix without draft KV never becomes matchable, every
KV slot ends up in the tree or freed exactly once, and chunked prefill still advances."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.radix_cache",
                    reason="SGLang is not importable here")

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.chunk_cache import ChunkCache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402

from dual_graph_worker.engines.sglang.radix import (  # noqa: E402
    DraftValidRadixCache,
    draft_valid_slots,
    tree_cache_factory,
)


class Allocator:
    """The slot allocator as the cache uses it: records every freed slot."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed: list[int] = []

    def free_segment(self, indices: torch.Tensor, *, start_pos: int) -> None:
        self.freed.extend(int(i) for i in indices)

    def free_segments(self, segments) -> None:
        for indices, start in segments:
            self.free_segment(indices, start_pos=start)


class Backlog:
    def __init__(self) -> None:
        self.count: dict[int, int] = {}

    def __call__(self, row: int) -> int:
        return self.count.get(row, 0)


def _cache(backlog: Backlog):
    pool = ReqToTokenPool(size=8, max_context_len=64, device="cpu", enable_memory_saver=False)
    alloc = Allocator()
    params = CacheInitParams(disable=False, req_to_token_pool=pool,
                             token_to_kv_pool_allocator=alloc, page_size=1, is_eagle=True)
    return DraftValidRadixCache(params, backlog), pool, alloc


class Req:
    """A request as the cache reads it, after a prefix match that found nothing (last_node is
    the root, as SGLang's init_next_round_input leaves it)."""

    def __init__(self, cache, row: int, prompt: list[int], pool, first_slot: int) -> None:
        self.req_pool_idx = row
        self.origin_input_ids = array("l", prompt)     # SGLang's Req holds arrays
        self.output_ids = array("l")
        self.extra_key = None
        self.cache_protected_len = 0
        self.last_node = cache.root_node
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.priority = 0
        self._pool = pool
        self._next = first_slot
        self.fill_end = len(prompt)
        self.give_slots(len(prompt))

    def give_slots(self, n: int) -> None:
        start = len(self.origin_input_ids) + len(self.output_ids) - n
        pool = self._pool
        pool.req_to_token[self.req_pool_idx, start:start + n] = torch.arange(
            self._next, self._next + n, dtype=torch.int32)
        self._next += n

    def get_fill_ids(self):
        return (self.origin_input_ids + self.output_ids)[:self.fill_end]

    def decode(self, tokens: list[int]) -> None:
        for t in tokens:
            self.output_ids.append(t)
            self.give_slots(1)


def _matched(cache, tokens: list[int]) -> int:
    res = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("l", tokens), None,
                                                            is_bigram=True)))
    return len(res.device_indices)


def test_valid_slots_are_the_committed_tokens_less_the_backlog():
    assert draft_valid_slots(20, 0) == 20
    assert draft_valid_slots(20, 5) == 15
    assert draft_valid_slots(20, 30) == 0


def test_a_deferred_prompt_is_not_matchable_until_caught_up():
    backlog = Backlog()
    cache, pool, alloc = _cache(backlog)
    prompt = list(range(100, 112))                        # 12 tokens, slots 1000..1011
    a = Req(cache, 1, prompt, pool, first_slot=1000)
    backlog.count[1] = 12                                 # the whole prompt deferred
    cache.cache_unfinished_req(a)                         # the prefill-end insert
    assert _matched(cache, prompt + [7]) == 0             # nothing stale in the tree
    assert a.prefix_indices.tolist() == list(range(1000, 1012))   # the row keeps its slots
    assert alloc.freed == []
    # Decode-mode steps: 5 more tokens behind, then a catch-up of everything.
    a.decode([7, 8, 9, 10, 11])
    backlog.count[1] = 0                                  # caught up before it finished
    cache.cache_finished_req(a, kv_len_to_handle=17)
    # Bigram keys: 17 tokens -> 16 slots with draft KV for (t_p, t_{p+1}); slot 16 freed.
    assert _matched(cache, prompt + [7, 8, 9, 10, 11, 99]) == 16
    assert alloc.freed == [1016]


def test_a_request_finishing_behind_caches_only_its_valid_prefix():
    backlog = Backlog()
    cache, pool, alloc = _cache(backlog)
    prompt = list(range(200, 210))                        # 10 tokens, slots 2000..2009
    a = Req(cache, 2, prompt, pool, first_slot=2000)
    cache.cache_unfinished_req(a)                         # EAGLE's prefill: all valid
    assert _matched(cache, prompt + [1]) == 9
    a.decode([1, 2, 3, 4, 5, 6])                          # 16 tokens, the last 6 in decode mode
    backlog.count[2] = 6
    cache.cache_finished_req(a, kv_len_to_handle=16)
    # Multi-turn: the next turn resends the answer; only slots with draft KV may match.
    assert _matched(cache, prompt + [1, 2, 3, 4, 5, 6, 50]) == 10
    # Every slot is in the tree (0..9) or freed exactly once (10..15).
    assert sorted(alloc.freed) == list(range(2010, 2016))


def test_chunked_prefill_advances_past_a_deferred_chunk():
    backlog = Backlog()
    cache, pool, alloc = _cache(backlog)
    prompt = list(range(300, 316))                        # 16 tokens in two chunks of 8
    a = Req(cache, 3, prompt[:8], pool, first_slot=3000)
    a.origin_input_ids = array("l", prompt)
    a.fill_end = 8
    backlog.count[3] = 8                                  # chunk 1 deferred
    cache.cache_unfinished_req(a, chunked=True)           # the stash between chunks
    assert a.cache_protected_len == 0 and len(a.prefix_indices) == 8   # next chunk at 8
    assert _matched(cache, prompt) == 0


def test_the_registered_factory_wraps_only_sglangs_plain_radix_cache(monkeypatch):
    import sglang.srt.mem_cache.registry as registry

    pool = ReqToTokenPool(size=4, max_context_len=16, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=pool,
                             token_to_kv_pool_allocator=Allocator(), page_size=1, is_eagle=True)
    monkeypatch.setattr(registry, "default_radix_cache_factory",
                        lambda ctx: RadixCache(ctx.params))
    unclamped = []
    lazy = SimpleNamespace(params=params, tp_worker=SimpleNamespace(
        dgw_draft_behind=Backlog(), dgw_tree_unclamped=unclamped.append))
    built = []
    monkeypatch.setattr(registry, "default_radix_cache_factory",
                        lambda ctx: built.append(RadixCache(ctx.params)) or built[-1])
    assert type(tree_cache_factory(lazy)) is DraftValidRadixCache
    assert tree_cache_factory(lazy) is built[-1]     # SGLang's own tree, adopted, not rebuilt
    keep_current = SimpleNamespace(params=params, tp_worker=SimpleNamespace())
    assert type(tree_cache_factory(keep_current)) is RadixCache
    chunk = ChunkCache(params)
    monkeypatch.setattr(registry, "default_radix_cache_factory", lambda ctx: chunk)
    assert tree_cache_factory(lazy) is chunk and not unclamped   # radix off: no tree to clamp

    class HiRadixLike(RadixCache):
        pass

    monkeypatch.setattr(registry, "default_radix_cache_factory",
                        lambda ctx: HiRadixLike(ctx.params))
    assert type(tree_cache_factory(lazy)) is HiRadixLike and unclamped == ["HiRadixLike"]


def test_the_factory_builds_one_tree_so_metrics_register_once(monkeypatch):
    """--enable-metrics: a tree registers its Prometheus series at construction, so a second
    tree built beside SGLang's raised DuplicateTimeseries and the server died at start-up."""
    import sglang.srt.mem_cache.base_prefix_cache as base
    import sglang.srt.mem_cache.registry as registry
    import sglang.srt.runtime_context as runtime_context
    from prometheus_client import REGISTRY
    from prometheus_client.metrics import MetricWrapperBase

    monkeypatch.setattr(runtime_context, "get_server_args", lambda: None)
    monkeypatch.setattr(base, "get_observability",
                        lambda: SimpleNamespace(extra_metric_labels=None))
    monkeypatch.setattr(registry, "default_radix_cache_factory",
                        lambda ctx: RadixCache(ctx.params))
    pool = ReqToTokenPool(size=4, max_context_len=16, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=pool, enable_metrics=True,
                             token_to_kv_pool_allocator=Allocator(), page_size=1, is_eagle=True)
    lazy = SimpleNamespace(params=params, tp_worker=SimpleNamespace(
        dgw_draft_behind=Backlog(), dgw_tree_unclamped=lambda name: None))
    before = set(REGISTRY._collector_to_names)
    try:
        cache = tree_cache_factory(lazy)
        assert type(cache) is DraftValidRadixCache and cache.metrics_collector is not None
    finally:
        for c in set(REGISTRY._collector_to_names) - before:
            if isinstance(c, MetricWrapperBase):
                REGISTRY.unregister(c)


def test_an_unclamped_tree_turns_prefill_deferral_off():
    from dual_graph_worker.engines.sglang.lazy_sync import LazyCatchUp

    lazy = LazyCatchUp.__new__(LazyCatchUp)          # only the deferral state matters here
    lazy.defer_prefill_off, lazy.prefill_reserve = None, 8192
    assert lazy.defers_prefill
    lazy.tree_unclamped("HiRadixCache")
    assert not lazy.defers_prefill and lazy.prefill_reserve == 0
    assert "HiRadixCache" in lazy.defer_prefill_off
