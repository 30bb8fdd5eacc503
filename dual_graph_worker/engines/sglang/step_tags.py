"""The tags the worker stamps on each launched batch (core.timing.ResultClock), which turn its
measured cost into the controller's observation, and a prefill's preview for the step log."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import PrefillTime, StepTime


class StepTag(NamedTuple):
    """A launched decode step, as the timing of its result needs it."""

    mode: Mode
    padded_bs: int
    catch_up_tokens: int
    kv_tokens: int = 0
    bs: int = 0

    def observation(self, seconds: float, carries_next: bool) -> StepTime:
        return StepTime(self.mode, self.padded_bs, seconds, self.catch_up_tokens, carries_next,
                        self.kv_tokens, self.bs)

    def continued_by(self, nxt: Any) -> bool:
        """`nxt` is a plain step of this mode: launching it costs what launching this one did."""
        return isinstance(nxt, StepTag) and nxt.mode is self.mode and not nxt.catch_up_tokens


class PrefillTag(NamedTuple):
    tokens: int
    draft: bool          # EAGLE's draft prefill ran (False: deferred)

    def observation(self, seconds: float, carries_next: bool) -> PrefillTime:
        return PrefillTime(self.tokens, seconds, self.draft)

    def continued_by(self, nxt: Any) -> bool:
        return True          # a prefill's cost is taken whole: never marked as carrying


class PrefillPreview(NamedTuple):
    """What a prefill's preview of the batch it grows saw and priced: the step log's
    prefill_choice line (goodputs: the latest full decision's, tok/s)."""

    bs: int
    requests: int
    queued: int
    tokens: int
    priced_tokens: int
    kv_tokens: int
    catch_up_tokens: int
    preview_draft: bool
    goodput_spec: Optional[float]
    goodput_decode: Optional[float]
