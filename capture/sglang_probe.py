"""An SGLang server's capture probe (DGW_CAPTURE_PROBE) as the tuner's measurements.

Each graph the server captured is a stage of one pool's key, by its runner: the target's verify
graph, the draft's chain and its draft extend make a speculative key; the worker's decode graph
(plus keep-current's one-token draft extend) a decode key. A key's capture time, pool bytes and
replay time are its stages' sums (several graphs of one stage and size, as LoRA variants, add
up); graphs of other runners go to meta.
"""

from __future__ import annotations

from collections import defaultdict
from types import MappingProxyType
from typing import Any, Mapping, Optional

from capture.measurements import GraphMeasurement, Measurements
from dual_graph_worker.core.capture_schema import GpuInfo, ModelInfo
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.jsonio import check_schema, need_field, need_mapping, need_number
from dual_graph_worker.core.modes import GraphKey, Mode, Stage
from dual_graph_worker.engines.sglang.capture_probe import SCHEMA

# (runner class, captured by the draft) -> the (mode, stage) its graphs serve.
STAGES: Mapping[tuple[str, bool], tuple[Mode, Stage]] = MappingProxyType({
    ("DecodeCudaGraphRunner", False): (Mode.SPEC, Stage.VERIFY),
    ("EAGLEDraftCudaGraphRunner", True): (Mode.SPEC, Stage.DRAFT),
    ("EAGLEDraftExtendCudaGraphRunner", True): (Mode.SPEC, Stage.DRAFT_EXTEND),
    ("DecodeModeCudaGraphRunner", False): (Mode.DECODE, Stage.DECODE),
    ("OneTokenDraftExtendRunner", True): (Mode.DECODE, Stage.DECODE),
})


def measurements_from_probe(probe: Any, total_pool_bytes: Optional[int] = None,
                            where: str = "capture probe") -> Measurements:
    """`probe`: the JSON the worker wrote; `total_pool_bytes`: the pools' size when captured
    together (a server started without the probe), if measured; `where`: the probe as error
    messages name it (its file's path, say)."""
    d = need_mapping(probe, where)
    check_schema(d, SCHEMA, where)
    model = ModelInfo.from_shape(need_mapping(d.get("model_shape"), f"{where}.model_shape"))
    sums: dict[GraphKey, dict[Stage, list[float]]] = defaultdict(dict)
    other = {"graphs": 0, "capture_s": 0.0, "pool_bytes": 0}
    for i, g in enumerate(d.get("graphs") or []):
        record = f"{where}.graphs[{i}]"
        g = need_mapping(g, record)
        stage = STAGES.get((g.get("runner"), bool(g.get("draft"))))
        if stage is None:
            # Other runners' graphs are only tallied; a field they lack counts as nothing.
            other["graphs"] += 1
            if g.get("capture_s") is not None:
                other["capture_s"] += need_number(g, "capture_s", record, allow_zero=True)
            if g.get("pool_bytes") is not None:
                other["pool_bytes"] += need_field(g, "pool_bytes", int, record)
            continue
        if g.get("pool_bytes") is None or g.get("replay_s") is None:
            raise ConfigError(f"{record} ({g.get('runner')} size {g.get('size')}) "
                              "has no pool size or replay time: the server captured it another "
                              "way (memory saver, a non-full graph backend); measure without")
        size = need_field(g, "size", int, record)
        if size < 1:
            raise ConfigError(f"{record}.size must be a batch size >= 1, got {size}")
        acc = sums[GraphKey(stage[0], size)].setdefault(stage[1], [0.0, 0, 0.0])
        acc[0] += need_number(g, "capture_s", record, allow_zero=True)
        pool_bytes = need_field(g, "pool_bytes", int, record)
        if pool_bytes < 0:
            raise ConfigError(f"{record}.pool_bytes must be >= 0, got {pool_bytes}")
        acc[1] += pool_bytes
        acc[2] += need_number(g, "replay_s", record, allow_zero=False)
    graphs, incomplete = [], []
    for key, stages in sorted(sums.items()):
        need = set(Stage.for_mode(key.mode, model.num_draft_tokens))
        if not need <= set(stages):
            incomplete.append(f"{key.label()} (no {', '.join(sorted(s.value for s in need - set(stages)))})")
            continue
        graphs.append(GraphMeasurement(
            key, sum(s[0] for s in stages.values()), sum(s[1] for s in stages.values()),
            sum(s[2] for s in stages.values()), {st: s[2] for st, s in stages.items()}))
    meta = {"engine": "sglang", "sglang": d.get("sglang"), "torch": d.get("torch"),
            "other_graphs": other, "incomplete_keys": incomplete}
    return Measurements(
        GpuInfo.from_json(d.get("gpu"), f"{where}.gpu"), model, tuple(graphs),
        total_pool_bytes=total_pool_bytes, synthetic=False,
        notes="measured by the SGLang worker's capture probe (DGW_CAPTURE_PROBE): every graph "
              "captured by the server into a pool of its own; a key's numbers are the sums of "
              "its stages' graphs; replay = median of replays on capture-time inputs (short "
              "contexts), so attention's share of a step is low",
        meta=meta)
