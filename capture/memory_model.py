"""The graph-pool memory model: what a set of captured graphs takes in pool memory.

memory(S) = peak_factor x (largest isolated pool_bytes of each graph pool's keys in S)
+ per_graph_bytes x |S| (docs/design.md, "Memory"). How many graph pools there are is the
engine's, a `PoolLayout`: `SharedPool` (the reference engine: one pool for both modes) or
`PoolPerMode` (SGLang: one per mode). `MemoryModel` is the numbers fitted to a measurements file
under one layout, and what the tuner, the report and the capture config hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Protocol

from capture.measurements import GraphMeasurement, Measurements
from capture.padding import PoolMemory
from capture.units import format_bytes
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.jsonio import need_field, need_mapping, need_number
from dual_graph_worker.core.modes import Mode

# A graph's own share of a graph pool where the measurements cannot tell it: one 2 MiB segment
# of the caching allocator (about 2 MiB a graph between SGLang's H200 servers).
SEGMENT_BYTES = 2 << 20
# A graph pool per mode without total_pool_bytes: the H200 servers measured 1.6-1.9x the pools'
# largest graphs alone (docs/design.md); 2 keeps the budget on the safe side.
FALLBACK_PEAK_FACTOR = 2.0


class PoolWords(NamedTuple):
    every: str      # where every graph's memory is counted
    chosen: str     # what the chosen graphs' figure is
    saved: str      # the memory a smaller choice saves


class PoolLayout(Protocol):
    """How an engine groups its graphs into pools: what a MemoryModel's numbers mean."""

    name: str           # MemoryModel.pools
    kind: str           # the JSON "kind"
    shared: bool        # every graph in one pool (one peak), else a pool per mode (a peak each)
    words: PoolWords    # how the layout's memory is named in tables and reports
    fallback_why: str   # why the fallback numbers, when no total_pool_bytes was measured
    rows_note: str      # how a tuning table's per-pool rows relate to its chosen/all rows

    def fit(self, m: Measurements) -> "MemoryModel": ...
    def check(self, model: "MemoryModel") -> None: ...
    def tops_text(self, model: "MemoryModel", tops: tuple[int, int]) -> str: ...
    def short_formula(self, model: "MemoryModel", per_graph: str) -> str: ...
    def formula(self, model: "MemoryModel", graphs: str) -> str: ...
    def fitted(self, model: "MemoryModel", total: str) -> str: ...
    def factor_json(self, model: "MemoryModel") -> dict: ...
    def factor_from_json(self, d: Any, where: str) -> float: ...


class SharedPool:
    """Both modes in one graph pool (the reference engine), peak_factor 1; per_graph_bytes =
    ceil((total - peak) / keys) from the measurements' every-key-together capture."""

    name, kind, shared = "shared", "shared-pool", True
    words = PoolWords("in one shared pool", "shared pool", "shared-pool")
    fallback_why = "2 MiB a graph is one allocator segment each, conservative"
    rows_note = ("(spec, decode: each pool's graphs alone; chosen, all: both pools in one "
                 "shared pool, so their memory is not the sum of the rows; all: every "
                 "measured graph, its waste over the same pool ranges)")

    def fit(self, m: Measurements) -> "MemoryModel":
        if m.total_pool_bytes is None:
            return MemoryModel(SEGMENT_BYTES, "fallback")
        peak = max(g.pool_bytes for g in m.graphs)
        per_graph = max(0, math.ceil((m.total_pool_bytes - peak) / len(m.graphs)))
        return MemoryModel(per_graph, "total_pool_bytes", measured_total_bytes=m.total_pool_bytes,
                           measured_peak_bytes=peak, measured_keys=len(m.graphs))

    def check(self, model: "MemoryModel") -> None:
        if model.peak_factor != 1.0:
            raise ConfigError(f"a shared-pool memory model counts its peak once: peak_factor "
                              f"must be 1, got {model.peak_factor!r}")

    def tops_text(self, model: "MemoryModel", tops: tuple[int, int]) -> str:
        return f"one shared pool: the larger top's isolated {format_bytes(max(tops))}"

    def short_formula(self, model: "MemoryModel", per_graph: str) -> str:
        return f"shared pool of all: largest + {per_graph}"

    def formula(self, model: "MemoryModel", graphs: str) -> str:
        return f"shared pool = largest isolated pool of the chosen graphs + {graphs}"

    def fitted(self, model: "MemoryModel", total: str) -> str:
        return f"{total}, the largest alone {format_bytes(model.measured_peak_bytes or 0)}"

    def factor_json(self, model: "MemoryModel") -> dict:
        return {}     # always 1: not written

    def factor_from_json(self, d: Any, where: str) -> float:
        return 1.0


