"""The per-step record every engine keeps: metrics, step logs, reports."""

from __future__ import annotations

from typing import NamedTuple

from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import Reason


class StepRecord(NamedTuple):
    """What one step did and why: exported as metrics (mode, padded bs, reason, graph or eager)."""

    step: int
    mode: Mode
    bs: int
    padded_bs: int
    reason: Reason
    graph: bool                 # False: ran eagerly (no graph covered bs)
    tokens: int                 # tokens emitted to requests this step
    mean_accept_len: float      # 1.0 for decode-mode steps

    def to_json(self) -> dict:
        return {"step": self.step, "mode": self.mode.value, "bs": self.bs,
                "padded_bs": self.padded_bs, "reason": self.reason.value, "graph": self.graph,
                "tokens": self.tokens, "mean_accept_len": self.mean_accept_len}

    @classmethod
    def from_json(cls, d: dict) -> "StepRecord":
        """A record from to_json's fields (other keys of `d` ignored)."""
        return cls(step=int(d["step"]), mode=Mode(d["mode"]), bs=int(d["bs"]),
                   padded_bs=int(d["padded_bs"]), reason=Reason(d["reason"]),
                   graph=bool(d["graph"]), tokens=int(d["tokens"]),
                   mean_accept_len=float(d["mean_accept_len"]))
