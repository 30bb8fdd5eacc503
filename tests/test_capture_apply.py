"""A tuned capture config drives the worker: its pools and calibration, for this GPU and model only."""

from __future__ import annotations

from pathlib import Path

import pytest

from dual_graph_worker.engines.reference.capture_config import model_shape, tuned_pools
from capture.config import build_capture_config, save_capture_config
from capture.distribution import parse_distribution
from capture.measurements import GraphMeasurement, Measurements
from dual_graph_worker.core.capture_schema import GpuInfo, ModelInfo
from capture.tuner import tune
from dual_graph_worker.engines.reference.build import EngineSpec, engine_from_dummy
from dual_graph_worker.engines.reference.config import tiny_shape
from dual_graph_worker.core.errors import StaleConfig
from dual_graph_worker.core.modes import GraphKey, Mode
from dual_graph_worker.core.controller import GoodputController
from bench.reference.variants import PoolSizes, build_variant

REPO = Path(__file__).resolve().parents[1]
GPU = GpuInfo("Synthetic GPU", "9.0")


@pytest.fixture(scope="module")
def engine():
    return engine_from_dummy(tiny_shape(), EngineSpec(num_draft_tokens=3, max_requests=16, max_context=64))


def _synthetic_measurements(engine) -> Measurements:
    """SYNTHETIC: decode 5 ms + 0.05 ms/request, spec 7 ms + 0.4 ms/request (crossover ~ bs 9
    at accept 2)."""
    sizes = (1, 2, 4, 6, 8, 12, 16)
    graphs = [GraphMeasurement(GraphKey(Mode.DECODE, b), 0.05, 2 ** 20 * b, 5e-3 + 0.05e-3 * b)
              for b in sizes]
    graphs += [GraphMeasurement(GraphKey(Mode.SPEC, b), 0.1, 4 * 2 ** 20 * b, 7e-3 + 0.4e-3 * b)
               for b in sizes]
    return Measurements(GPU, ModelInfo.from_shape(model_shape(engine)), tuple(graphs),
                        total_pool_bytes=4 * 2 ** 20 * 16 + 2 ** 20, synthetic=True,
                        notes="SYNTHETIC, hand-made for a test")


def test_tuned_config_sets_pools_and_calibration(engine, tmp_path):
    m = _synthetic_measurements(engine)
    result = tune(m, 2 ** 30, 10.0, parse_distribution("uniform:1-16", 16), 2.0)
    path = tmp_path / "config.json"
    save_capture_config(build_capture_config(m, result), path)
    tuned = tuned_pools(path, engine, gpu=GPU)
    assert tuned.spec_bs == result.spec_bs and tuned.decode_bs == result.decode_bs
    assert max(tuned.spec_bs) < 16, "the spec pool stops at the crossover, below the decode top"
    built = build_variant("dynamic", engine, PoolSizes.up_to(16, 16), use_cuda_graphs=False,
                          calib_context=8, progress=False, log=lambda s: None, tuned=tuned)
    assert built.worker.dispatch.spec_sizes == tuned.spec_bs
    assert built.worker.dispatch.decode_sizes == tuned.decode_bs
    assert isinstance(built.worker.policy, GoodputController)
    assert built.calibration is tuned.calibration                 # no re-measurement
    bs = tuned.spec_bs[0]
    # Nothing measured yet: the controller's estimate is the tuned calibration (its prior).
    assert built.worker.policy.step_time(Mode.SPEC, bs) == tuned.calibration.latency(Mode.SPEC, bs)


def test_config_from_another_model_is_refused(engine):
    h200 = REPO / "results/capture/config_h200_llama3-8b_acc2.json"
    with pytest.raises(StaleConfig, match="capture-tune"):
        tuned_pools(h200, engine, gpu=GpuInfo("NVIDIA H200", "9.0"))


def test_config_from_another_gpu_is_refused(engine, tmp_path):
    m = _synthetic_measurements(engine)
    result = tune(m, 2 ** 30, 10.0, parse_distribution("uniform:1-16", 16), 2.0)
    path = tmp_path / "config.json"
    save_capture_config(build_capture_config(m, result), path)
    with pytest.raises(StaleConfig, match="B200"):
        tuned_pools(path, engine, gpu=GpuInfo("NVIDIA B200", "10.0"))
