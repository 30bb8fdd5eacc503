"""The capture config: the one file the worker and the SGLang plugin read at start-up.

Schema `dgw-capture-config/1`:

    {
      "schema": "dgw-capture-config/1",
      "gpu": {"name": "NVIDIA H200", "compute_capability": "9.0"},
      "model": {"shape": {...}, "fingerprint": "6ace395f5678ea42"},   # as in the measurements
      "num_draft_tokens": 3,
      "spec_bs": [4, 8, 16, 24, 32, 40],          # sorted, non-empty
      "decode_bs": [4, 8, ..., 256],              # sorted, non-empty, top >= spec top
      "calibration": {CalibrationTable.to_json()},# replay latency of every chosen (mode, bs)
      "budgets": {"memory_bytes": 2147483648, "capture_s": 10.0},
      "tuning": {"accept_len": 3.0, "crossover_bs": 40, "exact": true,
                 "distribution": {"description": "uniform:1-256", "weights": {"1": 0.0039, ...}},
                 "exclude_compile_outlier": true,  # capture times of one-time compilation ...
                 "capture_outliers": [{"mode": "decode", "bs": 1, "measured_s": 2.4,
                                       "used_s": 0.074}]},          # ... replaced by the median
      "savings": {"chosen": {"graphs", "waste_tokens_per_step", "memory_bytes", "capture_s",
                             "isolated_sum_bytes"},
                  "all_candidates": {...same keys...},
                  "memory_model": {"kind": "shared-pool", "per_graph_bytes": 77673,
                                   "source": "total_pool_bytes", ...}},
      "synthetic": false                          # tuned on synthetic measurements: tests only
    }

`savings.*.memory_bytes` is the shared-pool model (`capture.tuner.MemoryModel`: the largest
isolated pool of the graphs + per_graph_bytes a graph, both pools in one pool);
`isolated_sum_bytes` is the sum of isolated pools (the model of configs written before it, which
lack `memory_model`, `isolated_sum_bytes` and the tuning's outlier fields: those still load, with
memory_model None). Savings are informational: the worker reads the sizes and the calibration.

`load_capture_config` refuses a malformed file with ConfigError and a stale one (another GPU,
another model shape) with StaleConfig; both messages name the problem and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional

from capture.distribution import BatchDistribution
from capture.jsonio import (check_schema, need_field, need_int_list, need_mapping, need_mode, need_number,
                            read_json, write_json)
from capture.measurements import GpuInfo, Measurements, ModelInfo, model_fingerprint
from capture.tuner import CaptureOutlier, MemoryModel, Totals, TuningResult
from dual_graph_worker.dispatch import DispatchTable
from dual_graph_worker.errors import ConfigError, StaleConfig
from dual_graph_worker.modes import GraphKey, Mode
from dual_graph_worker.policy import CalibrationTable

SCHEMA = "dgw-capture-config/1"
RETUNE = "re-run `make capture-tune`"


class Budgets(NamedTuple):
    memory_bytes: int
    capture_s: float


@dataclass(frozen=True)
class CaptureConfig:
    gpu: GpuInfo
    model: ModelInfo
    num_draft_tokens: int
    spec_bs: tuple[int, ...]
    decode_bs: tuple[int, ...]
    calibration: CalibrationTable
    budgets: Budgets
    accept_len: float
    crossover_bs: int
    distribution: BatchDistribution
    chosen: Totals
    all_candidates: Totals
    exact: bool = True
    synthetic: bool = False
    memory_model: Optional[MemoryModel] = None      # None: written before the shared-pool model
    exclude_compile_outlier: Optional[bool] = None  # None: written before the option existed
    capture_outliers: tuple[CaptureOutlier, ...] = ()

    def __post_init__(self) -> None:
        for name, sizes in (("spec_bs", self.spec_bs), ("decode_bs", self.decode_bs)):
            if not sizes:
                raise ConfigError(f"capture config: {name} is empty; each pool needs at least "
                                  f"one batch size ({RETUNE})")
            if list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
                raise ConfigError(f"capture config: {name} must be distinct batch sizes >= 1 in "
                                  f"ascending order, got {list(sizes)}")
        if self.decode_bs[-1] < self.spec_bs[-1]:
            raise ConfigError(f"capture config: the decode pool tops out at bs={self.decode_bs[-1]}"
                              f" below the spec pool's bs={self.spec_bs[-1]}; the decode pool must "
                              f"cover the spec range ({RETUNE})")
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
        return tuple(GraphKey(Mode.SPEC, b) for b in self.spec_bs) + tuple(
            GraphKey(Mode.DECODE, b) for b in self.decode_bs)

    def dispatch_table(self, allow_eager: bool = True) -> DispatchTable:
        return DispatchTable.build(self.spec_bs, self.decode_bs, allow_eager)

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
                diff = _shape_diff(self.model.shape, expected_shape)
                raise StaleConfig(f"{source} was tuned for model shape {self.model.fingerprint} "
                                  f"but this model's shape is {fp} ({diff}); {RETUNE} for this "
                                  "model")

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "gpu": self.gpu.to_json(),
            "model": self.model.to_json(),
            "num_draft_tokens": self.num_draft_tokens,
            "spec_bs": list(self.spec_bs),
            "decode_bs": list(self.decode_bs),
            "calibration": self.calibration.to_json(),
            "budgets": self.budgets._asdict(),
            "tuning": self._tuning_json(),
            "savings": self._savings_json(),
            "synthetic": self.synthetic,
        }

    def _tuning_json(self) -> dict:
        out = {"accept_len": self.accept_len, "crossover_bs": self.crossover_bs,
               "exact": self.exact, "distribution": self.distribution.to_json()}
        if self.exclude_compile_outlier is not None:
            out["exclude_compile_outlier"] = self.exclude_compile_outlier
            out["capture_outliers"] = [o.to_json() for o in self.capture_outliers]
        return out

    def _savings_json(self) -> dict:
        out = {"chosen": _totals_json(self.chosen),
               "all_candidates": _totals_json(self.all_candidates)}
        if self.memory_model is not None:
            out["memory_model"] = self.memory_model.to_json()
        return out

    @classmethod
    def from_json(cls, data: Any) -> "CaptureConfig":
        d = need_mapping(data, "capture config")
        check_schema(d, SCHEMA, "capture config")
        budgets = need_mapping(d.get("budgets"), "budgets")
        tuning = need_mapping(d.get("tuning"), "tuning")
        savings = need_mapping(d.get("savings"), "savings")
        synthetic = d.get("synthetic", False)
        if not isinstance(synthetic, bool):
            raise ConfigError(f"capture config: synthetic must be true or false, got {synthetic!r}")
        exclude = tuning.get("exclude_compile_outlier")
        if exclude is not None and not isinstance(exclude, bool):
            raise ConfigError(f"tuning.exclude_compile_outlier must be true or false, got "
                              f"{exclude!r}")
        outliers_raw = tuning.get("capture_outliers", [])
        if not isinstance(outliers_raw, list):
            raise ConfigError(f"tuning.capture_outliers must be a list, got {outliers_raw!r}")
        return cls(
            gpu=GpuInfo.from_json(d.get("gpu")),
            model=ModelInfo.from_json(d.get("model")),
            num_draft_tokens=need_field(d, "num_draft_tokens", int, "capture config"),
            spec_bs=need_int_list(d, "spec_bs", "capture config"),
            decode_bs=need_int_list(d, "decode_bs", "capture config"),
            calibration=CalibrationTable.from_json(need_mapping(d.get("calibration"),
                                                                "calibration")),
            budgets=Budgets(need_field(budgets, "memory_bytes", int, "budgets"),
                            need_number(budgets, "capture_s", "budgets", allow_zero=False)),
            accept_len=need_number(tuning, "accept_len", "tuning", allow_zero=False),
            crossover_bs=need_field(tuning, "crossover_bs", int, "tuning"),
            distribution=BatchDistribution.from_json(need_mapping(tuning.get("distribution"),
                                                                  "tuning.distribution")),
            chosen=_totals_from_json(savings.get("chosen"), "savings.chosen"),
            all_candidates=_totals_from_json(savings.get("all_candidates"),
                                             "savings.all_candidates"),
            exact=bool(tuning.get("exact", True)),
            synthetic=synthetic,
            memory_model=(MemoryModel.from_json(savings["memory_model"], "savings.memory_model")
                          if savings.get("memory_model") is not None else None),
            exclude_compile_outlier=exclude,
            capture_outliers=tuple(_outlier_from_json(o, f"tuning.capture_outliers[{i}]")
                                   for i, o in enumerate(outliers_raw)),
        )


def build_capture_config(measurements: Measurements, result: TuningResult) -> CaptureConfig:
    if result.crossover_bs is None:  # tune() never returns one, but the type allows it
        raise ConfigError("tuning found no crossover; nothing to write")
    return CaptureConfig(
        gpu=measurements.gpu, model=measurements.model,
        num_draft_tokens=measurements.num_draft_tokens, spec_bs=result.spec_bs,
        decode_bs=result.decode_bs, calibration=result.calibration,
        budgets=Budgets(result.memory_budget_bytes, result.time_budget_s),
        accept_len=result.accept_len, crossover_bs=result.crossover_bs,
        distribution=result.distribution, chosen=result.chosen,
        all_candidates=result.all_candidates, exact=result.exact,
        synthetic=measurements.synthetic, memory_model=result.memory_model,
        exclude_compile_outlier=result.exclude_compile_outlier,
        capture_outliers=result.capture_outliers)


def save_capture_config(config: CaptureConfig, path: str | Path) -> None:
    write_json(config.to_json(), path)


def load_capture_config(path: str | Path, expected_gpu: Optional[GpuInfo] = None,
                        expected_shape: Optional[Mapping[str, Any]] = None) -> CaptureConfig:
    """Read and check a capture config. ConfigError: unreadable, malformed or inconsistent;
    StaleConfig: tuned on another GPU / model shape than the expected ones (when given)."""
    source = f"capture config {path}"
    try:
        config = CaptureConfig.from_json(read_json(path, "capture config"))
    except ConfigError as exc:
        msg = str(exc)
        # Name the file once, and always say how to get a good one back.
        msg = msg if str(path) in msg else f"{source}: {msg}"
        hint = "" if "make capture-tune" in msg else f"; {RETUNE} to regenerate it"
        raise ConfigError(msg + hint) from exc
    config.check_matches(expected_gpu, expected_shape, source)
    return config


def _shape_diff(tuned: Mapping[str, Any], now: Mapping[str, Any], limit: int = 4) -> str:
    absent = "<absent>"
    diffs = [f"{k}: {tuned.get(k, absent)!r} when tuned, {now.get(k, absent)!r} now"
             for k in sorted(set(tuned) | set(now)) if tuned.get(k, absent) != now.get(k, absent)]
    more = f", and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more


def _totals_json(t: Totals) -> dict:
    out = {"graphs": t.graphs, "waste_tokens_per_step": t.waste_tokens,
           "memory_bytes": t.memory_bytes, "capture_s": t.capture_s}
    if t.isolated_sum_bytes is not None:
        out["isolated_sum_bytes"] = t.isolated_sum_bytes
    return out


def _totals_from_json(data: Any, where: str) -> Totals:
    d = need_mapping(data, where)
    return Totals(need_field(d, "graphs", int, where),
                  need_number(d, "waste_tokens_per_step", where, allow_zero=True),
                  need_field(d, "memory_bytes", int, where),
                  need_number(d, "capture_s", where, allow_zero=True),
                  need_field(d, "isolated_sum_bytes", int, where)
                  if "isolated_sum_bytes" in d else None)


def _outlier_from_json(data: Any, where: str) -> CaptureOutlier:
    d = need_mapping(data, where)
    mode = need_mode(d, where)
    return CaptureOutlier(GraphKey(mode, need_field(d, "bs", int, where)),
                          need_number(d, "measured_s", where, allow_zero=True),
                          need_number(d, "used_s", where, allow_zero=True))
