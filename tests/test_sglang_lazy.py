"""DGW_CONTINUITY=lazy-catch-up (not yet run on a GPU): everything testable on CPU.

Part one needs no SGLang: the config keys, the host backlog (backlog.py), the stash arena and
the catch-up index tensors (catch_up.py), and a simulation of whole request lifetimes that checks
lazy catch-up leaves exactly the draft KV inputs keep-current leaves, and that no speculative
step ever starts with a request behind. Part two imports SGLang 0.5.17 (skipped when it is not
importable) and drives lazy_sync.py and the worker's routing with fake model runners.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest
import torch

from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.engines.sglang import stash_room
from dual_graph_worker.engines.sglang.continuity_contract import NO_ROOM_NEEDED, RoomMade
from dual_graph_worker.engines.sglang.backlog import (
    LazyBacklog,
    RoomAction,
)
from dual_graph_worker.engines.sglang.catch_up import (
    Segment,
    StashArena,
    backlog_slots,
    build_catch_up_indices,
    final_rows,
    join_passes,
    plan_passes,
    shifted_prompt_tokens,
)
from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.core.planner import StepPlanner
from dual_graph_worker.core.simple_policies import ThresholdPolicy
from dual_graph_worker.core.settings import Settings
from dual_graph_worker.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_lazy_modules_do_not_import_sglang():
    code = textwrap.dedent("""
        import sys
        import dual_graph_worker.engines.sglang.backlog, dual_graph_worker.engines.sglang.catch_up
        import dual_graph_worker.core.settings, dual_graph_worker.engines.sglang.stash_room
        import dual_graph_worker.engines.sglang.hooks, dual_graph_worker.engines.sglang.kv_fill
        assert not any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ------------------------------------------------------------------------------------ config

def test_continuity_config():
    # Lazy catch-up is the default since the H200 bench; keep-current is one switch.
    assert Settings().continuity is Continuity.LAZY_CATCH_UP
    cfg = Settings.from_env({"DGW_CONTINUITY": "Keep-Current", "DGW_LAZY_STASH_MB": "64"})
    assert cfg.continuity is Continuity.KEEP_CURRENT and cfg.lazy_stash_mb == 64
    assert cfg.to_json()["continuity"] == "keep-current"
    assert Settings.from_env({"DGW_CONTINUITY": "lazy-catch-up"}) == Settings()
    with pytest.raises(ConfigError, match="keep-current"):
        Settings.from_env({"DGW_CONTINUITY": "lazy"})
    with pytest.raises(ConfigError, match="DGW_CONTINUITY"):
        Settings.from_env({"DGW_CONTINUITY": "none"})
    with pytest.raises(ConfigError, match="DGW_LAZY_STASH_MB"):
        Settings(lazy_stash_mb=-1)
    assert Settings().lazy_stash_mb == 0 and Settings().defer_draft_prefill   # auto, on
    assert not Settings.from_env({"DGW_DEFER_DRAFT_PREFILL": "0"}).defer_draft_prefill
    with pytest.raises(ConfigError, match="DGW_DEFER_DRAFT_PREFILL"):
        Settings.from_env({"DGW_DEFER_DRAFT_PREFILL": "sometimes"})



# ------------------------------------------------------------------------------------ backlog

def test_backlog_counts_cells_and_stats():
    b = LazyBacklog(num_rows=8, arena_cells=10)
    assert b.room_for(10) and not b.room_for(11)
    assert b.note_decode_step([3, 5, 1]) == 0
    assert b.note_decode_step([3, 5, 1]) == 3
    assert b.note_decode_step([5, 2]) == 6 and b.cursor == 8
    assert not b.room_for(3)
    with pytest.raises(RuntimeError, match="arena full"):
        b.note_decode_step([3, 5, 1])
    assert b.cursor == 8 and b.count[3] == 2            # a refused step changed nothing
    behind = b.behind([1, 2, 4, 5])
    assert behind.positions.tolist() == [0, 1, 3] and behind.counts.tolist() == [2, 1, 3]
    b.reset([2])                                         # row 2 re-admitted by a prefill
    assert b.behind([2]).positions.size == 0
    done = b.caught_up([1, 5], forced=True)
    assert done == (5, 1)                                # row 3 was behind, not in the batch
    assert b.cursor == 0 and not b.count.any()
    s = b.stats
    assert (s.decode_steps, s.stashed_tokens, s.catch_ups, s.forced_catch_ups) == (3, 8, 1, 1)
    assert (s.caught_up_tokens, s.max_backlog, s.orphans_dropped) == (5, 3, 1)
    b.note_decode_step([4])
    assert b.caught_up([], forced=True) == (0, 1) and b.stats.catch_ups == 1   # orphans only
    with pytest.raises(ValueError, match="one cell per request-pool row"):
        LazyBacklog(num_rows=8, arena_cells=7)


def test_arena_budget_and_why_not_a_row_per_kv_slot():
    # Llama-3-8B-shaped target: aux = 3 x 4096 bf16 per token, and the int64 token and cell ids.
    cell = StashArena.cell_bytes(12288, torch.bfloat16)
    assert cell == 12288 * 2 + 16 and (1024 << 20) // cell == 43662
    # One feature row per KV slot at the H200 bench's 855,835-token pool: ~21 GB, about twice
    # the ~10 GB left free after start-up (results/sglang/bench/report.md): that budget holds
    # fewer than half as many stash cells as the pool has slots.
    assert 10 * 10**9 // cell < 855835 // 2


def test_deferred_prefill_counts_chunks_and_keeps_pending_rows():
    b = LazyBacklog(num_rows=8, arena_cells=64)
    # rows 2 and 5 admitted; row 5's prompt continues in a later batch (chunked)
    assert b.note_prefill([2, 5], prefix_lens=[0, 0], extend_lens=[6, 4], chunked=1) == 0
    assert b.count[[2, 5]].tolist() == [6, 4] and b.cursor == 10
    assert b.pending_end[5] == 4 and b.pending_end[2] == -1
    assert b.continues_deferred_chunk([5], [4]) and not b.continues_deferred_chunk([5], [0])
    p = b.pending()
    assert p.rows.tolist() == [5] and p.ends.tolist() == [4] and p.counts.tolist() == [4]
    assert b.pending(exclude=[5]).rows.size == 0
    # A decode step of the running batch [2] and a catch-up of it: row 5 is no orphan, its
    # cells stay (the cursor restarts after them; the caller moves them to the front).
    b.note_decode_step([2])
    done = b.caught_up([2], forced=False)
    assert done == (7, 0) and b.count[5] == 4 and b.cursor == 4
    # row 5's last chunk, deferred: its backlog is both chunks; it is no longer pending
    assert b.note_prefill([5, 1], prefix_lens=[4, 0], extend_lens=[3, 2]) == 4
    assert b.count[[5, 1]].tolist() == [7, 2] and b.pending().rows.size == 0
    # a reused row (prefix 0) never inherits the old backlog
    b.note_prefill([5], prefix_lens=[0], extend_lens=[2])
    assert b.count[5] == 2
    s = b.stats
    assert (s.deferred_prefills, s.deferred_prefill_tokens, s.chunk_restarts) == (3, 17, 0)
    with pytest.raises(RuntimeError, match="do not defer"):
        b.note_prefill([3], prefix_lens=[0], extend_lens=[64])
    with pytest.raises(ValueError, match="extend lengths"):
        b.note_prefill([3], prefix_lens=[0], extend_lens=[0])


def test_eagle_prefill_after_a_deferred_chunk_is_counted_as_a_restart():
    b = LazyBacklog(num_rows=4, arena_cells=32)
    b.note_prefill([1], prefix_lens=[0], extend_lens=[5], chunked=0)
    b.reset([1], prefix_lens=[5])            # EAGLE's path took the next chunk
    assert b.stats.chunk_restarts == 1 and b.count[1] == 0 and b.pending_end[1] == -1
    b.reset([2], prefix_lens=[0])
    assert b.stats.chunk_restarts == 1


def test_plan_room_prefers_compaction_and_never_catches_up_for_the_reserve():
    b = LazyBacklog(num_rows=4, arena_cells=100)
    b.note_prefill([0, 1], prefix_lens=[0, 0], extend_lens=[30, 30])   # rows 0, 1
    assert b.plan_room([0], need=1, reserve=10) is RoomAction.NONE
    b.note_prefill([2], prefix_lens=[0], extend_lens=[35])
    # 95 used; batch [0] lives (30 cells), rows 1 and 2 are gone: a compaction frees 65
    assert b.plan_room([0], need=2, reserve=10) is RoomAction.COMPACT
    # live = 95 (all three in the batch): no compaction helps, the step itself fits: nothing
    assert b.plan_room([0, 1, 2], need=2, reserve=10) is RoomAction.NONE
    # ... and when the step itself does not fit, catch up
    assert b.plan_room([0, 1, 2], need=6, reserve=0) is RoomAction.CATCH_UP
    # a compaction for the reserve only when it frees a quarter of the arena
    assert b.plan_room([0, 1], need=2, reserve=15) is RoomAction.NONE     # 60 live + 2 + 15 + a quarter (25) > 100
    assert b.compacted([0]) == 30 and b.cursor == 30
    assert b.count.tolist() == [30, 0, 0, 0] and b.stats.orphans_dropped == 2
    assert b.stats.compactions == 1 and b.stats.compacted_cells == 30


def test_stash_arena_compact_moves_live_cells_in_order(tmp_path):
    rng = np.random.default_rng(0)
    for trial in range(20):
        cells, slots_n = int(rng.integers(8, 60)), 200
        arena = StashArena.allocate(cells, 3, torch.float32, slots_n, "cpu")
        used = int(rng.integers(1, cells + 1))
        slots = torch.from_numpy(rng.choice(slots_n, used, replace=False))
        aux = torch.randn(used, 3)
        tok = torch.from_numpy(rng.integers(0, 1000, used))
        arena.write(0, aux, tok, slots)
        live = slots[torch.from_numpy(rng.permutation(used)[:int(rng.integers(0, used + 1))])]
        want_aux, want_tok = arena.gather(live)
        order = torch.argsort(arena.cell_of_slot[live])
        n = arena.compact(live, chunk_rows=int(rng.integers(1, 9)))
        assert n == live.numel()
        got_aux, got_tok = arena.gather(live)
        assert torch.equal(got_aux, want_aux) and torch.equal(got_tok, want_tok)
        assert sorted(arena.cell_of_slot[live].tolist()) == list(range(n))
        assert torch.equal(arena.cell_of_slot[live[order]], torch.arange(n))  # order kept
    with pytest.raises(ValueError, match="cannot fit"):
        StashArena.allocate(2, 3, torch.float32, 8, "cpu").compact(torch.arange(3))


def test_shifted_prompt_tokens_match_eagles_per_request_loop():
    ids = torch.arange(100, 112)
    lens, tail = [5, 1, 6], torch.tensor([7, 8, 9])
    want, pt = [], 0
    for i, n in enumerate(lens):          # eagle_worker_v2._draft_extend_for_prefill's loop
        want += ids[pt + 1: pt + n].tolist() + [int(tail[i])]
        pt += n
    assert shifted_prompt_tokens(ids, lens, tail).tolist() == want
    with pytest.raises(ValueError, match="tail tokens"):
        shifted_prompt_tokens(ids, [5, 7], tail)


def test_backlog_slots_are_the_last_count_positions():
    r2t = torch.arange(4 * 10).reshape(4, 10)
    got = backlog_slots(req_pool_indices=torch.tensor([3, 1]), ends=torch.tensor([7, 4]),
                        counts=[2, 4], req_to_token=r2t)
    assert got.tolist() == [35, 36, 10, 11, 12, 13]


# ------------------------------------------------------------------------------------ passes

def _check_passes(counts, max_tokens, passes):
    seen = {i: [] for i in range(len(counts))}
    for k, segs in enumerate(passes):
        assert segs and sum(g.end - g.begin for g in segs) <= max_tokens
        assert len({g.req for g in segs}) == len(segs)        # one segment per request a pass
        for g in segs:
            seen[g.req].append((k, g))
    for i, n in enumerate(counts):
        ks = [k for k, _ in seen[i]]
        segs = [g for _, g in seen[i]]
        assert ks == sorted(ks) and len(set(ks)) == len(ks)   # later segments, later passes
        assert segs[0].begin == 0 and segs[-1].end == n
        assert all(a.end == b.begin for a, b in zip(segs, segs[1:]))
        assert [g.final for g in segs] == [False] * (len(segs) - 1) + [True]


