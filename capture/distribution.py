"""The expected distribution of running batch sizes, and a parser for the presets users type.

Presets (`parse_distribution`):
    uniform:LO-HI        every bs in LO..HI equally likely   (uniform:256 means uniform:1-256)
    geometric[:P]        P(bs) ~ (1-P)^(bs-1) on 1..max_bs (default P = 0.02): mostly small
                         batches; geometric:P,max=N sets the top
    fixed:N              always bs = N
    {"1": 0.5, "64": 2}  inline JSON object bs -> weight (normalised)
    @path.json           the same object read from a file
    steplog:PATH         the batch sizes a server ran, from its step log (DGW_STEP_LOG; .gz ok)
`max_bs` (the top of geometric, when not given as `geometric:P,max=N`) comes from the caller:
the CLI passes the largest measured decode batch size. uniform's HI and geometric's max may not
exceed MAX_PRESET_BS or max_bs, whichever is larger.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from dual_graph_worker.core.errors import ConfigError

_DEFAULT_GEOMETRIC_P = 0.02
# uniform and geometric list every batch size up to their top: a typo such as 1-99999999 would
# build that many entries and exhaust memory. No server runs batches anywhere near this.
MAX_PRESET_BS = 4096


@dataclass(frozen=True)
class BatchDistribution:
    """Probability of each raw batch size (weights normalised to sum 1, zero weights dropped)."""

    probs: Mapping[int, float]
    description: str

    @classmethod
    def from_weights(cls, weights: Mapping[int, float], description: str) -> "BatchDistribution":
        clean: dict[int, float] = {}
        for bs, w in weights.items():
            if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
                raise ConfigError(f"batch-size distribution: batch sizes must be integers >= 1, "
                                  f"got {bs!r}")
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0 \
                    or w == float("inf"):
                raise ConfigError(f"batch-size distribution: weight of bs={bs} must be a finite "
                                  f"number >= 0, got {w!r}")
            if w > 0:
                clean[bs] = float(w)
        total = sum(clean.values())
        if not clean or total <= 0:
            raise ConfigError("batch-size distribution has no positive weight; give at least one "
                              "batch size a weight > 0")
        return cls({bs: w / total for bs, w in sorted(clean.items())}, description)

    @property
    def max_bs(self) -> int:
        return max(self.probs)

    def mean(self) -> float:
        return sum(bs * p for bs, p in self.probs.items())

    def to_json(self) -> dict:
        return {"description": self.description,
                "weights": {str(bs): p for bs, p in self.probs.items()}}

    @classmethod
    def from_json(cls, data: Mapping, where: str = "distribution") -> "BatchDistribution":
        if not isinstance(data, Mapping) or not isinstance(data.get("weights"), Mapping):
            raise ConfigError(f"{where} must be {{'description': str, 'weights': {{bs: weight}}}}")
        return cls.from_weights(_int_keys(data["weights"], where),
                                str(data.get("description", "custom")))


def parse_distribution(text: str, max_bs: int) -> BatchDistribution:
    """Parse a preset (see the module docstring). Raises ConfigError with the accepted forms."""
    s = text.strip()
    if s.startswith("{"):
        return _from_json_text(s, "inline distribution", description="custom")
    if s.startswith("@"):
        path = Path(s[1:])
        try:
            body = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read distribution file {path}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"distribution file {path} is not a UTF-8 text file; pass a JSON "
                              "object of batch size -> weight") from exc
        return _from_json_text(body, f"distribution file {path}", description=s)
    name, _, arg = s.partition(":")
    limit = max(MAX_PRESET_BS, max_bs)
    if name == "uniform":
        m = re.fullmatch(r"(?:(\d+)-)?(\d+)", arg)
        lo, hi = ((_at_most(m.group(1) or "1", limit, name), _at_most(m.group(2), limit, name))
                  if m else (0, 0))
        if not m or not 1 <= lo <= hi:
            raise ConfigError(f"cannot read {text!r}: write uniform:LO-HI with 1 <= LO <= HI, "
                              "e.g. uniform:1-256")
        return BatchDistribution.from_weights({b: 1.0 for b in range(lo, hi + 1)}, s)
    if name == "geometric":
        m = re.fullmatch(r"(0?\.\d+|1(?:\.0*)?)?(?:,max=(\d+))?", arg)
        if not m:
            raise ConfigError(f"cannot read {text!r}: write geometric, geometric:P or "
                              "geometric:P,max=N with 0 < P <= 1, e.g. geometric:0.05,max=256")
        p = float(m.group(1)) if m.group(1) else _DEFAULT_GEOMETRIC_P
        top = _at_most(m.group(2), limit, name) if m.group(2) else max_bs
        if not 0 < p <= 1 or top < 1:
            raise ConfigError(f"{text!r}: need 0 < P <= 1 and max >= 1")
        weights = {b: (1 - p) ** (b - 1) for b in range(1, top + 1)}
        return BatchDistribution.from_weights(weights, f"geometric:{p:g},max={top}")
    if name == "steplog":
        return _from_step_log(Path(arg), s)
    if name == "fixed":
        if not arg.isdigit() or int(arg) < 1:
            raise ConfigError(f"cannot read {text!r}: write fixed:N with N >= 1, e.g. fixed:64")
        return BatchDistribution.from_weights({int(arg): 1.0}, s)
    raise ConfigError(f"unknown batch-size distribution {text!r}; use uniform:LO-HI, "
                      "geometric[:P], fixed:N, steplog:PATH, an inline JSON object "
                      "{\"bs\": weight} or @file.json")


def _at_most(digits: str, limit: int, preset: str) -> int:
    """A preset's batch size, or ConfigError when above `limit` (digit count first: int() of a
    very long string is itself refused)."""
    value = digits.lstrip("0") or "0"
    if len(value) > len(str(limit)) or int(value) > limit:
        shown = value if len(value) <= 12 else value[:12] + "..."
        raise ConfigError(f"{preset} distribution reaches bs={shown}, above bs={limit}, the "
                          "largest a preset lists; lower it, or give the weights as JSON "
                          "({\"bs\": weight} or @file.json)")
    return int(value)


def _from_step_log(path: Path, description: str) -> BatchDistribution:
    """Every decode-family step's batch size in a worker's step log, counted."""
    from dual_graph_worker.core.step_log import read_step_log

    counts: dict[int, float] = {}
    try:
        for record, _ in read_step_log(path):
            counts[record.bs] = counts.get(record.bs, 0.0) + 1.0
    except OSError as exc:
        raise ConfigError(f"cannot read step log {path}: {exc.strerror or exc}; write one with "
                          "DGW_STEP_LOG=PATH on the server") from exc
    if not counts:
        raise ConfigError(f"step log {path} holds no steps; write one with DGW_STEP_LOG=PATH on "
                          "a server under its usual load")
    return BatchDistribution.from_weights(counts, description)


def _from_json_text(body: str, what: str, description: str) -> BatchDistribution:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} is not valid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what} must be a JSON object {{\"bs\": weight}}")
    return BatchDistribution.from_weights(_int_keys(data, what), description)


def _int_keys(weights: Mapping, what: str) -> dict[int, float]:
    out = {}
    for k, v in weights.items():
        try:
            out[int(k)] = v
        except (TypeError, ValueError):
            raise ConfigError(f"{what}: key {k!r} is not an integer batch size") from None
    return out
