"""AcceptanceEstimate keeps its rows in lists for small batches and in numpy arrays for large ones
(a host-cost choice): whichever holds them, every estimate it gives is the same."""

from __future__ import annotations

import numpy as np
import pytest

from dual_graph_worker.core import acceptance
from dual_graph_worker.core.acceptance import AcceptanceEstimate

K = 3
ROWS = 512


def serve(steps: int = 400, seed: int = 5) -> tuple[list[tuple], AcceptanceEstimate, list[bool]]:
    """A batch that grows past the arrays' bound, shrinks below the lists' and back, with
    requests finishing and new ones (one at a time and in waves) taking free rows; each step
    reads the batch's expected acceptance and whether it holds newcomers, then adds one
    speculative step whose requests accept alike within their kind (easy or hard rows).
    Returns what was read, the estimate, and whether its rows were in arrays at each step."""
    rng = np.random.default_rng(seed)
    est = AcceptanceEstimate(K, ROWS)
    easy = rng.random(ROWS) < 0.4
    free = list(range(ROWS))
    batch: list[int] = []
    reads, arrays = [], []
    # (rows, share of requests finishing each step): 150 rows hold steady, every request measured.
    phases = [(24, 0.02)] * 60 + [(160, 0.02)] * 100 + [(70, 0.02)] * 40 + [(150, 0.0)] * 30 \
        + [(30, 0.02)] * 50 + [(120, 0.02)] * 120
    for step, (size, turnover) in enumerate(phases[:steps]):
        shrink = set(rng.choice(len(batch), max(len(batch) - size, 0), replace=False).tolist())
        finished = [r for i, r in enumerate(batch) if i in shrink or rng.random() < turnover]
        for r in finished:
            batch.remove(r)
            free.append(r)
        joining = [free.pop(int(rng.integers(len(free)))) for _ in range(size - len(batch))]
        if joining:
            est.admit(joining, step)
            batch += joining
        rows = np.array(batch)
        reads.append((est.expected(rows), est.newcomers(rows), est.mean, est.fresh))
        draws = np.where(easy[rows], rng.choice([3.0, 4.0], len(rows)),
                         rng.choice([1.0, 2.0], len(rows)))
        est.add(draws.tolist(), float(draws.sum()), rows, step)
        arrays.append(est._arrays)
    return reads, est, arrays


def test_large_batches_keep_their_rows_in_arrays_and_every_estimate_is_the_lists(monkeypatch):
    reads, est, arrays = serve()
    # The run moved its rows to arrays (160 rows; a wave of 80 joins them there at 150), back
    # to lists (30), and to arrays again.
    assert arrays[100] and not arrays[250] and arrays[-1]
    monkeypatch.setattr(acceptance, "_ARRAY_ROWS", ROWS + 1)
    lists_reads, lists_est, lists_arrays = serve()
    assert not any(lists_arrays)
    for step, (got, want) in enumerate(zip(reads, lists_reads)):
        assert got[0] == pytest.approx(want[0], rel=1e-12), step
        assert got[1:] == want[1:], step
    assert est.estimates() == lists_est.estimates()
    assert est.draw_var == lists_est.draw_var
    for name in acceptance._ARRAY_FIELDS:
        kept, listed = np.asarray(getattr(est, name)), np.asarray(getattr(lists_est, name))
        np.testing.assert_array_equal(kept, listed, err_msg=name)
    assert est._first_draws == lists_est._first_draws


def test_a_batch_near_a_bound_does_not_move_the_rows_every_step():
    est = AcceptanceEstimate(K, ROWS)
    est.admit(list(range(128)), 0)
    moves = 0
    for step, size in enumerate([100, 60, 90, 50, 95, 48] * 4):
        before = est._arrays
        rows = np.arange(size)
        est.add([2.0] * size, 2.0 * size, rows, step)
        moves += est._arrays != before
    assert moves == 1                           # into arrays at 100; 48-95 keep them there
    est.add([2.0] * 47, 94.0, np.arange(47), 99)
    assert not est._arrays


