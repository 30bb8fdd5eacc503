"""Lazy catch-up, device side but engine-agnostic: the stash and the catch-up batch's indices.

Plain torch (no SGLang), so every index computed here is unit-tested on CPU against a direct
loop; catch_up_pass.py runs these tensors through SGLang's draft model. ``StashArena`` holds the
(target aux at p, token at p+1) draft inputs filed under position p's KV slot; ``plan_passes``
splits the backlogs into draft forwards; ``build_catch_up_indices`` computes one pass's indices
from the batch's lengths, on the host when it has them, else on the device. docs/sglang-0.5.17.md
§6 says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Optional, Sequence

import numpy as np
import torch


def to_device(values, device) -> torch.Tensor:
    """A small host index list/array as an int64 device tensor (pinned, non-blocking H2D: the
    host never waits on the stream)."""
    host = torch.as_tensor(np.asarray(values, dtype=np.int64))
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class Segment(NamedTuple):
    """Backlog offsets ``[begin, end)`` (0 = the request's first position behind) of request
    ``req`` (an index into the catch-up's request list); ``final``: it ends the backlog, so its
    last row yields the request's next proposal."""

    req: int
    begin: int
    end: int
    final: bool


def plan_passes(counts: Sequence[int], max_tokens: int) -> list[list[Segment]]:
    """Each request's backlog (`counts`, batch order) cut into segments of at most `max_tokens`,
    packed into passes of at most `max_tokens` tokens round by round (round r: every request's
    r-th segment, in request order), so a request's segments run in order, one a pass."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    rounds: list[list[Segment]] = []
    for i, n in enumerate(counts):
        n = int(n)
        if n < 1:
            raise ValueError(f"request {i} has backlog {n}; only rows that are behind are "
                             "caught up")
        for r, b in enumerate(range(0, n, max_tokens)):
            e = min(b + max_tokens, n)
            if len(rounds) <= r:
                rounds.append([])
            rounds[r].append(Segment(i, b, e, e == n))
    passes: list[list[Segment]] = []
    for rnd in rounds:
        cur: list[Segment] = []
        used = 0
        for seg in rnd:
            n = seg.end - seg.begin
            if cur and used + n > max_tokens:
                passes.append(cur)
                cur, used = [], 0
            cur.append(seg)
            used += n
        if cur:
            passes.append(cur)
    return passes


@dataclass
class StashArena:
    aux: torch.Tensor            # [cells, A]: target aux hidden states at position p
    tokens: torch.Tensor         # [cells] int64: the token at position p + 1
    cell_of_slot: torch.Tensor   # [KV slots] int64: the cell filed under a KV slot
    cell_ids: torch.Tensor       # [cells] int64 = arange(cells); a step's cells are a view

    @classmethod
    def allocate(cls, cells: int, aux_width: int, aux_dtype: torch.dtype, num_slots: int,
                 device) -> "StashArena":
        dev = torch.device(device)
        return cls(aux=torch.zeros(cells, aux_width, dtype=aux_dtype, device=dev),
                   tokens=torch.zeros(cells, dtype=torch.int64, device=dev),
                   cell_of_slot=torch.zeros(num_slots, dtype=torch.int64, device=dev),
                   cell_ids=torch.arange(cells, dtype=torch.int64, device=dev))

    SLOT_BYTES: ClassVar[int] = torch.int64.itemsize     # a KV slot's cell_of_slot entry

    @staticmethod
    def cell_bytes(aux_width: int, aux_dtype: torch.dtype) -> int:
        """A cell's bytes: its feature row, its token id and its cell id (allocate's tensors)."""
        return aux_width * aux_dtype.itemsize + 2 * torch.int64.itemsize

    @property
    def cells(self) -> int:
        return self.aux.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.aux, self.tokens, self.cell_of_slot, self.cell_ids))

    def write(self, base: int, aux: torch.Tensor, tokens: torch.Tensor,
              slots: torch.Tensor) -> None:
        """File a decode step's draft inputs: row i of `aux` (target aux at the position the
        step wrote) and `tokens` (the token it emitted) under KV slot ``slots[i]``."""
        n = aux.shape[0]
        if tokens.shape[0] != n or slots.shape[0] != n:
            raise ValueError(f"stash rows disagree: aux {n}, tokens {tokens.shape[0]}, "
                             f"slots {slots.shape[0]}")
        if aux.shape[1:] != self.aux.shape[1:]:
            raise ValueError(f"target aux width {tuple(aux.shape[1:])} != stash width "
                             f"{tuple(self.aux.shape[1:])}")
        if base < 0 or base + n > self.cells:
            raise ValueError(f"cells [{base}, {base + n}) outside the arena of {self.cells}")
        self.aux[base:base + n].copy_(aux)
        self.tokens[base:base + n].copy_(tokens)
        self.cell_of_slot.index_copy_(0, slots.to(torch.int64), self.cell_ids[base:base + n])

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux rows, token ids) filed under `slots`, in order."""
        cells = self.cell_of_slot[slots]
        return self.aux[cells], self.tokens[cells]

    def compact(self, slots: torch.Tensor, chunk_rows: int = 8192) -> int:
        """Move the cells filed under `slots` (every live one, distinct) to ``[0, n)``, keeping
        their order, and refile them; every other cell becomes free. Returns n.

        In place, `chunk_rows` rows at a time, no arena-sized temporary: the i-th smallest of n
        distinct cells is >= i, so chunk ``[a, b)`` reads cells >= a (gathered into a temporary
        before it is written) and the later chunks read cells >= b, which no earlier chunk wrote.
        """
        n = int(slots.numel())
        if n > self.cells:
            raise ValueError(f"{n} live cells cannot fit an arena of {self.cells}")
        if n == 0:
            return 0
        src, order = torch.sort(self.cell_of_slot[slots])
        for a in range(0, n, chunk_rows):
            b = min(a + chunk_rows, n)
            self.aux[a:b] = self.aux[src[a:b]]
            self.tokens[a:b] = self.tokens[src[a:b]]
        self.cell_of_slot.index_copy_(0, slots.to(torch.int64)[order], self.cell_ids[:n])
        return n


