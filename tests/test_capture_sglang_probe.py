"""The SGLang capture probe (DGW_CAPTURE_PROBE) and its conversion to the tuner's measurements:
the probe wraps SGLang 0.5.17's own FullCudaGraphBackend capture path (a fake device, on CPU),
gives each graph a pool of its own, sizes and times it; the conversion makes keys of stages."""

from __future__ import annotations

import json
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from bench.sglang.capture_measure import together_bytes
from capture.config import build_capture_config, load_capture_config, save_capture_config
from capture.distribution import parse_distribution
from capture.measurements import load_measurements, save_measurements
from capture.sglang_probe import measurements_from_probe
from capture.tuner import tune
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import GraphKey, Mode, Stage
from dual_graph_worker.engines.sglang.capture_probe import SCHEMA, CaptureProbe

SHAPE = {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8,
         "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256, "dtype": "bfloat16",
         "draft_hidden_size": 4096, "num_draft_tokens": 3, "attention_backend": "triton"}


class FakeDevice:
    """torch.cuda's part the probe and the backend touch: a forward leaves what it allocated
    cached, except under capture, where it lands in the graph's pool; a capture empties the
    cache first (as torch.cuda.graph does); replays take 1 ms per size unit."""

    def __init__(self):
        self.reserved = 0
        self.cached = 0
        self.pools = 0
        self.now = 0.0
        self.capturing = False

    def forward(self, nbytes):
        self.cached += 0 if self.capturing else nbytes
        self.reserved += nbytes

    def empty_cache(self):
        self.reserved -= self.cached
        self.cached = 0

    def graph_pool_handle(self):
        self.pools += 1
        return ("pool", self.pools)

    def synchronize(self):
        pass

    def memory_reserved(self):
        return self.reserved

    @contextmanager
    def graph(self, cuda_graph, pool=None, stream=None):
        self.empty_cache()
        cuda_graph.pool = pool
        self.capturing = True
        yield
        self.capturing = False

    def Event(self, enable_timing=False):
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device):
        self.device = device

    def record(self):
        self.at = self.device.now

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.at - self.at) * 1e3


class FakeGraph:
    size = 0

    def __init__(self):
        self.replays = 0
        self.size = FakeGraph.size

    def replay(self):
        self.replays += 1
        DEVICE.now += self.size * 1e-3


DEVICE = FakeDevice()


@pytest.fixture
def sglang_backend(supported_sglang, monkeypatch):
    """A subclass of SGLang 0.5.17's FullCudaGraphBackend (the real one stays unpatched)."""
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import (
        FullCudaGraphBackend,
    )
    from sglang.srt.model_executor.runner.shape_key import ShapeKey

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    DEVICE.__init__()
    return type("Backend", (FullCudaGraphBackend,), {}), ShapeKey


def _runner(name, draft=False):
    cls = type(name, (), {})
    runner = cls()
    runner.device_module = DEVICE
    runner.model_runner = SimpleNamespace(tp_group=SimpleNamespace(barrier=lambda: None),
                                          is_draft_worker=draft)
    return runner


def test_the_probe_sizes_and_times_each_graph_of_sglangs_own_capture_path(sglang_backend,
                                                                          tmp_path):
    backend_cls, ShapeKey = sglang_backend
    clock = iter(range(100))
    pools = []
    probe = CaptureProbe(str(tmp_path / "probe.json"), DEVICE, clock=lambda: next(clock) * 0.5,
                         use_pool=pools.append)
    assert probe.install(backend_cls) is probe
    assert CaptureProbe("other", DEVICE).install(backend_cls) is probe     # once a process
    verify = backend_cls(_runner("DecodeCudaGraphRunner"))
    draft = backend_cls(_runner("EAGLEDraftCudaGraphRunner", draft=True))
    calls = []
    for backend, sizes in ((verify, (8, 4)), (draft, (8,))):
        for size in sizes:          # largest first, as SGLang captures
            FakeGraph.size = size
            # Each forward allocates 333 bytes a request: the captured one's are the pool.
            backend.capture_one(ShapeKey(size=size),
                                lambda s=size: (calls.append(s), DEVICE.forward(s * 333)))
    # SGLang's two warm-up forwards and the captured one ran, each graph in a fresh pool, which
    # SGLang was told of.
    assert calls == [8, 8, 8, 4, 4, 4, 8, 8, 8]
    captured = [g.pool for b in (verify, draft) for g in b._graphs.values()]
    assert len(set(captured)) == 3 and pools == captured
    probe.replay_all(repeats=3)
    probe.write({"gpu": {"name": "fake", "compute_capability": "9.0"}})
    data = json.loads((tmp_path / "probe.json").read_text())
    assert data["schema"] == SCHEMA and data["gpu"]["name"] == "fake"
    got = [(g["runner"], g["draft"], g["size"], g["capture_s"], g["pool_bytes"],
            round(g["replay_s"], 6)) for g in data["graphs"]]
    assert got == [("DecodeCudaGraphRunner", False, 8, 0.5, 2664, 0.008),
                   ("DecodeCudaGraphRunner", False, 4, 0.5, 1332, 0.004),
                   ("EAGLEDraftCudaGraphRunner", True, 8, 0.5, 2664, 0.008)]
    assert all(g.replays == 5 for b in (verify, draft) for g in b._graphs.values())


