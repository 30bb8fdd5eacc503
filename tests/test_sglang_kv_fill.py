"""DGW_CATCH_UP_KV_ONLY's K/V fill (engines/sglang/kv_fill.py, no SGLang import): the K/V it
writes equal those of the draft layer's own path (embeddings, fc, norms, the fused qkv
projection, RoPE), and it says why a draft it was not checked against cannot have it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dual_graph_worker.engines.sglang.kv_fill import fill_draft_kv, kv_fill_unavailable

H, HEAD, Q_HEADS, KV_HEADS, AUX = 8, 4, 2, 1, 3


class _RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class UnquantizedLinearMethod:
    """Named as SGLang's: the fill reads the k/v rows of the weight alone."""


class OtherLinearMethod:
    """Any other method: the fill calls the projection."""


class _QKV(nn.Module):
    def __init__(self, quant_method) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn((Q_HEADS + 2 * KV_HEADS) * HEAD, 2 * H))
        self.bias = None
        self.quant_method = quant_method
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return F.linear(x, self.weight), None


def _rope(positions, q, k):
    """Not RoPE, but as position-dependent and applied to q and k alike."""
    scale = (1.0 + positions.float())[:, None]
    return q * scale, k * scale.cos()


class MHATokenToKVPool:
    def __init__(self, dtype=torch.bfloat16, quantized=False) -> None:
        self.dtype = dtype
        self.is_quantized_kv_cache = quantized
        self.writes = []

    def set_kv_buffer(self, layer, loc, k, v, k_scale, v_scale):
        self.writes.append((layer, loc, k, v, k_scale, v_scale))


class LlamaForCausalLMEagle3:
    """Named as SGLang's EAGLE-3 draft: its `model` is the LlamaModel."""

    def __init__(self, model) -> None:
        self.model = model


def _runner(quant_method=UnquantizedLinearMethod(), layers=1, pool=None, norms=False):
    torch.manual_seed(0)

    def layer():
        attn = SimpleNamespace(tp_k_head_num=KV_HEADS, qk_head_dim=HEAD, tp_v_head_num=KV_HEADS,
                               v_head_dim=HEAD, k_scale=None, v_scale=None, layer_id=32,
                               sliding_window_size=-1)
        return SimpleNamespace(
            input_layernorm=_RMSNorm(H), hidden_norm=_RMSNorm(H),
            self_attn=SimpleNamespace(qkv_proj=_QKV(quant_method), rotary_emb=_rope, attn=attn,
                                      q_size=Q_HEADS * HEAD, kv_size=KV_HEADS * HEAD))

    model = SimpleNamespace(embed_tokens=nn.Embedding(50, H), fc=nn.Linear(AUX * H, H, bias=False),
                            input_norm=_RMSNorm(AUX * H) if norms else None,
                            fc_norm=[_RMSNorm(H) for _ in range(AUX)] if norms else None,
                            num_aux_hidden_states=AUX, layers=[layer() for _ in range(layers)],
                            is_mrope_enabled=False)
    return SimpleNamespace(model=LlamaForCausalLMEagle3(model),
                           token_to_kv_pool=pool or MHATokenToKVPool(),
                           attn_backend=SimpleNamespace())