def test_plan_passes_properties():
    assert plan_passes([3, 1, 2], 8) == [[Segment(0, 0, 3, True), Segment(1, 0, 1, True),
                                          Segment(2, 0, 2, True)]]
    assert plan_passes([5], 2) == [[Segment(0, 0, 2, False)], [Segment(0, 2, 4, False)],
                                   [Segment(0, 4, 5, True)]]
    rng = random.Random(0)
    for _ in range(200):
        counts = [rng.randint(1, 40) for _ in range(rng.randint(1, 12))]
        max_tokens = rng.randint(1, 60)
        _check_passes(counts, max_tokens, plan_passes(counts, max_tokens))
    with pytest.raises(ValueError):
        plan_passes([2, 0], 8)
    with pytest.raises(ValueError):
        plan_passes([2], 0)


# ------------------------------------------------------------------------------ arena + index

def test_stash_arena_files_rows_under_slots():
    arena = StashArena.allocate(cells=6, aux_width=2, aux_dtype=torch.float32, num_slots=20,
                                device="cpu")
    assert arena.cells == 6 and arena.nbytes == 6 * 2 * 4 + 6 * 8 + 20 * 8 + 6 * 8
    arena.write(0, torch.tensor([[1., 1.], [2., 2.]]), torch.tensor([11, 12], dtype=torch.int32),
                torch.tensor([7, 3]))
    arena.write(2, torch.tensor([[3., 3.]]), torch.tensor([13]), torch.tensor([9]))
    aux, tok = arena.gather(torch.tensor([3, 9, 7]))
    assert aux[:, 0].tolist() == [2., 3., 1.] and tok.tolist() == [12, 13, 11]
    assert tok.dtype == torch.int64
    arena.write(0, torch.tensor([[5., 5.]]), torch.tensor([15]), torch.tensor([4]))  # reuse
    assert arena.gather(torch.tensor([4]))[1].tolist() == [15]
    with pytest.raises(ValueError, match="width"):
        arena.write(0, torch.zeros(1, 3), torch.zeros(1), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="outside"):
        arena.write(5, torch.zeros(2, 2), torch.zeros(2), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="disagree"):
        arena.write(0, torch.zeros(2, 2), torch.zeros(1), torch.zeros(2, dtype=torch.int64))


def _reference_indices(segments, rows, ends, counts, req_to_token):
    pos, slots, last, prefix, seq = [], [], [], [], []
    for g in segments:
        start = ends[g.req] - counts[g.req]
        p = list(range(start + g.begin, start + g.end))
        prefix.append(p[0])
        seq.append(p[-1] + 1)
        pos += p
        slots += [int(req_to_token[rows[g.req], q]) for q in p]
        last.append(len(pos) - 1)
    return pos, slots, last, prefix, seq


class _Backlogs(NamedTuple):
    req_to_token: torch.Tensor
    rows: list[int]
    counts: list[int]
    ends: list[int]
    batch_positions: list[int]
    with_cpu: bool


def _random_backlogs(seed: int, least: int = 1):
    """60 random sets of requests behind (their request-pool rows, backlogs, committed lengths,
    batch positions), the host and the device path in turn; each with the generator."""
    rng = random.Random(seed)
    for trial in range(60):
        m = rng.randint(least, 6)
        rows = rng.sample(range(9), m)
        counts = [rng.randint(1, 20) for _ in range(m)]
        ends = [c + rng.randint(0, 30) for c in counts]
        yield _Backlogs(torch.randint(0, 5000, (9, 64), dtype=torch.int32), rows, counts, ends,
                        sorted(rng.sample(range(12), m)), trial % 2 == 0), rng


def _indices(b: _Backlogs, segs: list[Segment]):
    return build_catch_up_indices(
        segs, req_pool_indices=None if b.with_cpu else torch.tensor(b.rows),
        ends=None if b.with_cpu else torch.tensor(b.ends), counts=b.counts,
        batch_positions=b.batch_positions, req_to_token=b.req_to_token,
        rows_cpu=b.rows if b.with_cpu else None, ends_cpu=b.ends if b.with_cpu else None)


def test_final_rows_are_each_final_segments_last_position_behind_the_rest():
    """The K/V-only catch-up's forward pass: one row per segment that ends its request's
    backlog (its last position, prefix = everything before it), none for the others."""
    seen_none = False
    for b, rng in _random_backlogs(seed=2, least=2):
        req_to_token, rows, counts, ends, batch_positions, with_cpu = b
        # plan_passes gives a long backlog's early segments a pass each; a pass mixing
        # segments that end their backlog with ones that do not is built by hand.
        mixed = [Segment(0, 0, counts[0] - 1, False)] if counts[0] > 1 else []
        mixed += [Segment(i, 0, counts[i], True) for i in range(1, len(rows))]
        for segs in plan_passes(counts, rng.randint(1, 25)) + [mixed]:
            got = final_rows(_indices(b, segs))
            finals = [g for g in segs if g.final]
            if not finals:
                assert got is None
                seen_none = True
                continue
            last = [ends[g.req] - 1 for g in finals]
            assert got.positions.tolist() == last and got.num_tokens == len(finals)
            assert got.slots.tolist() == [int(req_to_token[rows[g.req], p])
                                          for g, p in zip(finals, last)]
            assert got.req_pool_indices.tolist() == [rows[g.req] for g in finals]
            assert got.seq_lens.tolist() == [ends[g.req] for g in finals]
            assert got.prefix_lens.tolist() == last and got.extend_lens_cpu == [1] * len(last)
            assert got.extend_lens.tolist() == [1] * len(last)
            assert got.last_rows.tolist() == list(range(len(last)))
            assert got.batch_positions == [batch_positions[g.req] for g in finals]
            assert got.final == [True] * len(last)
            assert got.prefix_lens.dtype == got.extend_lens.dtype == torch.int32
            if with_cpu:
                assert got.prefix_lens_cpu == last and got.seq_lens_cpu.tolist() == \
                    [ends[g.req] for g in finals]
            else:
                assert got.prefix_lens_cpu is None and got.seq_lens_cpu is None
    assert seen_none


def test_joined_passes_are_their_rows_in_order_as_one_pass():
    """The K/V-only catch-up's one forward: every pass's final rows, joined."""
    for b, rng in _random_backlogs(seed=3, least=2):
        plan = plan_passes(b.counts, rng.randint(1, 25))
        parts = [p for p in (final_rows(_indices(b, segs)) for segs in plan) if p is not None]
        got = join_passes(parts)
        finals = [g for segs in plan for g in segs if g.final]
        last = [b.ends[g.req] - 1 for g in finals]
        assert got.positions.tolist() == last and got.num_tokens == len(last)
        assert got.slots.tolist() == [int(b.req_to_token[b.rows[g.req], p])
                                      for g, p in zip(finals, last)]
        assert got.req_pool_indices.tolist() == [b.rows[g.req] for g in finals]
        assert got.seq_lens.tolist() == [b.ends[g.req] for g in finals]
        assert got.prefix_lens.tolist() == last and got.extend_lens_cpu == [1] * len(last)
        assert got.last_rows.tolist() == list(range(len(last)))
        assert got.batch_positions == [b.batch_positions[g.req] for g in finals]
        assert got.final == [True] * len(last)
        if b.with_cpu:
            assert got.prefix_lens_cpu == last and got.seq_lens_cpu.tolist() == \
                [b.ends[g.req] for g in finals]
        else:
            assert got.prefix_lens_cpu is None and got.seq_lens_cpu is None


def test_catch_up_indices_match_a_direct_loop():
    for b, rng in _random_backlogs(seed=1):
        req_to_token, rows, counts, ends, batch_positions, with_cpu = b
        for segs in plan_passes(counts, rng.randint(1, 25)):
            idx = _indices(b, segs)
            pos, slots, last, prefix, seq = _reference_indices(segs, rows, ends, counts,
                                                               req_to_token)
            assert idx.positions.tolist() == pos and idx.slots.tolist() == slots
            assert idx.slots.dtype == torch.int64 and idx.num_tokens == len(pos)
            assert idx.last_rows.tolist() == last
            assert idx.prefix_lens.tolist() == prefix and idx.seq_lens.tolist() == seq
            assert idx.extend_lens.tolist() == idx.extend_lens_cpu == \
                [g.end - g.begin for g in segs]
            assert idx.prefix_lens.dtype == idx.extend_lens.dtype == torch.int32
            assert idx.req_pool_indices.dtype == idx.seq_lens.dtype == idx.last_rows.dtype \
                == idx.positions.dtype == torch.int64
            assert idx.req_pool_indices.tolist() == [rows[g.req] for g in segs]
            assert idx.batch_positions == [batch_positions[g.req] for g in segs]
            assert idx.final == [g.final for g in segs]
            if with_cpu:
                assert idx.prefix_lens_cpu == prefix and idx.seq_lens_cpu.tolist() == seq
            else:
                assert idx.prefix_lens_cpu is None and idx.seq_lens_cpu is None
    with pytest.raises(ValueError, match="outside"):
        build_catch_up_indices([Segment(0, 0, 5, True)], req_pool_indices=torch.tensor([0]),
                               ends=torch.tensor([9]), counts=[4], batch_positions=[0],
                               req_to_token=torch.zeros(1, 16, dtype=torch.int32))
    seg, table = [Segment(0, 0, 4, True)], torch.zeros(1, 16, dtype=torch.int32)
    for bad, match in (({"ends_cpu": [9]}, "both rows_cpu and ends_cpu"),
                       ({"rows_cpu": [0], "ends_cpu": [3]}, "more tokens than it holds"),
                       ({"rows_cpu": [0, 1], "ends_cpu": [9]}, "2 rows and 1 lengths"),
                       ({}, "rows_cpu and ends_cpu")):
        with pytest.raises(ValueError, match=match):
            build_catch_up_indices(seg, counts=[4], batch_positions=[0], req_to_token=table,
                                   **bad)


# ---------------------------------------------------------- whole lifetimes, lazy vs current

