"""What ranks exchange: each estimate's rank-local sums since the last exchange, as typed records,
and the flat vector of floats every rank reduces (policy.Reducer's wire format), laid out from
the records' fields in declaration order, so its length and order are the same on every rank.
Records are NamedTuples, as the per-step records are: cheaper to build than dataclasses."""

from __future__ import annotations

from itertools import chain, compress
from typing import Mapping, NamedTuple, Sequence

from dual_graph_worker.core.regressions import KEY_SLOTS, LINE


class KeyWindow(NamedTuple):
    """One step-time key's sums over its steps since the last exchange (x: context tokens, y:
    seconds), in the order regressions.ContextSums.add reads them and StepTimeTable.add fills
    them."""

    seconds: float
    steps: float
    tokens: float
    tokens_sq: float
    tokens_seconds: float
    seconds_sq: float


assert len(KeyWindow._fields) == KEY_SLOTS      # one field a regressions.ContextSums slot
_STEPS_AT = KeyWindow._fields.index("steps")
_NO_WINDOW = KeyWindow(*[0.0] * KEY_SLOTS)


class StepSums(NamedTuple):
    """Every step-time key's sums: `windows` holds the keys with steps (key -> its window, keys
    ascending), every other key's sums are zero. On the wire, slot-major: each of KeyWindow's
    fields for every key in turn."""

    keys: int
    windows: dict[int, KeyWindow]

    @classmethod
    def from_vector(cls, vector: list[float]) -> StepSums:
        keys, rest = divmod(len(vector), KEY_SLOTS)
        if rest:
            raise ValueError(f"{len(vector)} floats are no whole number of step-time windows")
        steps = vector[_STEPS_AT * keys:(_STEPS_AT + 1) * keys]
        return cls(keys, {i: KeyWindow(*vector[i::keys])
                          for i in compress(range(keys), steps)})

    def to_vector(self) -> list[float]:
        keys = self.keys
        vector = [0.0] * (KEY_SLOTS * keys)
        for i, window in self.windows.items():
            vector[i::keys] = window
        return vector

    def plus(self, windows: Mapping[int, Sequence[float]]) -> StepSums:
        """These sums with each of `windows` (key -> window) added to its key's."""
        merged = dict(self.windows)
        for i, window in windows.items():
            merged[i] = KeyWindow(*[a + b for a, b in zip(merged.get(i, _NO_WINDOW), window)])
        return StepSums(self.keys, dict(sorted(merged.items())))


class BatchSums(NamedTuple):
    """Sums of batches beside the steps (x: tokens, y: seconds): regressions (LINE) of prefills
    with and without the draft, of catch-ups at a switch back from decode and inside a
    speculative run (after deferred prefills), switches without a catch-up (count, seconds), and
    catch-ups at a switch that fill the draft's K/V alone (batch_costs.CatchUpWork). A rank's
    lists fill in place until the exchange hands them over."""

    prefill_draft: list[float]
    prefill_plain: list[float]
    catch_up_switch: list[float]
    catch_up_run: list[float]
    switches: list[float]
    kv_catch_up: list[float]

    @classmethod
    def zeros(cls) -> BatchSums:
        return cls(prefill_draft=[0.0] * LINE, prefill_plain=[0.0] * LINE,
                   catch_up_switch=[0.0] * LINE, catch_up_run=[0.0] * LINE,
                   switches=[0.0, 0.0], kv_catch_up=[0.0] * LINE)

    @classmethod
    def from_vector(cls, vector: list[float]) -> BatchSums:
        if len(vector) != BATCH_WIDTH:
            raise ValueError(f"batch sums of {len(vector)} floats, laid out for {BATCH_WIDTH}")
        return cls(*[vector[start:stop] for start, stop in _BATCH_SLICES])

    def to_vector(self) -> list[float]:
        return list(chain.from_iterable(self))

    def empty(self) -> bool:
        """Nothing measured: every sum zero."""
        return not any(map(any, self))


def _slices(record: Sequence[list[float]]) -> tuple[tuple[int, int], ...]:
    """Each field's (start, stop) in a record's vector."""
    out, at = [], 0
    for field in record:
        out.append((at, at + len(field)))
        at += len(field)
    return tuple(out)


_BATCH_SLICES = _slices(BatchSums.zeros())
BATCH_WIDTH = _BATCH_SLICES[-1][1]


class ExchangeSums(NamedTuple):
    """What a rank hands the reduction at an exchange, and what comes back: the step times'
    sums, then the batch costs'."""

    step_times: StepSums
    batch_costs: BatchSums

    @classmethod
    def from_vector(cls, vector: list[float]) -> ExchangeSums:
        split = len(vector) - BATCH_WIDTH
        if split < 0:
            raise ValueError(f"an exchange vector of {len(vector)} floats, too short for its "
                             "batch sums")
        return cls(StepSums.from_vector(vector[:split]), BatchSums.from_vector(vector[split:]))

    def to_vector(self) -> list[float]:
        vector = self.step_times.to_vector()
        vector += self.batch_costs.to_vector()
        return vector