def shifted_prompt_tokens(input_ids: torch.Tensor, extend_lens: Sequence[int],
                          tail_tokens: torch.Tensor) -> torch.Tensor:
    """The draft's input ids over a prefill batch: EAGLE-3 reads, at position p, the token at
    p + 1, so each request's chunk shifts left by one and its last row takes `tail_tokens[i]`
    (the sampled token, or the next prompt token of a chunked prompt). What EAGLE's own prefill
    draft extend builds with a per-request loop (eagle_worker_v2.py:742-752), in two kernels."""
    lens = np.asarray(extend_lens, dtype=np.int64)
    if lens.size != tail_tokens.shape[0] or int(lens.sum()) != input_ids.shape[0]:
        raise ValueError(f"prefill batch: {input_ids.shape[0]} input ids, extend lengths "
                         f"summing to {int(lens.sum())}, {tail_tokens.shape[0]} tail tokens")
    last = to_device(np.cumsum(lens) - 1, input_ids.device)
    out = torch.empty(input_ids.shape[0], dtype=torch.int64, device=input_ids.device)
    out[:-1] = input_ids[1:]
    out[last] = tail_tokens.to(torch.int64)
    return out


class CatchUpIndices(NamedTuple):
    """One pass: ``s`` segments, ``num_tokens`` positions, segment-major order."""

    req_pool_indices: torch.Tensor   # [s] int64 device: request-pool row of each segment
    positions: torch.Tensor          # [T] int64 device
    slots: torch.Tensor              # [T] int64 device: KV slot of each position
    prefix_lens: torch.Tensor        # [s] int32 device: positions before the segment
    extend_lens: torch.Tensor        # [s] int32 device
    seq_lens: torch.Tensor           # [s] int64 device: prefix + extend
    last_rows: torch.Tensor          # [s] int64 device: row of each segment's last position
    extend_lens_cpu: list[int]
    prefix_lens_cpu: Optional[list[int]]      # None when the batch has no host seq_lens
    seq_lens_cpu: Optional[torch.Tensor]      # int64 host, None likewise
    num_tokens: int
    batch_positions: list[int]       # [s] index of each segment's request in the batch
    final: list[bool]                # [s]


def final_rows(idx: CatchUpIndices) -> Optional[CatchUpIndices]:
    """The last position of each segment that ends its request's backlog, as a pass of
    one-token segments behind everything before it (None: no segment of `idx` is final): the
    rows whose draft output a proposal reads, once the K/V of every row is in the cache."""
    picked = [j for j, final in enumerate(idx.final) if final]
    if not picked:
        return None
    n, device = len(picked), idx.seq_lens.device
    every = n == len(idx.final)
    sel = None if every else to_device(picked, device)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t if every else t[sel]

    last, seq_lens = pick(idx.last_rows), pick(idx.seq_lens)
    seq_cpu = idx.seq_lens_cpu
    if seq_cpu is not None and not every:
        seq_cpu = seq_cpu[picked]
    return CatchUpIndices(
        req_pool_indices=pick(idx.req_pool_indices),
        positions=idx.positions[last], slots=idx.slots[last],
        prefix_lens=(seq_lens - 1).to(torch.int32),
        extend_lens=torch.ones(n, dtype=torch.int32, device=device),
        seq_lens=seq_lens, last_rows=torch.arange(n, dtype=torch.int64, device=device),
        extend_lens_cpu=[1] * n,
        prefix_lens_cpu=None if seq_cpu is None else (seq_cpu - 1).tolist(),
        seq_lens_cpu=seq_cpu, num_tokens=n,
        batch_positions=[idx.batch_positions[j] for j in picked], final=[True] * n)


