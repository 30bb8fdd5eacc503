"""The two execution modes and the key that names one captured graph set."""

from __future__ import annotations

import enum
from typing import NamedTuple


class Mode(str, enum.Enum):
    """SPEC: draft chain -> verify (K+1 tokens a request) -> draft extend.
    DECODE: one target token a request, exactly the graph a plain server replays."""

    SPEC = "spec"
    DECODE = "decode"

    def tokens_per_request(self, num_draft_tokens: int) -> int:
        return num_draft_tokens + 1 if self is Mode.SPEC else 1


# Each mode's counterpart (a dict lookup: cheaper per step than a property on the enum).
OTHER = {Mode.SPEC: Mode.DECODE, Mode.DECODE: Mode.SPEC}


class GraphKey(NamedTuple):
    """One entry of a pool: the padded batch size the graphs of `mode` were captured for."""

    mode: Mode
    bs: int

    def label(self) -> str:
        return f"{self.mode.value}-bs{self.bs}"


class Stage(str, enum.Enum):
    """The stages of a step; each is one graph launch when a graph exists."""

    DRAFT = "draft"
    VERIFY = "verify"
    DRAFT_EXTEND = "draft_extend"
    DECODE = "decode"

    @staticmethod
    def for_mode(mode: Mode, num_draft_tokens: int) -> tuple["Stage", ...]:
        if mode is Mode.DECODE:
            return (Stage.DECODE,)
        # With K = 1 the only proposal comes from the previous draft extend: no chain to run.
        if num_draft_tokens == 1:
            return (Stage.VERIFY, Stage.DRAFT_EXTEND)
        return (Stage.DRAFT, Stage.VERIFY, Stage.DRAFT_EXTEND)
