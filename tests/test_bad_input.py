"""Bad input gives a clear, typed error that names the fix, and leaves the worker usable:
nothing a request already produced is lost and no KV slot leaks."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.engines.reference.build import (EngineSpec, engine_from_checkpoints,
                                                       engine_from_dummy)
from dual_graph_worker.engines.reference.config import (DraftConfig, ModelPair, TargetConfig,
                                                        tiny_shape)
from dual_graph_worker.engines.reference.toy import toy_configs, toy_permutations
from dual_graph_worker.engines.reference.weights import (draft_state_dict, load_draft, load_target,
                                                         save_folder)
from dual_graph_worker.core.errors import (CheckpointError, ConfigError, ContextOverflow, DualGraphError,
                                      NoGraphForBatch)
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.simple_policies import PinnedPolicy
from dual_graph_worker.engines.reference.worker import DualGraphWorker, WorkerConfig

K = 3
TOY_VOCAB = 64


# ---------------------------------------------------------------- K and pools


@pytest.mark.parametrize("k", [0, -1])
def test_num_draft_tokens_below_one_is_a_config_error(k, toy_ckpts):
    with pytest.raises(ConfigError, match="num_draft_tokens") as exc:
        engine_from_dummy(tiny_shape(), EngineSpec(num_draft_tokens=k, max_requests=2, max_context=16))
    assert "decode" in str(exc.value)            # names the alternative: pin decode mode
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        engine_from_checkpoints(toy_ckpts.target, toy_ckpts.drafts["f100"],
                                EngineSpec(num_draft_tokens=k, max_requests=2, max_context=16))


def test_worker_without_eager_rejects_more_running_requests_than_any_graph(toy_engine):
    with pytest.raises(ConfigError, match="eager fallback disabled"):
        DualGraphWorker(toy_engine(), WorkerConfig(spec_bs=(1, 2), decode_bs=(1, 2, 4),
                                                   allow_eager=False, max_running=8),
                        PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=K))


def test_worker_rejects_more_running_requests_than_request_rows(toy_engine):
    with pytest.raises(ConfigError, match="max_requests"):
        DualGraphWorker(toy_engine(max_requests=4), WorkerConfig(spec_bs=(1, 2), decode_bs=(1, 8)),
                        PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=K))


def test_decode_pool_below_spec_pool_is_a_config_error_at_worker_construction(toy_engine):
    with pytest.raises(ConfigError, match="add larger decode batch sizes"):
        DualGraphWorker(toy_engine(), WorkerConfig(spec_bs=(1, 8), decode_bs=(1, 4)),
                        PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=K))


def test_no_graph_for_batch_loses_nothing_and_leaks_nothing(toy_engine, toy_perm, make_worker,
                                                            slot_check):
    """A step whose batch no pool covers, with eager fallback disabled, raises NoGraphForBatch
    before anything runs: the requests keep running with their tokens, every slot is accounted
    for, and once the batch fits again they finish with the right tokens.

    (The worker's constructor and max_running keep a real schedule from reaching this: here the
    dispatch table is swapped for a smaller eager-less one to drive the step's error path.)"""
    prompts = [[1, 2], [3], [4, 5, 6], [7]]
    w = make_worker(toy_engine("f100"), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K), spec_bs=(1, 2, 4),
                    decode_bs=(1, 2, 4))
    w.add_requests(prompts, 16)
    w.step()
    w.step()
    before_tokens = w.table.tokens.copy()
    before_lens = w.table.seq_lens.copy()
    free_before = w.kv.allocator.num_free
    good = w.dispatch
    w.dispatch = DispatchTable.build((1, 2), (1, 2), allow_eager=False)
    w.policy = w.policy                      # the planner plans over the worker's table
    steps = w.planner.steps
    with pytest.raises(NoGraphForBatch, match="capture larger batch sizes"):
        w.step()
    assert w.planner.steps == steps          # raised before the policy committed the step
    assert w.num_running == 4
    assert (w.table.seq_lens == before_lens).all()
    assert (w.table.tokens == before_tokens).all()
    assert w.kv.allocator.num_free == free_before
    slot_check(w)
    w.dispatch = good
    w.policy = w.policy
    while w.num_running:
        w.step()
        slot_check(w)
    outs = {f.rid: f.output for f in w.take_finished()}
    for i, p in enumerate(prompts):
        assert list(outs[i]) == toy_perm.continuation(p[-1], 16)