class _Sim:
    """Requests on a shared KV slot pool, stepped in decode and spec mode; 'draft KV' at a slot
    is the draft's input there (token at p+1, target aux at p): for a one-layer EAGLE-3 draft
    that input alone determines the K/V written at p. keep-current writes it every decode
    step; lazy stashes and catches up with the real backlog / arena / index / room code.

    Prompts are prefilled in chunks of at most `chunk` tokens (None: whole), and other steps
    may run between a prompt's chunks. With `defer`, the lazy run defers a chunk's draft
    extend at random (always when it continues a deferred chunk, as the worker does) when the
    arena has room for it plus `reserve` (if more chunks follow)."""

    A = 3

    def __init__(self, lazy: bool, rows=6, slots=1200, ctx=160, cells=None, max_tokens=7,
                 seed=0, defer=False, reserve=0, chunk=None, max_prompt=8):
        self.lazy, self.R, self.ctx, self.max_tokens = lazy, rows, ctx, max_tokens
        self.defer, self.reserve, self.chunk, self.max_prompt = defer, reserve, chunk, max_prompt
        self.rng = random.Random(seed)
        self.defer_rng = random.Random(seed + 1000)   # the lazy run's own coin: same schedule
        self.free = list(range(1, slots))
        self.rng.shuffle(self.free)
        self.req_to_token = torch.zeros(rows, ctx, dtype=torch.int32)
        self.kv = torch.full((slots, 1 + self.A), float("nan"))
        self.seq: dict[int, int] = {}       # running row -> committed length
        self.filling: dict[int, list[int]] = {}   # row -> [prefilled, prompt] mid-prompt
        self.owner: dict[int, int] = {}     # row -> request id
        self.held: dict[int, list[int]] = {}
        self.restarted: set[int] = set()    # request ids whose deferred chunk went EAGLE's way
        self.next_id = 0
        self.backlog = LazyBacklog(rows, cells or rows)
        self.arena = StashArena.allocate(cells or rows, self.A, torch.float32, slots, "cpu")
        self.spec_steps_checked = 0

    # the target's outputs, a function of (request, position) only
    def token(self, rid, p):
        return (rid * 7919 + p * 31) % 997 + 2

    def aux(self, rid, p):
        return [float(rid), float(p), float(rid * p % 101)]

    def truth(self, rid, p):
        return torch.tensor([float(self.token(rid, p + 1))] + self.aux(rid, p))

    def slot(self, row, p):
        s = self.free.pop()
        self.req_to_token[row, p] = s
        self.held[row].append(s)
        return s

    def running(self):
        return sorted(self.seq)        # batch order (any fixed order works)

    def admit(self, row, prompt):
        self.owner[row], self.held[row] = self.next_id, []
        self.next_id += 1
        self.filling[row] = [0, prompt]
        self.prefill(row)

    def prefill(self, row):
        """One prefill chunk of `row`'s prompt: EAGLE's prefill draft extend, or deferred."""
        start, total = self.filling[row]
        n = min(total - start, self.chunk or total)
        final = start + n == total
        rid, b = self.owner[row], self.backlog
        slots = [self.slot(row, p) for p in range(start, start + n)]
        want = self.lazy and self.defer and (b.continues_deferred_chunk([row], [start])
                                             or self.defer_rng.random() < 0.6)
        if want and b.can_defer(n, reserve=0 if final else self.reserve,
                                chunked_prompt=None if final else total):
            base = b.note_prefill([row], [start], [n], chunked=-1 if final else 0)
            self.arena.write(base, torch.tensor([self.aux(rid, p) for p in range(start, start + n)]),
                             torch.tensor([self.token(rid, p + 1)
                                           for p in range(start, start + n)]),
                             torch.tensor(slots))
        else:
            for p, s in zip(range(start, start + n), slots):
                self.kv[s] = self.truth(rid, p)
            if self.lazy:
                if b.continues_deferred_chunk([row], [start]):
                    self.restarted.add(rid)
                b.reset([row], prefix_lens=[start])
        if final:
            del self.filling[row]
            self.seq[row] = total
        else:
            self.filling[row][0] = start + n

    def finish(self, row):
        self.free += self.held.pop(row)
        self.rng.shuffle(self.free)
        del self.seq[row], self.owner[row]

    def catch_up(self, rows, forced):
        behind = self.backlog.behind(rows)
        if behind.positions.size == 0:
            return []
        ends = torch.tensor([self.seq[r] for r in rows])[torch.from_numpy(behind.positions)]
        rpi = torch.tensor(rows)[torch.from_numpy(behind.positions)]
        for segs in plan_passes(behind.counts, self.max_tokens):
            idx = build_catch_up_indices(segs, req_pool_indices=rpi, ends=ends,
                                         counts=behind.counts, batch_positions=behind.positions,
                                         req_to_token=self.req_to_token)
            aux, tok = self.arena.gather(idx.slots)
            self.kv[idx.slots] = torch.cat([tok[:, None].float(), aux], dim=1)
            # the proposal rows are each request's last position behind, end - 1
            for j, g in enumerate(segs):
                if g.final:
                    assert int(idx.positions[idx.last_rows[j]]) == self.seq[rows[
                        int(behind.positions[g.req])]] - 1
        self.backlog.caught_up(np.asarray(rows)[behind.positions], forced=forced)
        return stash_room.front_pending(self.arena, self.backlog, self.req_to_token,
                                        np.asarray(rows, dtype=np.int64), "cpu")

    def decode(self):
        rows = self.running()
        if self.lazy:
            owed = int(self.backlog.behind(np.asarray(rows, dtype=np.int64)).counts.sum())
            room = stash_room.make_room(
                self.arena, self.backlog, self.req_to_token, np.asarray(rows, dtype=np.int64),
                reserve=self.reserve, req_pool_indices=torch.tensor(rows),
                seq_lens=torch.tensor([self.seq[r] for r in rows]),
                catch_up=lambda behind: self.catch_up(rows, forced=True))
            # A forced catch-up reports what it brought up to date (the step's cost holds it).
            assert room.caught_up_tokens == (owed if room.action is RoomAction.CATCH_UP else 0)
        slots, aux, tok = [], [], []
        for r in rows:
            L, rid = self.seq[r], self.owner[r]
            s = self.slot(r, L)
            if self.lazy:
                slots.append(s)
                aux.append(self.aux(rid, L))
                tok.append(self.token(rid, L + 1))
            else:
                self.kv[s] = self.truth(rid, L)
            self.seq[r] = L + 1
        if self.lazy:
            base = self.backlog.note_decode_step(rows)
            self.arena.write(base, torch.tensor(aux), torch.tensor(tok), torch.tensor(slots))

    def spec(self):
        rows = self.running()
        if self.lazy:
            self.catch_up(rows, forced=False)
        self.assert_current(rows)                   # never draft from a stale state
        self.spec_steps_checked += 1
        for r in rows:
            rid, L = self.owner[r], self.seq[r]
            for p in range(L, L + self.rng.randint(1, 4)):     # accepted tokens
                self.kv[self.slot(r, p)] = self.truth(rid, p)
            self.seq[r] = p + 1

    def assert_current(self, rows):
        for r in rows:
            rid = self.owner[r]
            if rid in self.restarted:
                continue
            got = self.kv[self.req_to_token[r, : self.seq[r]].long()]
            want = torch.stack([self.truth(rid, p) for p in range(self.seq[r])])
            assert torch.equal(got, want), (r, rid)

    def run(self, steps):
        for _ in range(steps):
            if self.lazy:
                # Every token behind holds a cell, so an empty arena means nobody is behind
                # (the backlog's fast path reads no counts then).
                assert self.backlog.count.sum() <= self.backlog.cursor
            free_rows = [r for r in range(self.R) if r not in self.owner]
            if self.filling and self.rng.random() < 0.5:
                self.prefill(self.rng.choice(sorted(self.filling)))
            elif free_rows and self.rng.random() < 0.3:
                self.admit(self.rng.choice(free_rows), self.rng.randint(1, self.max_prompt))
            elif self.seq and self.rng.random() < 0.1:
                self.finish(self.rng.choice(self.running()))
            elif self.seq:
                full = any(self.seq[r] + 4 >= self.ctx for r in self.seq)
                if full:
                    self.finish(max(self.seq, key=self.seq.get))
                elif self.rng.random() < 0.3:
                    self.spec()
                else:
                    self.decode()
        return self


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cells,max_tokens", [(6, 3), (40, 7), (400, 64)])
def test_lazy_catch_up_leaves_the_draft_state_keep_current_leaves(seed, cells, max_tokens):
    lazy = _Sim(True, cells=cells, max_tokens=max_tokens, seed=seed).run(400)
    current = _Sim(False, seed=seed).run(400)
    assert lazy.spec_steps_checked > 10 and lazy.spec_steps_checked == current.spec_steps_checked
    assert lazy.seq == current.seq and lazy.owner == current.owner
    rows = lazy.running()
    lazy.catch_up(rows, forced=False)
    lazy.assert_current(rows)
    current.assert_current(rows)
    s = lazy.backlog.stats
    assert s.catch_ups > 0 and s.caught_up_tokens > 0
    if cells == 6:
        assert s.forced_catch_ups > 0          # a tiny arena forces catch-ups in decode mode


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cells,reserve,chunk", [(24, 4, 4), (60, 5, 5), (400, 6, 6),
                                                 (400, 0, None)])
def test_deferred_prefills_and_compactions_leave_the_draft_state_keep_current_leaves(
        seed, cells, reserve, chunk):
    kw = dict(seed=seed, chunk=chunk, max_prompt=14, max_tokens=9)
    lazy = _Sim(True, cells=cells, defer=True, reserve=reserve, **kw).run(500)
    current = _Sim(False, **kw).run(500)
    assert lazy.spec_steps_checked > 10 and lazy.spec_steps_checked == current.spec_steps_checked
    assert lazy.seq == current.seq and lazy.owner == current.owner
    rows = lazy.running()
    lazy.catch_up(rows, forced=False)
    lazy.assert_current(rows)
    s = lazy.backlog.stats
    assert s.deferred_prefills > 0 and s.deferred_prefill_tokens > 0
    assert s.chunk_restarts == len(lazy.restarted)
    if cells == 400:
        assert s.chunk_restarts == 0            # room for every deferred prompt's next chunk
    if cells == 24:
        assert s.compactions > 0                # orphans reclaimed without draft work


def test_a_deferred_chunked_prompt_never_fills_the_arena_under_a_large_batch():
    """The reported crash: 24 cells, a reserve of 4, a 40-token prompt in chunks of 20 while
    five requests decode between its chunks. Deferring the first chunk would leave 20 pending
    cells that no catch-up frees, and a decode step of 5 would find no room (20 + 5 > 24). The
    deferral rule now refuses that chunk (EAGLE's prefill runs), so nothing overflows."""
    sim = _Sim(True, rows=6, cells=24, defer=True, reserve=4, chunk=20, max_prompt=8, seed=3)
    sim.defer_rng.random = lambda: 0.0                  # every chunk would like to defer
    for row in range(5):
        sim.admit(row, 6)
    sim.admit(5, 40)                                     # chunk 1 of 2: 20 tokens
    for _ in range(12):
        sim.decode()                                     # five rows, between the chunks
    sim.prefill(5)                                       # chunk 2: the prompt completes
    for _ in range(6):
        sim.decode()
    sim.spec()                                           # catches up; drafts from current state
    b = sim.backlog
    assert b.pending_cells() == 0 and b.cursor <= b.arena_cells
    # The rule itself: the first chunk is refused only when the whole prompt plus a decode
    # step of every row could not stay in the arena.
    fresh = LazyBacklog(6, 24)
    assert not fresh.can_defer(20, reserve=4, chunked_prompt=40)
    assert fresh.can_defer(8, reserve=4, chunked_prompt=16)       # 16 + 6 <= 24
    assert fresh.can_defer(20)                                    # a whole prompt: no pending


@pytest.mark.parametrize("seed", range(8))
def test_deferred_chunked_prompts_under_a_small_arena_never_overflow(seed):
    """Random lifetimes with long chunked prompts in a small arena: no 'stash arena full'."""
    lazy = _Sim(True, rows=6, cells=30, defer=True, reserve=4, chunk=10, max_prompt=40,
                max_tokens=9, seed=seed).run(600)
    rows = lazy.running()
    lazy.catch_up(rows, forced=False)
    lazy.assert_current(rows)


# ============================================================ with SGLang 0.5.17 (CPU only)

@pytest.fixture
def sgl(supported_sglang):
    from dual_graph_worker.engines.sglang import lazy_sync

    return lazy_sync


def _bare_lazy(lazy_sync, rows=8, cells=16, slots=64, aux_width=4, topk=1, draft=None,
               kv_only=False):
    lz = object.__new__(lazy_sync.LazyCatchUp)
    lz.dw = draft or SimpleNamespace(topk=topk)
    lz.req_to_token = torch.arange(rows * 32, dtype=torch.int32).reshape(rows, 32)
    lz.arena = StashArena.allocate(cells, aux_width, torch.float32, slots * 8, "cpu")
    lz.backlog = LazyBacklog(rows, cells)
    lz.max_pass_tokens = 8192
    lz.prefill_reserve = 0
    lz.defer_prefill_off = None
    lz.kv_only_off = None if kv_only else "off"
    lz.kv_only_min_tokens = 1
    lz.kv_check = False
    lz.draft_hidden = (6, torch.float32)
    lz.on_event = None
    return lz


def test_rows_of_reads_host_rows(sgl):
    b = SimpleNamespace(req_pool_indices_cpu=torch.tensor([4, 2]), seq_lens=torch.zeros(2))
    assert sgl.rows_of(b).tolist() == [4, 2]
    b = SimpleNamespace(req_pool_indices_cpu=None, seq_lens=torch.zeros(2),
                        reqs=[SimpleNamespace(req_pool_idx=3), SimpleNamespace(req_pool_idx=1)])
    assert sgl.rows_of(b).tolist() == [3, 1]
    with pytest.raises(RuntimeError, match="host request-pool rows"):
        sgl.rows_of(SimpleNamespace(req_pool_indices_cpu=torch.tensor([1]),
                                    seq_lens=torch.zeros(2)))


