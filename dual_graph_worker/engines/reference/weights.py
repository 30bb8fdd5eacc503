"""Weights of the reference engine: dummy-random from a config, or read from HF-format folders.

Projections are kept fused (qkv, gate_up) as one matrix each so a layer is two GEMMs for
attention and two for the MLP, like SGLang's QKVParallelLinear / MergedColumnParallelLinear.
Checkpoint names follow HF Llama (target) and SGLang's LlamaForCausalLMEagle3 loader (draft), so
the same folders load in SGLang.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional

import torch

from dual_graph_worker.engines.reference.config import DraftConfig, ModelPair, TargetConfig
from dual_graph_worker.core.errors import CheckpointError


@dataclass
class LayerWeights:
    input_norm: torch.Tensor      # [H]
    qkv: torch.Tensor             # [(h + 2 kvh) * d, H_in]
    o: torch.Tensor               # [H, h * d]
    post_norm: torch.Tensor       # [H]
    gate_up: torch.Tensor         # [2 I, H]
    down: torch.Tensor            # [H, I]


@dataclass
class TargetWeights:
    embed: torch.Tensor           # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor            # [H]
    lm_head: torch.Tensor         # [V, H]


@dataclass
class DraftWeights:
    fc: torch.Tensor              # [H, n_aux * H_target]
    hidden_norm: torch.Tensor     # [H]
    layer: LayerWeights           # qkv reads 2H: [norm(embed), norm(hidden)]
    norm: torch.Tensor            # [H]
    lm_head: torch.Tensor         # [V_draft, H]


def named_sizes(w: object, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(dotted name, element count) of every tensor in a weights dataclass."""
    if isinstance(w, torch.Tensor):
        yield prefix, w.numel()
    elif is_dataclass(w):
        for f in fields(w):
            yield from named_sizes(getattr(w, f.name), f"{prefix}.{f.name}".lstrip("."))
    elif isinstance(w, list):
        for i, item in enumerate(w):
            yield from named_sizes(item, f"{prefix}.{i}")


def _linear(out_f: int, in_f: int, g: torch.Generator, dtype, device) -> torch.Tensor:
    w = torch.randn(out_f, in_f, generator=g, dtype=torch.float32, device=device)
    return (w / in_f ** 0.5).to(dtype)


def _ones(n: int, dtype, device) -> torch.Tensor:
    return torch.ones(n, dtype=dtype, device=device)


def _dummy_layer(h_in: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int,
                 g: torch.Generator, dtype, device) -> LayerWeights:
    return LayerWeights(
        input_norm=_ones(hidden, dtype, device),
        qkv=_linear((heads + 2 * kv_heads) * head_dim, h_in, g, dtype, device),
        o=_linear(hidden, heads * head_dim, g, dtype, device),
        post_norm=_ones(hidden, dtype, device),
        gate_up=_linear(2 * inter, hidden, g, dtype, device),
        down=_linear(hidden, inter, g, dtype, device),
    )


def dummy_weights(pair: ModelPair, seed: int = 0, dtype=torch.float32,
                  device: str | torch.device = "cpu") -> tuple[TargetWeights, DraftWeights]:
    """Random weights (like SGLang's load_format=dummy): acceptance is ~0, tokens are arbitrary
    but deterministic for a seed."""
    g = torch.Generator(device=device).manual_seed(seed)
    t, d = pair.target, pair.draft
    target = TargetWeights(
        embed=torch.randn(t.vocab_size, t.hidden_size, generator=g, device=device).to(dtype),
        layers=[_dummy_layer(t.hidden_size, t.hidden_size, t.num_heads, t.num_kv_heads,
                             t.head_dim, t.intermediate_size, g, dtype, device)
                for _ in range(t.num_layers)],
        norm=_ones(t.hidden_size, dtype, device),
        lm_head=_linear(t.vocab_size, t.hidden_size, g, dtype, device),
    )
    draft = DraftWeights(
        fc=_linear(d.hidden_size, d.num_aux_hidden_states * d.target_hidden_size, g, dtype, device),
        hidden_norm=_ones(d.hidden_size, dtype, device),
        layer=_dummy_layer(2 * d.hidden_size, d.hidden_size, d.num_heads, d.num_kv_heads,
                           d.head_dim, d.intermediate_size, g, dtype, device),
        norm=_ones(d.hidden_size, dtype, device),
        lm_head=_linear(d.draft_vocab_size, d.hidden_size, g, dtype, device),
    )
    return target, draft


# ---------------------------------------------------------------- HF-format folders


def _read_config(folder: Path, role: str) -> dict:
    cfg = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"{role} checkpoint '{folder}' is not a directory; pass the folder "
                              "holding config.json and *.safetensors (dgw make-toy-checkpoints "
                              "writes one)")
    try:
        return json.loads(cfg.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{role} checkpoint '{folder}' has no config.json") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{role} checkpoint '{folder}': config.json is unreadable ({exc})") from None


def _read_tensors(folder: Path, role: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{role} checkpoint '{folder}' has no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{role} checkpoint file '{f}' is unreadable ({exc}); "
                                  "re-download or re-create it") from None
    return out


