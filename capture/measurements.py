"""Recorded capture measurements: what the GPU run writes and the tuner reads.

One JSON file per (GPU, model shape, K), schema ``dgw-capture-measurements/1``: per candidate
(mode, bs) key its capture time, isolated pool growth and replay latency, plus optional totals.
Loading checks the schema, types, ranges and the shape's fingerprint, and raises ConfigError
naming the field. docs/design.md, "Choosing the batch sizes", gives every field's meaning;
tests/data/capture/ holds an example.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from dual_graph_worker.core.capture_schema import GpuInfo, ModelInfo
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.jsonio import (check_schema, need_field, need_mapping, need_mode,
                                           need_number, read_json, write_json)
from dual_graph_worker.core.modes import GraphKey, Mode, Stage

SCHEMA = "dgw-capture-measurements/1"

@dataclass(frozen=True)
class GraphMeasurement:
    """One candidate key: docs/design.md ("Measurements") says how each number is measured."""

    key: GraphKey
    capture_s: float       # capture of every stage graph of the key
    pool_bytes: int        # pool growth capturing the key alone into a fresh pool
    replay_s: float        # median step latency: the goodput policy's t(mode, bs)
    stage_replay_s: Mapping[Stage, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Here rather than in from_json, so measurements built in memory (an engine's probe)
        # are held to the same ranges as a file.
        where = self.key.label()
        d = {"bs": self.key.bs, "capture_s": self.capture_s, "pool_bytes": self.pool_bytes,
             "replay_s": self.replay_s}
        if need_field(d, "bs", int, where) < 1:
            raise ConfigError(f"{where}.bs must be >= 1, got {self.key.bs}")
        if need_field(d, "pool_bytes", int, where) < 0:
            raise ConfigError(f"{where}.pool_bytes must be >= 0, got {self.pool_bytes}")
        need_number(d, "capture_s", where, allow_zero=True)
        need_number(d, "replay_s", where, allow_zero=False)
        for stage, t in self.stage_replay_s.items():
            need_number({stage.value: t}, stage.value, f"{where}.stage_replay_s", allow_zero=True)

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
        entry, where = where, f"{where} ({mode.value} bs={bs})"
        capture_s = need_number(d, "capture_s", where, allow_zero=True)
        pool_bytes = need_field(d, "pool_bytes", int, where)
        replay_s = need_number(d, "replay_s", where, allow_zero=True)   # > 0: __post_init__
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
        try:
            return cls(GraphKey(mode, bs), capture_s, pool_bytes, replay_s, stages)
        except ConfigError as exc:
            raise ConfigError(f"{entry}: {exc}") from None


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
    def engine(self) -> str:
        """The engine whose graphs were measured: meta "engine", "reference" when not recorded."""
        return str(self.meta.get("engine", "reference"))

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
    return Measurements.from_json(read_json(path, "measurements file", "re-run `make capture-measure` on the GPU"))


def save_measurements(measurements: Measurements, path: str | Path) -> None:
    write_json(measurements.to_json(), path)
