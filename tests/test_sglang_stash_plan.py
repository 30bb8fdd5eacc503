"""Sizing the lazy catch-up stash at start-up: LazyCatchUp built on fake SGLang runners (CPU),
and stash_plan.plan_stash's numbers and refusals."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from dual_graph_worker.core.errors import ConfigError

MIB = 1 << 20
# aux width 12 (3 aux layers of 4) in bf16, plus the int64 token and cell ids: 40 bytes a cell.
CELLS_PER_MIB = MIB // 40


@pytest.fixture
def lazy_sync(supported_sglang):
    from dual_graph_worker.engines.sglang import lazy_sync

    return lazy_sync


def _draft_runner(*, chunk, radix_backend, standalone, eagle3_model, target_hidden=4):
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    hf = SimpleNamespace(eagle_config=None, target_hidden_size=target_hidden,
                         num_aux_hidden_states=3)
    if eagle3_model:          # a draft whose K/V can be filled alone (kv_fill_unavailable: None)
        attn = SimpleNamespace(sliding_window_size=None)
        model = type("LlamaForCausalLMEagle3", (), {})()
        model.model = SimpleNamespace(layers=[SimpleNamespace(self_attn=SimpleNamespace(
            attn=attn))])
    else:
        model = object()
    pool = type("MHATokenToKVPool", (), {})()
    pool.dtype = torch.bfloat16
    return SimpleNamespace(
        attn_backend=TritonAttnBackend.__new__(TritonAttnBackend), model=model,
        token_to_kv_pool=pool,
        model_config=SimpleNamespace(hf_config=hf, dtype=torch.bfloat16, spec_hidden_size=6,
                                     hidden_size=4),
        spec_algorithm=SimpleNamespace(is_eagle3=lambda: True, is_standalone=lambda: standalone),
        server_args=SimpleNamespace(chunked_prefill_size=chunk,
                                    disable_radix_cache=radix_backend is None,
                                    radix_cache_backend=radix_backend))


def _lazy(lazy_sync, *, stash_mb, rows=8, slots=100_000, chunk=4096, radix_backend=None,
          standalone=False, eagle3_model=False, target_hidden=4, **kw):
    dr = _draft_runner(chunk=chunk, radix_backend=radix_backend, standalone=standalone,
                       eagle3_model=eagle3_model, target_hidden=target_hidden)
    target = SimpleNamespace(token_to_kv_pool=SimpleNamespace(size=slots - 1, page_size=1))
    pool = SimpleNamespace(req_to_token=torch.zeros(rows, 4, dtype=torch.int32))
    return lazy_sync.LazyCatchUp(SimpleNamespace(draft_runner=dr), target, pool,
                                 stash_mb=stash_mb, **kw)


def _started(caplog) -> str:
    (line,) = [r.getMessage() for r in caplog.records if "lazy catch-up stash" in r.getMessage()]
    return line


def test_an_explicit_stash_defers_prefills_and_leaves_kv_only_off(lazy_sync, caplog):
    caplog.set_level(logging.INFO, logger=lazy_sync.__name__)
    lz = _lazy(lazy_sync, stash_mb=1)
    assert lz.arena.cells == CELLS_PER_MIB and lz.backlog.cursor == 0
    assert lz.arena.cell_of_slot.shape == (100_000,)
    assert (lz.max_pass_tokens, lz.prefill_reserve) == (4096, 4096)
    assert lz.defer_prefill_off is None and lz.defers_prefill
    assert (lz.kv_only_off, lz.kv_only_min_tokens) == ("off", 2048)
    assert _started(caplog) == (
        f"dual-graph: lazy catch-up stash: {CELLS_PER_MIB} tokens x 12 torch.bfloat16 features "
        f"({lz.arena.nbytes / MIB:.0f} MiB), 100000 KV slots, catch-up passes of <= 4096 "
        "tokens; deferred draft prefill: on; K/V-only catch-up: off")


def test_the_auto_stash_is_capped_at_the_kv_slots_and_says_what_is_off(lazy_sync, caplog):
    """No GPU: 1 GiB, more cells than KV slots, so as many cells as slots; the default pass
    size; another radix backend turns deferral off; a draft that is no EAGLE-3 Llama turns
    K/V-only off, with a warning."""
    caplog.set_level(logging.INFO, logger=lazy_sync.__name__)
    lz = _lazy(lazy_sync, stash_mb=0, chunk=None, radix_backend="lmcache", kv_only=True)
    assert lz.arena.cells == 100_000 and lz.max_pass_tokens == 8192
    assert lz.defer_prefill_off.startswith("off: the radix cache backend 'lmcache' may cache")
    assert lz.prefill_reserve == 0
    why = "the draft model is object, not one of LlamaForCausalLMEagle3"
    assert lz.kv_only_off == why
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"dual-graph: DGW_CATCH_UP_KV_ONLY ignored: {why}; catch-ups run the "
                        "draft's whole layer"]
    assert _started(caplog).endswith(f"; deferred draft prefill: {lz.defer_prefill_off}; "
                                         f"K/V-only catch-up: {why}")


@pytest.mark.parametrize("chunk, kv_only_off", [
    (4096, None),
    (2048, "catch-up passes hold at most 2048 tokens, under twice the 2048 a pass needs to be "
           "split (SGLang's chunked_prefill_size)")])
def test_kv_only_catch_ups_need_passes_of_twice_their_bound(lazy_sync, caplog, chunk,
                                                            kv_only_off):
    caplog.set_level(logging.INFO, logger=lazy_sync.__name__)
    lz = _lazy(lazy_sync, stash_mb=1, chunk=chunk, eagle3_model=True, kv_only=True)
    assert lz.kv_only_off == kv_only_off
    assert _started(caplog).endswith(
        "K/V-only catch-up: " + (kv_only_off or "passes of >= 2048 tokens"))


def test_deferral_is_off_for_a_standalone_draft_or_a_stash_without_a_chunks_room(lazy_sync):
    lz = _lazy(lazy_sync, stash_mb=1, standalone=True)
    assert lz.defer_prefill_off == "off: the draft carries no hidden state (STANDALONE)"
    lz = _lazy(lazy_sync, stash_mb=1, chunk=30_000)
    assert lz.defer_prefill_off == (
        f"off: the stash ({CELLS_PER_MIB} tokens) cannot hold a decode step of 8 rows plus one "
        "prefill chunk of 30000; raise DGW_LAZY_STASH_MB")
    assert lz.prefill_reserve == 0
    assert _lazy(lazy_sync, stash_mb=1, defer_prefill=False).defer_prefill_off == \
        "off (DGW_DEFER_DRAFT_PREFILL=0)"


def test_a_stash_smaller_than_the_request_rows_is_refused(lazy_sync):
    """12288-wide bf16 features: 42 cells in 1 MiB, under 64 rows; 2 MiB would do."""
    with pytest.raises(ConfigError) as err:
        _lazy(lazy_sync, stash_mb=1, rows=64, target_hidden=4096)
    assert str(err.value) == (
        "DGW_LAZY_STASH_MB=1 holds 42 stashed tokens of 12288 x torch.bfloat16 features, fewer "
        "than the 64 request-pool rows one decode step may need; set DGW_LAZY_STASH_MB >= 2")


# ------------------------------------------------------------------------------ plan_stash

@pytest.fixture
def stash_plan(supported_sglang):
    from dual_graph_worker.engines.sglang import stash_plan

    return stash_plan


def _plan(stash_plan, **kw):
    args = dict(stash_mb=1, free_bytes=None, rows=8, slots=100_000, aux_width=12,
                aux_dtype=torch.bfloat16,
                server_args=SimpleNamespace(chunked_prefill_size=4096, disable_radix_cache=True),
                draft_hidden=(6, torch.bfloat16), defer_prefill=True, kv_only=True,
                kv_fill_blocker=None)
    return stash_plan.plan_stash(**{**args, **kw})


def test_plan_of_an_explicit_stash(stash_plan):
    plan = _plan(stash_plan)
    assert plan == stash_plan.StashPlan(
        cells=CELLS_PER_MIB, need_bytes=CELLS_PER_MIB * 40 + 100_000 * 8, max_pass_tokens=4096,
        defer_prefill_off=None, kv_only_off=None)
    assert (plan.prefill_reserve, plan.kv_only_min_tokens) == (4096, 2048)
    assert _plan(stash_plan, kv_only=False, kv_fill_blocker="ignored").kv_only_off == "off"
    assert _plan(stash_plan, kv_fill_blocker="no fill").kv_only_off == "no fill"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_plans_bytes_are_what_the_arena_allocates(stash_plan, dtype):
    from dual_graph_worker.engines.sglang.catch_up import StashArena

    plan = _plan(stash_plan, slots=5_000, aux_dtype=dtype)
    arena = StashArena.allocate(plan.cells, 12, dtype, 5_000, "cpu")
    assert plan.cells == 5_000 and arena.nbytes == plan.need_bytes


def test_plan_of_an_auto_stash_leaves_the_slot_map_its_room(stash_plan):
    """40% of 1 GiB free, less 20M slots' 8-byte map, in 40-byte cells; the default pass."""
    plan = _plan(stash_plan, stash_mb=0, free_bytes=1 << 30, slots=20_000_000,
                 server_args=SimpleNamespace(chunked_prefill_size=0, disable_radix_cache=True))
    assert (plan.cells, plan.need_bytes, plan.max_pass_tokens) == (6_737_418, 429_496_720, 8192)