class PoolPerMode:
    """A graph pool per mode, the spec runners' together (SGLang), measured as a server measures
    them, runner buffers and all; per_graph_bytes = SEGMENT_BYTES and peak_factor =
    (total - per_graph_bytes x keys) / (spec peak + decode peak), at least 1."""

    name, kind, shared = "per-mode", "pool-per-mode", False
    words = PoolWords("in a graph pool per mode", "by the model", "graph-pool")
    fallback_why = (f"{FALLBACK_PEAK_FACTOR:g}x the peaks and a segment a graph, "
                    "conservative on the H200")
    rows_note = ("(spec, decode: each pool's graphs in its own graph pool; chosen, all: both "
                 "pools, their memory the sum of the rows; all: every measured graph, its waste "
                 "over the same pool ranges)")

    def fit(self, m: Measurements) -> "MemoryModel":
        if m.total_pool_bytes is None:
            return MemoryModel(SEGMENT_BYTES, "fallback", self.name, FALLBACK_PEAK_FACTOR)
        peaks = sum(max(g.pool_bytes for g in m.graphs if g.key.mode is mode) for mode in Mode)
        # One together-capture fits one parameter: the factor; a graph's share stays a segment.
        rest = m.total_pool_bytes - SEGMENT_BYTES * len(m.graphs)
        factor = max(1.0, rest / peaks) if peaks else 1.0
        return MemoryModel(SEGMENT_BYTES, "total_pool_bytes", self.name, factor,
                           m.total_pool_bytes, peaks, len(m.graphs))

    def check(self, model: "MemoryModel") -> None:
        pass          # any factor >= 1: PoolMemory checks it

    def tops_text(self, model: "MemoryModel", tops: tuple[int, int]) -> str:
        return (f"a pool per mode: {model.peak_factor:.2f} x (the tops' isolated "
                f"{format_bytes(tops[0])} + {format_bytes(tops[1])})")

    def short_formula(self, model: "MemoryModel", per_graph: str) -> str:
        return f"a pool per mode: {model.peak_factor:.2f} x each mode's largest + {per_graph}"

    def formula(self, model: "MemoryModel", graphs: str) -> str:
        return (f"a pool per mode = {model.peak_factor:.2f} x (largest isolated spec key + "
                f"largest isolated decode key of the chosen) + {graphs}")

    def fitted(self, model: "MemoryModel", total: str) -> str:
        return (f"{total} as a server measures its pools, the two modes' largest keys alone "
                f"{format_bytes(model.measured_peak_bytes or 0)}; one together-capture fits "
                "the factor, a graph's own share is one allocator segment")

    def factor_json(self, model: "MemoryModel") -> dict:
        return {"peak_factor": model.peak_factor}

    def factor_from_json(self, d: Any, where: str) -> float:
        return need_number(d, "peak_factor", where, allow_zero=False)


# By MemoryModel.pools; the order is the one error messages list.
LAYOUTS: Mapping[str, PoolLayout] = MappingProxyType(
    {layout.name: layout for layout in (SharedPool(), PoolPerMode())})
# SGLang keeps a graph pool per runner; the reference engine (and any other) one for every graph.
_LAYOUT_OF_ENGINE: Mapping[str, PoolLayout] = MappingProxyType({"sglang": LAYOUTS["per-mode"]})