def test_row_context_total_follows_its_rows_while_the_batch_keeps_its_row_tensor(sgl):
    from dual_graph_worker.engines.sglang.row_context import RowContext

    ctx = RowContext(8)
    first = SimpleNamespace(req_pool_indices_cpu=torch.tensor([4, 2]), seq_lens=torch.zeros(2))
    rows, total = ctx.of(first)
    ctx.admitted(rows, np.array([100, 30]))
    rows, total = ctx.of(first)
    assert rows.tolist() == [4, 2] and total == 130 and not rows.flags.writeable
    ctx.advanced(rows, np.array([3.0, 1.0]), 4)              # the same batch's step
    assert ctx.of(first) == (rows, 134)
    again = SimpleNamespace(req_pool_indices_cpu=torch.tensor([4, 2]), seq_lens=torch.zeros(2))
    assert ctx.of(again)[1] == 134                          # as summed afresh
    assert ctx.of(first)[1] == 134
    # A step of an older batch that shares a row moves the total of the current one.
    ctx.advanced(np.array([2, 5]), np.array([2.0, 2.0]), 4)
    assert ctx.of(first)[1] == 136
    # A new row tensor (SGLang's filter or merge) is read afresh.
    merged = SimpleNamespace(req_pool_indices_cpu=torch.tensor([4, 2, 5]), seq_lens=torch.zeros(3))
    assert ctx.of(merged)[1] == 138
    ctx.admitted(np.array([5]), np.array([7]))
    assert ctx.of(merged)[1] == 143


def test_row_context_keeps_every_rows_length_while_steps_wait_to_be_applied(sgl):
    """A steady batch's steps reach the rows' own lengths only every _FLUSH_STEPS: a new row
    tensor, a re-admitted row or a step of another batch must still see every one of them."""
    from dual_graph_worker.engines.sglang.row_context import RowContext

    ctx = RowContext(8)
    batch = SimpleNamespace(req_pool_indices_cpu=torch.tensor([1, 3]), seq_lens=torch.zeros(2))
    rows, _ = ctx.of(batch)
    ctx.admitted(rows, np.array([10, 20]))
    rows, _ = ctx.of(batch)
    steps = RowContext._FLUSH_STEPS + 5                     # one flush, then 5 waiting
    for _ in range(steps):
        ctx.advanced(rows, [2.0, 1.0], 3)
    assert ctx.of(batch) == (rows, 30 + 3 * steps)
    one = SimpleNamespace(req_pool_indices_cpu=torch.tensor([3]), seq_lens=torch.zeros(1))
    assert ctx.of(one)[1] == 20 + steps                     # row 3 alone, read afresh
    rows, _ = ctx.of(batch)
    ctx.advanced(rows, [1.0, 1.0], 2)
    ctx.admitted(np.array([1]), np.array([5]))              # row 1 holds a new request
    assert ctx.of(batch)[1] == 5 + 20 + steps + 1


def test_carried_draft_input_keeps_spec_shapes_without_new_tensors(sgl):
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    di = EagleDraftInput(topk_p=torch.rand(3, 1), topk_index=torch.zeros(3, 1, dtype=torch.int64),
                         hidden_states=torch.rand(3, 5), bonus_tokens=torch.zeros(3))
    out = sgl.LazyCatchUp.carried_draft_input(di, torch.tensor([4, 5, 6]), topk=1)
    assert out.topk_p is di.topk_p and out.topk_index is di.topk_index
    assert out.hidden_states is di.hidden_states
    assert out.bonus_tokens.dtype == torch.int32 and out.bonus_tokens.tolist() == [4, 5, 6]
    with pytest.raises(RuntimeError, match="topk_p"):
        sgl.LazyCatchUp.carried_draft_input(di, torch.tensor([4, 5]), topk=1)
    di.hidden_states = None
    with pytest.raises(RuntimeError, match="hidden_states"):
        sgl.LazyCatchUp.carried_draft_input(di, torch.tensor([4, 5, 6]), topk=1)


def test_merge_never_writes_in_place(sgl):
    old = torch.zeros(4, 2)
    new = torch.ones(2, 2, dtype=torch.float64)
    out = sgl._merge(old, torch.tensor([3, 1]), new)
    assert out.dtype == old.dtype and out[:, 0].tolist() == [0., 1., 0., 1.]
    assert not old.any()
    assert sgl._merge(old, None, torch.ones(4, 2)) is not old


def test_stash_and_make_room(sgl):
    lz = _bare_lazy(sgl, rows=8, cells=8)
    rows = np.array([5, 1, 2])
    lz.stash(rows, aux=torch.rand(3, 4), sampled=torch.tensor([1, 2, 3]),
             out_cache_loc=torch.tensor([10, 11, 12]))
    assert lz.backlog.cursor == 3 and lz.backlog.count[[5, 1, 2]].tolist() == [1, 1, 1]
    with pytest.raises(RuntimeError, match="do not match the stash"):
        lz.stash(rows, aux=torch.rand(3, 5), sampled=torch.zeros(3),
                 out_cache_loc=torch.zeros(3, dtype=torch.int64))
    assert lz.backlog.cursor == 3                       # bookkeeping untouched by the error
    with pytest.raises(RuntimeError, match="no hidden states"):
        lz.stash(rows, aux=None, sampled=torch.zeros(3),
                 out_cache_loc=torch.zeros(3, dtype=torch.int64))
    batch = SimpleNamespace(req_pool_indices=torch.tensor([5, 1, 2]),
                            seq_lens=torch.tensor([3, 3, 3]))
    assert lz.before_decode_step(batch, rows) == ([], 0)    # room left: nothing runs
    lz.backlog.note_decode_step([0, 3, 4, 6, 7])       # fills the arena with other rows
    lz.backlog.reset([2])                               # row 2 re-admitted: current
    # Full arena, nobody in this batch behind: the arena holds only orphans, which a
    # compaction drops without a draft forward (the bare LazyCatchUp has no draft runner).
    one = SimpleNamespace(req_pool_indices=torch.tensor([2]), seq_lens=torch.tensor([3]))
    assert lz.before_decode_step(one, np.array([2])) == ([], 0)
    assert lz.backlog.cursor == 0 and lz.backlog.stats.orphans_dropped == 7
    assert lz.backlog.stats.compactions == 1 and lz.backlog.stats.forced_catch_ups == 0


class _FakeDraftRunner:
    """What catch_up_pass.run_pass touches on the draft ModelRunner; forward returns per-row
    logits whose argmax is the position of the row (so proposals are checkable) and hidden =
    position."""

    def __init__(self, vocab=512, hidden=6):
        self.vocab, self.hidden = vocab, hidden
        self.tp_group = None
        self.attn_backend = SimpleNamespace(init_forward_metadata=self._plan)
        self.planned, self.forwards = [], []
        self.server_args = SimpleNamespace(chunked_prefill_size=8192)

    def _plan(self, fb):
        self.planned.append(fb)

    def forward(self, fb):
        self.forwards.append(fb)
        pos = fb.positions
        rows = fb.spec_info.select_index
        logits = torch.full((rows.shape[0], self.vocab), -1.0)
        logits[torch.arange(rows.shape[0]), pos[rows] % self.vocab] = 1.0
        hidden = pos[:, None].float().expand(-1, self.hidden).clone()
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=logits,
                                                             hidden_states=hidden))


def _fake_init_new(view, runner, *, capture_hidden_mode, return_hidden_states_before_norm):
    prefix, ext = view.prefix_lens, view.extend_lens
    pos = torch.cat([torch.arange(int(p), int(p) + int(n)) for p, n in zip(prefix, ext)])
    fb = SimpleNamespace(view=view, positions=pos, spec_info=view.spec_info,
                         capture_hidden_mode=capture_hidden_mode, forward_mode=view.forward_mode,
                         input_ids=view.input_ids, out_cache_loc=view.out_cache_loc,
                         return_logprob=True, extend_seq_lens_cpu=None, ready=False)
    fb.mark_forward_metadata_ready = lambda: setattr(fb, "ready", True)
    return fb


@pytest.fixture
def catch_up_pass(supported_sglang):
    from dual_graph_worker.engines.sglang import catch_up_pass

    return catch_up_pass


@pytest.fixture
def fake_sglang_forward(sgl, catch_up_pass, monkeypatch):
    monkeypatch.setattr(catch_up_pass.ForwardBatch, "init_new", staticmethod(_fake_init_new))
    from dual_graph_worker.engines.sglang import draft_context

    for name in ("speculative_moe_backend_context", "speculative_moe_a2a_backend_context"):
        monkeypatch.setattr(draft_context, name, contextlib.nullcontext)
    monkeypatch.setattr(sgl, "spec_stage_span", lambda *a, **k: contextlib.nullcontext())
    return sgl


def _draft(runner, topk: int) -> SimpleNamespace:
    return SimpleNamespace(topk=topk, draft_runner=runner,
                           draft_tp_context=lambda group: contextlib.nullcontext())