def test_plan_takes_the_smallest_ranks_cells_and_defers_only_with_a_chunks_room(stash_plan,
                                                                                monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_reduce",
                        lambda t, op, group: t.copy_(torch.minimum(t, torch.tensor([1000]))))
    plan = _plan(stash_plan, tp_group=SimpleNamespace(world_size=2, cpu_group="cpu"))
    assert plan.cells == 1000 and plan.prefill_reserve == 0
    assert plan.defer_prefill_off == (
        "off: the stash (1000 tokens) cannot hold a decode step of 8 rows plus one prefill "
        "chunk of 4096; raise DGW_LAZY_STASH_MB")


def test_plan_refuses_too_few_cells_and_more_than_half_the_free_memory(stash_plan):
    with pytest.raises(ConfigError) as err:
        _plan(stash_plan, rows=64, aux_width=12288)
    assert str(err.value) == (
        "DGW_LAZY_STASH_MB=1 holds 42 stashed tokens of 12288 x torch.bfloat16 features, fewer "
        "than the 64 request-pool rows one decode step may need; set DGW_LAZY_STASH_MB >= 2")
    with pytest.raises(ConfigError) as err:              # 1677721 cells and 10M slots' map
        _plan(stash_plan, stash_mb=64, free_bytes=200 * MIB, slots=10_000_000)
    assert str(err.value) == (
        "the lazy-catch-up stash needs 140 MiB but only 200 MiB are free after start-up; lower "
        "DGW_LAZY_STASH_MB or --mem-fraction-static, or use DGW_CONTINUITY=keep-current")


