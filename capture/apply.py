"""Using a tuned capture config: the pools' batch sizes and the calibration table a worker runs
with, after checking the config was tuned for this GPU and this model shape.

    tuned = tuned_pools("capture/config.json", engine)     # StaleConfig if GPU/model differ
    WorkerConfig(spec_bs=tuned.spec_bs, decode_bs=tuned.decode_bs, ...)
    GoodputPolicy(tuned.calibration)
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

from capture.config import load_capture_config
from capture.measurements import GpuInfo
from dual_graph_worker.policy import CalibrationTable


class TunedPools(NamedTuple):
    spec_bs: tuple[int, ...]
    decode_bs: tuple[int, ...]
    calibration: CalibrationTable
    source: str


def model_shape(engine) -> dict:
    """The shape keys a capture config is fingerprinted on, read from the engine's description."""
    d = engine.describe()
    t, dr = d["model"]["target"], d["model"]["draft"]
    return {"hidden_size": t["hidden_size"], "num_layers": t["num_layers"], "num_heads": t["num_heads"],
            "num_kv_heads": t["num_kv_heads"], "head_dim": t["head_dim"],
            "intermediate_size": t["intermediate_size"], "vocab_size": t["vocab_size"],
            "dtype": d["dtype"], "draft_hidden_size": dr["hidden_size"],
            "num_draft_tokens": d["num_draft_tokens"], "attention_backend": d["attention_backend"]}


def tuned_pools(path: str | Path, engine, gpu: Optional[GpuInfo] = None) -> TunedPools:
    """Load `path` for `engine`; refuses (StaleConfig) a config tuned on another GPU or model.
    `gpu` defaults to the current CUDA device (none on CPU: then only the model is checked)."""
    if gpu is None and engine.device.type == "cuda":
        gpu = GpuInfo.from_torch(engine.device.index or 0)
    cfg = load_capture_config(path, expected_gpu=gpu, expected_shape=model_shape(engine))
    return TunedPools(cfg.spec_bs, cfg.decode_bs, cfg.calibration, str(path))