@pytest.mark.parametrize("mode", [Mode.SPEC, Mode.DECODE])
@pytest.mark.parametrize("fails_in", ["run", "download"])
def test_failure_inside_a_step_returns_its_slots_and_keeps_requests(mode, fails_in, toy_engine,
                                                                    toy_perm, make_worker,
                                                                    slot_check):
    """An exception while the step runs (e.g. a device error) cancels the step's slot plan; one
    after its stages ran (reading the result back) also puts back the rows' tokens and draft
    state the stages moved on, so the requests' later tokens are still the target's."""
    prompts = [[5, 6], [7, 8, 9]]
    w = make_worker(toy_engine("f100"), PinnedPolicy(mode=mode, num_draft_tokens=K))
    w.add_requests(prompts, 12)
    w.step()
    free_before, lens_before = w.kv.allocator.num_free, w.table.seq_lens.copy()
    owner = w.runner if fails_in == "run" else w.bufs
    real = getattr(owner, fails_in)

    def boom(*a, **kw):
        if fails_in == "download":
            real(*a, **kw)                            # the stages ran, their results came back
        raise RuntimeError("simulated device failure")

    setattr(owner, fails_in, boom)
    with pytest.raises(RuntimeError, match="simulated"):
        w.step()
    assert w.kv.allocator.num_free == free_before
    assert (w.table.seq_lens == lens_before).all() and w.num_running == 2
    slot_check(w)
    setattr(owner, fails_in, real)
    while w.num_running:
        w.step()
    outs = {f.rid: f.output for f in w.take_finished()}
    for i, p in enumerate(prompts):
        assert list(outs[i]) == toy_perm.continuation(p[-1], 12)


def test_custom_policy_asking_for_spec_beyond_the_spec_pool_gets_decode(toy_engine, toy_perm,
                                                                       make_worker):
    """The spec pool's buffers cannot hold a bigger spec batch: the worker runs decode instead
    of crashing (or raising NoGraphForBatch when eager is off)."""
    from dual_graph_worker.core.policy import Decision, Reason

    class AlwaysSpec(PinnedPolicy):
        def decide(self, inputs):
            return Decision(Mode.SPEC, Reason.PINNED)     # ignores spec_padded_bs on purpose

    for allow_eager in (True, False):
        w = make_worker(toy_engine("f100"), AlwaysSpec(mode=Mode.SPEC, num_draft_tokens=K), spec_bs=(1, 2),
                        decode_bs=(1, 2, 4, 8), allow_eager=allow_eager)
        prompts, max_new = [[1], [2], [3], [4]], [10, 12, 3, 4]
        w.add_requests(prompts, max_new)
        rec = w.step().record
        assert rec.mode is Mode.DECODE and rec.reason is Reason.NO_SPEC_GRAPH
        while w.num_running:
            w.step()
        outs = {f.rid: f.output for f in w.take_finished()}
        for i, p in enumerate(prompts):
            assert list(outs[i]) == toy_perm.continuation(p[-1], max_new[i])
        assert any(r.mode is Mode.SPEC for r in w.stats.records)      # once bs fell to 2


# ---------------------------------------------------------------- requests


def test_context_overflow_at_admission_names_the_limits(toy_engine, make_worker, slot_check):
    w = make_worker(toy_engine(max_context=32), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K))
    with pytest.raises(ContextOverflow, match="max_context") as exc:
        w.add_requests([[1, 2, 3], [1] * 20], [8, 10])        # 20 + 10 + K = 33 > 32
    assert "max_new_tokens" in str(exc.value)
    assert w.num_running == 0
    assert w.kv.allocator.num_free == w.kv.allocator.num_slots - 1
    w.add_requests([[1] * 20], 9)                             # 20 + 9 + 3 = 32: fits exactly
    while w.num_running:
        w.step()
        slot_check(w)


