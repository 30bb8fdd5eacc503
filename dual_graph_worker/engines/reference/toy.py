"""Toy checkpoints with a known answer: real (not simulated) acceptance at a chosen rate.

Construction (docs/design.md, "Real acceptance without trained weights"), with vocab V == hidden H:
- target: embedding = identity, every attention and MLP weight zero, norms one, so the residual
  stream and every aux hidden state at a token t is e_t; lm_head = permutation matrix of a fixed
  permutation p, so greedy next(t) = p(t) and any prompt's continuation is known in advance;
- EAGLE-3 draft: fc = [P_p, 0, 0] (the target's hidden for t becomes e_{p(t)}, the token just
  emitted); attention zero; the SwiGLU MLP maps one-hot e_a to e_{s(a)} - e_a (RMSNorm scales a
  one-hot vector by sqrt(H), gate = (k/sqrt(H)) I, up = I/sqrt(H), down = (P_s - I)/silu(k)), so
  the residual becomes e_{s(a)}; lm_head = identity. The draft proposes s-chains.
Choosing s = p on a fraction f of tokens sets the agreement: accept length 1 + f + ... + f^K.
The same folders load in SGLang 0.5.17 (LlamaForCausalLM + LlamaForCausalLMEagle3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, NamedTuple

import torch

from dual_graph_worker.engines.reference.config import DraftConfig, TargetConfig
from dual_graph_worker.engines.reference.weights import (DraftWeights, LayerWeights, TargetWeights,
                                                         draft_state_dict, save_folder,
                                                         target_state_dict)
from dual_graph_worker.core.errors import ConfigError

GATE_GAIN = 8.0                       # k: silu(k) ~ k, so the MLP is close to linear on one-hots
AGREEMENT_LEVELS: Mapping[str, float] = MappingProxyType({"f100": 1.0, "f50": 0.5, "f0": 0.0})


@dataclass(frozen=True)
class ToyPermutations:
    p: torch.Tensor                   # [V] target: next(t) = p[t]
    s: torch.Tensor                   # [V] draft:  proposal after a = s[a]
    agreement: float

    def continuation(self, last_token: int, n: int) -> list[int]:
        out, t = [], last_token
        for _ in range(n):
            t = int(self.p[t])
            out.append(t)
        return out


def expected_accept_len(agreement: float, num_draft_tokens: int) -> float:
    """Tokens per request per spec step if proposals agree at rate `agreement` independently."""
    return sum(agreement ** j for j in range(num_draft_tokens + 1))


def toy_permutations(vocab: int, agreement: float, seed: int = 0) -> ToyPermutations:
    if not 0.0 <= agreement <= 1.0:
        raise ConfigError(f"agreement must be in [0, 1], got {agreement}")
    g = torch.Generator().manual_seed(seed)
    p = torch.randperm(vocab, generator=g)
    agree = torch.zeros(vocab, dtype=torch.bool)
    agree[torch.randperm(vocab, generator=g)[: round(agreement * vocab)]] = True
    # Where the draft disagrees it proposes p(a)+1, which is never p(a).
    s = torch.where(agree, p, (p + 1) % vocab)
    return ToyPermutations(p, s, agreement)


def two_cycle_permutations(vocab: int, seed: int = 0) -> tuple[ToyPermutations, torch.Tensor]:
    """A target chain of two cycles over halves of the vocabulary, and a draft that agrees on
    the first (accept length K+1) and never on the second (1). A request stays in the cycle its
    prompt ends in, so the prompt sets its acceptance. Returns the pair and the easy-token mask."""
    if vocab < 4 or vocab % 2:
        raise ConfigError(f"a two-cycle toy needs an even vocabulary >= 4, got {vocab}")
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    easy, hard = order[: vocab // 2], order[vocab // 2:]
    p = torch.empty(vocab, dtype=torch.long)
    p[easy], p[hard] = easy.roll(-1), hard.roll(-1)
    s = p.clone()
    s[hard] = p[p[hard]]              # two ahead: never p(a) in a cycle longer than one
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[easy] = True
    return ToyPermutations(p, s, 0.5), mask


def _perm_matrix(perm: torch.Tensor) -> torch.Tensor:
    """M with M @ e_t = e_{perm[t]}."""
    v = perm.numel()
    m = torch.zeros(v, v)
    m[perm, torch.arange(v)] = 1.0
    return m


def _zero_layer(h_in: int, hidden: int, heads: int, kvh: int, hd: int, inter: int) -> LayerWeights:
    return LayerWeights(torch.ones(hidden), torch.zeros((heads + 2 * kvh) * hd, h_in),
                        torch.zeros(hidden, heads * hd), torch.ones(hidden),
                        torch.zeros(2 * inter, hidden), torch.zeros(hidden, inter))


def toy_configs(hidden: int = 64, layers: int = 8, heads: int = 4, kv_heads: int = 2,
                max_pos: int = 2048) -> tuple[TargetConfig, DraftConfig]:
    # hidden = vocab, split into `heads` heads of an even width (rotary embedding pairs).
    step = 2 * heads
    if heads < 1 or hidden < step or hidden % step:
        raise ConfigError(f"toy hidden size (= vocab) must be a positive multiple of {step} "
                          f"({heads} heads of an even width), got {hidden}; e.g. 64 or 256")
    t = TargetConfig(vocab_size=hidden, hidden_size=hidden, num_layers=layers, num_heads=heads,
                     num_kv_heads=kv_heads, intermediate_size=hidden, max_position_embeddings=max_pos)
    d = DraftConfig(vocab_size=hidden, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                    intermediate_size=hidden, target_hidden_size=hidden, max_position_embeddings=max_pos)
    return t, d


def toy_target_weights(cfg: TargetConfig, perms: ToyPermutations) -> TargetWeights:
    H = cfg.hidden_size
    if cfg.vocab_size != H:
        raise ConfigError(f"toy construction needs vocab == hidden, got {cfg.vocab_size} vs {H}")
    layers = [_zero_layer(H, H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size)
              for _ in range(cfg.num_layers)]
    return TargetWeights(torch.eye(H), layers, torch.ones(H), _perm_matrix(perms.p))


def toy_draft_weights(cfg: DraftConfig, perms: ToyPermutations) -> DraftWeights:
    H, inter = cfg.hidden_size, cfg.intermediate_size
    if inter < H:
        raise ConfigError(f"toy draft needs intermediate_size >= hidden ({inter} < {H})")
    layer = _zero_layer(2 * H, H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, inter)
    root = math.sqrt(H)
    layer.gate_up[:H, :] = torch.eye(H) * (GATE_GAIN / root)
    layer.gate_up[inter:inter + H, :] = torch.eye(H) / root
    silu_k = GATE_GAIN / (1.0 + math.exp(-GATE_GAIN))
    layer.down[:, :H] = (_perm_matrix(perms.s) - torch.eye(H)) / silu_k
    fc = torch.zeros(H, cfg.num_aux_hidden_states * cfg.target_hidden_size)
    fc[:, :H] = _perm_matrix(perms.p)
    return DraftWeights(fc, torch.ones(H), layer, torch.ones(H), torch.eye(H))


@dataclass(frozen=True)
class ToyCheckpoints:
    root: Path
    target: Path
    drafts: dict[str, Path]           # "f100" / "f50" / "f0" -> folder


def _save_toy(folder: Path, cfg: TargetConfig | DraftConfig, tensors: dict, meta: dict) -> Path:
    """One HF folder: the config (float32; `meta` under "dgw_toy") and the tensors."""
    return save_folder(folder, cfg.to_hf() | {"torch_dtype": "float32", "dgw_toy": meta}, tensors)


def write_toy_checkpoints(root: str | Path, hidden: int = 64, layers: int = 8, heads: int = 4,
                          kv_heads: int = 2, seed: int = 0) -> ToyCheckpoints:
    """Write DIR/target and DIR/draft-f100, draft-f50, draft-f0 (HF format, float32 tensors)."""
    root = Path(root)
    tcfg, dcfg = toy_configs(hidden, layers, heads, kv_heads)
    base = toy_permutations(hidden, 1.0, seed)
    target = _save_toy(root / "target", tcfg,
                       target_state_dict(tcfg, toy_target_weights(tcfg, base)), {"seed": seed})
    drafts = {}
    for name, f in AGREEMENT_LEVELS.items():
        perms = toy_permutations(hidden, f, seed)
        drafts[name] = _save_toy(root / f"draft-{name}", dcfg,
                                 draft_state_dict(dcfg, toy_draft_weights(dcfg, perms)),
                                 {"seed": seed, "agreement": f})
    return ToyCheckpoints(root, target, drafts)


class TwoCycleToy(NamedTuple):
    """The two-cycle toy's checkpoints, its permutations and its easy-token mask."""

    checkpoints: ToyCheckpoints
    perms: ToyPermutations
    easy: torch.Tensor


def write_two_cycle_checkpoints(root: str | Path, hidden: int = 64, layers: int = 8,
                                seed: int = 0) -> TwoCycleToy:
    """DIR/target and DIR/draft-two-cycle of `two_cycle_permutations`."""
    root = Path(root)
    tcfg, dcfg = toy_configs(hidden, layers)
    perms, easy = two_cycle_permutations(hidden, seed)
    meta = {"seed": seed, "two_cycle": True}
    target = _save_toy(root / "target", tcfg,
                       target_state_dict(tcfg, toy_target_weights(tcfg, perms)), meta)
    draft = _save_toy(root / "draft-two-cycle", dcfg,
                      draft_state_dict(dcfg, toy_draft_weights(dcfg, perms)), meta)
    return TwoCycleToy(ToyCheckpoints(root, target, {"two-cycle": draft}), perms, easy)
