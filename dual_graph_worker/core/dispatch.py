"""Batch size -> captured graph key, as a table built once at start-up.

Like vLLM's Model Runner V2, the lookup is precomputed for every batch size up to the largest
captured one, so dispatch on the hot path is one list index. A batch size no pool covers gets an
explicit `EagerDispatch` answer (never a guessed key), or a `NoGraphForBatch` error when eager
fallback is disabled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Union

from dual_graph_worker.core.errors import ConfigError, NoGraphForBatch
from dual_graph_worker.core.modes import GraphKey, Mode


@dataclass(frozen=True)
class EagerDispatch:
    """No captured graph covers this batch: run the step eagerly."""

    mode: Mode
    bs: int
    reason: str


Dispatch = Union[GraphKey, EagerDispatch]


def check_decode_covers_spec(spec_top: int, decode_top: int, fix: str, where: str = "") -> None:
    """ConfigError unless the decode pool reaches every batch the spec pool does: a batch
    leaving speculation must find a decode graph. `fix`: what the message tells the user;
    `where`: what it begins with (the file that set the pools)."""
    if decode_top < spec_top:
        raise ConfigError(f"{where}the decode pool tops out at bs={decode_top} below the spec "
                          f"pool's bs={spec_top}; the decode pool must cover the spec range: "
                          f"{fix}")


def _validated_sizes(name: str, sizes: Iterable[int]) -> tuple[int, ...]:
    out = tuple(sorted(set(int(s) for s in sizes)))
    if any(s < 1 for s in out):
        raise ConfigError(f"{name} batch sizes must be >= 1, got {list(out)}; remove the zero "
                          "or negative entries")
    return out


@dataclass(frozen=True)
class DispatchTable:
    """Immutable map (mode, raw bs) -> smallest covering GraphKey of that mode's pool."""

    spec_sizes: tuple[int, ...]
    decode_sizes: tuple[int, ...]
    allow_eager: bool
    _spec_lut: tuple[Optional[GraphKey], ...]
    _decode_lut: tuple[Optional[GraphKey], ...]

    @classmethod
    def build(cls, spec_sizes: Iterable[int], decode_sizes: Iterable[int],
              allow_eager: bool = True) -> "DispatchTable":
        spec = _validated_sizes("spec pool", spec_sizes)
        decode = _validated_sizes("decode pool", decode_sizes)
        if spec and decode:
            check_decode_covers_spec(max(spec), max(decode), "add larger decode batch sizes")
        return cls(spec, decode, allow_eager, cls._lut(Mode.SPEC, spec),
                   cls._lut(Mode.DECODE, decode))

    @staticmethod
    def _lut(mode: Mode, sizes: tuple[int, ...]) -> tuple[Optional[GraphKey], ...]:
        # index bs -> smallest captured size >= bs; index 0 unused.
        lut: list[Optional[GraphKey]] = [None]
        it = iter(sizes)
        cur = next(it, None)
        for bs in range(1, (sizes[-1] if sizes else 0) + 1):
            while cur is not None and cur < bs:
                cur = next(it, None)
            lut.append(GraphKey(mode, cur) if cur is not None else None)
        return tuple(lut)

    @property
    def max_spec_bs(self) -> int:
        return self.spec_sizes[-1] if self.spec_sizes else 0

    @property
    def max_decode_bs(self) -> int:
        return self.decode_sizes[-1] if self.decode_sizes else 0

    def keys(self) -> tuple[GraphKey, ...]:
        return tuple(GraphKey(Mode.SPEC, b) for b in self.spec_sizes) + tuple(
            GraphKey(Mode.DECODE, b) for b in self.decode_sizes)

    def step_sizes(self, max_bs: int) -> dict[Mode, tuple[int, ...]]:
        """The padded sizes each mode's steps run at: its pool's, or every size up to `max_bs`
        where it captured none (its steps run eagerly at their own size)."""
        every = tuple(range(1, max_bs + 1))
        return {Mode.SPEC: self.spec_sizes or every, Mode.DECODE: self.decode_sizes or every}

    def has_graph(self, mode: Mode, bs: int) -> bool:
        lut = self._spec_lut if mode is Mode.SPEC else self._decode_lut
        return 0 < bs < len(lut)

    def lookup(self, mode: Mode, bs: int) -> Dispatch:
        if bs < 1:
            raise ValueError(f"batch size must be >= 1, got {bs}")
        lut = self._spec_lut if mode is Mode.SPEC else self._decode_lut
        if bs < len(lut):
            return lut[bs]  # type: ignore[return-value]
        pool_max = len(lut) - 1
        reason = (f"bs={bs} exceeds the {mode.value} pool (largest captured bs={pool_max})"
                  if pool_max else f"the {mode.value} pool captured no graphs")
        if not self.allow_eager:
            raise NoGraphForBatch(
                f"{reason} and eager fallback is disabled; capture larger batch sizes "
                "(capture config / --decode-bs) or cap max running requests at "
                f"{pool_max}, or enable eager fallback")
        return EagerDispatch(mode, bs, reason)

    def padded_bs(self, mode: Mode, bs: int) -> int:
        """Rows a step of `bs` requests computes in `mode` (bs itself when run eagerly)."""
        lut = self._spec_lut if mode is Mode.SPEC else self._decode_lut
        return lut[bs].bs if 0 < bs < len(lut) else bs  # type: ignore[union-attr]
