"""Using a tuned capture config: the pools' batch sizes and the calibration table a worker runs
with, after checking the config was tuned for this GPU and this model shape.

    tuned = tuned_pools("out/capture/config.json", engine) # StaleConfig if GPU/model differ
    WorkerConfig(spec_bs=tuned.spec_bs, decode_bs=tuned.decode_bs, ...)
    # tuned.calibration: the goodput controller's prior (variants.build_variant)

The SGLang plugin reads the same file through `dual_graph_worker.engines.sglang.capture_config`,
with its shape built by `build_model_shape` from SGLang's model config.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

from dual_graph_worker.core.capture_schema import GpuInfo, build_model_shape, load_capture
from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.engines.reference.engine import ReferenceEngine


class TunedPools(NamedTuple):
    spec_bs: tuple[int, ...]
    decode_bs: tuple[int, ...]
    calibration: CalibrationTable


def model_shape(engine: ReferenceEngine) -> dict:
    """The reference engine's shape keys, from its model pair and settings."""
    t, dr = engine.pair.target, engine.pair.draft
    return build_model_shape(
        hidden_size=t.hidden_size, num_layers=t.num_layers, num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, intermediate_size=t.intermediate_size,
        vocab_size=t.vocab_size, dtype=engine.dtype, draft_hidden_size=dr.hidden_size,
        num_draft_tokens=engine.limits.num_draft_tokens, attention_backend=engine.attention.name)


def tuned_pools(path: str | Path, engine, gpu: Optional[GpuInfo] = None) -> TunedPools:
    """Load `path` for `engine`; refuses (StaleConfig) a config tuned on another GPU or model.
    `gpu` defaults to the current CUDA device (none on CPU: then only the model is checked)."""
    if gpu is None and engine.device.type == "cuda":
        gpu = GpuInfo.from_torch(engine.device.index or 0)
    cfg = load_capture(path, expected_gpu=gpu, expected_shape=model_shape(engine))
    return TunedPools(cfg.spec_bs, cfg.decode_bs, cfg.calibration)
