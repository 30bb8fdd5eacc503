"""Recorded capture measurements: what the GPU run writes and the tuner reads.

One JSON file per (GPU, model shape, K). Schema `dgw-capture-measurements/1`:

    {
      "schema": "dgw-capture-measurements/1",
      "synthetic": false,            # true for generated files (tests, demos): never tune on one
      "notes": "free text",          # optional
      "meta": {...},                 # optional, free-form (torch version, ...), kept verbatim;
                                     # "one_time_compile_s": the warm-up capture and replay of
                                     # the smallest key of each mode (one-time compilation), kept
                                     # out of every capture_s (capture.measure)
      "gpu": {"name": "NVIDIA H200", "compute_capability": "9.0"},
      "model": {
        "shape": {                   # what determines graph memory and latency; extra keys allowed
          "hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8,
          "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256,
          "dtype": "bfloat16", "draft_hidden_size": 4096, "num_draft_tokens": 3,
          "attention_backend": "triton"
        },
        "fingerprint": "<model_fingerprint(shape)>"
      },
      "graphs": [                    # one entry per candidate key (mode, bs), no duplicates
        {"mode": "spec", "bs": 8,
         "capture_s": 0.41,          # wall time to capture every stage graph of this key
         "pool_bytes": 52428800,     # graph-pool growth capturing this key ALONE into a fresh
                                     # pool (isolated). Graphs captured together into one pool,
                                     # largest first, reuse its blocks: the tuner models the
                                     # shared pool as max(pool_bytes) + a per-graph residue
                                     # (capture.tuner.MemoryModel), not as their sum
         "replay_s": 0.0081,         # median step latency replaying this key's graphs
         "stage_replay_s": {"draft": 0.002, "verify": 0.005, "draft_extend": 0.001}  # optional
        },
        ...
      ],
      "total_pool_bytes": 488636416  # optional: pool growth capturing every key together into
                                     # one pool; gives the tuner its per-graph residue
    }

Loading checks the schema, types and ranges, that the fingerprint matches the shape (a hand-edited
shape would otherwise silently keep its old fingerprint), and raises ConfigError naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from dual_graph_worker.core.jsonio import (check_schema, need_field, need_mapping, need_mode, need_number,
                            read_json,
                            write_json)
from dual_graph_worker.core.capture_schema import GpuInfo, ModelInfo, model_fingerprint
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import GraphKey, Mode, Stage

SCHEMA = "dgw-capture-measurements/1"

@dataclass(frozen=True)
class GraphMeasurement:
    """One candidate key: see the module docstring for how each number must be measured."""

    key: GraphKey
    capture_s: float       # capture of every stage graph of the key
    pool_bytes: int        # pool growth capturing the key alone into a fresh pool
    replay_s: float        # median step latency: the goodput policy's t(mode, bs)
    stage_replay_s: Mapping[Stage, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        out: dict = {"mode": self.key.mode.value, "bs": self.key.bs, "capture_s": self.capture_s,
                     "pool_bytes": self.pool_bytes, "replay_s": self.replay_s}
        if self.stage_replay_s:
            out["stage_replay_s"] = {s.value: t for s, t in self.stage_replay_s.items()}
        return out

    @classmethod
    def from_json(cls, data: Any, num_draft_tokens: int, where: str) -> "GraphMeasurement":
        d = need_mapping(data, where)
        mode = need_mode(d, where)
        bs = need_field(d, "bs", int, where)
        if bs < 1:
            raise ConfigError(f"{where}.bs must be >= 1, got {bs}")
        where = f"{where} ({mode.value} bs={bs})"
        capture_s = need_number(d, "capture_s", where, allow_zero=True)
        pool_bytes = need_field(d, "pool_bytes", int, where)
        if pool_bytes < 0:
            raise ConfigError(f"{where}.pool_bytes must be >= 0, got {pool_bytes}")
        replay_s = need_number(d, "replay_s", where, allow_zero=False)
        stages: dict[Stage, float] = {}
        allowed = Stage.for_mode(mode, num_draft_tokens)
        for name, t in need_mapping(d.get("stage_replay_s", {}), f"{where}.stage_replay_s").items():
            try:
                stage = Stage(name)
            except ValueError:
                stage = None
            if stage not in allowed:
                raise ConfigError(f"{where}.stage_replay_s has stage {name!r}; a {mode.value} "
                                  f"step has stages {[s.value for s in allowed]}")
            stages[stage] = need_number({name: t}, name, f"{where}.stage_replay_s", allow_zero=True)
        return cls(GraphKey(mode, bs), capture_s, pool_bytes, replay_s, stages)


@dataclass(frozen=True)
class Measurements:
    """A whole measurements file; construction checks duplicates and that both modes appear."""

    gpu: GpuInfo
    model: ModelInfo
    graphs: tuple[GraphMeasurement, ...]
    total_pool_bytes: Optional[int] = None
    synthetic: bool = False
    notes: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        seen: set[GraphKey] = set()
        for g in self.graphs:
            if g.key in seen:
                raise ConfigError(f"graphs lists {g.key.label()} twice; keep one measurement "
                                  "per (mode, bs)")
            seen.add(g.key)
        for mode in Mode:
            if not self.sizes(mode):
                raise ConfigError(f"graphs has no {mode.value} entries; measure at least one "
                                  f"{mode.value} batch size")

    @property
    def num_draft_tokens(self) -> int:
        return self.model.num_draft_tokens

    @property
    def one_time_compile_s(self) -> Optional[float]:
        """The warm-up capture and replay measured apart (meta), when it was measured."""
        value = self.meta.get("one_time_compile_s")
        return (float(value) if isinstance(value, (int, float)) and not isinstance(value, bool)
                else None)

    def sizes(self, mode: Mode) -> tuple[int, ...]:
        return tuple(sorted(g.key.bs for g in self.graphs if g.key.mode is mode))

    def by_key(self) -> dict[GraphKey, GraphMeasurement]:
        return {g.key: g for g in self.graphs}

    def get(self, mode: Mode, bs: int) -> Optional[GraphMeasurement]:
        return self.by_key().get(GraphKey(mode, bs))

    def to_json(self) -> dict:
        out: dict = {"schema": SCHEMA, "synthetic": self.synthetic}
        if self.notes:
            out["notes"] = self.notes
        if self.meta:
            out["meta"] = dict(self.meta)
        out.update(gpu=self.gpu.to_json(), model=self.model.to_json(),
                   graphs=[g.to_json() for g in sorted(self.graphs, key=lambda g: g.key)])
        if self.total_pool_bytes is not None:
            out["total_pool_bytes"] = self.total_pool_bytes
        return out

    @classmethod
    def from_json(cls, data: Any) -> "Measurements":
        d = need_mapping(data, "measurements")
        check_schema(d, SCHEMA, "measurements")
        model = ModelInfo.from_json(d.get("model"))
        graphs_raw = d.get("graphs")
        if not isinstance(graphs_raw, list) or not graphs_raw:
            raise ConfigError("measurements.graphs must be a non-empty list of "
                              "{mode, bs, capture_s, pool_bytes, replay_s}")
        graphs = tuple(GraphMeasurement.from_json(g, model.num_draft_tokens, f"graphs[{i}]")
                       for i, g in enumerate(graphs_raw))
        total = d.get("total_pool_bytes")
        if total is not None and (not isinstance(total, int) or isinstance(total, bool)
                                  or total < 0):
            raise ConfigError(f"total_pool_bytes must be an integer >= 0 or absent, got {total!r}")
        synthetic = d.get("synthetic", False)
        if not isinstance(synthetic, bool):
            raise ConfigError(f"synthetic must be true or false, got {synthetic!r}")
        return cls(GpuInfo.from_json(d.get("gpu")), model, graphs, total, synthetic,
                   str(d.get("notes", "")), dict(need_mapping(d.get("meta", {}), "meta")))


def load_measurements(path: str | Path) -> Measurements:
    return Measurements.from_json(read_json(path, "measurements file"))


def save_measurements(measurements: Measurements, path: str | Path) -> None:
    write_json(measurements.to_json(), path)
