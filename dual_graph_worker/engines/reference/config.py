"""Model shapes of the reference engine: a Llama-family target and an EAGLE-3 draft.

Both read and write HF-style config.json dicts, with the field names SGLang 0.5.17 reads, so
the toy checkpoints this project writes load in SGLang unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

from dual_graph_worker.core.errors import CheckpointError, ConfigError


def _require(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise CheckpointError(f"{where}: config.json has no '{key}'; is this a Llama-family "
                              "HF checkpoint? (needed: hidden_size, num_hidden_layers, "
                              "num_attention_heads, intermediate_size, vocab_size)")
    return d[key]


# The fewest target layers whose default aux layers (2, L/2, L-3) are three distinct ones.
MIN_LAYERS = 7


@dataclass(frozen=True)
class TargetConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0                    # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    aux_layer_ids: Optional[tuple[int, ...]] = None   # None: SGLang's default [2, L//2, L-3]

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_kv_heads}")
        layers = self.capture_layers
        if len(set(layers)) != len(layers) or not all(0 < i < self.num_layers for i in layers):
            raise ConfigError(f"EAGLE-3 reads aux hidden states at the inputs of layers "
                              f"{list(layers)} of a {self.num_layers}-layer target: they must "
                              f"be distinct and within 1..{self.num_layers - 1} (SGLang's "
                              f"default 2, L/2, L-3 needs >= {MIN_LAYERS} layers)")

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Layers whose *input* residual stream is an aux hidden state (SGLang's convention)."""
        if self.aux_layer_ids is not None:
            return tuple(i + 1 for i in self.aux_layer_ids)
        n = self.num_layers
        return (2, n // 2, n - 3)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], where: str = "target") -> "TargetConfig":
        heads = _require(d, "num_attention_heads", where)
        eagle = d.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            vocab_size=_require(d, "vocab_size", where),
            hidden_size=_require(d, "hidden_size", where),
            num_layers=_require(d, "num_hidden_layers", where),
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads", heads),
            intermediate_size=_require(d, "intermediate_size", where),
            head_dim=d.get("head_dim") or 0,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=d.get("rope_theta", 10000.0),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            aux_layer_ids=tuple(eagle) if eagle else None,
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "intermediate_size": self.intermediate_size,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": 0, "eos_token_id": None, "attention_bias": False,
        }


@dataclass(frozen=True)
class DraftConfig:
    """EAGLE-3 draft (SGLang's LlamaForCausalLMEagle3): fc over 3 target hidden states, one
    decoder layer whose attention reads [norm(embed), norm(hidden)] (2H wide), an LM head. The
    token embedding is the target's (SGLang shares it for EAGLE-3)."""

    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    target_hidden_size: int
    head_dim: int = 0
    draft_vocab_size: int = 0            # 0: vocab_size (no d2t map)
    num_aux_hidden_states: int = 3
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.draft_vocab_size == 0:
            object.__setattr__(self, "draft_vocab_size", self.vocab_size)
        if self.draft_vocab_size != self.vocab_size:
            raise ConfigError(f"draft_vocab_size={self.draft_vocab_size} != vocab_size="
                              f"{self.vocab_size}: the reference engine has no d2t token map; "
                              "use a draft whose vocabulary equals the target's")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], where: str = "draft") -> "DraftConfig":
        heads = _require(d, "num_attention_heads", where)
        hidden = _require(d, "hidden_size", where)
        return cls(
            vocab_size=_require(d, "vocab_size", where), hidden_size=hidden, num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads", heads),
            intermediate_size=_require(d, "intermediate_size", where),
            target_hidden_size=d.get("target_hidden_size", hidden),
            head_dim=d.get("head_dim") or 0, draft_vocab_size=d.get("draft_vocab_size") or 0,
            num_aux_hidden_states=d.get("num_aux_hidden_states", 3),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5), rope_theta=d.get("rope_theta", 10000.0),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "hidden_size": self.hidden_size, "target_hidden_size": self.target_hidden_size,
            "num_hidden_layers": 1, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "intermediate_size": self.intermediate_size,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "num_aux_hidden_states": self.num_aux_hidden_states, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bias": False,
        }


@dataclass(frozen=True)
class ModelPair:
    """A target and its draft, checked against each other once."""

    target: TargetConfig
    draft: DraftConfig

    def __post_init__(self) -> None:
        t, d = self.target, self.draft
        problems = []
        if d.vocab_size != t.vocab_size:
            problems.append(f"vocab: draft {d.vocab_size} vs target {t.vocab_size}")
        if d.target_hidden_size != t.hidden_size:
            problems.append(f"hidden size: draft expects target_hidden_size={d.target_hidden_size}, "
                            f"target has hidden_size={t.hidden_size}")
        if d.num_aux_hidden_states != len(t.capture_layers):
            problems.append(f"aux hidden states: draft fuses {d.num_aux_hidden_states}, target "
                            f"captures {len(t.capture_layers)}")
        if problems:
            raise ConfigError("draft and target do not match (" + "; ".join(problems) +
                              "): pick the EAGLE-3 draft trained for this target")

    def shape_dict(self) -> dict[str, Any]:
        return {"target": asdict(self.target), "draft": asdict(self.draft)}


def llama3_8b_shape(max_position_embeddings: int = 8192) -> ModelPair:
    """Llama-3-8B target and an EAGLE-3 draft of the published shape (for dummy-weight benches)."""
    t = TargetConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                     num_kv_heads=8, intermediate_size=14336, rope_theta=500000.0,
                     max_position_embeddings=max_position_embeddings)
    d = DraftConfig(vocab_size=128256, hidden_size=4096, num_heads=32, num_kv_heads=8,
                    intermediate_size=14336, target_hidden_size=4096, rope_theta=500000.0,
                    max_position_embeddings=max_position_embeddings)
    return ModelPair(t, d)


def tiny_shape(vocab: int = 128, hidden: int = 64, layers: int = 8, heads: int = 4,
               kv_heads: int = 2, intermediate: int = 128, max_pos: int = 1024) -> ModelPair:
    """A model small enough for CPU tests and the CPU demo."""
    t = TargetConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                     num_kv_heads=kv_heads, intermediate_size=intermediate,
                     max_position_embeddings=max_pos)
    d = DraftConfig(vocab_size=vocab, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                    intermediate_size=intermediate, target_hidden_size=hidden,
                    max_position_embeddings=max_pos)
    return ModelPair(t, d)


# A toy's width (= vocab) stays a toy's: a CPU builds and runs it in seconds. Here, torch-free,
# so a command's --help reads it without importing torch.
TOY_MAX_HIDDEN = 4096

# Named shapes for the command-line tools (bench, capture measurement, profiling workload).
MODEL_SHAPES: Mapping[str, Callable[[], ModelPair]] = MappingProxyType(
    {"llama3-8b": llama3_8b_shape, "tiny": tiny_shape})


def named_shape(name: str) -> ModelPair:
    if name not in MODEL_SHAPES:
        raise ConfigError(f"unknown model shape '{name}'; choose one of {', '.join(MODEL_SHAPES)}")
    return MODEL_SHAPES[name]()
