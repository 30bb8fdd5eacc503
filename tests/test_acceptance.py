"""AcceptanceEstimate's per-request state and the loops over a batch's rows run in C where a
compiler builds them and in Python otherwise (row_state.py): both give the same floats, whatever
form the rows and accept lengths are handed over in."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from dual_graph_worker.core import acceptance, native, row_state
from dual_graph_worker.core.acceptance import AcceptanceEstimate
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.settings import RowLoops

K = 3
ROWS = 512


@pytest.fixture(scope="module")
def c_loops() -> RowLoops:
    try:
        row_state.loops_in_c(RowLoops.C)
    except ConfigError as e:
        pytest.skip(f"the C loops cannot be built here: {e}")
    return RowLoops.C


def serve(loops: RowLoops, steps: int = 400, seed: int = 5, ints: bool = False,
          rows_as=np.array) -> tuple[list[tuple], AcceptanceEstimate]:
    """A batch that grows past the arrays' bound, shrinks below the lists' and back, with
    requests finishing and new ones (one at a time and in waves) taking free rows; each step
    reads the batch's expected acceptance and whether it holds newcomers, then adds one
    speculative step whose requests accept alike within their kind (easy or hard rows).
    `ints`: accept lengths handed over as ints; `rows_as`: how a batch's rows are handed over.
    Returns what was read and the estimate."""
    rng = np.random.default_rng(seed)
    est = AcceptanceEstimate(K, ROWS, loops)
    easy = rng.random(ROWS) < 0.4
    free = list(range(ROWS))
    batch: list[int] = []
    reads = []
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
        handed = rows_as(batch)
        reads.append((est.expected(handed), est.newcomers(handed), est.mean, est.fresh))
        draws = np.where(easy[rows], rng.choice([3.0, 4.0], len(rows)),
                         rng.choice([1.0, 2.0], len(rows)))
        accepts = draws.astype(int).tolist() if ints else draws.tolist()
        est.add(accepts, float(draws.sum()), handed, step)
    return reads, est



def test_the_c_loops_give_the_python_loops_floats(c_loops):
    """A batch growing, shrinking and turning over (small batches weighed row by row, large ones
    pooled), requests measured and not: every read and every row's state is the same float."""
    reads, est = serve(c_loops)
    want_reads, want = serve(RowLoops.PYTHON)
    assert type(est._rows).__name__ == "RowState" and type(want._rows).__name__ == "PyRowState"
    assert reads == want_reads
    got_rows, want_rows = est.rows_snapshot(), want.rows_snapshot()
    for got_field, want_field in zip(got_rows[:3], want_rows[:3]):
        np.testing.assert_array_equal(np.array(got_field), np.array(want_field))
    assert got_rows[3] == want_rows[3]                      # first draws
    assert est.estimates() == want.estimates() and est.draw_var == want.draw_var
    assert sum(e == e for e in got_rows[0]) > 100           # most rows measured by then


@pytest.mark.parametrize("loops", [RowLoops.PYTHON, "c"])
@pytest.mark.parametrize("rows_as", [list, lambda b: np.array(b, dtype=np.int32),
                                     lambda b: np.repeat(np.array(b), 2)[::2]],
                         ids=["list", "int32", "strided"])
def test_rows_and_accept_lengths_in_any_form_read_the_same(loops, rows_as, request):
    """A worker may hand its rows over as a list, int32, or a strided view, and its accept
    lengths as ints: the same reads as an int64 array of floats' rows."""
    if loops == "c":
        loops = request.getfixturevalue("c_loops")
    reads, est = serve(loops, steps=250, ints=True, rows_as=rows_as)
    want_reads, want = serve(loops, steps=250)
    assert reads == want_reads and est.estimates() == want.estimates()


@pytest.mark.parametrize("loops", [RowLoops.PYTHON, "c"])
def test_a_row_outside_the_pool_is_refused(loops, request):
    if loops == "c":
        loops = request.getfixturevalue("c_loops")
    est = AcceptanceEstimate(K, 8, loops)
    with pytest.raises(IndexError):
        est.add([2.0], 2.0, np.array([8]), 1)
    with pytest.raises((IndexError, TypeError)):
        est.expected(np.array([0.5]))


def test_where_the_c_loops_cannot_build_auto_runs_python_and_c_names_why(monkeypatch, tmp_path,
                                                                        caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))               # no `cc` either
    monkeypatch.setattr(native.sysconfig, "get_config_var",
                        lambda name: "/nonexistent/cc" if name == "CC" else None)
    row_state._c_loops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            est = AcceptanceEstimate(K, ROWS, RowLoops.AUTO)
        assert type(est._rows) is row_state.PyRowState
        assert "no C compiler" in caplog.text and "DGW_ROW_LOOPS=python" in caplog.text
        with pytest.raises(ConfigError, match="DGW_ROW_LOOPS=c: no C compiler"):
            AcceptanceEstimate(K, ROWS, RowLoops.C)
    finally:
        row_state._c_loops.cache_clear()


