"""Using a tuned capture config: the pools' batch sizes and the calibration table a worker runs
with, after checking the config was tuned for this GPU and this model shape.

    tuned = tuned_pools("capture/config.json", engine)     # StaleConfig if GPU/model differ
    WorkerConfig(spec_bs=tuned.spec_bs, decode_bs=tuned.decode_bs, ...)
    GoodputPolicy(tuned.calibration)

The SGLang plugin reads the same file through `dual_graph_worker.engines.sglang.capture_config`,
with its shape built by `build_model_shape` from SGLang's model config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Optional

from capture.config import load_capture_config
from capture.measurements import GpuInfo
from dual_graph_worker.policy import CalibrationTable


class TunedPools(NamedTuple):
    spec_bs: tuple[int, ...]
    decode_bs: tuple[int, ...]
    calibration: CalibrationTable


def build_model_shape(*, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                      head_dim: int, intermediate_size: Optional[int], vocab_size: int,
                      dtype: Any, draft_hidden_size: int, num_draft_tokens: int,
                      attention_backend: str, **extra: Any) -> dict:
    """The shape keys a capture config is fingerprinted on, for any engine (the reference worker
    and the SGLang plugin build theirs here, so the two cannot drift apart). `dtype` may be a
    torch dtype; `num_draft_tokens` is K, the draft steps per speculative step. `extra` keys
    (e.g. tp_size) are hashed too; pass them only when they differ from what a reference run
    records, so a config tuned there still matches a server that runs the same shapes."""
    shape = {"hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
             "num_kv_heads": num_kv_heads, "head_dim": head_dim,
             "intermediate_size": intermediate_size, "vocab_size": vocab_size,
             "dtype": str(dtype).removeprefix("torch."), "draft_hidden_size": draft_hidden_size,
             "num_draft_tokens": num_draft_tokens, "attention_backend": attention_backend}
    return {**shape, **extra}


def model_shape(engine) -> dict:
    """The reference engine's shape keys, read from its description."""
    d = engine.describe()
    t, dr = d["model"]["target"], d["model"]["draft"]
    return build_model_shape(
        hidden_size=t["hidden_size"], num_layers=t["num_layers"], num_heads=t["num_heads"],
        num_kv_heads=t["num_kv_heads"], head_dim=t["head_dim"],
        intermediate_size=t["intermediate_size"], vocab_size=t["vocab_size"], dtype=d["dtype"],
        draft_hidden_size=dr["hidden_size"], num_draft_tokens=d["num_draft_tokens"],
        attention_backend=d["attention_backend"])


def tuned_pools(path: str | Path, engine, gpu: Optional[GpuInfo] = None) -> TunedPools:
    """Load `path` for `engine`; refuses (StaleConfig) a config tuned on another GPU or model.
    `gpu` defaults to the current CUDA device (none on CPU: then only the model is checked)."""
    if gpu is None and engine.device.type == "cuda":
        gpu = GpuInfo.from_torch(engine.device.index or 0)
    cfg = load_capture_config(path, expected_gpu=gpu, expected_shape=model_shape(engine))
    return TunedPools(cfg.spec_bs, cfg.decode_bs, cfg.calibration)