def join_passes(parts: Sequence[CatchUpIndices]) -> CatchUpIndices:
    """Passes as one, in order: the K/V-only catch-up runs the draft's layer once over every
    pass's final rows, after all the passes' K/V are filled."""
    if len(parts) == 1:
        return parts[0]
    offsets = np.cumsum([0] + [p.num_tokens for p in parts[:-1]])
    host = all(p.seq_lens_cpu is not None and p.prefix_lens_cpu is not None for p in parts)
    return CatchUpIndices(
        req_pool_indices=torch.cat([p.req_pool_indices for p in parts]),
        positions=torch.cat([p.positions for p in parts]),
        slots=torch.cat([p.slots for p in parts]),
        prefix_lens=torch.cat([p.prefix_lens for p in parts]),
        extend_lens=torch.cat([p.extend_lens for p in parts]),
        seq_lens=torch.cat([p.seq_lens for p in parts]),
        last_rows=torch.cat([p.last_rows + int(o) for p, o in zip(parts, offsets)]),
        extend_lens_cpu=[n for p in parts for n in p.extend_lens_cpu],
        prefix_lens_cpu=[n for p in parts for n in p.prefix_lens_cpu] if host else None,
        seq_lens_cpu=torch.cat([p.seq_lens_cpu for p in parts]) if host else None,
        num_tokens=sum(p.num_tokens for p in parts),
        batch_positions=[b for p in parts for b in p.batch_positions],
        final=[f for p in parts for f in p.final])


def backlog_slots(*, req_pool_indices: torch.Tensor, ends: torch.Tensor, counts: Sequence[int],
                  req_to_token: torch.Tensor) -> torch.Tensor:
    """KV slots of every position behind, ``[ends[i] - counts[i], ends[i])`` per row, in row
    order: the live cells a compaction keeps (one whole-backlog segment per row, without the
    rest of a pass's indices)."""
    n = np.asarray(counts, dtype=np.int64)
    sn = to_device(n, ends.device)
    rows = torch.arange(len(n), device=ends.device)
    return _segment_tokens(rows, torch.zeros_like(sn), sn, sn, ends=ends,
                           req_pool_indices=req_pool_indices, req_to_token=req_to_token,
                           num_tokens=int(n.sum())).slots


class _SegmentTokens(NamedTuple):
    rows: torch.Tensor        # request-pool row per segment
    prefix: torch.Tensor      # first position of each segment
    cum: torch.Tensor         # inclusive cumulative segment lengths
    positions: torch.Tensor   # per token
    slots: torch.Tensor       # per token: its KV slot


def _segment_tokens(sr: torch.Tensor, sb: torch.Tensor, sl: torch.Tensor, sn: torch.Tensor, *,
                    ends: torch.Tensor, req_pool_indices: torch.Tensor,
                    req_to_token: torch.Tensor, num_tokens: int) -> _SegmentTokens:
    """Device indices of segments (request `sr`, begin `sb` and length `sl` inside a backlog of
    `sn` positions that ends at ``ends[sr]``), one entry per token in segment order."""
    start = ends.to(torch.int64)[sr] - sn                # first position behind
    prefix = start + sb
    cum = torch.cumsum(sl, 0)
    seg_of_tok = torch.repeat_interleave(torch.arange(sr.shape[0], device=sr.device), sl,
                                         output_size=num_tokens)
    offset = torch.arange(num_tokens, device=sr.device) - (cum - sl)[seg_of_tok]
    positions = prefix[seg_of_tok] + offset
    rows = req_pool_indices.to(torch.int64)[sr]
    slots = req_to_token[rows[seg_of_tok], positions].to(torch.int64)
    return _SegmentTokens(rows, prefix, cum, positions, slots)