@pytest.mark.parametrize("bad", [[1, 2, TOY_VOCAB], [-1, 3], [10 ** 6]])
def test_out_of_vocab_prompt_ids_are_rejected_before_anything_is_admitted(bad, toy_engine,
                                                                         make_worker):
    w = make_worker(toy_engine(), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K))
    with pytest.raises(ValueError, match=rf"\[0, {TOY_VOCAB}\)"):
        w.add_requests([[1, 2], bad], 5)
    assert w.num_running == 0
    assert w.kv.allocator.num_free == w.kv.allocator.num_slots - 1


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_below_one_is_rejected(n, toy_engine, make_worker):
    w = make_worker(toy_engine(), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        w.add_requests([[1, 2]], n)
    with pytest.raises(ValueError, match="max_new_tokens"):
        w.add_requests([[1, 2], [3]], [4, n])
    assert w.num_running == 0


def test_empty_prompt_is_rejected(toy_engine, make_worker):
    w = make_worker(toy_engine(), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K))
    with pytest.raises(ValueError, match="at least one token"):
        w.add_requests([[]], 4)
    assert w.num_running == 0


@pytest.mark.parametrize("prompts, max_new, want", [
    ([], 4, "at least one prompt"),
    ([[1, 2], [3]], [4], "1 entries for 2 prompts"),
    ([[1, 2]], [4, 5], "2 entries for 1 prompts"),
    ([[1.9, 2.2]], 4, "flat list of integer token ids"),
    ([[[1, 2]]], 4, "flat list of integer token ids"),
    ([[1, 2]], [2.5], "max_new_tokens must be integers"),
])
def test_malformed_requests_are_one_clear_error_and_admit_nothing(prompts, max_new, want,
                                                                  toy_engine, make_worker):
    """A count list of the wrong length was cut by zip (or failed in a torch mask), float ids
    were truncated to other tokens: each is refused, naming the fix."""
    w = make_worker(toy_engine(), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K))
    with pytest.raises(ValueError, match=want):
        w.add_requests(prompts, max_new)
    assert w.num_running == 0
    w.add_requests([[1, 2]], np.int64(3))               # a numpy count is an integer too
    assert w.num_running == 1


def test_admitting_beyond_max_running_is_a_config_error(toy_engine, make_worker):
    w = make_worker(toy_engine(), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K), max_running=3)
    w.add_requests([[1], [2]], 4)
    with pytest.raises(ConfigError, match="max_running=3"):
        w.add_requests([[3], [4]], 4)
    assert w.num_running == 2


def test_step_without_requests_says_what_to_do(toy_engine, make_worker):
    w = make_worker(toy_engine(), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K))
    with pytest.raises(RuntimeError, match="add_requests"):
        w.step()


# ---------------------------------------------------------------- draft / target mismatch


def _write_mismatched_draft(src, folder, vocab: int, target_hidden: int):
    """A self-consistent EAGLE-3 draft (config and tensors agree) made for another target."""
    H = 64
    cfg = DraftConfig(vocab_size=vocab, hidden_size=H, num_heads=4, num_kv_heads=2,
                      intermediate_size=H, target_hidden_size=target_hidden)
    _, dw = load_draft(src)
    dw.fc = torch.zeros(H, 3 * target_hidden)
    dw.lm_head = torch.zeros(vocab, H)
    return save_folder(folder, cfg.to_hf(), draft_state_dict(cfg, dw))


@pytest.mark.parametrize("vocab,target_hidden,words", [
    (96, 64, ["vocab: draft 96 vs target 64"]),
    (64, 32, ["hidden size", "target_hidden_size=32"]),
    (96, 32, ["vocab", "hidden size"]),
])
def test_draft_target_mismatch_is_a_config_error(vocab, target_hidden, words, toy_ckpts, tmp_path):
    draft = _write_mismatched_draft(toy_ckpts.drafts["f100"], tmp_path / "draft", vocab,
                                    target_hidden)
    with pytest.raises(ConfigError, match="pick the EAGLE-3 draft trained for this target") as exc:
        engine_from_checkpoints(toy_ckpts.target, draft, EngineSpec(max_requests=2, max_context=16))
    for w in words:
        assert w in str(exc.value)