def test_why_prefills_are_not_deferred_and_the_auto_stash_budget(stash_plan):
    why = stash_plan._why_not_defer_prefills
    radix_off = SimpleNamespace(disable_radix_cache=True)
    kw = dict(cells=10_000, rows=100, reserve=8192, draft_hidden=(4096, torch.bfloat16))
    assert why(True, radix_off, **kw) is None
    assert "DGW_DEFER_DRAFT_PREFILL=0" in why(False, radix_off, **kw)
    # The radix cache on: deferral needs the draft-valid tree (radix.py), not another backend.
    draft_valid = SimpleNamespace(disable_radix_cache=False, radix_cache_backend="dual_graph")
    assert why(True, draft_valid, **kw) is None
    other = SimpleNamespace(disable_radix_cache=False, radix_cache_backend="lmcache")
    assert "--radix-cache-backend" in why(True, other, **kw)
    assert "STANDALONE" in why(True, radix_off, **{**kw, "draft_hidden": (None, None)})
    assert "DGW_LAZY_STASH_MB" in why(True, radix_off, **{**kw, "cells": 8000})
    budget = stash_plan._stash_budget
    assert budget(64, 10 << 30, slot_map_bytes=0) == 64 * MIB                 # explicit
    assert budget(0, 10 << 30, slot_map_bytes=MIB) == int((10 << 30) * 0.4) - MIB
    assert budget(0, None, slot_map_bytes=0) == 1024 * MIB                    # no GPU


def test_stash_size_is_the_smallest_ranks_on_every_rank(stash_plan, monkeypatch):
    import torch.distributed as dist

    same = stash_plan._same_on_every_rank
    assert same(1234, None) == 1234
    assert same(1234, SimpleNamespace(world_size=1)) == 1234
    seen = []

    def fake_all_reduce(t, op, group):               # another rank had less memory free
        seen.append((op, group))
        t.copy_(torch.minimum(t, torch.tensor([1000])))

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    assert same(1234, SimpleNamespace(world_size=2, cpu_group="cpu")) == 1000
    assert seen == [(dist.ReduceOp.MIN, "cpu")]
