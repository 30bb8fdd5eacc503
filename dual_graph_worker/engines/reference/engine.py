"""The reference engine: Llama target + EAGLE-3 draft over a paged KV cache, greedy sampling.

Per-request model state lives on the device, indexed by request-table row, so graphs read and
write it by gather/scatter and the host only uploads rows, lengths and slots each step:
- last_token[row]:   x_L, the last emitted token (not yet in the target's KV);
- draft_token[row]:  d_1, the draft's proposal for x_{L+1};
- draft_hidden[row]: the draft's residual stream at position L-1, the chain's next input.
Invariant between steps: target and draft KV hold positions [0, L) (lazy continuity aside).
Tensors that one stage hands to the next (verify features) are static buffers made at bind,
never graph-pool temporaries, because the next stage's graph may reuse that pool memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from dual_graph_worker.engines.reference.buffers import StaticInputs
from dual_graph_worker.engines.reference.engine_api import (DecodeOutput, EngineDescription,
                                                          EngineLimits, PrefillMode,
                                                          StageContinuity, StageFn)
from dual_graph_worker.engines.reference.attention import AttnBatch
from dual_graph_worker.engines.reference.attention_choice import AttentionChoice, TorchAttention
from dual_graph_worker.engines.reference.config import ModelPair
from dual_graph_worker.engines.reference.kv_cache import KVPool, ReqToTokenTable
from dual_graph_worker.engines.reference.kv_slots import DUMMY_SLOT
from dual_graph_worker.engines.reference.model import DraftModel, Rope, TargetModel
from dual_graph_worker.engines.reference.weights import DraftWeights, TargetWeights
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import Stage


@dataclass
class RequestState:
    last_token: torch.Tensor     # [R] int64
    draft_token: torch.Tensor    # [R] int64
    draft_hidden: torch.Tensor   # [R, H_draft]


def _fields(state: RequestState) -> tuple[torch.Tensor, ...]:
    return state.last_token, state.draft_token, state.draft_hidden


class ReferenceEngine:
    def __init__(self, pair: ModelPair, target_w: TargetWeights, draft_w: DraftWeights, *,
                 num_draft_tokens: int, max_requests: int, max_context: int, num_slots: int,
                 device: str | torch.device = "cpu", dtype=torch.float32,
                 attention: AttentionChoice = TorchAttention(), weights_note: str = "dummy",
                 forced_accept_len: Optional[int] = None) -> None:
        if num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens (K) must be >= 1, got {num_draft_tokens}; "
                              "for no speculation use the plain decode worker (mode pinned to decode)")
        for name, model in (("target", pair.target), ("draft", pair.draft)):
            if max_context > model.max_position_embeddings:
                raise ConfigError(f"max_context={max_context} exceeds the {name}'s "
                                  f"max_position_embeddings={model.max_position_embeddings}; "
                                  "lower max_context")
        if forced_accept_len is not None and not 1 <= forced_accept_len <= num_draft_tokens + 1:
            raise ConfigError(f"forced accept length must be an integer in [1, K+1="
                              f"{num_draft_tokens + 1}], got {forced_accept_len}")
        self.forced_accept_len = forced_accept_len
        self.pair, self.device, self.dtype = pair, torch.device(device), dtype
        self.weights_note = weights_note
        self.limits = EngineLimits(num_slots, max_requests + 1, max_context, num_draft_tokens)
        t, d = pair.target, pair.draft
        dev = self.device
        self.table = ReqToTokenTable(self.limits.max_requests, max_context, dev)
        self.target_kv = KVPool.allocate(t.num_layers, num_slots, t.num_kv_heads, t.head_dim, dtype, dev)
        self.draft_kv = KVPool.allocate(1, num_slots, d.num_kv_heads, d.head_dim, dtype, dev)
        self.attention = attention.build(dev, (t.head_dim, d.head_dim))
        rope_t = Rope(t.head_dim, t.rope_theta, t.max_position_embeddings, dev, dtype)
        rope_d = rope_t if (d.head_dim, d.rope_theta) == (t.head_dim, t.rope_theta) else \
            Rope(d.head_dim, d.rope_theta, d.max_position_embeddings, dev, dtype)
        self.target = TargetModel(t, target_w, self.target_kv, self.table, self.attention, rope_t)
        self.draft = DraftModel(d, draft_w, target_w.embed, self.draft_kv, self.table, self.attention, rope_d)
        R = self.limits.max_requests
        self.state = RequestState(torch.zeros(R, dtype=torch.int64, device=dev),
                                  torch.zeros(R, dtype=torch.int64, device=dev),
                                  torch.zeros(R, d.hidden_size, dtype=dtype, device=dev))
        self._saved = RequestState(*(torch.zeros_like(s) for s in _fields(self.state)))
        self.aux_width = len(t.capture_layers) * t.hidden_size
        self._stash: Optional[torch.Tensor] = None      # lazy continuity: features per KV slot

    def save_rows(self, rows: torch.Tensor) -> None:
        """Copy the per-request state of device `rows` (which every step moves on) into buffers
        made once: no allocation on the per-step path."""
        n = rows.shape[0]
        for state, saved in zip(_fields(self.state), _fields(self._saved)):
            torch.index_select(state, 0, rows, out=saved[:n])

    def restore_rows(self, rows: torch.Tensor) -> None:
        """`rows`' state as save_rows found it: a step that failed part-way leaves no trace."""
        n = rows.shape[0]
        for state, saved in zip(_fields(self.state), _fields(self._saved)):
            state.index_copy_(0, rows, saved[:n])

    # ------------------------------------------------------------------ description
    @property
    def vocab_size(self) -> int:
        return self.pair.target.vocab_size

    def describe(self) -> EngineDescription:
        return EngineDescription(
            "reference", self.attention.name, str(self.dtype).removeprefix("torch."),
            str(self.device), self.weights_note, self.limits.num_draft_tokens,
            (f"forced accept length {self.forced_accept_len}"
             if self.forced_accept_len is not None else "real (draft vs target)"),
            self.pair.shape_dict())

    def attn_batch(self, rows: torch.Tensor, prefix: torch.Tensor, width: int) -> AttnBatch:
        return AttnBatch(rows, prefix, width, self.limits.max_context)

    # ------------------------------------------------------------------ graph stages
    def bind(self, bufs: StaticInputs, continuity: StageContinuity,
             max_spec_bs: int) -> Mapping[Stage, StageFn]:
        return GraphStages(self, bufs, continuity, max_spec_bs).by_stage()

    def ensure_stash(self) -> None:
        """The slot-indexed feature stash, made once: shared by every worker bound to this
        engine, since catch_up reads it for whichever lazy worker runs."""
        if self._stash is None:
            self._stash = torch.zeros(self.limits.num_slots, self.aux_width, dtype=self.dtype,
                                      device=self.device)

    def draft_decoded(self, out: DecodeOutput) -> None:
        d = self.draft.forward(out.tokens, out.features, out.positions, out.slots, out.batch)
        self.keep_draft(out.rows, d.hidden, d.prenorm)

    def keep_draft(self, rows: torch.Tensor, hidden: torch.Tensor, prenorm: torch.Tensor) -> None:
        """Rows' next draft token (greedy over the draft's `hidden`) and the hidden state it
        continues from."""
        self.state.draft_token.index_copy_(0, rows, self.draft.greedy(hidden))
        self.state.draft_hidden.index_copy_(0, rows, prenorm)

    def stash_features(self, out: DecodeOutput) -> None:
        self._stash_made().index_copy_(0, out.slots, out.features)

    def _stash_made(self) -> torch.Tensor:
        if self._stash is None:
            raise RuntimeError("the feature stash is made by the lazy catch-up strategy "
                               "(LazyCatchUp asks the engine for it)")
        return self._stash

    def fill_synthetic_context(self, rows: np.ndarray, context_len: int, slots: np.ndarray) -> None:
        """Point rows' first `context_len` positions at distinct slots, so calibration timings
        read as much KV as real requests of that length (the slots' contents do not matter)."""
        r = self._to_device(np.asarray(rows, dtype=np.int64))
        s = self._to_device(np.asarray(slots, dtype=np.int64).reshape(len(rows), context_len))
        self.table.table[r[:, None], torch.arange(context_len, device=self.device)[None, :]] = s

    # ------------------------------------------------------------------ eager extends
    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _padded(self, seqs: Sequence[np.ndarray], fill: int = 0) -> torch.Tensor:
        width = max(len(s) for s in seqs)
        out = np.full((len(seqs), width), fill, dtype=np.int64)
        for i, s in enumerate(seqs):
            out[i, : len(s)] = s
        return self._to_device(out)

    @torch.inference_mode()
    def prefill(self, rows: np.ndarray, prompts: Sequence[np.ndarray],
                slots: Sequence[np.ndarray], mode: PrefillMode) -> np.ndarray:
        B = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        ids = self._padded(prompts)
        W = ids.shape[1]
        loc = self._padded(slots, fill=DUMMY_SLOT)         # padding queries write the dummy slot
        rows_t = self._to_device(np.asarray(rows, dtype=np.int64))
        pos = torch.arange(W, device=self.device).expand(B, W)
        valid = pos < lens[:, None]
        self.table.write(rows_t[:, None].expand(B, W)[valid], pos[valid], loc[valid])
        zero = torch.zeros(B, dtype=torch.int64, device=self.device)
        batch = self.attn_batch(rows_t, zero, W)
        out = self.target.forward(ids.view(-1), pos.reshape(-1), loc.view(-1), batch)
        last = torch.arange(B, device=self.device) * W + lens - 1
        first = self.target.greedy(out.hidden[last])
        self.state.last_token.index_copy_(0, rows_t, first)
        if mode is PrefillMode.DEFERRED:
            flat = valid.view(-1)
            self._stash_made().index_copy_(0, loc.view(-1)[flat], out.aux[flat])
        if mode is not PrefillMode.WITH_DRAFT:
            return first.cpu().numpy()
        # Draft extend over the prompt: position p reads (token p+1, target feature at p).
        shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        shifted[torch.arange(B, device=self.device), lens - 1] = first
        d = self.draft.forward(shifted.view(-1), out.aux, pos.reshape(-1), loc.view(-1), batch)
        self.keep_draft(rows_t, d.hidden[last], d.prenorm[last])
        return first.cpu().numpy()

    @torch.inference_mode()
    def catch_up(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                 tokens: np.ndarray, slots: np.ndarray) -> None:
        stash = self._stash_made()
        B = len(rows)
        starts = np.asarray(starts, dtype=np.int64)
        lens = np.asarray(ends, dtype=np.int64) - starts
        W = int(lens.max())
        j = np.arange(W)
        valid_np = j < lens[:, None]
        # Each row's positions start..end-1, padding repeating its last (masked out below).
        at = starts[:, None] + np.minimum(j, lens[:, None] - 1)
        r = np.arange(B)[:, None]
        upload = self._to_device
        loc = upload(np.where(valid_np, slots[r, at], DUMMY_SLOT))
        ids = upload(np.where(valid_np, tokens[r, at + 1], 0))              # token at p+1
        pos = upload(starts[:, None] + np.where(valid_np, j, 0))           # padding: start
        valid, n = upload(valid_np), upload(lens)
        hidden = stash[loc.view(-1)] * valid.view(-1, 1).to(self.dtype)
        rows_t = upload(np.asarray(rows, dtype=np.int64))
        start_t = upload(starts)
        d = self.draft.forward(ids.view(-1), hidden, pos.view(-1), loc.view(-1),
                               self.attn_batch(rows_t, start_t, W))
        last = torch.arange(B, device=self.device) * W + n - 1
        self.keep_draft(rows_t, d.hidden[last], d.prenorm[last])


