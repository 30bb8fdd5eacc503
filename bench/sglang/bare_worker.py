"""A DualGraphEagleWorker holding only its per-step state (no model, no graphs, no GPU): the
worker's glue as the CPU tests and `host_cost` drive it. Needs SGLang importable."""

from __future__ import annotations

# A few sizes of each pool, for the CPU tests (the benches pass SGLang's default lists).
TEST_SPEC_BS = (1, 2, 3, 4, 6, 8, 16, 32, 48)
TEST_DECODE_BS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)


class NoDraftWork:
    """A continuity strategy with nothing to do (the worker's glue is what is measured)."""

    defers_prefill = False

    def pending_tokens(self, rows):
        return 0

    def defers_prefill_of(self, batch, next_step_decodes):
        return False

    def on_prefill(self, batch):
        pass

    def before_spec_step(self, batch, rows):
        return []

    def before_decode_step(self, batch, rows):
        from dual_graph_worker.engines.sglang.continuity_contract import NO_ROOM_NEEDED

        return NO_ROOM_NEEDED


def bare_worker(policy, continuity=None, step_log=None, sizes=(TEST_SPEC_BS, TEST_DECODE_BS)):
    """The bare worker deciding by `policy` over graphs of `sizes` (spec, decode);
    `continuity` defaults to one with nothing to do."""
    from dual_graph_worker.core.counters import WorkerCounters
    from dual_graph_worker.core.dispatch import DispatchTable
    from dual_graph_worker.core.ledger import StepLedger
    from dual_graph_worker.core.planner import StepPlanner
    from dual_graph_worker.core.settings import Settings
    from dual_graph_worker.core.step_log import StepLogWriter
    from dual_graph_worker.core.timing import ResultClock
    from dual_graph_worker.engines.sglang.decode_pool import eager_decode_pool
    from dual_graph_worker.engines.sglang.draft_extend_graph import DraftSyncGraphs
    from dual_graph_worker.engines.sglang.row_context import RowContext
    from dual_graph_worker.engines.sglang.nvtx_spans import StepSpans
    from dual_graph_worker.engines.sglang.worker import DualGraphEagleWorker

    w = object.__new__(DualGraphEagleWorker)
    w.adaptive_controller = None
    w.settings = Settings()
    w._ledger = StepLedger()
    w._clock = ResultClock()
    w.counters = WorkerCounters()
    w._metrics = None
    w._completed = 0
    w.planner = StepPlanner(DispatchTable.build(*sizes), policy)
    w.continuity = continuity or NoDraftWork()
    w._stall_watch = None
    w._step_log = None if step_log is None else StepLogWriter(step_log)
    w.req_to_token_pool = None                   # no pool: every running row held
    w._spans = StepSpans.from_settings(Settings())
    w._decode_pool = eager_decode_pool()
    w._draft_sync = DraftSyncGraphs(runner="width-1-graphs")
    w._context = RowContext(512)
    return w