@dataclass(frozen=True)
class MemoryModel:
    """The model's numbers under the layout `pools` names (LAYOUTS): source "total_pool_bytes"
    when fitted to the measurements' every-key-together capture, "fallback" when none was
    recorded (SEGMENT_BYTES a graph, and FALLBACK_PEAK_FACTOR per mode). `measured_*` say what
    the fit was made from."""

    per_graph_bytes: int
    source: str
    pools: str = "shared"
    peak_factor: float = 1.0
    measured_total_bytes: Optional[int] = None
    measured_peak_bytes: Optional[int] = None     # the peaks' sum: one per graph pool
    measured_keys: Optional[int] = None

    SOURCES = ("total_pool_bytes", "fallback")

    def __post_init__(self) -> None:
        if self.source not in self.SOURCES:
            raise ConfigError(f"memory model source must be one of {list(self.SOURCES)}, got "
                              f"{self.source!r}")
        if self.pools not in LAYOUTS:
            raise ConfigError(f"memory model pools must be one of {list(LAYOUTS)}, got "
                              f"{self.pools!r}")
        self.layout.check(self)
        self.pool_memory()    # checks per_graph_bytes and peak_factor

    @property
    def layout(self) -> PoolLayout:
        return LAYOUTS[self.pools]

    @property
    def shared(self) -> bool:
        return self.layout.shared

    def pool_memory(self) -> PoolMemory:
        """The model as the solver applies it to (spec, decode) problems."""
        return PoolMemory(self.per_graph_bytes, self.peak_factor, self.shared)

    @classmethod
    def from_measurements(cls, m: Measurements) -> "MemoryModel":
        return _LAYOUT_OF_ENGINE.get(m.engine, LAYOUTS["shared"]).fit(m)

    def memory(self, graphs: Iterable[GraphMeasurement]) -> int:
        chosen = list(graphs)
        return self.pool_memory().bytes([[g.pool_bytes for g in chosen if g.key.mode is mode]
                                         for mode in (Mode.SPEC, Mode.DECODE)])

    @property
    def words(self) -> PoolWords:
        """How this layout's memory is named in tables and reports."""
        return self.layout.words

    def tops_text(self, tops: tuple[int, int]) -> str:
        """The peak part of the (spec top, decode top) choice, spelled out."""
        return self.layout.tops_text(self, tops)

    def rows_note(self) -> str:
        """How a tuning table's per-pool rows relate to its chosen/all rows."""
        return self.layout.rows_note

    def short_formula(self) -> str:
        """formula() in a plot title's few words."""
        return self.layout.short_formula(self, f"{format_bytes(self.per_graph_bytes)}/graph")

    def formula(self) -> str:
        return self.layout.formula(self, f"{format_bytes(self.per_graph_bytes)} x graphs")

    def describe(self) -> str:
        if self.source == "fallback":
            return (f"{self.formula()} (fallback: the measurements have no total_pool_bytes; "
                    f"{self.layout.fallback_why})")
        total = (f"from total_pool_bytes: all {self.measured_keys} keys captured together took "
                 f"{format_bytes(self.measured_total_bytes or 0)}")
        return f"{self.formula()} ({self.layout.fitted(self, total)})"

    def to_json(self) -> dict:
        out: dict = {"kind": self.layout.kind, "per_graph_bytes": self.per_graph_bytes,
                     "source": self.source}
        out.update(self.layout.factor_json(self))
        if self.source == "total_pool_bytes":
            out.update(measured_total_bytes=self.measured_total_bytes,
                       measured_peak_bytes=self.measured_peak_bytes,
                       measured_keys=self.measured_keys)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = "memory_model") -> "MemoryModel":
        d = need_mapping(data, where)
        layout = next((p for p in LAYOUTS.values() if d.get("kind") == p.kind), None)
        if layout is None:
            raise ConfigError(f"{where}.kind must be one of "
                              f"{[p.kind for p in LAYOUTS.values()]}, got {d.get('kind')!r}")
        source = need_field(d, "source", str, where)
        extra = {} if source != "total_pool_bytes" else {
            k: need_field(d, k, int, where)
            for k in ("measured_total_bytes", "measured_peak_bytes", "measured_keys")}
        factor = layout.factor_from_json(d, where)
        return cls(need_field(d, "per_graph_bytes", int, where), source, layout.name, factor,
                   **extra)