def _rows_5_7_2_behind(lz, host_lens: bool = True) -> tuple:
    """Rows 5, 2 (batch positions 0, 2) ran 3 and 1 lazy decode steps; row 7 (position 1) is
    current (prefilled since); what those steps emitted is stashed (aux = position, token =
    100 + position). The batch's draft input (proposals -1, p 0.5) and the batch."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    seq = {5: 10, 7: 4, 2: 6}
    for step, rws in enumerate([[5, 2], [5], [5]]):
        starts = {5: 7, 2: 5}
        pos = [starts[r] + step for r in rws]
        slots = torch.tensor([int(lz.req_to_token[r, p]) for r, p in zip(rws, pos)])
        lz.stash(np.array(rws), aux=torch.tensor([[float(p)] * 4 for p in pos]),
                 sampled=torch.tensor([100 + p for p in pos]), out_cache_loc=slots)
    batch_rows = [5, 7, 2]
    di = EagleDraftInput(topk_p=torch.full((3, 1), 0.5), hidden_states=torch.zeros(3, 6),
                         topk_index=torch.full((3, 1), -1, dtype=torch.int64),
                         bonus_tokens=torch.tensor([1, 2, 3], dtype=torch.int32))
    batch = SimpleNamespace(
        req_pool_indices_cpu=torch.tensor(batch_rows), req_pool_indices=torch.tensor(batch_rows),
        seq_lens=torch.tensor([seq[r] for r in batch_rows]),
        seq_lens_cpu=torch.tensor([seq[r] for r in batch_rows]) if host_lens else None,
        seq_lens_sum=20, spec_info=di, forward_mode=ForwardMode.DECODE, input_ids=None,
        out_cache_loc=None, sampling_info=None)
    return di, batch


@pytest.mark.parametrize("host_lens", [True, False])
def test_before_spec_step_catches_up_and_installs_proposals(fake_sglang_forward, host_lens):
    sgl = fake_sglang_forward
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    runner = _FakeDraftRunner()
    lz = _bare_lazy(sgl, rows=8, cells=32, draft=_draft(runner, topk=1))
    events = []
    lz.on_event = lambda e: type(e) is sgl.CatchUpEvent and events.append(e._asdict())
    di, batch = _rows_5_7_2_behind(lz, host_lens)
    old_p = di.topk_p
    keep = lz.before_spec_step(batch, sgl.rows_of(batch))
    assert keep and runner.forwards and all(fb.ready for fb in runner.forwards)
    fb = runner.forwards[0]
    v = fb.view
    assert v.forward_mode == ForwardMode.DRAFT_EXTEND_V2 and fb.return_logprob is False
    # positions 7..9 of row 5, then position 5 of row 2: (token at p+1, aux at p)
    assert fb.positions.tolist() == [7, 8, 9, 5]
    assert v.input_ids.tolist() == [107, 108, 109, 105]
    assert v.spec_info.hidden_states[:, 0].tolist() == [7., 8., 9., 5.]
    assert v.out_cache_loc.tolist() == [int(lz.req_to_token[5, p]) for p in (7, 8, 9)] + \
        [int(lz.req_to_token[2, 5])]
    assert v.req_pool_indices.tolist() == [5, 2] and v.seq_lens.tolist() == [10, 6]
    assert v.spec_info.select_index.tolist() == [2, 3]
    if host_lens:
        assert (v.prefix_lens, v.extend_lens) == ([7, 5], [3, 1])
        assert v.seq_lens_cpu.tolist() == [10, 6] and v.seq_lens_sum == 16
    else:
        assert v.prefix_lens.tolist() == [7, 5] and v.extend_lens.tolist() == [3, 1]
        assert fb.extend_seq_lens_cpu == [3, 1] and v.seq_lens_cpu is None
    # proposals: rows 0 and 2 replaced (argmax = position of the last row), row 1 kept
    assert di.topk_index[:, 0].tolist() == [9, -1, 5]
    assert di.topk_p[:, 0].tolist() == [1.0, 0.5, 1.0] and old_p[:, 0].tolist() == [0.5] * 3
    assert di.hidden_states[:, 0].tolist() == [9., 0., 5.]
    assert di.bonus_tokens.tolist() == [1, 2, 3]
    assert batch.forward_mode == ForwardMode.DECODE and batch.out_cache_loc is None  # untouched
    assert not lz.backlog.count.any() and lz.backlog.cursor == 0
    (host_us,) = [e.pop("host_us") for e in events]
    assert events == [{"forced": False, "requests": 2, "tokens": 4, "passes": 1,
                       "max_backlog": 3, "orphans": 0, "host_indices": host_lens,
                       "kv_error": None}]
    assert list(host_us) == ["indices", "batch", "metadata", "forward", "proposals",
                             "bookkeeping"]
    assert lz.before_spec_step(batch, sgl.rows_of(batch)) == [] and len(runner.forwards) == 1   # nothing behind


class _KVRunner(_FakeDraftRunner):
    """A draft runner with a KV pool: its forward writes K = V = 1 at the batch's slots
    (unless `writes` is False)."""

    def __init__(self, slots: int = 512, writes: bool = True):
        super().__init__()
        self.writes = writes
        self.k, self.v = torch.zeros(slots, 1, 2), torch.zeros(slots, 1, 2)
        attn = SimpleNamespace(layer_id=32)
        self.model = SimpleNamespace(model=SimpleNamespace(
            layers=[SimpleNamespace(self_attn=SimpleNamespace(attn=attn))]))
        self.token_to_kv_pool = SimpleNamespace(get_key_buffer=lambda layer_id: self.k,
                                                get_value_buffer=lambda layer_id: self.v)

    def forward(self, fb):
        if self.writes:
            self.k[fb.view.out_cache_loc] = self.v[fb.view.out_cache_loc] = 1.0
        return super().forward(fb)


@pytest.mark.parametrize("filled, error, layer_writes", [(1.0, 0.0, True), (0.9, 0.1, True),
                                                         (1.0, 1e30, False)])
def test_a_checked_kv_only_catch_up_logs_how_far_the_fill_was_from_the_layer(
        fake_sglang_forward, catch_up_pass, monkeypatch, filled, error, layer_writes):
    """DGW_CATCH_UP_KV_CHECK: the whole layer runs over the split pass after the fill, its K/V
    replace the fill's, and the event carries their largest relative difference. The fill's
    slots are zeroed first, so a layer that wrote nothing there reads as far off, not exact."""
    sgl = fake_sglang_forward
    runner = _KVRunner(writes=layer_writes)

    def fill(runner_, aux, tokens, positions, slots):
        runner.k[slots] = runner.v[slots] = filled

    monkeypatch.setattr(catch_up_pass, "fill_draft_kv", fill)
    lz = _bare_lazy(sgl, rows=8, cells=32, draft=_draft(runner, topk=1), kv_only=True)
    lz.kv_check = True
    events, gathered = [], []
    lz.on_event = lambda e: type(e) is sgl.CatchUpEvent and events.append(e)
    gather = lz.arena.gather
    lz.arena.gather = lambda slots: gathered.append(slots.tolist()) or gather(slots)
    di, batch = _rows_5_7_2_behind(lz)
    lz.before_spec_step(batch, sgl.rows_of(batch))
    (fb,) = runner.forwards
    assert len(gathered) == 1             # the layer runs on the fill's inputs, not a copy
    assert fb.positions.tolist() == [7, 8, 9, 5]            # the whole layer, every row
    assert di.topk_index[:, 0].tolist() == [9, -1, 5]
    (event,) = events
    assert event.kv_error == pytest.approx(error)


def test_the_controller_learns_of_kv_only_catch_ups_from_the_continuity(sgl, monkeypatch):
    """With K/V-only catch-ups on, the policy's context gets their bound, pass size and this
    draft's share; off, or checked (each split pass then also runs the whole layer), none.
    Passes too short to split turn it off, saying why."""
    from dual_graph_worker.core.batch_costs import CatchUpWork
    from dual_graph_worker.engines.sglang.stash_plan import _passes_too_short

    monkeypatch.setattr(sgl, "kv_share", lambda runner: 0.25)
    draft = _draft(_FakeDraftRunner(), topk=1)
    lz = _bare_lazy(sgl, draft=draft, kv_only=True)
    assert lz.catch_up_work == CatchUpWork(1, 0.25, lz.max_pass_tokens)
    lz.kv_check = True
    assert lz.catch_up_work is None
    assert _bare_lazy(sgl, draft=draft).catch_up_work is None
    assert "chunked_prefill_size" in _passes_too_short(1024, 2048)
    assert "twice" in _passes_too_short(3000, 2048)
    assert _passes_too_short(4096, 2048) is None


def test_a_forced_kv_only_catch_up_runs_no_forward(fake_sglang_forward, monkeypatch):
    """A catch-up forced before a decode step wants no proposals: K/V-only, the fill is all."""
    sgl = fake_sglang_forward
    fills = _recorded_fills(monkeypatch)
    runner = _FakeDraftRunner()
    lz = _bare_lazy(sgl, rows=8, cells=32, draft=_draft(runner, topk=1), kv_only=True)
    _, batch = _rows_5_7_2_behind(lz)
    rows = sgl.rows_of(batch)
    res = lz._catch_up(batch, rows, lz.backlog.behind(rows), forced=True, want_proposals=False)
    assert [f[2] for f in fills] == [[7, 8, 9, 5]] and not runner.forwards
    assert res.event.forced and res.event.tokens == 4 and not lz.backlog.count.any()


@pytest.mark.parametrize("kv_only", [False, True])
def test_catch_up_in_several_passes_installs_the_last_one(fake_sglang_forward, monkeypatch,
                                                          kv_only):
    """Row 3 is five tokens behind, row 0 one, in passes of 2 tokens. K/V-only: every pass's
    K/V filled, then one draft forward over the positions where backlogs end."""
    sgl = fake_sglang_forward
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    fills = _recorded_fills(monkeypatch)
    runner = _FakeDraftRunner()
    lz = _bare_lazy(sgl, rows=4, cells=64, draft=_draft(runner, topk=2), kv_only=kv_only)
    lz.max_pass_tokens = 2
    for p in range(5):                       # row 3 five tokens behind, row 0 one (last step)
        rws = [3] if p < 4 else [3, 0]
        lz.stash(np.array(rws), aux=torch.zeros(len(rws), 4),
                 sampled=torch.zeros(len(rws), dtype=torch.int64),
                 out_cache_loc=torch.tensor([int(lz.req_to_token[r, 20 + p]) for r in rws]))
    di = EagleDraftInput(topk_p=torch.zeros(2, 2), topk_index=torch.zeros(2, 2, dtype=torch.int64),
                         hidden_states=torch.zeros(2, 6), bonus_tokens=torch.zeros(2))
    batch = SimpleNamespace(req_pool_indices_cpu=torch.tensor([3, 0]),
                            req_pool_indices=torch.tensor([3, 0]),
                            seq_lens=torch.tensor([25, 25]), seq_lens_cpu=None, spec_info=di,
                            sampling_info=None)
    lz.before_spec_step(batch, sgl.rows_of(batch))
    passes = [[20, 21], [24], [22, 23], [24]]
    assert [f[2] for f in fills] == (passes if kv_only else [])
    assert [f.positions.tolist() for f in runner.forwards] == \
        ([[24, 24]] if kv_only else passes)
    assert di.topk_index[:, 0].tolist() == [24, 24] and di.topk_index.shape == (2, 2)
    assert di.hidden_states[:, 0].tolist() == [24., 24.]


def test_a_catch_up_mixing_filled_and_whole_passes_installs_every_proposal(
        fake_sglang_forward, monkeypatch):
    """Row 5's three tokens fill a pass (its last row waits for the joined forward); row 2's one
    token is too short to split and runs the whole layer in between: both proposals land in
    their batch positions, in the order the forwards gave them."""
    sgl = fake_sglang_forward
    fills = _recorded_fills(monkeypatch)
    runner = _FakeDraftRunner()
    lz = _bare_lazy(sgl, rows=8, cells=32, draft=_draft(runner, topk=1), kv_only=True)
    lz.max_pass_tokens = lz.kv_only_min_tokens = 3
    di, batch = _rows_5_7_2_behind(lz)
    assert lz.before_spec_step(batch, sgl.rows_of(batch))
    assert [f[2] for f in fills] == [[7, 8, 9]]
    assert [fb.positions.tolist() for fb in runner.forwards] == [[5], [9]]
    assert di.topk_index[:, 0].tolist() == [9, -1, 5]
    assert di.hidden_states[:, 0].tolist() == [9., 0., 5.]
    assert not lz.backlog.count.any()


def _recorded_fills(monkeypatch) -> list:
    from dual_graph_worker.engines.sglang import catch_up_pass

    fills = []

    def fill(runner, aux, tokens, positions, slots):
        fills.append((aux[:, 0].tolist(), tokens.tolist(), positions.tolist(), slots.tolist()))

    monkeypatch.setattr(catch_up_pass, "fill_draft_kv", fill)
    return fills


@pytest.mark.parametrize("min_tokens", [1, 5])
def test_a_kv_only_catch_up_fills_every_row_and_runs_the_layer_at_the_last(
        fake_sglang_forward, monkeypatch, min_tokens):
    """DGW_CATCH_UP_KV_ONLY: the K/V of every backlog position are filled from the stash, and
    the draft's forward runs over each request's last position alone, behind them; the
    proposals installed are those of the whole-layer catch-up. A pass under
    kv_only_min_tokens (here 4 tokens against 5) runs the whole layer."""
    sgl = fake_sglang_forward
    fills = _recorded_fills(monkeypatch)
    runner = _FakeDraftRunner()
    lz = _bare_lazy(sgl, rows=8, cells=32, draft=_draft(runner, topk=1), kv_only=True)
    lz.kv_only_min_tokens = min_tokens
    di, batch = _rows_5_7_2_behind(lz)
    assert lz.before_spec_step(batch, sgl.rows_of(batch))
    assert di.topk_index[:, 0].tolist() == [9, -1, 5]
    assert di.hidden_states[:, 0].tolist() == [9., 0., 5.]
    assert not lz.backlog.count.any()
    (fb,) = runner.forwards
    if min_tokens > 4:
        assert not fills and fb.positions.tolist() == [7, 8, 9, 5]
        return
    slot = {(r, p): int(lz.req_to_token[r, p]) for r, p in ((5, 7), (5, 8), (5, 9), (2, 5))}
    assert fills == [([7., 8., 9., 5.], [107, 108, 109, 105], [7, 8, 9, 5], list(slot.values()))]
    v = fb.view
    assert fb.positions.tolist() == [9, 5] and v.input_ids.tolist() == [109, 105]
    assert v.spec_info.hidden_states[:, 0].tolist() == [9., 5.]
    assert v.out_cache_loc.tolist() == [slot[5, 9], slot[2, 5]]
    assert (v.prefix_lens, v.extend_lens) == ([9, 5], [1, 1])
    assert v.seq_lens.tolist() == [10, 6] and v.spec_info.select_index.tolist() == [0, 1]


def test_validator_refuses_lazy_with_pd_and_unified_memory(sgl):
    from dual_graph_worker.engines.sglang.continuity_launch import LazyCatchUpLaunch

    check = LazyCatchUpLaunch.check_server_args
    check(SimpleNamespace(disaggregation_mode="null"))
    with pytest.raises(ConfigError, match="disaggregation"):
        check(SimpleNamespace(disaggregation_mode="decode"))
    with pytest.raises(ConfigError, match="unified-memory"):
        check(SimpleNamespace(disaggregation_mode="null", enable_unified_memory=True))
    # Any backend but triton, flashinfer and fa3 (Hopper's default): refused before the
    # weights load, naming the flag to add; those three, or the draft's default, pass.
    for name in ("attention_backend", "decode_attention_backend",
                 "speculative_draft_attention_backend"):
        with pytest.raises(ConfigError, match="--attention-backend triton"):
            check(SimpleNamespace(**{name: "trtllm_mha"}))
    check(SimpleNamespace(attention_backend="fa3"))
    check(SimpleNamespace(attention_backend="triton", prefill_attention_backend=None))
    check(SimpleNamespace(attention_backend="flashinfer", decode_attention_backend="triton"))



def test_the_catch_up_refuses_a_draft_backend_it_was_not_checked_against(sgl):
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from dual_graph_worker.engines.sglang.lazy_sync import LazyCatchUp

    def draft(backend):
        return SimpleNamespace(draft_runner=SimpleNamespace(attn_backend=backend))

    with pytest.raises(ConfigError, match="--attention-backend triton"):
        LazyCatchUp(draft(object()), None, None, stash_mb=0)
    # A triton or flashinfer backend passes the check (and fails later, on the missing pool).
    for backend in (TritonAttnBackend, FlashInferAttnBackend):
        with pytest.raises(AttributeError):
            LazyCatchUp(draft(backend.__new__(backend)), None, None, stash_mb=0)


# ------------------------------------------------------------------------- the worker glue

@pytest.fixture
def lazy_worker(bare_sglang_worker):
    from dual_graph_worker.engines.sglang.continuity import KeepCurrent

    def make(lazy):
        w = bare_sglang_worker(ThresholdPolicy(threshold=4, num_draft_tokens=3),
                               continuity=lazy or KeepCurrent("draft-worker", "width-1-graphs"))
        w.planner = StepPlanner(DispatchTable.build([1, 2, 4], [1, 2, 4, 8, 16]), w.planner.policy)
        w.req_to_token_pool = _RowPool(size=64)
        return w

    return make


class _RowPool:
    """SGLang's ReqToTokenPool as far as the worker reads it: size and available_size()."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.used = 0

    def available_size(self) -> int:
        return self.size - self.used