class _Names:
    """Looks tensors up by HF name, with a clear error listing what is missing."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], role: str, folder: Path,
                 dtype, device) -> None:
        self.t, self.role, self.folder, self.dtype, self.device = tensors, role, folder, dtype, device

    def get(self, *candidates: str, shape: Optional[tuple[int, ...]] = None) -> torch.Tensor:
        for name in candidates:
            if name in self.t:
                w = self.t[name]
                if shape is not None and tuple(w.shape) != shape:
                    raise CheckpointError(
                        f"{self.role} checkpoint '{self.folder}': '{name}' has shape "
                        f"{tuple(w.shape)}, config.json implies {shape}")
                return w.to(device=self.device, dtype=self.dtype)
        raise CheckpointError(f"{self.role} checkpoint '{self.folder}' lacks tensor "
                              f"'{candidates[0]}'")


def _layer(n: _Names, p: str, h_in: int, hidden: int, heads: int, kvh: int, hd: int,
           inter: int) -> LayerWeights:
    return LayerWeights(
        input_norm=n.get(f"{p}.input_layernorm.weight", shape=(hidden,)),
        qkv=torch.cat([n.get(f"{p}.self_attn.q_proj.weight", shape=(heads * hd, h_in)),
                       n.get(f"{p}.self_attn.k_proj.weight", shape=(kvh * hd, h_in)),
                       n.get(f"{p}.self_attn.v_proj.weight", shape=(kvh * hd, h_in))]),
        o=n.get(f"{p}.self_attn.o_proj.weight", shape=(hidden, heads * hd)),
        post_norm=n.get(f"{p}.post_attention_layernorm.weight", shape=(hidden,)),
        gate_up=torch.cat([n.get(f"{p}.mlp.gate_proj.weight", shape=(inter, hidden)),
                           n.get(f"{p}.mlp.up_proj.weight", shape=(inter, hidden))]),
        down=n.get(f"{p}.mlp.down_proj.weight", shape=(hidden, inter)),
    )


def load_target(folder: str | Path, dtype=torch.float32, device="cpu") -> tuple[TargetConfig, TargetWeights]:
    folder = Path(folder)
    cfg = TargetConfig.from_hf(_read_config(folder, "target"), f"target '{folder}'")
    n = _Names(_read_tensors(folder, "target"), "target", folder, dtype, device)
    H, V = cfg.hidden_size, cfg.vocab_size
    layers = [_layer(n, f"model.layers.{i}", H, H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size) for i in range(cfg.num_layers)]
    embed = n.get("model.embed_tokens.weight", shape=(V, H))
    lm_head = n.get("lm_head.weight", shape=(V, H)) if "lm_head.weight" in n.t else embed
    return cfg, TargetWeights(embed, layers, n.get("model.norm.weight", shape=(H,)), lm_head)


def load_draft(folder: str | Path, dtype=torch.float32, device="cpu") -> tuple[DraftConfig, DraftWeights]:
    folder = Path(folder)
    cfg = DraftConfig.from_hf(_read_config(folder, "draft"), f"draft '{folder}'")
    raw = _read_tensors(folder, "draft")
    # Accept the three spellings SGLang's loader accepts: bare, "model."-prefixed, legacy "midlayer".
    norm_names = {k.replace("midlayer.", "layers.0.").removeprefix("model."): v for k, v in raw.items()}
    n = _Names(norm_names, "draft", folder, dtype, device)
    H = cfg.hidden_size
    layer = _layer(n, "layers.0", 2 * H, H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size)
    return cfg, DraftWeights(
        fc=n.get("fc.weight", shape=(H, cfg.num_aux_hidden_states * cfg.target_hidden_size)),
        hidden_norm=n.get("layers.0.hidden_norm.weight", shape=(H,)),
        layer=layer,
        norm=n.get("norm.weight", shape=(H,)),
        lm_head=n.get("lm_head.weight", shape=(cfg.draft_vocab_size, H)),
    )


def target_state_dict(cfg: TargetConfig, w: TargetWeights) -> dict[str, torch.Tensor]:
    """HF Llama names (unfused q/k/v and gate/up), for writing checkpoints."""
    out = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.norm,
           "lm_head.weight": w.lm_head}
    for i, lw in enumerate(w.layers):
        out.update(_layer_state(f"model.layers.{i}", lw, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
    return out


def draft_state_dict(cfg: DraftConfig, w: DraftWeights) -> dict[str, torch.Tensor]:
    """Names SGLang's LlamaForCausalLMEagle3.load_weights maps (no embed: EAGLE-3 shares the target's)."""
    out = {"fc.weight": w.fc, "layers.0.hidden_norm.weight": w.hidden_norm,
           "norm.weight": w.norm, "lm_head.weight": w.lm_head}
    out.update(_layer_state("layers.0", w.layer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
    return out


def _layer_state(p: str, lw: LayerWeights, heads: int, kvh: int, hd: int) -> dict[str, torch.Tensor]:
    q, k, v = lw.qkv.split([heads * hd, kvh * hd, kvh * hd])
    gate, up = lw.gate_up.chunk(2)
    return {f"{p}.input_layernorm.weight": lw.input_norm, f"{p}.self_attn.q_proj.weight": q,
            f"{p}.self_attn.k_proj.weight": k, f"{p}.self_attn.v_proj.weight": v,
            f"{p}.self_attn.o_proj.weight": lw.o, f"{p}.post_attention_layernorm.weight": lw.post_norm,
            f"{p}.mlp.gate_proj.weight": gate, f"{p}.mlp.up_proj.weight": up,
            f"{p}.mlp.down_proj.weight": lw.down}


def save_folder(folder: str | Path, config: dict, tensors: Mapping[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
              str(folder / "model.safetensors"))
    return folder
