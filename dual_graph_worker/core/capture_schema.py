"""The part of a capture config (``make capture-tune``) a server reads, and the identity checks.

A config names the GPU it was tuned on, the model shape (fingerprinted), K, both pools' batch
sizes, the replay calibration and the crossover the tuner predicted. Engines read it through
`load_capture`, which refuses a malformed file (ConfigError) and one tuned on another GPU
or model shape (StaleConfig). The capture tools write the full file (capture/config.py extends
`ServingCapture` with budgets, distribution and savings).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.dispatch import DispatchTable, check_decode_covers_spec
from dual_graph_worker.core.errors import ConfigError, StaleConfig
from dual_graph_worker.core.jsonio import (check_schema, need_field, need_int_list,
                                           need_mapping, need_number, read_json)
from dual_graph_worker.core.modes import GraphKey

SCHEMA = "dgw-capture-config/1"
RETUNE = "re-run `make capture-tune`"
_CC = re.compile(r"^\d+\.\d+$")

# The shape keys the fingerprint must see; a file may add more (e.g. tp_size), all are hashed.
REQUIRED_SHAPE_KEYS = (
    "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
    "vocab_size", "dtype", "draft_hidden_size", "num_draft_tokens", "attention_backend",
)


def model_fingerprint(shape: Mapping[str, Any]) -> str:
    """16 hex digits of sha256 over canonical JSON (sorted keys, no spaces): key order and
    formatting of the source file do not matter; any value change does."""
    try:
        canonical = json.dumps(dict(shape), sort_keys=True, separators=(",", ":"),
                               ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model shape must be plain JSON values (numbers, strings), got "
                          f"{exc}") from exc
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()[:16]


@dataclass(frozen=True)
class GpuInfo:
    name: str
    compute_capability: str   # "9.0" (H100/H200), "10.0" (B200), "12.0" (RTX PRO 6000 Blackwell)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError("gpu.name must be a non-empty string such as 'NVIDIA H200'")
        if not isinstance(self.compute_capability, str) or not _CC.match(self.compute_capability):
            raise ConfigError(f"gpu.compute_capability must look like '9.0', got "
                              f"{self.compute_capability!r}")

    @property
    def sm(self) -> str:
        return "SM" + self.compute_capability.replace(".", "")

    def describe(self) -> str:
        return f"'{self.name}' ({self.sm})"

    def to_json(self) -> dict:
        return {"name": self.name, "compute_capability": self.compute_capability}

    @classmethod
    def from_json(cls, data: Any, where: str = "gpu") -> "GpuInfo":
        d = need_mapping(data, where)
        return cls(need_field(d, "name", str, where),
                   need_field(d, "compute_capability", str, where))

    @classmethod
    def from_torch(cls, device_index: int = 0) -> "GpuInfo":
        """The GPU this process runs on (imports torch lazily: the tuner itself never needs it)."""
        import torch

        major, minor = torch.cuda.get_device_capability(device_index)
        return cls(torch.cuda.get_device_name(device_index), f"{major}.{minor}")


@dataclass(frozen=True)
class ModelInfo:
    """The model shape the graphs were captured for, and its fingerprint."""

    shape: Mapping[str, Any]
    fingerprint: str

    @classmethod
    def from_shape(cls, shape: Mapping[str, Any]) -> "ModelInfo":
        return cls(dict(shape), model_fingerprint(shape))

    @property
    def num_draft_tokens(self) -> int:
        return int(self.shape["num_draft_tokens"])

    def to_json(self) -> dict:
        return {"shape": dict(self.shape), "fingerprint": self.fingerprint}

    @classmethod
    def from_json(cls, data: Any, where: str = "model") -> "ModelInfo":
        d = need_mapping(data, where)
        shape = dict(need_mapping(d.get("shape"), f"{where}.shape"))
        missing = [k for k in REQUIRED_SHAPE_KEYS if k not in shape]
        if missing:
            raise ConfigError(f"{where}.shape lacks {missing}; it must name at least "
                              f"{list(REQUIRED_SHAPE_KEYS)}")
        k = shape["num_draft_tokens"]
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"{where}.shape.num_draft_tokens must be an integer >= 1, got {k!r}")
        stored = need_field(d, "fingerprint", str, where)
        actual = model_fingerprint(shape)
        if stored != actual:
            raise ConfigError(f"{where}.fingerprint is {stored!r} but the shape hashes to "
                              f"{actual!r}: the shape was edited after recording; re-record it "
                              "(or write the new fingerprint with dual_graph_worker.core."
                              "capture_schema.model_fingerprint)")
        return cls(shape, stored)



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




@dataclass(frozen=True)
class ServingCapture:
    """What a server takes from a capture config: identity, both pools, the prior."""

    gpu: GpuInfo
    model: ModelInfo
    num_draft_tokens: int
    spec_bs: tuple[int, ...]
    decode_bs: tuple[int, ...]
    calibration: CalibrationTable
    accept_len: float
    crossover_bs: int
    synthetic: bool = False
    measured_on: str = "reference"     # whose graphs the measurements timed: reference, sglang

    def __post_init__(self) -> None:
        for name, sizes in (("spec_bs", self.spec_bs), ("decode_bs", self.decode_bs)):
            if not sizes:
                raise ConfigError(f"capture config: {name} is empty; each pool needs at least "
                                  f"one batch size ({RETUNE})")
            if list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
                raise ConfigError(f"capture config: {name} must be distinct batch sizes >= 1 in "
                                  f"ascending order, got {list(sizes)}")
        check_decode_covers_spec(self.spec_bs[-1], self.decode_bs[-1], RETUNE, "capture config: ")
        k = self.num_draft_tokens
        if self.model.num_draft_tokens != k or self.calibration.num_draft_tokens != k:
            raise ConfigError(f"capture config: num_draft_tokens disagree (config {k}, model "
                              f"shape {self.model.num_draft_tokens}, calibration "
                              f"{self.calibration.num_draft_tokens}); {RETUNE}")
        missing = [key.label() for key in self.keys() if key not in self.calibration.latency_s]
        if missing:
            raise ConfigError(f"capture config: the calibration table has no latency for "
                              f"{missing}; {RETUNE}")

    def keys(self) -> tuple[GraphKey, ...]:
        return self.dispatch_table().keys()

    def dispatch_table(self) -> DispatchTable:
        return DispatchTable.build(self.spec_bs, self.decode_bs)

    def check_matches(self, expected_gpu: Optional[GpuInfo] = None,
                      expected_shape: Optional[Mapping[str, Any]] = None,
                      source: str = "capture config") -> None:
        """Raise StaleConfig when this config was tuned on another GPU or model shape."""
        if expected_gpu is not None and (expected_gpu.name.strip(),
                                         expected_gpu.compute_capability) != (
                self.gpu.name.strip(), self.gpu.compute_capability):
            raise StaleConfig(f"{source} was tuned on {self.gpu.describe()} but this GPU is "
                              f"{expected_gpu.describe()}; {RETUNE} on this GPU")
        if expected_shape is not None:
            fp = model_fingerprint(expected_shape)
            if fp != self.model.fingerprint:
                diff = shape_diff(self.model.shape, expected_shape)
                raise StaleConfig(f"{source} was tuned for model shape {self.model.fingerprint} "
                                  f"but this model's shape is {fp} ({diff}); {RETUNE} for this "
                                  "model")

    @staticmethod
    def serving_fields(data: Any) -> dict:
        """The constructor arguments of the served part, parsed and type-checked."""
        d = need_mapping(data, "capture config")
        check_schema(d, SCHEMA, "capture config")
        tuning = need_mapping(d.get("tuning"), "tuning")
        synthetic = d.get("synthetic", False)
        if not isinstance(synthetic, bool):
            raise ConfigError(f"capture config: synthetic must be true or false, got {synthetic!r}")
        return dict(
            gpu=GpuInfo.from_json(d.get("gpu")),
            model=ModelInfo.from_json(d.get("model")),
            num_draft_tokens=need_field(d, "num_draft_tokens", int, "capture config"),
            spec_bs=need_int_list(d, "spec_bs", "capture config"),
            decode_bs=need_int_list(d, "decode_bs", "capture config"),
            calibration=CalibrationTable.from_json(need_mapping(d.get("calibration"),
                                                                "calibration")),
            accept_len=need_number(tuning, "accept_len", "tuning", allow_zero=False),
            crossover_bs=need_field(tuning, "crossover_bs", int, "tuning"),
            synthetic=synthetic,
            measured_on=str(d.get("measured_on", "reference")))

    @classmethod
    def from_json(cls, data: Any) -> "ServingCapture":
        return cls(**cls.serving_fields(data))


def load_capture(path: str | Path, cls: type = ServingCapture,
                 expected_gpu: Optional[GpuInfo] = None,
                 expected_shape: Optional[Mapping[str, Any]] = None):
    """Read and check a capture config as `cls` (ServingCapture or a subclass). ConfigError:
    unreadable, malformed or inconsistent; StaleConfig: tuned on another GPU / model shape."""
    source = f"capture config {path}"
    try:
        config = cls.from_json(read_json(path, "capture config", "re-run `make capture-tune`"))
    except ConfigError as exc:
        msg = str(exc)
        # Name the file once, and always say how to get a good one back.
        msg = msg if str(path) in msg else f"{source}: {msg}"
        hint = "" if "make capture-tune" in msg else f"; {RETUNE} to regenerate it"
        raise ConfigError(msg + hint) from exc
    config.check_matches(expected_gpu, expected_shape, source)
    return config


def shape_diff(tuned: Mapping[str, Any], now: Mapping[str, Any], limit: int = 4) -> str:
    absent = "<absent>"
    diffs = [f"{k}: {tuned.get(k, absent)!r} when tuned, {now.get(k, absent)!r} now"
             for k in sorted(set(tuned) | set(now)) if tuned.get(k, absent) != now.get(k, absent)]
    more = f", and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more
