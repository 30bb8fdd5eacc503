"""capture.measure without a GPU: the warm-up runs first, pays the one-time compile, and is
recorded in meta instead of in the first key's capture_s (the worker and CUDA are faked)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import capture.measure as measure_mod
from dual_graph_worker.core.capture_schema import GpuInfo
from capture.tuner import find_compile_outliers
from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.core.modes import GraphKey, Mode

COMPILE_S = 2.0      # what the first capture of each mode costs, once
CAPTURE_S = 0.07


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _FakeRunner:
    """Captures cost COMPILE_S more the first time a mode is captured in the process."""

    def __init__(self, dispatch: DispatchTable, clock: _Clock) -> None:
        self.dispatch, self.clock = dispatch, clock
        self.graphs: dict = {}
        self.pool = None
        self.compiled: set[Mode] = set()
        self.calls: list[tuple[GraphKey, ...]] = []

    def capture(self, keys=None, progress=True):
        keys = tuple(keys) if keys is not None else self.dispatch.keys()
        self.calls.append(keys)
        self.pool = self.pool or object()
        out = []
        for k in keys:
            s = CAPTURE_S + (COMPILE_S if k.mode not in self.compiled else 0.0)
            self.compiled.add(k.mode)
            self.clock.now += s
            self.graphs[k] = True
            out.append(SimpleNamespace(key=k, seconds=s, pool_bytes=k.bs << 20))
        return SimpleNamespace(keys=tuple(out), pool_bytes=max(k.bs for k in keys) << 20)


class _FakeWorker:
    def __init__(self, engine, config, policy, clock: _Clock) -> None:
        self.dispatch = DispatchTable.build(config.spec_sizes, config.decode_sizes)
        self.runner = _FakeRunner(self.dispatch, clock)
        self.replays: list[GraphKey] = []


@pytest.fixture
def fake(monkeypatch):
    clock = _Clock()
    made = []

    def worker(engine, config, policy):
        made.append(_FakeWorker(engine, config, policy, clock))
        return made[-1]

    def latency(w, key, context_len, repeats=5):
        assert key in w.runner.graphs, "replay of a key that is not captured"
        w.replays.append(key)
        return 0.001 * key.bs

    def reset(w):
        w.runner.graphs.clear()
        w.runner.pool = None

    monkeypatch.setattr(measure_mod, "time", SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(measure_mod, "DualGraphWorker", worker)
    monkeypatch.setattr(measure_mod, "WorkerConfig",
                        lambda spec, dec, graphs, continuity: SimpleNamespace(
                            spec_sizes=spec, decode_sizes=dec))
    monkeypatch.setattr(measure_mod, "measure_step_latency", latency)
    monkeypatch.setattr(measure_mod, "_reset", reset)
    monkeypatch.setattr(measure_mod.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(measure_mod.GpuInfo, "from_torch",
                        classmethod(lambda cls, i=0: GpuInfo("NVIDIA H200", "9.0")))
    return made


def _engine():
    target = SimpleNamespace(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=16, intermediate_size=128, vocab_size=128)
    return SimpleNamespace(
        limits=SimpleNamespace(num_draft_tokens=3), dtype="bfloat16",
        pair=SimpleNamespace(target=target, draft=SimpleNamespace(hidden_size=64)),
        attention=SimpleNamespace(name="triton"))


def test_warm_up_keeps_compile_time_out_of_every_key(fake) -> None:
    m = measure_mod.measure(_engine(), candidates=(1, 2, 4, 8), log=lambda *_: None)
    runner = fake[0].runner
    # Warm-up first: the smallest key of each mode, alone, then replayed once.
    assert runner.calls[:2] == [(GraphKey(Mode.DECODE, 1),), (GraphKey(Mode.SPEC, 1),)]
    assert fake[0].replays[:2] == [GraphKey(Mode.DECODE, 1), GraphKey(Mode.SPEC, 1)]
    assert m.meta["one_time_compile_s"] == pytest.approx(2 * (COMPILE_S + CAPTURE_S))
    assert all(g.capture_s == pytest.approx(CAPTURE_S) for g in m.graphs)
    assert find_compile_outliers(m) == ()
    assert len(m.graphs) == 8 and not m.synthetic and "warm-up" in m.notes