def test_model_pair_mismatch_is_a_config_error():
    t, d = toy_configs(64)
    d32 = DraftConfig(vocab_size=64, hidden_size=64, num_heads=4, num_kv_heads=2,
                      intermediate_size=64, target_hidden_size=32)
    with pytest.raises(ConfigError, match="hidden size"):
        ModelPair(t, d32)
    d_aux = DraftConfig(vocab_size=64, hidden_size=64, num_heads=4, num_kv_heads=2,
                        intermediate_size=64, target_hidden_size=64, num_aux_hidden_states=2)
    with pytest.raises(ConfigError, match="aux hidden states"):
        ModelPair(t, d_aux)
    ModelPair(t, d)                                     # the matching pair is fine


@pytest.mark.parametrize("edit,err,words", [
    # config.json edited alone: its tensors no longer match it -> the checkpoint is inconsistent
    (dict(target_hidden_size=32), CheckpointError, ["fc.weight", "config.json implies"]),
    (dict(vocab_size=96, draft_vocab_size=96), CheckpointError, ["lm_head.weight", "shape"]),
    (dict(draft_vocab_size=32), ConfigError, ["draft_vocab_size=32", "d2t"]),
    # a draft with its own RoPE could not reach the context's last positions
    (dict(max_position_embeddings=8, rope_theta=5e5), ConfigError,
     ["draft's max_position_embeddings=8", "lower max_context"]),
])
def test_edited_draft_config_json_is_reported(edit, err, words, toy_ckpts, tmp_path):
    draft = shutil.copytree(toy_ckpts.drafts["f100"], tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text()) | edit
    (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(err) as exc:
        engine_from_checkpoints(toy_ckpts.target, draft, EngineSpec(max_requests=2, max_context=16))
    for w in words:
        assert w in str(exc.value)


@pytest.mark.parametrize("layers,aux", [(3, None), (6, None), (8, (1, 3, 7)), (8, (0, 0, 4))])
def test_target_whose_aux_layers_collapse_or_fall_outside_is_a_config_error(layers, aux):
    """At 4-6 layers SGLang's default aux layers (2, L/2, L-3) repeat one (its draft's fc then
    sees two or one hidden states); an aux id past the last layer is never captured."""
    with pytest.raises(ConfigError, match="distinct and within"):
        TargetConfig(vocab_size=64, hidden_size=64, num_layers=layers, num_heads=4,
                     num_kv_heads=2, intermediate_size=64, aux_layer_ids=aux)
    TargetConfig(vocab_size=64, hidden_size=64, num_layers=7, num_heads=4, num_kv_heads=2,
                 intermediate_size=64)


def test_heads_not_multiple_of_kv_heads_is_a_config_error():
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        TargetConfig(vocab_size=64, hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=3,
                     intermediate_size=64)


# ---------------------------------------------------------------- unreadable checkpoints


def _copy_target(toy_ckpts, tmp_path):
    return shutil.copytree(toy_ckpts.target, tmp_path / "target")


def test_missing_checkpoint_directory(toy_ckpts, tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        engine_from_checkpoints(tmp_path / "nope", toy_ckpts.drafts["f100"], EngineSpec())
    with pytest.raises(CheckpointError, match="draft checkpoint .* is not a directory"):
        engine_from_checkpoints(toy_ckpts.target, tmp_path / "nope", EngineSpec())


def test_missing_config_json(toy_ckpts, tmp_path):
    t = _copy_target(toy_ckpts, tmp_path)
    (t / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_target(t)


def test_corrupt_config_json(toy_ckpts, tmp_path):
    t = _copy_target(toy_ckpts, tmp_path)
    (t / "config.json").write_text("{ this is not json")
    with pytest.raises(CheckpointError, match="config.json is unreadable"):
        load_target(t)


def test_config_json_without_a_required_field(toy_ckpts, tmp_path):
    t = _copy_target(toy_ckpts, tmp_path)
    cfg = json.loads((t / "config.json").read_text())
    del cfg["hidden_size"]
    (t / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no 'hidden_size'"):
        load_target(t)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_safetensors(damage, toy_ckpts, tmp_path):
    t = _copy_target(toy_ckpts, tmp_path)
    f = t / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"garbage": b"\x00\xff" * 64, "truncated": data[: len(data) // 2],
                   "empty": b""}[damage])
    with pytest.raises(CheckpointError, match="unreadable .*re-download or re-create"):
        load_target(t)


def test_no_safetensors_files(toy_ckpts, tmp_path):
    t = _copy_target(toy_ckpts, tmp_path)
    (t / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_target(t)


@pytest.mark.parametrize("role,name", [("target", "model.layers.3.mlp.down_proj.weight"),
                                       ("target", "model.norm.weight"),
                                       ("draft", "fc.weight"),
                                       ("draft", "layers.0.hidden_norm.weight")])
def test_missing_tensor_is_named(role, name, toy_ckpts, tmp_path):
    from safetensors.torch import load_file, save_file

    src = toy_ckpts.target if role == "target" else toy_ckpts.drafts["f50"]
    folder = shutil.copytree(src, tmp_path / role)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(folder / "model.safetensors"))
    loader = load_target if role == "target" else load_draft
    with pytest.raises(CheckpointError, match=f"lacks tensor '{name}'"):
        loader(folder)


def test_errors_share_one_base_class():
    for e in (ConfigError, CheckpointError, NoGraphForBatch, ContextOverflow):
        assert issubclass(e, DualGraphError)


# ---------------------------------------------------------------- engine options


def test_engine_option_errors():
    with pytest.raises(ConfigError, match="'torch' or 'triton'"):
        engine_from_dummy(tiny_shape(), EngineSpec(max_requests=2, max_context=16, attention="flash"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            engine_from_dummy(tiny_shape(), EngineSpec(max_requests=2, max_context=16,
                                                       attention="triton"))
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        engine_from_dummy(tiny_shape(max_pos=64), EngineSpec(max_requests=2, max_context=128))
    with pytest.raises(ConfigError, match="agreement"):
        toy_permutations(TOY_VOCAB, 1.5)


def test_worker_config_errors(toy_engine):
    with pytest.raises(ConfigError, match="both pools are empty"):
        WorkerConfig(spec_bs=(), decode_bs=())
    with pytest.raises(ConfigError, match="spec_bs=()"):
        WorkerConfig(spec_bs=(1, 2), decode_bs=(1, 2), continuity=None)
    with pytest.raises(ConfigError, match="remove the zero or negative entries"):
        DualGraphWorker(toy_engine(), WorkerConfig(spec_bs=(0, 1), decode_bs=(1, 2)),
                        PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=K))


def test_failed_prefill_admits_nothing_and_leaks_nothing(monkeypatch):
    """An engine error during prefill (e.g. out of memory) leaves the worker as it was."""
    from dual_graph_worker.engines.reference.build import EngineSpec, engine_from_dummy
    from dual_graph_worker.engines.reference.config import tiny_shape
    from dual_graph_worker.core.modes import Mode
    from dual_graph_worker.core.simple_policies import PinnedPolicy
    from dual_graph_worker.engines.reference.worker import DualGraphWorker, WorkerConfig

    engine = engine_from_dummy(tiny_shape(), EngineSpec(num_draft_tokens=3, max_requests=8, max_context=64))
    w = DualGraphWorker(engine, WorkerConfig((1, 2, 4), (1, 2, 4, 8)), PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=3))
    w.add_requests([[1, 2, 3]], 5)
    free_before, running_before = w.kv.allocator.num_free, w.num_running

    def boom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(engine, "prefill", boom)
    with pytest.raises(RuntimeError, match="out of memory"):
        w.add_requests([[4, 5, 6, 7], [8, 9]], 5)
    assert w.kv.allocator.num_free == free_before
    assert w.num_running == running_before
    w.kv.allocator.check()
    monkeypatch.undo()
    while w.num_running:
        w.step()
    assert len(w.take_finished()[0].output) == 5


def test_a_head_width_the_triton_kernel_cannot_tile_is_one_clear_error():
    """--hidden 96 on a GPU made head width 24: a Triton compile traceback, now one line with
    the widths that work (checked before the kernel is imported, so on any machine)."""
    from dual_graph_worker.engines.reference.build import ATTENTION_BACKENDS

    triton = ATTENTION_BACKENDS["triton"]
    with pytest.raises(ConfigError, match=r"powers of two >= 16, got \[8, 24\].*--hidden 64"):
        triton.build(torch.device("cuda"), (24, 8, 64))
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        triton.build(torch.device("cpu"), (64,))