def _extend_batch(rows, length, queued=0, in_batch=False):
    """A prefill batch of request-pool `rows`, each `length` tokens long after it."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    n = len(rows)
    return SimpleNamespace(forward_mode=ForwardMode.EXTEND, is_extend_in_batch=in_batch,
                           seq_lens=torch.full((n,), length), seq_lens_cpu=torch.full((n,), length),
                           extend_num_tokens=length * n, req_pool_indices_cpu=torch.tensor(rows),
                           dgw_queued_requests=queued)


def _previewing(lazy_worker, monkeypatch, pending_per_row):
    """A lazy worker whose prefills defer when the next step decodes, and the previews it
    asks its planner for."""
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    lazy = SimpleNamespace(on_prefill=lambda b: None,
                           pending_tokens=lambda rows: pending_per_row * len(rows),
                           defers_prefill_of=lambda b, decodes: decodes())
    w = lazy_worker(lazy)
    monkeypatch.setattr(EAGLEWorkerV2, "forward_batch_generation",
                        lambda self, batch, on_publish=None, grammar_barrier=None: "prefill")
    monkeypatch.setattr(type(w), "_deferred_prefill", lambda self, batch, on_publish: "deferred")
    previews = []
    preview = w.planner.preview
    w.planner.preview = lambda bs, **kw: previews.append((bs, kw)) or preview(bs, **kw)
    return w, previews


def test_a_prefills_preview_prices_the_drafts_prefill_of_the_whole_wave(sgl, lazy_worker,
                                                                         monkeypatch):
    """A wave of long prompts reaches the worker in chunks: the first chunk's preview prices the
    draft's prefill of its own prompts and of those queued behind it that the request pool can
    admit, at its mean, with what the draft owes the running batch it joins."""
    w, previews = _previewing(lazy_worker, monkeypatch, pending_per_row=100)
    chunk = lambda rows, queued: _extend_batch(rows, 2048, queued)

    w.req_to_token_pool.used = 4                       # an idle server: the wave's first chunk
    w.forward_batch_generation(chunk([0, 1, 2, 3], queued=60))
    assert previews[-1] == (64, {"kv_tokens": 64 * 2048, "prefill_tokens": 64 * 2048,
                                 "catch_up_tokens": 0})
    # The next chunk joins those four (deferred: the draft owes them their prompts) ...
    w.req_to_token_pool.used = 8
    w.forward_batch_generation(chunk([4, 5, 6, 7], queued=56))
    assert previews[-1][1]["catch_up_tokens"] == 4 * 100
    assert previews[-1][1]["prefill_tokens"] == 60 * 2048
    # ... and at a full pool only this chunk's requests join, whatever waits behind them.
    w.req_to_token_pool.size, w.req_to_token_pool.used = 8, 8
    w._running_rows = np.arange(4)
    w.forward_batch_generation(chunk([4, 5, 6, 7], queued=600))
    assert previews[-1] == (8, {"kv_tokens": 8 * 2048, "prefill_tokens": 4 * 2048,
                                "catch_up_tokens": 4 * 100})


def test_a_prefills_preview_prices_the_running_requests_at_their_own_context(
        sgl, lazy_worker, monkeypatch):
    """Spec steps grow with context far faster than decode's: a short prompt joining requests
    8k tokens deep previews the batch at their 8k, not at the short prompt's length."""
    w, previews = _previewing(lazy_worker, monkeypatch, pending_per_row=0)

    def prefill(rows, length, queued=0):
        w.req_to_token_pool.used = max(rows) + 1
        return w.forward_batch_generation(_extend_batch(rows, length, queued))

    prefill([0, 1, 2, 3], 8192)
    w._context.advanced(np.arange(4), [3.0] * 4, 12)           # a step of theirs
    prefill([4], 200, queued=2)
    assert previews[-1] == (7, {"kv_tokens": 4 * 8195 + 200 + 2 * 200,
                                "prefill_tokens": 3 * 200, "catch_up_tokens": 0})


def test_a_prefill_under_mlp_sync_is_admitted_by_the_worker(sgl, lazy_worker, monkeypatch):
    """SGLang sets is_extend_in_batch on every prefill when MLP sync is on (an MoE all-to-all
    backend, no DP attention): the worker's own prefill still runs, so the request is admitted
    (its row's backlog and estimates reset) and its draft prefill may be deferred."""
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    lazy = SimpleNamespace(on_prefill=lambda b: None, pending_tokens=lambda rows: 0,
                           defers_prefill_of=lambda b, decodes: True)
    w = lazy_worker(lazy)
    monkeypatch.setattr(EAGLEWorkerV2, "forward_batch_generation",
                        lambda self, batch, on_publish=None, grammar_barrier=None: "eagle")
    monkeypatch.setattr(type(w), "_deferred_prefill", lambda self, batch, on_publish: "deferred")
    admitted = []
    observe = w.planner.policy.observe
    w.planner.policy.observe = lambda e: admitted.append(type(e).__name__) or observe(e)
    w.req_to_token_pool.used = 2
    assert w.forward_batch_generation(_extend_batch([0, 1], 64, in_batch=True)) == "deferred"
    assert admitted == ["Admitted"]


def test_a_radix_cache_that_ends_deferral_tells_the_policy(sgl, lazy_worker):
    """SGLang builds its radix cache after the policy: when lazy catch-up cannot keep it
    draft-valid, deferral ends, and the policy hears that prompts now run the draft's prefill."""
    from dual_graph_worker.core.policy import DraftPrefills

    lazy = SimpleNamespace(on_prefill=lambda b: None, pending_tokens=lambda rows: 0,
                           defers_prefill=True)
    lazy.tree_unclamped = lambda name: setattr(lazy, "defers_prefill", False)
    w = lazy_worker(lazy)
    seen = []
    w.planner.policy.observe = seen.append
    w._tree_unclamped("HiRadixCache")
    assert seen == [DraftPrefills(deferred=False)]


@pytest.mark.parametrize("deferred", [True, False])
def test_both_kinds_of_prefill_are_stamped_once_launched(sgl, lazy_worker, monkeypatch, deferred):
    """Their costs are compared (the draft's prefill rate is the difference): each is stamped
    after its own launch, as a decode step is, so neither holds its host launch and the other
    not."""
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    lazy = SimpleNamespace(on_prefill=lambda b: None, pending_tokens=lambda rows: 0,
                           defers_prefill_of=lambda b, decodes: deferred)
    w = lazy_worker(lazy)
    stamped_at_launch = []
    launch = lambda *a, **k: stamped_at_launch.append(w._clock.in_flight) or "launched"
    monkeypatch.setattr(EAGLEWorkerV2, "forward_batch_generation", launch)
    monkeypatch.setattr(type(w), "_deferred_prefill", launch)
    w.req_to_token_pool.used = 2
    assert w.forward_batch_generation(_extend_batch([0, 1], 64)) == "launched"
    assert stamped_at_launch == [0] and w._clock.peek().draft is not deferred