def build_catch_up_indices(segments: Sequence[Segment], *, counts: Sequence[int],
                           batch_positions: Sequence[int], req_to_token: torch.Tensor,
                           req_pool_indices: Optional[torch.Tensor] = None,
                           ends: Optional[torch.Tensor] = None,
                           rows_cpu: Optional[Sequence[int]] = None,
                           ends_cpu: Optional[Sequence[int]] = None) -> CatchUpIndices:
    """Indices of one pass.

    `counts`, `batch_positions` and the request lists below are indexed by the catch-up's
    request list; ``ends[i]`` is request i's committed length (the batch's ``seq_lens``), so its
    backlog is ``[ends[i] - counts[i], ends[i])``. With the host's request-pool rows and lengths
    (`rows_cpu`, `ends_cpu`) every index is computed on the host and uploaded at once, leaving
    one gather on the device (the switch is host-bound: ~25 small launches cost more than the
    draft's own work there), and the host mirrors let the attention backend size its buffers
    exactly. Without them the device's `req_pool_indices` and `ends` are used and the mirrors
    are None.
    """
    if not segments:
        raise ValueError("a catch-up pass needs at least one segment")
    counts = np.asarray(counts, dtype=np.int64)
    seg_req = np.asarray([g.req for g in segments], dtype=np.int64)
    begin = np.asarray([g.begin for g in segments], dtype=np.int64)
    lens = np.asarray([g.end - g.begin for g in segments], dtype=np.int64)
    if (lens < 1).any() or (begin < 0).any() or (begin + lens > counts[seg_req]).any():
        raise ValueError("segment outside its request's backlog")
    if (rows_cpu is None) != (ends_cpu is None):
        raise ValueError("the host path needs both rows_cpu and ends_cpu")
    host = dict(extend_lens_cpu=lens.tolist(), num_tokens=int(lens.sum()),
                batch_positions=np.asarray(batch_positions, dtype=np.int64)[seg_req].tolist(),
                final=[bool(g.final) for g in segments])
    if rows_cpu is not None:
        rows, ends_h = (np.asarray(x, dtype=np.int64) for x in (rows_cpu, ends_cpu))
        if rows.shape != counts.shape or ends_h.shape != counts.shape:
            raise ValueError(f"{counts.size} requests behind but {rows.size} rows and "
                             f"{ends_h.size} lengths")
        if (ends_h < counts).any():
            raise ValueError("a request is behind by more tokens than it holds")
        return CatchUpIndices(**_host_indices(seg_req, begin, lens, counts, req_to_token, rows,
                                              ends_h), **host)
    if req_pool_indices is None or ends is None:
        raise ValueError("catch-up indices need the device's req_pool_indices and ends, or "
                         "the host's rows_cpu and ends_cpu")
    sr, sb, sl, sn = to_device(np.stack([seg_req, begin, lens, counts[seg_req]]),
                               ends.device).unbind(0)
    tok = _segment_tokens(sr, sb, sl, sn, ends=ends, req_pool_indices=req_pool_indices,
                          req_to_token=req_to_token, num_tokens=host["num_tokens"])
    return CatchUpIndices(
        req_pool_indices=tok.rows, positions=tok.positions, slots=tok.slots,
        prefix_lens=tok.prefix.to(torch.int32), extend_lens=sl.to(torch.int32),
        seq_lens=tok.prefix + sl, last_rows=tok.cum - 1, prefix_lens_cpu=None,
        seq_lens_cpu=None, **host)


def _host_indices(seg_req: np.ndarray, begin: np.ndarray, lens: np.ndarray, counts: np.ndarray,
                  req_to_token: torch.Tensor, rows: np.ndarray, ends: np.ndarray) -> dict:
    """The device fields of CatchUpIndices and their host mirrors, computed on the host: the
    arithmetic of _segment_tokens in numpy, since on CPU tensors torch's per-op cost dominates
    arithmetic this small."""
    s, t = len(seg_req), int(lens.sum())
    prefix = ends[seg_req] - counts[seg_req] + begin
    cum = np.cumsum(lens)
    seg_of_tok = np.repeat(np.arange(s), lens)
    positions = prefix[seg_of_tok] + np.arange(t) - (cum - lens)[seg_of_tok]
    seg_rows = rows[seg_req]
    # One upload: [positions | token rows | rows | prefix, extend | seq | last rows].
    dev = to_device(np.concatenate(
        [positions, seg_rows[seg_of_tok], seg_rows, prefix, lens, prefix + lens, cum - 1]),
        req_to_token.device)
    lens32 = dev[2 * t + s:2 * t + 3 * s].to(torch.int32)
    return dict(req_pool_indices=dev[2 * t:2 * t + s], positions=dev[:t],
                slots=req_to_token[dev[t:2 * t], dev[:t]].to(torch.int64),
                prefix_lens=lens32[:s], extend_lens=lens32[s:],
                seq_lens=dev[2 * t + 3 * s:2 * t + 4 * s], last_rows=dev[2 * t + 4 * s:],
                prefix_lens_cpu=prefix.tolist(), seq_lens_cpu=torch.from_numpy(prefix + lens))
