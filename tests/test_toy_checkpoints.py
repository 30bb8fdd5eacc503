"""The toy checkpoints (docs/design.md, "Real acceptance without trained weights"): HF folders that
SGLang's loaders accept, with vocab == hidden, an 8-layer target whose greedy continuation is a
known permutation, and EAGLE-3 drafts that agree with it on a chosen fraction of tokens."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from dual_graph_worker.engines.reference.toy import (AGREEMENT_LEVELS, expected_accept_len,
                                                     toy_configs, toy_permutations,
                                                     write_toy_checkpoints)
from dual_graph_worker.engines.reference.config import ModelPair
from dual_graph_worker.engines.reference.weights import (dummy_weights, load_draft, load_target,
                                                          named_sizes)
from dual_graph_worker.core.batch_costs import draft_share
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.simple_policies import PinnedPolicy

V = 64


def _cfg(folder):
    return json.loads((folder / "config.json").read_text())


def test_folders_written(toy_ckpts):
    assert set(toy_ckpts.drafts) == {"f100", "f50", "f0"}
    for folder in [toy_ckpts.target, *toy_ckpts.drafts.values()]:
        assert (folder / "config.json").is_file()
        assert (folder / "model.safetensors").is_file()
        assert folder.parent == toy_ckpts.root


def test_target_config(toy_ckpts):
    c = _cfg(toy_ckpts.target)
    assert c["architectures"] == ["LlamaForCausalLM"]
    assert c["model_type"] == "llama"
    assert c["vocab_size"] == c["hidden_size"] == V
    assert c["num_hidden_layers"] == 8          # 8 so the three aux layers (2, 4, 5) are distinct
    assert c["tie_word_embeddings"] is False
    assert c["torch_dtype"] == "float32"


@pytest.mark.parametrize("level", ["f100", "f50", "f0"])
def test_draft_config(level, toy_ckpts):
    c = _cfg(toy_ckpts.drafts[level])
    assert c["architectures"] == ["LlamaForCausalLMEagle3"]
    assert c["vocab_size"] == c["hidden_size"] == V
    assert c["draft_vocab_size"] == c["vocab_size"]
    assert c["target_hidden_size"] == V
    assert c["num_hidden_layers"] == 1
    assert c["num_aux_hidden_states"] == 3
    assert c["dgw_toy"]["agreement"] == AGREEMENT_LEVELS[level]


def test_tensor_names_follow_hf_and_sglang_eagle3(toy_ckpts):
    t = load_file(str(toy_ckpts.target / "model.safetensors"))
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(t)
    assert sum(k.endswith("self_attn.q_proj.weight") for k in t) == 8
    d = load_file(str(toy_ckpts.drafts["f50"] / "model.safetensors"))
    assert {"fc.weight", "lm_head.weight", "norm.weight", "layers.0.hidden_norm.weight",
            "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= set(d)
    assert not any("embed_tokens" in k for k in d)          # EAGLE-3 shares the target's
    assert d["fc.weight"].shape == (V, 3 * V)
    assert d["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * V
    assert all(v.dtype == torch.float32 for v in [*t.values(), *d.values()])


def test_target_weights_are_identity_embedding_and_permutation_head(toy_ckpts, toy_perm):
    cfg, w = load_target(toy_ckpts.target)
    assert torch.equal(w.embed, torch.eye(V))
    for t in range(V):
        assert int(w.lm_head[:, t].argmax()) == int(toy_perm.p[t])
        assert float(w.lm_head[:, t].sum()) == 1.0
    for lw in w.layers:
        assert not lw.qkv.any() and not lw.o.any() and not lw.gate_up.any() and not lw.down.any()
    assert cfg.capture_layers == (2, 4, 5)


@pytest.mark.parametrize("level", ["f100", "f50", "f0"])
def test_draft_agreement_fraction(level, toy_ckpts, toy_perm):
    f = AGREEMENT_LEVELS[level]
    perms = toy_permutations(V, f)
    assert torch.equal(perms.p, toy_perm.p)                 # same target permutation
    agree = (perms.s == perms.p).float().mean().item()
    assert agree == round(f * V) / V
    _, dw = load_draft(toy_ckpts.drafts[level])
    assert torch.equal(dw.lm_head, torch.eye(V))
    assert torch.equal(dw.fc[:, :V].argmax(0), toy_perm.p)  # target feature e_t -> e_p(t)
    assert not dw.fc[:, V:].any()
    assert expected_accept_len(perms.agreement, 3) == pytest.approx(sum(f ** j for j in range(4)))


def test_target_greedy_continuation_is_the_permutation(toy_engine, toy_perm, make_worker,
                                                       run_schedule):
    """Every token, as a one-token prompt, continues along p (plain greedy decode)."""
    prompts = [[t] for t in range(V)]
    w = make_worker(toy_engine("f0", max_requests=V + 1), PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=3),
                    spec_bs=(1, 64), decode_bs=(1, 64))
    run = run_schedule(w, prompts, 3)
    for t in range(V):
        assert list(run.outputs[t]) == toy_perm.continuation(t, 3)
        assert run.outputs[t][0] == int(toy_perm.p[t])
    # the continuation really is a walk on p: p is a permutation (a bijection on the vocab)
    assert sorted(toy_perm.p.tolist()) == list(range(V))


def test_longer_prompts_continue_from_their_last_token(toy_engine, toy_perm, make_worker,
                                                       run_schedule):
    prompts = [[5, 9, 2], [2], [63, 0, 0, 0, 2]]
    run = run_schedule(make_worker(toy_engine("f100"), PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=3)), prompts, 10)
    assert run.outputs[0] == run.outputs[1] == run.outputs[2]
    assert list(run.outputs[0]) == toy_perm.continuation(2, 10)


def test_writing_is_deterministic_and_seeded(tmp_path, toy_ckpts):
    again = write_toy_checkpoints(tmp_path / "again")
    for a, b in [(toy_ckpts.target, again.target),
                 *[(toy_ckpts.drafts[k], again.drafts[k]) for k in toy_ckpts.drafts]]:
        assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
        assert _cfg(a) == _cfg(b)
    assert not torch.equal(toy_permutations(V, 1.0, seed=1).p, toy_permutations(V, 1.0, seed=0).p)


def test_draft_mlp_maps_a_one_hot_to_its_successor(toy_ckpts):
    """The SwiGLU construction: residual e_a + MLP(norm(e_a)) == e_{s(a)} (up to silu(k) ~ k)."""
    import torch.nn.functional as F

    from dual_graph_worker.engines.reference.model import rms_norm

    perms = toy_permutations(V, 0.5)
    cfg, dw = load_draft(toy_ckpts.drafts["f50"])
    lw = dw.layer
    x = torch.eye(V)
    gate, up = F.linear(rms_norm(x, lw.post_norm, cfg.rms_norm_eps), lw.gate_up).chunk(2, dim=-1)
    out = x + F.linear(F.silu(gate) * up, lw.down)
    assert torch.equal(out.argmax(-1), perms.s)
    assert torch.allclose(out, torch.eye(V)[perms.s], atol=1e-3)
    assert math.isclose(float(out.max()), 1.0, abs_tol=1e-3)


def test_the_reference_engines_share_comes_from_its_weight_tensors():
    t, d = toy_configs(64)
    tw, dw = dummy_weights(ModelPair(t, d))
    names = dict(named_sizes(dw))
    assert names["layer.qkv"] == dw.layer.qkv.numel() and "lm_head" in names
    assert 0.0 < draft_share(named_sizes(tw), named_sizes(dw)) < 0.5
