"""The capture config: the one file the worker and the SGLang plugin read at start-up.

Schema ``dgw-capture-config/1``: the GPU and model shape it was tuned for, each pool's batch
sizes, the calibration of every chosen key, the budgets, the tuning inputs and outcome, and
informational savings. ``load_capture_config`` refuses a malformed file (ConfigError) and a
stale one (StaleConfig), naming the fix. docs/design.md, "Choosing the batch sizes".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional

from capture.distribution import BatchDistribution
from capture.measurements import Measurements
from capture.memory_model import MemoryModel
from capture.result import CaptureOutlier, Totals, TuningResult
from dual_graph_worker.core.capture_schema import SCHEMA, GpuInfo, ServingCapture, load_capture
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.jsonio import (need_field, need_mapping, need_mode, need_number,
                                           write_json)
from dual_graph_worker.core.modes import GraphKey


class Budgets(NamedTuple):
    memory_bytes: int
    capture_s: float


@dataclass(frozen=True, kw_only=True)
class CaptureConfig(ServingCapture):
    """The whole file: the served part plus what the tuner chose it under, and what it saves."""

    budgets: Budgets
    distribution: BatchDistribution
    chosen: Totals
    all_candidates: Totals
    exact: bool
    memory_model: Optional[MemoryModel]             # None: written before the shared-pool model
    exclude_compile_outlier: Optional[bool]         # None: written before the option existed
    capture_outliers: tuple[CaptureOutlier, ...]

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
            "measured_on": self.measured_on,
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
        served = ServingCapture.serving_fields(data)
        d = need_mapping(data, "capture config")
        budgets = need_mapping(d.get("budgets"), "budgets")
        tuning = need_mapping(d.get("tuning"), "tuning")
        savings = need_mapping(d.get("savings"), "savings")
        exclude = tuning.get("exclude_compile_outlier")
        if exclude is not None and not isinstance(exclude, bool):
            raise ConfigError(f"tuning.exclude_compile_outlier must be true or false, got "
                              f"{exclude!r}")
        exact = tuning.get("exact", True)
        if not isinstance(exact, bool):
            raise ConfigError(f"tuning.exact must be true or false, got {exact!r}")
        outliers_raw = tuning.get("capture_outliers", [])
        if not isinstance(outliers_raw, list):
            raise ConfigError(f"tuning.capture_outliers must be a list, got {outliers_raw!r}")
        return cls(
            **served,
            budgets=Budgets(need_field(budgets, "memory_bytes", int, "budgets"),
                            need_number(budgets, "capture_s", "budgets", allow_zero=False)),
            distribution=BatchDistribution.from_json(need_mapping(tuning.get("distribution"),
                                                                  "tuning.distribution")),
            chosen=_totals_from_json(savings.get("chosen"), "savings.chosen"),
            all_candidates=_totals_from_json(savings.get("all_candidates"),
                                             "savings.all_candidates"),
            exact=exact,
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
        accept_len=result.accept_len, crossover_bs=result.threshold_bs,
        distribution=result.distribution, chosen=result.chosen,
        all_candidates=result.all_candidates, exact=result.exact,
        synthetic=measurements.synthetic,
        measured_on=measurements.engine,
        memory_model=result.memory_model,
        exclude_compile_outlier=result.exclude_compile_outlier,
        capture_outliers=result.capture_outliers)


def save_capture_config(config: CaptureConfig, path: str | Path) -> None:
    write_json(config.to_json(), path)


def load_capture_config(path: str | Path, expected_gpu: Optional[GpuInfo] = None,
                        expected_shape: Optional[Mapping[str, Any]] = None) -> CaptureConfig:
    """The whole config at `path` (capture_schema.load_capture has the refusals)."""
    return load_capture(path, CaptureConfig, expected_gpu, expected_shape)


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