class GraphStages:
    """One worker's graph stages over its static inputs (device ops on static storage only, so
    each can be captured). Several workers may bind one engine (the bench compares them side by
    side): each gets its own verify buffer, since its graphs capture that address."""

    def __init__(self, engine: ReferenceEngine, bufs: StaticInputs, continuity: StageContinuity,
                 max_spec_bs: int) -> None:
        self.engine, self.bufs, self.continuity = engine, bufs, continuity
        self.st = engine.state
        self.K = engine.limits.num_draft_tokens
        self.W = W = self.K + 1
        dev, spec_rows = engine.device, max(max_spec_bs, 1)
        self.verify_aux = torch.zeros(spec_rows * W, engine.aux_width, dtype=engine.dtype,
                                      device=dev)
        self.offsets = torch.arange(W, device=dev)
        self.row_starts = torch.arange(spec_rows, device=dev) * W   # first row of each request
        self.forced = self._forced_accepts()

    def _forced_accepts(self) -> Optional[torch.Tensor]:
        """Benchmarks on dummy weights (acceptance ~0) force an accepted length, like
        SGLANG_SIMULATE_ACC_LEN: tokens are then meaningless, timings are not."""
        n = self.engine.forced_accept_len
        if n is None:
            return None
        return torch.full((self.bufs.sizes.max_bs,), n - 1, dtype=torch.int64,
                          device=self.engine.device)

    def by_stage(self) -> dict[Stage, StageFn]:
        stages: dict[Stage, StageFn] = {Stage.DECODE: self.decode, Stage.VERIFY: self.verify,
                                        Stage.DRAFT_EXTEND: self.draft_extend}
        if self.K > 1:
            stages[Stage.DRAFT] = self.draft_chain
        return stages

    def decode(self, P: int) -> None:
        eng, bufs, st = self.engine, self.bufs, self.st
        rows, L, loc = bufs.req_pool_indices[:P], bufs.seq_lens[:P], bufs.out_cache_loc[:P]
        ids, pos = bufs.input_ids[:P], bufs.positions[:P]
        torch.index_select(st.last_token, 0, rows, out=ids)
        pos.copy_(L)
        eng.table.write(rows, pos, loc)
        batch = eng.attn_batch(rows, L, 1)
        out = eng.target.forward(ids, pos, loc, batch)
        y = eng.target.greedy(out.hidden)
        bufs.out_tokens[:P, 0].copy_(y)
        bufs.accept_lens[:P].fill_(1)
        st.last_token.index_copy_(0, rows, y)
        self.continuity.in_decode_graph(eng, DecodeOutput(rows, y, out.aux, pos, loc, batch))

    def draft_chain(self, P: int) -> None:
        eng, bufs, st, W = self.engine, self.bufs, self.st, self.W
        rows, L = bufs.req_pool_indices[:P], bufs.seq_lens[:P]
        loc = bufs.out_cache_loc[: P * W].view(P, W)
        ids = bufs.input_ids[: P * W].view(P, W)
        tok, hid = st.draft_token[rows], st.draft_hidden[rows]
        for j in range(1, self.K):
            pos = L + (j - 1)
            # Map position pos to the slot this chain step writes, so the attention below
            # reads the K/V just written (and the chain's earlier steps), not a stale slot
            # left in the table by a previous step's rejected drafts.
            eng.table.write(rows, pos, loc[:, j - 1])
            d = eng.draft.forward(tok, hid, pos, loc[:, j - 1], eng.attn_batch(rows, pos, 1))
            tok, hid = eng.draft.greedy(d.hidden), d.prenorm
            ids[:, j + 1].copy_(tok)

    def verify(self, P: int) -> None:
        eng, bufs, st, W = self.engine, self.bufs, self.st, self.W
        rows, L = bufs.req_pool_indices[:P], bufs.seq_lens[:P]
        loc = bufs.out_cache_loc[: P * W]
        ids = bufs.input_ids[: P * W].view(P, W)
        pos = bufs.positions[: P * W].view(P, W)
        ids[:, 0].copy_(st.last_token[rows])
        ids[:, 1].copy_(st.draft_token[rows])
        pos.copy_(L[:, None] + self.offsets)
        eng.table.write(rows[:, None], pos, loc.view(P, W))
        out = eng.target.forward(ids.view(-1), pos.view(-1), loc, eng.attn_batch(rows, L, W))
        y = eng.target.greedy(out.hidden).view(P, W)
        accepted = self._accepted(ids, y, P)
        bufs.out_tokens[:P].copy_(y)
        bufs.accept_lens[:P].copy_(accepted + 1)
        st.last_token.index_copy_(0, rows, y.gather(1, accepted[:, None]).squeeze(1))
        self.verify_aux[: P * W].copy_(out.aux)

    def _accepted(self, ids: torch.Tensor, y: torch.Tensor, P: int) -> torch.Tensor:
        """Drafts accepted per request: the leading drafts the target agrees with (or forced)."""
        if self.forced is None:
            return (ids[:, 1:] == y[:, :-1]).long().cumprod(1).sum(1)
        return self.forced[:P]

    def draft_extend(self, P: int) -> None:
        eng, bufs, W = self.engine, self.bufs, self.W
        rows, L = bufs.req_pool_indices[:P], bufs.seq_lens[:P]
        loc, pos = bufs.out_cache_loc[: P * W], bufs.positions[: P * W]
        ids = bufs.out_tokens[:P].reshape(-1)
        d = eng.draft.forward(ids, self.verify_aux[: P * W], pos, loc, eng.attn_batch(rows, L, W))
        last = self.row_starts[:P] + bufs.accept_lens[:P] - 1
        eng.keep_draft(rows, d.hidden[last], d.prenorm[last])