def test_a_forced_catch_up_in_a_decode_step_is_timed_and_counted_as_one(sgl, lazy_worker,
                                                                          monkeypatch):
    """A full stash makes a decode step catch the draft up first: its cost goes to the
    catch-up fit, not to decode's step time, and the counters see the catch-up."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    lazy = SimpleNamespace(pending_tokens=lambda rows: 0,
                           before_decode_step=lambda b, r: RoomMade(["kept"], 120))
    w = lazy_worker(lazy)
    handed = []
    monkeypatch.setattr(type(w), "_decode_step", lambda self, batch, rows, keep_alive, *a:
                        handed.append(keep_alive) or "decode-result")
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, is_extend_in_batch=False,
                            seq_lens=torch.zeros(8, dtype=torch.int64),
                            req_pool_indices_cpu=torch.arange(8))
    assert w.forward_batch_generation(batch) == "decode-result"     # 8 > 4: decode
    assert handed == [["kept"]]
    tag = w._clock.peek()
    assert (tag.mode.value, tag.catch_up_tokens) == ("decode", 120)
    assert (w.counters.catch_ups, w.counters.catch_up_tokens) == (1, 120)


def test_worker_routes_lazy_hooks(sgl, lazy_worker, monkeypatch):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    calls = []
    continues = {"chunk": False}
    can_defer = lambda b: b.seq_lens.shape[0] != 7                 # 7: no room
    lazy = SimpleNamespace(on_prefill=lambda b: calls.append("prefill"),
                           before_spec_step=lambda b, r: calls.append("catch-up") or ["fb"],
                           before_decode_step=lambda b, r: NO_ROOM_NEEDED,
                           pending_tokens=lambda rows: 0,
                           defers_prefill_of=lambda b, decodes: can_defer(b) and (
                               decodes() or continues["chunk"]))
    w = lazy_worker(lazy)
    monkeypatch.setattr(EAGLEWorkerV2, "forward_batch_generation",
                        lambda self, batch, on_publish=None, grammar_barrier=None:
                        calls.append("spec") or SimpleNamespace(extra_keep_alive_refs=["x"]))
    monkeypatch.setattr(type(w), "_decode_step", lambda self, batch, rows, keep_alive, on_publish, gb:
                        calls.append("decode") or "decode-result")
    monkeypatch.setattr(type(w), "_deferred_prefill", lambda self, batch, on_publish:
                        calls.append("deferred") or "deferred-result")

    def batch(bs, mode=ForwardMode.DECODE):
        return SimpleNamespace(forward_mode=mode, is_extend_in_batch=False,
                               seq_lens=torch.zeros(bs, dtype=torch.int64),
                               req_pool_indices_cpu=torch.arange(bs), extend_num_tokens=bs)

    def prefill(bs, running, queued=0):
        # The scheduler allocates the prefill's rows before it calls the worker; its queue
        # hook (hooks.py) leaves the number of requests still waiting on the batch.
        w.req_to_token_pool.used = running + bs
        b = batch(bs, ForwardMode.EXTEND)
        if queued:
            b.dgw_queued_requests = queued
        return w.forward_batch_generation(b)

    prefill(3, running=0)                # the batch will speculate (3 <= 4): EAGLE's prefill
    res = w.forward_batch_generation(batch(2))
    assert res.extra_keep_alive_refs == ["x", "fb"]
    prefill(3, running=0)                                     # speculating: EAGLE's prefill
    w.forward_batch_generation(batch(9))
    assert prefill(3, running=9) == "deferred-result"         # decoding: deferred
    prefill(7, running=9)                                     # decoding, no room: EAGLE's
    w.forward_batch_generation(batch(1, ForwardMode.IDLE))
    # prefill: reset then EAGLE's prefill; spec: catch-up first; decode pool; idle: EAGLE only
    assert calls == ["prefill", "spec", "catch-up", "spec", "prefill", "spec", "decode",
                     "deferred", "prefill", "spec", "spec"]

    # The policy decides at the batch size the prefill grows the running batch to, not by
    # the last step's mode: a burst at a speculating server is deferred ...
    calls.clear()
    w.forward_batch_generation(batch(2))
    assert prefill(6, running=2) == "deferred-result"
    # ... and a small prefill at a decoding server whose running batch drained is not.
    w.forward_batch_generation(batch(9))
    prefill(1, running=0)
    assert calls == ["catch-up", "spec", "deferred", "decode", "prefill", "spec"]
    # previews committed nothing: the next step still follows the policy from its last mode
    assert w.planner.plan(3).mode.value == "spec"
    # the first batch of a burst: 3 rows now, 6 requests still queued behind it -> deferred
    calls.clear()
    assert prefill(3, running=0, queued=6) == "deferred-result"
    assert prefill(3, running=0) != "deferred-result"
    # ... unless the server cannot admit them: a pool of 4 rows never runs 9 requests at once
    w.req_to_token_pool.size = 4
    assert prefill(3, running=0, queued=6) != "deferred-result"
    w.req_to_token_pool.size = 64

    # a chunk continuing a deferred prompt is deferred whatever the mode
    calls.clear()
    continues["chunk"] = True
    prefill(3, running=0)
    assert calls == ["deferred"]

    # DGW_STALL_TRACE's sampler hears one beat per call, prefill or step, whatever the path
    w._stall_watch = SimpleNamespace(beats=0)
    w._stall_watch.beat = lambda: setattr(w._stall_watch, "beats", w._stall_watch.beats + 1)
    prefill(3, running=0)
    w.forward_batch_generation(batch(2))
    w.forward_batch_generation(batch(1, ForwardMode.IDLE))
    assert w._stall_watch.beats == 3


def test_deferred_prefill_stashes_the_prompt_and_returns_placeholders(sgl, tmp_path):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    lz = _bare_lazy(sgl, rows=8, cells=64, slots=64, aux_width=4)
    lz.prefill_reserve = 16
    req_a = object()
    req_b = SimpleNamespace(origin_input_ids=list(range(20)))   # 20-token prompt, 7 prefilled
    ids = torch.arange(200, 209)
    batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, multimodal_inputs=[None, None], reqs=[req_a, req_b],
        chunked_req=req_b, chunked_req_next_prompt_token=77, extend_num_tokens=9,
        extend_lens=[5, 4], prefix_lens=[0, 3], input_ids=ids,
        req_pool_indices_cpu=torch.tensor([6, 2]), seq_lens=torch.tensor([5, 7]),
        out_cache_loc=torch.arange(100, 109))
    assert lz.can_defer(batch)                          # 9 tokens + a 16-token reserve fit
    lz.backlog.cursor = 40
    assert not lz.can_defer(batch)
    lz.backlog.cursor = 0
    # The chunked prompt stays pending until its last chunk: the arena must hold it whole
    # plus a decode step of every row (20 + 8 <= 64 here; a 60-token prompt would not fit).
    long = SimpleNamespace(origin_input_ids=list(range(60)))
    assert not lz.can_defer(SimpleNamespace(**{**vars(batch), "chunked_req": long}))
    assert lz.can_defer(SimpleNamespace(**{**vars(batch), "chunked_req": None}))
    lz.backlog.cursor = 0
    assert not lz.can_defer(SimpleNamespace(**{**vars(batch), "multimodal_inputs": [1, None]}))
    lz.defer_prefill_off = "off: the radix cache is on"
    assert not lz.can_defer(batch)
    lz.defer_prefill_off = None
    aux = torch.rand(9, 4)
    with pytest.raises(RuntimeError, match="FULL hidden capture"):
        lz.defer_prefill(batch, aux=torch.rand(9, 5), next_token_ids=torch.tensor([11, 12]))
    assert lz.backlog.cursor == 0                       # nothing recorded by the refusal
    nd = lz.defer_prefill(batch, aux=aux, next_token_ids=torch.tensor([11, 12]))
    # placeholders of spec mode's shapes and dtypes; the sampled tokens are the bonus tokens
    assert nd.topk_p.shape == (2, 1) and nd.topk_p.dtype == torch.float32
    assert nd.topk_index.shape == (2, 1) and nd.topk_index.dtype == torch.int64
    assert nd.hidden_states.shape == (2, 6) and nd.bonus_tokens.tolist() == [11, 12]
    b = lz.backlog
    assert b.count[[6, 2]].tolist() == [5, 4] and b.cursor == 9
    assert b.pending_end[2] == 7 and b.pending_end[6] == -1     # req_b continues (chunked)
    got_aux, got_tok = lz.arena.gather(torch.arange(100, 109))
    assert torch.equal(got_aux, aux)
    # request a: its prompt shifted by one, then its sampled token; request b (chunked): the
    # next prompt token closes its chunk (eagle_utils._eagle_prefill_tail_tokens)
    assert got_tok.tolist() == [201, 202, 203, 204, 11, 206, 207, 208, 77]
    assert lz.must_defer(SimpleNamespace(req_pool_indices_cpu=torch.tensor([2]),
                                         seq_lens=torch.zeros(1), prefix_lens=[7]))


def _decode_fixture(lazy_worker, monkeypatch, lazy):
    """A worker whose target forward, ForwardBatch and draft extend are fakes, for _decode_step."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    from dual_graph_worker.engines.sglang import continuity as continuity_mod
    from dual_graph_worker.engines.sglang import worker as worker_mod

    w = lazy_worker(lazy)
    w.topk = 1
    w.req_to_token_pool = SimpleNamespace(
        req_to_token=torch.arange(8 * 32, dtype=torch.int32).reshape(8, 32))
    aux = torch.rand(2, 4)
    target = SimpleNamespace(logits_output=SimpleNamespace(hidden_states=aux,
                                                           next_token_logprobs=None),
                             next_token_ids=torch.tensor([41, 42]), can_run_cuda_graph=True,
                             routed_experts_output=None, indexer_topk_output=None)
    w._target_worker = SimpleNamespace(model_runner=SimpleNamespace(
        decode_cuda_graph_runner="verify", attn_backend="verify-attn"),
        forward_batch_generation=lambda batch, forward_batch: target)
    w._draft_worker = "draft-worker"
    monkeypatch.setattr(worker_mod.ForwardBatch, "init_new",
                        staticmethod(lambda view, mr, **kw: "target-forward-batch"))
    sync_calls = []

    def fake_sync(dw, batch, *, target_hidden, sampled, out_cache_loc, graph_runner, counts=None):
        assert graph_runner == "width-1-graphs"          # the worker's captured graphs
        sync_calls.append((dw, target_hidden, sampled, out_cache_loc))
        return SimpleNamespace(next_draft_input="kept-current", forward_batch="draft-fb")

    monkeypatch.setattr(continuity_mod, "run_one_token_draft_extend", fake_sync)
    di = EagleDraftInput(topk_p=torch.rand(2, 1), topk_index=torch.zeros(2, 1, dtype=torch.int64),
                         hidden_states=torch.rand(2, 6),
                         bonus_tokens=torch.tensor([7, 9], dtype=torch.int32))
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, spec_info=di, input_ids=None,
                            out_cache_loc=None, seq_lens=torch.tensor([5, 8]),
                            seq_lens_cpu=torch.tensor([5, 8]), seq_lens_sum=13,
                            req_pool_indices=torch.tensor([3, 6]),
                            req_pool_indices_cpu=torch.tensor([3, 6]), has_grammar=False,
                            return_logprob=False)
    published = []
    return w, batch, aux, sync_calls, published


def test_decode_step_keep_current_is_unchanged(sgl, lazy_worker, monkeypatch):
    w, batch, aux, sync_calls, published = _decode_fixture(lazy_worker, monkeypatch, None)
    # Keep-current makes no room: its (immutable, shared) empty keep-alive joins the list.
    res = w._decode_step(batch, np.array([3, 6]), NO_ROOM_NEEDED.keep_alive, published.append,
                         None)
    assert res.next_draft_input == "kept-current"
    assert res.extra_keep_alive_refs == ["target-forward-batch", "draft-fb"]
    (dw, hidden, sampled, loc), = sync_calls
    assert dw == "draft-worker" and hidden is aux and sampled.tolist() == [41, 42]
    assert loc.tolist() == [3 * 32 + 5, 6 * 32 + 8]
    assert published[0].tolist() == [6, 9] and res.accept_lens.tolist() == [1, 1]
    assert res.speculative_num_draft_tokens == 1


def test_decode_step_lazy_stashes_and_carries(sgl, lazy_worker, monkeypatch):
    lz = _bare_lazy(sgl, rows=8, cells=8)
    w, batch, aux, sync_calls, published = _decode_fixture(lazy_worker, monkeypatch, lz)
    di = batch.spec_info
    res = w._decode_step(batch, np.array([3, 6]), [], published.append, None)
    assert not sync_calls                                   # no draft forward in decode mode
    nd = res.next_draft_input
    assert nd.topk_p is di.topk_p and nd.hidden_states is di.hidden_states
    assert nd.bonus_tokens.tolist() == [41, 42] and nd.bonus_tokens.dtype == torch.int32
    assert res.extra_keep_alive_refs == ["target-forward-batch"]
    assert lz.backlog.count[[3, 6]].tolist() == [1, 1] and lz.backlog.cursor == 2
    got_aux, got_tok = lz.arena.gather(torch.tensor([3 * 32 + 5, 6 * 32 + 8]))
    assert torch.equal(got_aux, aux) and got_tok.tolist() == [41, 42]
    assert published[0].tolist() == [6, 9]


@pytest.mark.parametrize("lazy", [False, True])
def test_only_keep_currents_draft_extend_is_a_draft_extend_stage(sgl, lazy_worker, monkeypatch,
                                                                 lazy):
    """A decode step's stages as the profile checker expects them (profiling.engines): the
    one-token draft extend of keep-current in stage:draft_extend, and lazy's stash in none."""
    import contextlib

    stages = []

    @contextlib.contextmanager
    def stage_range(name):
        stages.append(name)
        yield

    lz = _bare_lazy(sgl, rows=8, cells=8) if lazy else None
    w, batch, _, _, published = _decode_fixture(lazy_worker, monkeypatch, lz)
    # The worker's own stage ranges, inside its step; keep-current's draft extend is one of them.
    monkeypatch.setattr(w._spans, "stage", stage_range)
    if not lazy:
        monkeypatch.setattr(w.continuity, "_stage", stage_range)
    w._decode_step(batch, np.array([3, 6]), [], published.append, None)
    assert ("draft_extend" in stages) is not lazy and "decode" in stages


def test_keep_current_draws_its_stage_ranges_from_the_workers_spans(lazy_worker):
    """Its draft extend's range is the worker's (gated by the step's own listener check)."""
    from types import SimpleNamespace

    from dual_graph_worker.engines.sglang.continuity import KeepCurrent

    w = lazy_worker(None)
    w._draft_worker, w._draft_sync, w._accept_ones = "dw", SimpleNamespace(runner=None), None
    w._target_worker = None
    assert KeepCurrent.build(w._continuity_context())._stage == w._spans.stage


def test_lazy_catch_up_builds_itself_from_the_workers_context(sgl, lazy_worker, monkeypatch):
    """Its settings reach the stash, its events the worker's step log with the running totals,
    and the radix cache's hooks the target worker (where the cache's factory finds them)."""
    from dual_graph_worker.engines.sglang.backlog import BacklogStats
    from dual_graph_worker.engines.sglang.radix import BEHIND_ATTR, UNCLAMPED_ATTR

    made = {}

    def init(self, draft_worker, target_runner, req_to_token_pool, **kw):
        made.update(kw, dw=draft_worker, runner=target_runner, pool=req_to_token_pool)
        self.backlog = SimpleNamespace(stats=BacklogStats(catch_ups=2))

    monkeypatch.setattr(sgl.LazyCatchUp, "__init__", init)
    w = lazy_worker(None)
    w.settings = Settings(lazy_stash_mb=64, defer_draft_prefill=False, catch_up_kv_only=True)
    w._draft_worker, w._draft_sync, w._accept_ones = "dw", SimpleNamespace(runner=None), None
    w._target_worker = SimpleNamespace(model_runner="target-runner")
    logged = []
    monkeypatch.setattr(w, "_log_lazy_event", lambda event, totals: logged.append((event, totals)))
    lazy = sgl.LazyCatchUp.build(w._continuity_context())
    assert made == dict(dw="dw", runner="target-runner", pool=w.req_to_token_pool, stash_mb=64,
                        defer_prefill=False, kv_only=True, kv_check=False)
    lazy.on_event("an-event")
    assert logged == [("an-event", BacklogStats(catch_ups=2))]
    assert getattr(w._target_worker, BEHIND_ATTR) == lazy.behind
    assert getattr(w._target_worker, UNCLAMPED_ATTR) == w._tree_unclamped