def _layers_own_kv(runner, aux, tokens, positions):
    """What the draft's input layer writes: LlamaModel.forward, then LlamaAttention's
    qkv_proj, split and RoPE (llama_eagle3.py, llama.py)."""
    model = runner.model.model
    layer = model.layers[0]
    hidden = aux
    if aux.shape[-1] != H:
        if model.input_norm is not None:
            hidden = model.input_norm(hidden)
        if model.fc_norm is not None:
            hidden = torch.cat([n(c) for n, c in zip(model.fc_norm, hidden.chunk(AUX, -1))], -1)
        hidden = model.fc(hidden)
    x = torch.cat([layer.input_layernorm(model.embed_tokens(tokens)), layer.hidden_norm(hidden)],
                  -1)
    qkv, _ = layer.self_attn.qkv_proj(x)
    q, k, v = qkv.split([Q_HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
    _, k = _rope(positions, q, k)
    return k.reshape(-1, KV_HEADS, HEAD), v.reshape(-1, KV_HEADS, HEAD)


@pytest.mark.parametrize("quant_method", [UnquantizedLinearMethod(), OtherLinearMethod()])
@pytest.mark.parametrize("aux_width, norms", [(AUX * H, False), (AUX * H, True), (H, False)])
def test_the_fill_writes_the_layers_own_k_and_v(quant_method, aux_width, norms):
    runner = _runner(quant_method, norms=norms)
    aux = torch.randn(5, aux_width)
    tokens = torch.tensor([3, 9, 9, 41, 0])
    positions = torch.tensor([7, 8, 9, 5, 0])
    slots = torch.tensor([70, 71, 72, 50, 3])
    with torch.no_grad():
        k_ref, v_ref = _layers_own_kv(runner, aux, tokens, positions)
        proj = runner.model.model.layers[0].self_attn.qkv_proj
        calls = proj.calls
        fill_draft_kv(runner, aux, tokens, positions, slots)
    # The unquantized path reads the weight's k/v rows and never runs the projection.
    assert proj.calls - calls == (0 if isinstance(quant_method, UnquantizedLinearMethod) else 1)
    ((layer, loc, k, v, k_scale, v_scale),) = runner.token_to_kv_pool.writes
    assert layer is runner.model.model.layers[0].self_attn.attn
    assert loc.tolist() == slots.tolist() and (k_scale, v_scale) == (None, None)
    assert k.shape == v.shape == (5, KV_HEADS, HEAD)
    torch.testing.assert_close(k, k_ref)
    torch.testing.assert_close(v, v_ref)


def test_a_draft_it_was_not_checked_against_is_named():
    assert kv_fill_unavailable(_runner()) is None
    assert "2 layers" in kv_fill_unavailable(_runner(layers=2))
    assert "float8" in kv_fill_unavailable(_runner(pool=MHATokenToKVPool(torch.float8_e4m3fn)))
    assert "MHATokenToKVPool" in kv_fill_unavailable(_runner(pool=MHATokenToKVPool(quantized=True)))
    windowed = _runner()
    windowed.model.model.layers[0].self_attn.attn.sliding_window_size = 4096
    assert "sliding window" in kv_fill_unavailable(windowed)
    mrope = _runner()
    mrope.model.model.is_mrope_enabled = True
    assert "multimodal" in kv_fill_unavailable(mrope)
    assert "LlamaForCausalLMEagle3" in kv_fill_unavailable(SimpleNamespace(model=SimpleNamespace()))
    for attr in ("attn_cp_size", "dcp_size"):        # fa3's context parallel, triton's decode's
        cp = _runner()
        setattr(cp.attn_backend, attr, 2)
        assert "context-parallel" in kv_fill_unavailable(cp)


def test_a_kv_only_tokens_share_of_the_layer_at_the_llama3_8b_shape():
    """fc (12288 -> 4096) and the k/v rows (8192 -> 2 x 1024) over fc, qkv (8192 -> 6144),
    o_proj (4096 -> 4096) and the MLP (4096 -> 2 x 14336 -> 4096): ~0.23, one rank."""
    from dual_graph_worker.engines.sglang.kv_fill import kv_share

    attn = SimpleNamespace(qkv_proj=SimpleNamespace(input_size=8192,
                                                    output_size_per_partition=6144),
                           o_proj=SimpleNamespace(input_size_per_partition=4096, output_size=4096),
                           kv_size=1024)
    mlp = SimpleNamespace(gate_up_proj=SimpleNamespace(input_size=4096,
                                                       output_size_per_partition=28672),
                          down_proj=SimpleNamespace(input_size_per_partition=14336,
                                                    output_size=4096))
    model = SimpleNamespace(fc=nn.Linear(12288, 4096, bias=False, device="meta"),
                            layers=[SimpleNamespace(self_attn=attn, mlp=mlp)])
    share = kv_share(SimpleNamespace(model=SimpleNamespace(model=model)))
    assert share == pytest.approx((12288 * 4096 + 8192 * 2048) / (
        12288 * 4096 + 8192 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096))
    assert 0.22 < share < 0.24