def _graph(runner, size, draft=False, pool=1000, replay=0.001):
    return {"runner": runner, "draft": draft, "size": size, "capture_s": 0.1,
            "pool_bytes": pool * size, "replay_s": replay}


def _probe(sizes=(1, 2, 4, 8), decode=(1, 2, 4, 8, 16), extra=()):
    # H200-like: a decode step ~5 ms, a spec step ~7 ms, growing slowly with the batch.
    graphs = []
    for bs in sizes:
        graphs += [_graph("DecodeCudaGraphRunner", bs, pool=3000, replay=0.004 + bs * 5e-5),
                   _graph("EAGLEDraftCudaGraphRunner", bs, True, pool=500, replay=0.002),
                   _graph("EAGLEDraftExtendCudaGraphRunner", bs, True, pool=500, replay=0.001)]
    graphs += [_graph("DecodeModeCudaGraphRunner", bs, pool=1000, replay=0.005 + bs * 2e-5)
               for bs in decode]
    return {"schema": SCHEMA, "gpu": {"name": "NVIDIA H200", "compute_capability": "9.0"},
            "model_shape": SHAPE, "sglang": "0.5.17", "torch": "2.11",
            "graphs": graphs + list(extra)}


def test_stages_make_keys_and_other_graphs_go_to_meta():
    prefill = _graph("PrefillCudaGraphRunner", 512, pool=10)
    half = [_graph("DecodeCudaGraphRunner", 16, pool=3000)]       # a spec size without a draft
    m = measurements_from_probe(_probe(extra=[prefill] + half), total_pool_bytes=123)
    assert m.sizes(Mode.SPEC) == (1, 2, 4, 8) and m.sizes(Mode.DECODE) == (1, 2, 4, 8, 16)
    spec8 = m.get(Mode.SPEC, 8)
    assert spec8.pool_bytes == 8 * 4000 and spec8.capture_s == pytest.approx(0.3)
    assert spec8.replay_s == pytest.approx(0.0074)
    assert spec8.stage_replay_s == pytest.approx({Stage.VERIFY: 0.0044, Stage.DRAFT: 0.002,
                                                  Stage.DRAFT_EXTEND: 0.001})
    assert m.get(Mode.DECODE, 4).stage_replay_s.keys() == {Stage.DECODE}
    assert m.total_pool_bytes == 123 and m.gpu.name == "NVIDIA H200"
    assert m.meta["other_graphs"] == {"graphs": 1, "capture_s": 0.1, "pool_bytes": 5120}
    assert m.meta["incomplete_keys"] == [f"{GraphKey(Mode.SPEC, 16).label()} (no draft, "
                                         "draft_extend)"]
    assert m.meta["engine"] == "sglang" and m.model.num_draft_tokens == 3


def test_a_graph_the_probe_could_not_size_is_refused_with_the_fix():
    probe = _probe()
    probe["graphs"][0]["pool_bytes"] = None
    with pytest.raises(ConfigError, match="memory saver"):
        measurements_from_probe(probe)
    with pytest.raises(ConfigError, match="schema"):
        measurements_from_probe(dict(_probe(), schema="dgw-capture-measurements/1"))


@pytest.mark.parametrize("field, value, message", [
    ("size", None, r"graphs\[1\]\.size is missing"),
    ("size", "8", r"graphs\[1\]\.size must be int, got '8'"),
    ("size", -1, r"graphs\[1\]\.size must be a batch size >= 1, got -1"),
    ("capture_s", None, r"graphs\[1\]\.capture_s is missing"),
    ("capture_s", "slow", r"graphs\[1\]\.capture_s must be a finite number, got 'slow'"),
    ("pool_bytes", -5, r"graphs\[1\]\.pool_bytes must be >= 0, got -5"),
    ("replay_s", 0, r"graphs\[1\]\.replay_s must be > 0"),
])
def test_a_bad_probe_record_names_the_file_record_and_field(field, value, message):
    # Each of these was a KeyError/ValueError traceback; capture_measure prints ConfigError only.
    probe = _probe()
    if value is None:
        del probe["graphs"][1][field]
    else:
        probe["graphs"][1][field] = value
    with pytest.raises(ConfigError, match="^capture probe /runs/probe.json." + message):
        measurements_from_probe(probe, where="capture probe /runs/probe.json")