def test_a_built_extension_is_taken_from_the_cache(monkeypatch, tmp_path, c_loops):
    """The first load builds into the cache; a later one (another process, another rank) only
    imports it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    builds = []
    build = native._build
    monkeypatch.setattr(native, "_build", lambda *a: builds.append(a) or build(*a))
    first = native.load(row_state._SOURCE, "dgw_row_state")
    second = native.load(row_state._SOURCE, "dgw_row_state")
    assert len(builds) == 1 and list((tmp_path / "dual-graph-worker" / "native").iterdir())
    assert first.RowState(4, 4, 0.2, 0.64, 0.04).newest([0, 3]) == -1
    assert second.RowState(4, 4, 0.2, 0.64, 0.04).pooled(np.arange(4)) == (0.0, 0)


def test_first_estimates_fold_at_most_every_few_speculative_steps_and_at_once_when_asked():
    """Once the spreads are trusted, a request's first estimate waits for the fold due
    _FOLD_EVERY speculative steps after the last (a fold costs the same whatever it holds), or
    for fold(), which the exchange calls whatever the mode; until then each folds at once."""
    def serve_until_pending() -> AcceptanceEstimate:
        est = AcceptanceEstimate(K, ROWS, RowLoops.PYTHON)
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


@pytest.mark.parametrize("loops", [RowLoops.PYTHON, "c"])
def test_a_nan_accept_length_unmeasures_a_row_and_its_draws_start_over(loops, request):
    """Never from an engine, but no write past a row's first draws: the row collects four more
    and is measured again, in C as in Python."""
    if loops == "c":
        loops = request.getfixturevalue("c_loops")
    est, row = AcceptanceEstimate(K, 4, loops), np.array([2])
    for step, accept in enumerate([2.0, 2.0, 3.0, 3.0, float("nan")] + [4.0] * 9, start=1):
        est.add([accept], accept, row, step)
    assert est.rows_snapshot()[0][2] == 4.0 and est.rows_snapshot()[3][2] == []


def test_a_corrupt_cached_build_is_named_and_auto_runs_python(monkeypatch, tmp_path, caplog,
                                                              c_loops):
    """A cached file that is no extension (a disk fault, a copied cache): named, not a crash."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = native.cached_path(row_state._SOURCE, "dgw_row_state")
    built.parent.mkdir(parents=True)
    built.write_bytes(b"not an ELF file")
    with pytest.raises(native.NativeBuildError, match="delete it to rebuild"):
        native.load(row_state._SOURCE, "dgw_row_state")
    row_state._c_loops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            est = AcceptanceEstimate(K, ROWS, RowLoops.AUTO)
        assert type(est._rows) is row_state.PyRowState and "delete it" in caplog.text
    finally:
        row_state._c_loops.cache_clear()


def test_a_row_state_never_initialised_refuses_every_row(c_loops):
    kind = type(AcceptanceEstimate(K, 4, c_loops)._rows)
    bare = kind.__new__(kind)
    with pytest.raises(IndexError):
        bare.add(np.array([0]), [2.0], [], [])
    assert bare.snapshot() == ([], [], [], [])


@pytest.mark.parametrize("k", [2, 3, 5])
def test_the_two_row_states_agree_on_random_calls(c_loops, k):
    """Below AcceptanceEstimate: fractional accept lengths, an odd number of first draws,
    a row twice in one batch, random weights: every answer and every row the same float."""
    rng = np.random.default_rng(k)
    args = (64, k, 0.2, 0.64, 0.04)
    both = [row_state.row_state(c_loops, *args), row_state.PyRowState(*args)]
    for step in range(300):
        rows = rng.integers(0, 64, rng.integers(1, 40))
        if step % 7 == 0:
            for state in both:
                state.admit(rows[:3].tolist(), step)
        accepts = (rng.random(len(rows)) * 4.0 + 1.0).tolist()
        weights = rng.random(6).tolist()
        outs = []
        for state in both:
            firsts, within = [], []
            outs.append((state.add(rows, accepts, firsts, within), firsts, within,
                         state.pooled(rows), state.newest(rows), state.weighted(rows, *weights)))
        assert outs[0] == outs[1], step
    snaps = [state.snapshot() for state in both]
    for got, want in zip(snaps[0][:3], snaps[1][:3]):
        np.testing.assert_array_equal(np.array(got), np.array(want))
    assert snaps[0][3] == snaps[1][3]


def test_a_conversion_that_calls_back_is_refused_not_a_crash(c_loops):
    """An accept length whose __float__ shrinks the list, or calls the object again: no read
    past the list, no scratch overwritten under the loop."""
    state = row_state.row_state(c_loops, 8, 4, 0.2, 0.64, 0.04)
    accepts: list = []

    class Shrinks:
        def __float__(self):
            accepts.clear()
            return 2.0

    accepts += [Shrinks()] + [2.0] * 7
    state.add(np.arange(8), accepts, [], [])
    assert state.snapshot()[3][:2] == [[2.0], []]           # row 0 drew; the loop stopped

    class CallsBack:
        def __float__(self):
            state.pooled(np.arange(8))
            return 2.0

    with pytest.raises(RuntimeError, match="from within one of its methods"):
        state.add(np.arange(8), [CallsBack()] * 8, [], [])
    assert state.pooled(np.arange(8)) == (0.0, 0)           # usable after


def test_settings_check_refuses_c_loops_that_cannot_build(monkeypatch, tmp_path, capsys):
    """`dgw settings --check` (and the server at launch, before any weights load) builds the
    loops DGW_ROW_LOOPS names: `c` without a compiler is one line, not a traceback later."""
    from dual_graph_worker.cli import main as dgw_main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(native.sysconfig, "get_config_var",
                        lambda name: "/nonexistent/cc" if name == "CC" else None)
    monkeypatch.setenv("DGW_ROW_LOOPS", "c")
    row_state._c_loops.cache_clear()
    try:
        assert dgw_main(["settings", "--check"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: DGW_ROW_LOOPS=c: no C compiler")
        monkeypatch.setenv("DGW_ROW_LOOPS", "python")
        assert dgw_main(["settings", "--check"]) == 0
    finally:
        row_state._c_loops.cache_clear()