@pytest.mark.parametrize("host_lens", [True, False])
def test_catch_up_pass_through_the_real_init_new_and_logits_pruning(sgl, catch_up_pass,
                                                                      monkeypatch, host_lens):
    """SGLang's own ForwardBatch.init_new on the pass's view (of a real ScheduleBatch), and the
    logits processor's DRAFT_EXTEND_V2 pruning on the result: LM head rows = each request's
    last row, FULL hidden states unpruned (what catch_up_pass.proposals gathers from)."""
    import sglang.srt.model_executor.forward_batch_info as fbi
    from sglang.srt.layers.logits_processor import LogitsMetadata, LogitsProcessor
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    monkeypatch.setattr(fbi, "enable_num_token_non_padded", lambda: False)   # no EP group
    runner = _FakeDraftRunner()
    runner.device, runner.is_draft_worker, runner.dcp_size = "cpu", True, 1
    runner.server_args = SimpleNamespace(attention_backend="torch_native", enable_lora=False)
    runner.ngram_embedding_manager = SimpleNamespace(enabled=False)
    runner.model_config = SimpleNamespace(model_is_mrope=False)
    draft = SimpleNamespace(topk=1, draft_runner=runner,
                            draft_tp_context=lambda group: contextlib.nullcontext())
    lz = _bare_lazy(sgl, rows=8, cells=16, draft=draft)
    reqs = [SimpleNamespace(rid=f"r{i}", lora_id=None, grammar=None, req_pool_idx=r,
                            token_type_ids=None) for i, r in enumerate([5, 7, 2])]
    batch = ScheduleBatch(reqs=reqs)
    batch.forward_mode = ForwardMode.DECODE
    batch.req_pool_indices = batch.req_pool_indices_cpu = torch.tensor([5, 7, 2])
    batch.seq_lens = torch.tensor([10, 4, 6])
    batch.seq_lens_cpu = torch.tensor([10, 4, 6]) if host_lens else None
    batch.seq_lens_sum = 20
    batch.spec_info = EagleDraftInput(topk_p=torch.ones(3, 1), hidden_states=torch.zeros(3, 6),
                                      topk_index=torch.zeros(3, 1, dtype=torch.int64),
                                      bonus_tokens=torch.zeros(3, dtype=torch.int32))
    (segs,) = plan_passes([3, 1], 64)
    idx = build_catch_up_indices(segs, req_pool_indices=torch.tensor([5, 2]),
                                 ends=torch.tensor([10, 6]), counts=[3, 1], batch_positions=[0, 2],
                                 req_to_token=lz.req_to_token,
                                 rows_cpu=[5, 2] if host_lens else None,
                                 ends_cpu=[10, 6] if host_lens else None)
    fb, _ = catch_up_pass.run_pass(runner, lz.arena, batch, idx, catch_up_pass.Laps())
    assert isinstance(fb, fbi.ForwardBatch) and runner.planned == [fb]
    assert fb.forward_mode == ForwardMode.DRAFT_EXTEND_V2 and fb.batch_size == 2
    assert fb.capture_hidden_mode == CaptureHiddenMode.FULL and fb.forward_metadata_ready
    assert fb.positions.tolist() == [7, 8, 9, 5] and fb.extend_start_loc.tolist() == [0, 3]
    assert fb.extend_seq_lens.tolist() == [3, 1] and fb.extend_prefix_lens.tolist() == [7, 5]
    assert fb.extend_seq_lens_cpu == [3, 1] and fb.seq_lens.tolist() == [10, 6]
    assert fb.extend_num_tokens == 4 and fb.return_logprob is False
    assert fb.extend_prefix_lens_cpu == ([7, 5] if host_lens else None)
    assert fb.seq_lens_sum == (16 if host_lens else None)
    # The ScheduleBatch itself is untouched: EAGLE's step runs on it next.
    assert batch.forward_mode == ForwardMode.DECODE and batch.seq_lens.tolist() == [10, 4, 6]
    assert isinstance(batch.spec_info, EagleDraftInput) and batch.out_cache_loc is None
    md = LogitsMetadata.from_forward_batch(fb)
    assert md.draft_extend_select_index.tolist() == [2, 3] and not md.extend_return_logprob
    lp = object.__new__(LogitsProcessor)
    hidden = torch.arange(4.)[:, None].repeat(1, 6)
    pruned = lp._get_pruned_states(hidden, None, [hidden + 100], md)
    assert pruned[0][:, 0].tolist() == [2., 3.]                 # LM head input: last rows
    stored = lp._get_hidden_states_to_store(hidden, None, [hidden + 100], *pruned[:4], md)
    assert stored.shape == (4, 6)                               # FULL: every row, unpruned


def test_worker_deferred_prefill_runs_the_target_alone_and_publishes_first(sgl, lazy_worker):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    order = []
    out = SimpleNamespace(logits_output=SimpleNamespace(hidden_states="aux"),
                          next_token_ids="sampled", new_seq_lens=None, next_draft_input=None)

    def target(batch, capture_hidden_mode):
        order.append(("target", capture_hidden_mode))
        return out

    lazy = SimpleNamespace(deferred_prefill=lambda b, aux, next_token_ids:
                           order.append(("stash", aux, next_token_ids)) or "placeholders")
    w = lazy_worker(lazy)
    w._target_worker = SimpleNamespace(forward_batch_generation=target)
    batch = SimpleNamespace(seq_lens="lengths")
    res = w._deferred_prefill(batch, lambda lens: order.append(("publish", lens)))
    assert res is out and res.new_seq_lens == "lengths"
    assert res.next_draft_input == "placeholders"
    assert order == [("target", CaptureHiddenMode.FULL), ("publish", "lengths"),
                     ("stash", "aux", "sampled")]


def test_deferred_chunked_prompt_then_decode_then_catch_up(fake_sglang_forward):
    """A prompt of 6 deferred over two chunks (4 + 2) while another running request decodes,
    one lazy decode step, then a speculative step: its catch-up feeds the draft positions
    0..6 of the prompt's request (prompt shifted by one, the chunk's next prompt token at the
    chunk boundary, the sampled token after the prompt, then the decode step's token), and the
    running request's cells survive the pending chunk (and vice versa)."""
    sgl = fake_sglang_forward
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    runner = _FakeDraftRunner()
    draft = SimpleNamespace(topk=1, draft_runner=runner,
                            draft_tp_context=lambda group: contextlib.nullcontext())
    lz = _bare_lazy(sgl, rows=8, cells=32, draft=draft)
    r2t = lz.req_to_token
    prompt = [50, 51, 52, 53, 54, 55]
    req = SimpleNamespace(origin_input_ids=prompt)

    def prefill(start, n, chunked):
        ids = torch.tensor(prompt[start:start + n])
        batch = SimpleNamespace(
            forward_mode=ForwardMode.EXTEND, multimodal_inputs=[None], reqs=[req],
            chunked_req=req if chunked else None,
            chunked_req_next_prompt_token=prompt[start + n] if chunked else None,
            extend_num_tokens=n, extend_lens=[n], prefix_lens=[start], input_ids=ids,
            req_pool_indices_cpu=torch.tensor([3]), seq_lens=torch.tensor([start + n]),
            out_cache_loc=r2t[3, start:start + n].to(torch.int64))
        assert lz.must_defer(batch) == (start > 0) and lz.can_defer(batch)
        aux = torch.tensor([[float(p)] * 4 for p in range(start, start + n)])
        return lz.defer_prefill(batch, aux=aux, next_token_ids=torch.tensor([99]))

    prefill(0, 4, chunked=True)
    assert lz.backlog.pending().rows.tolist() == [3]
    # meanwhile row 6 (running, committed length 9) runs a lazy decode step: position 9
    lz.stash(np.array([6]), aux=torch.full((1, 4), 9.0), sampled=torch.tensor([77]),
             out_cache_loc=r2t[6, 9:10].to(torch.int64))
    prefill(4, 2, chunked=False)                       # the prompt's last chunk
    assert lz.backlog.count[[3, 6]].tolist() == [6, 1] and lz.backlog.pending().rows.size == 0
    # one lazy decode step of both (row 3 at position 6 emits 98, row 6 at 10 emits 78)
    lz.stash(np.array([3, 6]), aux=torch.tensor([[6.0] * 4, [10.0] * 4]),
             sampled=torch.tensor([98, 78]),
             out_cache_loc=torch.stack([r2t[3, 6], r2t[6, 10]]).to(torch.int64))
    di = EagleDraftInput(topk_p=torch.full((2, 1), 0.5), hidden_states=torch.zeros(2, 6),
                         topk_index=torch.full((2, 1), -1, dtype=torch.int64),
                         bonus_tokens=torch.tensor([1, 2], dtype=torch.int32))
    batch = SimpleNamespace(
        req_pool_indices_cpu=torch.tensor([3, 6]), req_pool_indices=torch.tensor([3, 6]),
        seq_lens=torch.tensor([7, 11]), seq_lens_cpu=torch.tensor([7, 11]), seq_lens_sum=18,
        spec_info=di, forward_mode=ForwardMode.DECODE, input_ids=None, out_cache_loc=None,
        sampling_info=None)
    lz.before_spec_step(batch, sgl.rows_of(batch))
    fb, = runner.forwards
    v = fb.view
    assert fb.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 9, 10]
    assert v.input_ids.tolist() == [51, 52, 53, 54, 55, 99, 98, 77, 78]
    assert v.spec_info.hidden_states[:, 0].tolist() == [0., 1., 2., 3., 4., 5., 6., 9., 10.]
    assert v.out_cache_loc.tolist() == r2t[3, :7].tolist() + r2t[6, 9:11].tolist()
    assert (v.prefix_lens, v.extend_lens) == ([0, 9], [7, 2])
    assert di.topk_index[:, 0].tolist() == [6, 10]          # proposals from each last row
    assert not lz.backlog.count.any() and lz.backlog.cursor == 0
    assert lz.backlog.stats.deferred_prefills == 2 and lz.backlog.stats.chunk_restarts == 0


def test_a_prompt_aborted_between_its_chunks_leaves_nothing_behind():
    """Abort mid-chunk: SGLang frees the row without telling the worker. The next prefill batch
    (which would have carried the next chunk) drops the pending marker; the next compaction
    reclaims its cells; a new request in the reused row starts clean."""
    b = LazyBacklog(4, 64)
    b.note_prefill([2], [0], [10], chunked=0)          # chunk 1 of row 2, deferred
    assert b.pending_cells() == 10 and b.pending_end[2] == 10
    # The next prefill batch holds other rows only: row 2's request is gone.
    assert b.drop_abandoned_pending([0, 1]) == 1
    assert b.pending_cells() == 0 and b.count[2] == 0 and b.pending_end[2] == -1
    assert b.live_after_reclaim([0, 1]) == 0            # a compaction keeps none of its cells
    # A pending row that is in the batch (its next chunk) is kept.
    b.note_prefill([3], [0], [8], chunked=0)
    assert b.drop_abandoned_pending([3, 0]) == 0 and b.pending_cells() == 8


def test_every_continuity_has_its_launch_needs_and_its_strategy(sgl):
    """Launch checks, the radix cache and the draft-sync graphs follow the strategy a setting
    names, from one table each (no flag for the worker to branch on)."""
    from dual_graph_worker.engines.sglang.continuity import STRATEGIES
    from dual_graph_worker.engines.sglang.continuity_launch import LAUNCH
    from dual_graph_worker.engines.sglang.radix import BACKEND

    assert set(LAUNCH) == set(STRATEGIES) == set(Continuity)
    assert all(cls.kind is kind for kind, cls in STRATEGIES.items())
    lazy, keep = LAUNCH[Continuity.LAZY_CATCH_UP], LAUNCH[Continuity.KEEP_CURRENT]
    assert (lazy.radix_backend, keep.radix_backend) == (BACKEND, None)
    refused = SimpleNamespace(attention_backend="trtllm_mha")
    with pytest.raises(ConfigError, match="--attention-backend triton"):
        lazy.check_server_args(refused)
    keep.check_server_args(refused)
    assert [STRATEGIES[k].draft_sync_graphs for k in Continuity] == \
        [k is Continuity.KEEP_CURRENT for k in Continuity]