def test_accept_lengths_as_ints_or_floats_give_the_same_estimates_in_arrays():
    """A worker may hand its accept lengths over as ints: the arrays read them as the floats."""
    rng = np.random.default_rng(3)
    ints, floats = AcceptanceEstimate(K, ROWS), AcceptanceEstimate(K, ROWS)
    rows = np.arange(200)
    for est in (ints, floats):
        est.admit(rows.tolist(), 0)
    for step in range(1, 12):
        draws = rng.integers(1, K + 2, len(rows))
        ints.add(draws.tolist(), float(draws.sum()), rows, step)
        floats.add(draws.astype(float).tolist(), float(draws.sum()), rows, step)
    assert ints._arrays and floats._arrays
    assert ints.expected(rows) == floats.expected(rows)
    assert ints.estimates() == floats.estimates()
    np.testing.assert_array_equal(ints._rows, floats._rows)


@pytest.mark.parametrize("size", [40, 70, 150])
def test_a_pooled_batch_reads_the_same_whichever_pass_it_takes_first(size):
    """A pooled batch that held unmeasured rows is read next in one pass that drops them; a
    host-cost hint only: with or without unmeasured rows, in lists or arrays, the same float."""
    _, est, _ = serve()
    est._store_for(size)
    measured = [r for r in range(ROWS) if est._rows[r] == est._rows[r]]
    fresh = sorted(set(range(ROWS)) - set(measured))[:5]
    assert len(measured) >= size and len(fresh) == 5
    est.admit(fresh, 500)
    for batch in (measured[:size], measured[:size - 5] + fresh):
        rows = np.array(batch)
        reads = []
        for hint in (False, True, False):
            est._unmeasured_in_batch = hint
            reads.append(est.expected(rows))
        assert reads[0] == reads[1] == reads[2]
        assert est._unmeasured_in_batch is (batch[-1] in fresh)


def test_first_estimates_fold_at_most_every_few_speculative_steps_and_at_once_when_asked():
    """Once the spreads are trusted, a request's first estimate waits for the fold due
    _FOLD_EVERY speculative steps after the last (a fold costs the same whatever it holds), or
    for fold(), which the exchange calls whatever the mode; until then each folds at once."""
    def serve_until_pending() -> AcceptanceEstimate:
        est = AcceptanceEstimate(K, ROWS)
        est.admit(list(range(16)), 0)
        est.admit([16], 1)
        est.add(draws, sum(draws), old, 1)
        for step in range(2, 6):                   # the new request's 4th draw at step 5
            est.add(draws + [4.0], sum(draws) + 4.0, both, step)
        return est

    old, both = np.arange(16), np.arange(17)
    draws = [2.0] * 8 + [3.0] * 8
    est = serve_until_pending()
    before = est.fresh                             # the old requests', folded at step 4
    assert before == pytest.approx(2.5, abs=0.1)
    for step in (6, 7):
        est.add(draws, sum(draws), old, step)
        assert est.fresh == before
    est.add(draws, sum(draws), old, 8)             # 4 steps since the last fold
    assert est.fresh == pytest.approx(before + acceptance._ROW_ALPHA * (4.0 - before))
    asked = serve_until_pending()
    asked.fold()
    assert asked.fresh == est.fresh


@pytest.mark.parametrize("size", [20, 64, 200])
def test_a_batch_that_never_changes_gives_what_a_new_array_a_step_gives(size):
    """A batch handed over as one read-only array skips work (host cost only): add reuses what
    expected read of it, and once its adds settled its rows' noise (_SETTLED_AFTER) leaves that
    alone. Every read and estimate is the same as with a new writeable array each step, through
    an admission into the batch that unsettles it."""
    rng = np.random.default_rng(size)
    frozen, fresh = AcceptanceEstimate(K, ROWS), AcceptanceEstimate(K, ROWS)
    rows = np.arange(size)
    rows.flags.writeable = False
    settled = 0
    for step in range(1, 2 * acceptance._SETTLED_AFTER + 40):
        if step == acceptance._SETTLED_AFTER + 30:
            for est in (frozen, fresh):
                est.admit([size // 2], step)
        draws = rng.integers(1, K + 2, size).astype(float).tolist()
        reads = [est.expected(batch) for est, batch in ((frozen, rows), (fresh, np.arange(size)))]
        assert reads[0] == reads[1], step
        frozen.add(draws, sum(draws), rows, step)
        fresh.add(draws, sum(draws), np.arange(size), step)
        settled += frozen._run_rows is rows and frozen._run_adds >= acceptance._SETTLED_AFTER
    assert 0 < settled < acceptance._SETTLED_AFTER and fresh._run_rows is None
    for name in acceptance._ARRAY_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(frozen, name)),
                                      np.asarray(getattr(fresh, name)), err_msg=name)
    assert frozen.estimates() == fresh.estimates()
