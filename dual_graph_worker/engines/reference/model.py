"""Forward passes of the reference engine: a Llama-family target and an EAGLE-3 draft.

Written as functions over weight dataclasses so that one forward is a fixed sequence of tensor
ops on static-shaped inputs (capturable in a CUDA graph). Math follows SGLang 0.5.17's
LlamaForCausalLM and LlamaForCausalLMEagle3 (residual-stream form of the fused add-norms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dual_graph_worker.engines.reference.attention import AttentionBackend, AttnBatch
from dual_graph_worker.engines.reference.config import DraftConfig, TargetConfig
from dual_graph_worker.engines.reference.kv_cache import KVPool, ReqToTokenTable
from dual_graph_worker.engines.reference.weights import DraftWeights, LayerWeights, TargetWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class Rope:
    """Rotary embedding (rotate-half convention of HF Llama), cos/sin cached up to max position."""

    def __init__(self, head_dim: int, theta: float, max_pos: int, device, dtype) -> None:
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
        f = torch.outer(torch.arange(max_pos, dtype=torch.float64, device=device), inv)
        self.cos = f.cos().to(dtype)
        self.sin = f.sin().to(dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [N, heads, d], positions [N]."""
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass(frozen=True)
class AttnShape:
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


def _attention_block(lw: LayerWeights, x: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor,
                     layer: int, kv: KVPool, table: ReqToTokenTable, rope: Rope,
                     backend: AttentionBackend, batch: AttnBatch, s: AttnShape) -> torch.Tensor:
    qkv = F.linear(x, lw.qkv)
    q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
    q = rope.apply(q.view(-1, s.heads, s.head_dim), positions)
    k = rope.apply(k.view(-1, s.kv_heads, s.head_dim), positions)
    kv.write(layer, loc, k, v.view(-1, s.kv_heads, s.head_dim))
    o = backend.attend(q, kv.k[layer], kv.v[layer], table.table, batch, s.scale)
    return F.linear(o, lw.o)


def _mlp(lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, lw.gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, lw.down)


@dataclass(frozen=True)
class TargetOutput:
    hidden: torch.Tensor      # [N, H] final-normed, feeds the LM head
    aux: torch.Tensor         # [N, n_aux * H] EAGLE-3 features (residual stream at capture layers)


@dataclass(frozen=True)
class DraftOutput:
    hidden: torch.Tensor      # [N, H] final-normed, feeds the draft LM head
    prenorm: torch.Tensor     # [N, H] residual stream: the next chain step's input hidden


class TargetModel:
    def __init__(self, cfg: TargetConfig, w: TargetWeights, kv: KVPool, table: ReqToTokenTable,
                 backend: AttentionBackend, rope: Rope) -> None:
        self.cfg, self.w, self.kv, self.table, self.backend, self.rope = cfg, w, kv, table, backend, rope
        self.shape = AttnShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.capture = set(cfg.capture_layers)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor,
                batch: AttnBatch) -> TargetOutput:
        eps = self.cfg.rms_norm_eps
        x = self.w.embed[ids]
        aux = []
        for i, lw in enumerate(self.w.layers):
            if i in self.capture:
                aux.append(x)
            x = x + _attention_block(lw, rms_norm(x, lw.input_norm, eps), positions, loc, i, self.kv,
                                     self.table, self.rope, self.backend, batch, self.shape)
            x = x + _mlp(lw, rms_norm(x, lw.post_norm, eps))
        return TargetOutput(rms_norm(x, self.w.norm, eps), torch.cat(aux, dim=-1))

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.w.lm_head).argmax(-1)


class DraftModel:
    """EAGLE-3 draft. `hidden` is the target's aux features (n_aux * H wide, passed through fc)
    on the first step after the target ran, or the draft's own prenorm output (H wide) in a chain."""

    def __init__(self, cfg: DraftConfig, w: DraftWeights, embed: torch.Tensor, kv: KVPool,
                 table: ReqToTokenTable, backend: AttentionBackend, rope: Rope) -> None:
        self.cfg, self.w, self.embed, self.kv, self.table = cfg, w, embed, kv, table
        self.backend, self.rope = backend, rope
        self.shape = AttnShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                loc: torch.Tensor, batch: AttnBatch) -> DraftOutput:
        eps, lw = self.cfg.rms_norm_eps, self.w.layer
        if hidden.shape[-1] != self.cfg.hidden_size:
            hidden = F.linear(hidden, self.w.fc)
        x_in = torch.cat([rms_norm(self.embed[ids], lw.input_norm, eps),
                          rms_norm(hidden, self.w.hidden_norm, eps)], dim=-1)
        x = hidden + _attention_block(lw, x_in, positions, loc, 0, self.kv, self.table, self.rope,
                                      self.backend, batch, self.shape)
        x = x + _mlp(lw, rms_norm(x, lw.post_norm, eps))
        return DraftOutput(rms_norm(x, self.w.norm, eps), x)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.w.lm_head).argmax(-1)
