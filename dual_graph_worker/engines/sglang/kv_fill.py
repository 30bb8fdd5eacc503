"""The draft's K/V for caught-up positions, without the rest of its layer.

A catch-up needs, at every backlog position, only what later steps read: the draft layer's K/V
there. Only a request's last position also needs the layer's output (its next proposal). An
EAGLE-3 draft's K/V at a position depend on that position's inputs alone (token embedding and
the target's aux features, through fc and the k/v projections): about a quarter of the FLOPs of
the whole layer, whose attention output, o_proj and MLP the draft extend otherwise computes at
every position. docs/design.md (lazy catch-up) has the figures.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

# A catch-up pass is split from this many tokens: it saves ~0.7 us a token of the draft's work
# and costs ~1 ms more host work (the fill's launches, a second batch), a loss in the small,
# host-bound catch-ups of a switch at a small batch.
KV_ONLY_MIN_TOKENS = 2048
# The draft whose input layer's K/V it computes as the layer does (llama_eagle3.py).
_DRAFTS = ("LlamaForCausalLMEagle3",)
# The KV pools it writes to as the attention backends do: plain MHA, unquantized.
_POOLS = ("MHATokenToKVPool",)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kv_fill_unavailable(runner: Any) -> Optional[str]:
    """Why the draft model of ModelRunner `runner` cannot have its K/V filled alone (None: it
    can): a one-layer EAGLE-3 draft (llama_eagle3.py), plain RoPE, full attention, an
    unquantized MHA pool, no context parallelism."""
    name = type(getattr(runner, "model", None)).__name__
    if name not in _DRAFTS:
        return f"the draft model is {name}, not one of {', '.join(_DRAFTS)}"
    model = runner.model.model
    if len(model.layers) != 1:
        return f"the draft has {len(model.layers)} layers (K/V past the first need the layer " \
               "before)"
    if getattr(model, "is_mrope_enabled", False):
        return "the draft uses multimodal RoPE"
    attn = model.layers[0].self_attn.attn
    if getattr(attn, "sliding_window_size", None) not in (None, -1):
        return "the draft attends over a sliding window"
    pool = runner.token_to_kv_pool
    if type(pool).__name__ not in _POOLS or getattr(pool, "dtype", None) not in _DTYPES \
            or getattr(pool, "is_quantized_kv_cache", False):
        return f"the draft's KV pool is {type(pool).__name__} of {getattr(pool, 'dtype', None)}"
    backend = runner.attn_backend
    if getattr(backend, "attn_cp_size", 1) != 1 or getattr(backend, "dcp_size", 1) != 1:
        return "the draft's attention is context-parallel (its KV writes are split by rank)"
    return None


@torch.no_grad()          # whatever mode the caller is in: nothing here is ever differentiated
def fill_draft_kv(runner: Any, aux: torch.Tensor, token_ids: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor) -> None:
    """Write the draft layer's K/V at KV `slots` (RoPE `positions`) from the stashed inputs
    there: `aux`, the target's aux features, and `token_ids`, as LlamaModel.forward and the
    input layer of llama_eagle3.py compute them."""
    model = runner.model.model
    layer = model.layers[0]
    attn = layer.self_attn
    embeds = layer.input_layernorm(model.embed_tokens(token_ids))
    x = torch.cat([embeds, layer.hidden_norm(_project_aux(model, aux, embeds.shape[-1]))], -1)
    k, v = _kv_projection(attn, x)
    _, k = attn.rotary_emb(positions, k.clone(), k)
    radix = attn.attn
    runner.token_to_kv_pool.set_kv_buffer(
        radix, slots, k.reshape(-1, radix.tp_k_head_num, radix.qk_head_dim),
        v.reshape(-1, radix.tp_v_head_num, radix.v_head_dim), radix.k_scale, radix.v_scale)


def kv_share(runner: Any) -> float:
    """A K/V-only token's multiply-adds over a whole-layer token's, on this rank (fc is not
    sharded, the layer is): fc and the k/v rows of qkv_proj over fc, qkv_proj, o_proj and the
    MLP. ~0.23 for a Llama-3-8B-shaped EAGLE-3 draft on one rank."""
    model = runner.model.model
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    fc = model.fc.in_features * model.fc.out_features
    qkv = attn.qkv_proj.input_size * attn.qkv_proj.output_size_per_partition
    kv = attn.qkv_proj.input_size * 2 * attn.kv_size
    o = attn.o_proj.input_size_per_partition * attn.o_proj.output_size
    ffn = mlp.gate_up_proj.input_size * mlp.gate_up_proj.output_size_per_partition \
        + mlp.down_proj.input_size_per_partition * mlp.down_proj.output_size
    return (fc + kv) / (fc + qkv + o + ffn)


def _project_aux(model: Any, aux: torch.Tensor, width: int) -> torch.Tensor:
    """The target's aux features as the draft's hidden input (LlamaModel.forward's fc path)."""
    if aux.shape[-1] == width:
        return aux
    if model.input_norm is not None:
        aux = model.input_norm(aux)
    if model.fc_norm is not None:
        chunks = aux.chunk(model.num_aux_hidden_states, dim=-1)
        aux = torch.cat([norm(chunk) for norm, chunk in zip(model.fc_norm, chunks)], dim=-1)
    return model.fc(aux)


def _kv_projection(attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) of qkv_proj: with unquantized weights and no bias, the k/v rows of its weight
    alone; otherwise the whole projection, q dropped."""
    proj = attn.qkv_proj
    if type(getattr(proj, "quant_method", None)).__name__ == "UnquantizedLinearMethod" \
            and getattr(proj, "bias", None) is None:
        kv = F.linear(x, proj.weight[attn.q_size:])
    else:
        kv = proj(x)[0][..., attn.q_size:]
    return kv.split([attn.kv_size, attn.kv_size], dim=-1)