def test_an_other_runners_bad_number_is_refused_too():
    probe = _probe(extra=[dict(_graph("PrefillCudaGraphRunner", 512), capture_s="1,5")])
    with pytest.raises(ConfigError, match=r"capture_s must be a finite number, got '1,5'"):
        measurements_from_probe(probe)


def test_sglang_measurements_tune_into_a_config_that_says_where_it_was_measured(tmp_path):
    from capture.sglang_flags import capture_flags

    m = measurements_from_probe(_probe())
    save_measurements(m, tmp_path / "m.json")
    m = load_measurements(tmp_path / "m.json")
    result = tune(m, memory_budget_bytes=2**30, time_budget_s=30.0, accept_len=3.0,
                  distribution=parse_distribution("uniform:1-16", 16))
    save_capture_config(build_capture_config(m, result), tmp_path / "c.json")
    config = load_capture_config(tmp_path / "c.json")
    assert config.measured_on == "sglang"
    text = capture_flags(config, str(tmp_path / "c.json")).render(config)
    assert "SGLang graphs" in text and "reference engine" not in text


def test_together_bytes_sums_the_pools_runners_only():
    info = {"memory_usage": {"graph": {"prefill": 0.5, "target_verify": 0.25,
                                       "draft_decode": 0.25, "decode_pool": 0.5}}}
    assert together_bytes(info) == 2**30
    assert together_bytes({}) is None


def test_registration_installs_the_probe_only_when_asked(supported_sglang, monkeypatch, tmp_path):
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import (
        FullCudaGraphBackend,
    )

    from dual_graph_worker.engines.sglang.capture_probe import installed_capture_probe
    from dual_graph_worker.engines.sglang.plugin import register

    for name in ("__init__", "capture_one"):      # restored after the test
        monkeypatch.setattr(FullCudaGraphBackend, name, getattr(FullCudaGraphBackend, name))
    monkeypatch.setattr(FullCudaGraphBackend, "_dgw_capture_probe", None, raising=False)
    monkeypatch.delenv("DGW_CAPTURE_PROBE", raising=False)
    register()
    assert installed_capture_probe() is None
    monkeypatch.setenv("DGW_CAPTURE_PROBE", str(tmp_path / "probe.json"))
    register()
    probe = installed_capture_probe()
    assert probe is not None and probe.path == str(tmp_path / "probe.json")


def test_the_measuring_run_writes_measurements_from_two_engine_starts(monkeypatch, tmp_path,
                                                                       capsys):
    from bench.sglang import capture_measure

    starts = []

    def fake_run_child(folder, spec, *, shim_dir, timeout):
        starts.append(spec)
        probe = spec["env"].get("DGW_CAPTURE_PROBE")
        if probe:
            with open(probe, "w") as fh:
                fh.write(json.dumps(_probe()))
        result = {"server_info": {"memory_usage": {"graph": {
            "target_verify": 0.5, "decode_pool": 0.25, "prefill": 9.0}}}}
        # As run_child does: the engine's result in FOLDER/NAME.json, after the probe wrote
        # its file (an H200 run lost the probe to the engine named "probe").
        (folder / f"{spec['name']}.json").write_text(json.dumps(result))
        return result | {"returncode": 0}

    monkeypatch.setattr(capture_measure, "run_child", fake_run_child)
    assert capture_measure.main(["--out", str(tmp_path), "--max-bs", "64"]) == 0
    m = load_measurements(tmp_path / "measurements.json")
    assert m.total_pool_bytes == int(0.75 * 2**30) and m.meta["engine"] == "sglang"
    # Both starts capture the same candidates, both pools up to the largest.
    probed, served = starts
    assert probed["engine_kwargs"]["cuda_graph_bs_decode"] == served["engine_kwargs"][
        "cuda_graph_bs_decode"] and max(probed["engine_kwargs"]["cuda_graph_bs_decode"]) == 64
    assert probed["env"]["DGW_SPEC_MAX_BS"] == probed["env"]["DGW_DECODE_MAX_BS"] == "64"
    assert "DGW_CAPTURE_PROBE" not in served["env"]
    assert "wrote" in capsys.readouterr().out
    # A probed server that wrote nothing: one line naming its log.
    monkeypatch.setattr(capture_measure, "run_child", lambda *a, **k: {"returncode": 2})
    assert capture_measure.main(["--out", str(tmp_path / "again")]) == 1
    assert "probe.log" in capsys.readouterr().err

