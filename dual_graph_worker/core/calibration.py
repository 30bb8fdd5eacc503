"""Capture-time calibration: time graph replays of each pool into a CalibrationTable.

Engine-agnostic: the worker hands in, per captured batch size, the replay callables of one step
in each mode (decode: the target decode graph; spec: draft chain + verify + draft extend) and a
timer. Every TP rank replays (the graphs hold collectives) and rank 0's table is broadcast, so
every rank decides from the same numbers (policy decisions must never depend on a rank's own
clock).

Replays run with capture-time inputs and leave out host work, so both latencies are lower
bounds: the goodput controller takes them only as its prior.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Protocol, Sequence

from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.jsonio import read_json
from dual_graph_worker.core.modes import GraphKey, Mode

@dataclass(frozen=True)
class CalibrationTable:
    """Measured step latency (seconds) per captured (mode, padded bs); broadcast to all ranks."""

    latency_s: Mapping[GraphKey, float]
    num_draft_tokens: int
    source: str = "measured"

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.latency_s.items() if not 0 < v < math.inf}
        if bad:
            raise ConfigError(f"calibration latencies must be finite and > 0 seconds, got {bad}; "
                              "re-run the calibration (make capture-tune)")

    def latency(self, mode: Mode, padded_bs: int) -> Optional[float]:
        return self.latency_s.get(GraphKey(mode, padded_bs))

    def to_json(self) -> dict:
        return {"num_draft_tokens": self.num_draft_tokens, "source": self.source,
                "latency_s": [{"mode": k.mode.value, "bs": k.bs, "seconds": v}
                              for k, v in sorted(self.latency_s.items())]}

    @classmethod
    def from_json(cls, data: Mapping) -> "CalibrationTable":
        try:
            lat = {GraphKey(Mode(e["mode"]), int(e["bs"])): float(e["seconds"])
                   for e in data["latency_s"]}
            return cls(lat, int(data["num_draft_tokens"]), str(data.get("source", "measured")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"calibration table is malformed ({exc!r}); expected "
                              "{'num_draft_tokens': K, 'latency_s': [{'mode','bs','seconds'}]}; "
                              "regenerate it with `make capture-tune`") from exc

    @classmethod
    def load(cls, path: str | Path, num_draft_tokens: Optional[int] = None
             ) -> "CalibrationTable":
        """The table in `path`; `num_draft_tokens`: the K the server drafts, which its spec
        latencies must have been measured at."""
        table = cls.from_json(read_json(path, "calibration table", "re-run `make capture-tune`"))
        if num_draft_tokens is not None and table.num_draft_tokens != num_draft_tokens:
            raise ConfigError(f"calibration table {path} was measured drafting "
                              f"{table.num_draft_tokens} tokens a step, this server drafts "
                              f"{num_draft_tokens}; measure one for this server, or unset "
                              "DGW_CALIBRATION to measure the prior at start-up")
        return table


Replay = Callable[[], object]


class ReplayTimer(Protocol):
    def __call__(self, fns: Sequence[Replay], *, warmup: int, iters: int) -> float:
        """Seconds one call of every fn in `fns` (in order) takes, per iteration."""


def wall_clock_timer(clock: Callable[[], float],
                     sync: Callable[[], None] = lambda: None) -> ReplayTimer:
    """A timer from a clock and a device sync (CUDA: torch.cuda.synchronize): the median of
    `iters` synchronised iterations after `warmup` untimed ones."""

    def timer(fns: Sequence[Replay], *, warmup: int, iters: int) -> float:
        for _ in range(warmup):
            for fn in fns:
                fn()
        sync()
        samples = []
        for _ in range(iters):
            t0 = clock()
            for fn in fns:
                fn()
            sync()
            samples.append(clock() - t0)
        return statistics.median(samples)

    return timer


def measure_calibration(decode_steps: Mapping[int, Sequence[Replay]],
                        spec_steps: Mapping[int, Sequence[Replay]], *,
                        num_draft_tokens: int, timer: ReplayTimer,
                        warmup: int = 2, iters: int = 5) -> CalibrationTable:
    """Latency per (mode, captured bs) from timed replays of each pool's graphs."""
    if not decode_steps or not spec_steps:
        raise ConfigError("calibration needs captured graphs in both pools; with CUDA graphs "
                          "disabled use DGW_POLICY=threshold")
    latency: dict[GraphKey, float] = {}
    for mode, steps in ((Mode.DECODE, decode_steps), (Mode.SPEC, spec_steps)):
        for bs, fns in sorted(steps.items()):
            # Clamp at a nanosecond: a table entry must be > 0 (CalibrationTable checks).
            latency[GraphKey(mode, int(bs))] = max(
                float(timer(fns, warmup=warmup, iters=iters)), 1e-9)
    return CalibrationTable(latency, num_draft_tokens=num_draft_tokens,
                            source="measured: graph replays at capture")
