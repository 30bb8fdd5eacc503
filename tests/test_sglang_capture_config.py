"""DGW_CAPTURE_CONFIG: a tuned capture config read by the SGLang plugin.

The first part needs no SGLang (fake model configs stand in for SGLang's ModelConfig); the last
part imports SGLang 0.5.17 and is skipped cleanly when it is not importable.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dual_graph_worker.engines.reference.capture_config import model_shape
from dual_graph_worker.core.capture_schema import GpuInfo, model_fingerprint
from capture.synthetic import LLAMA3_8B_EAGLE3_SHAPE
from dual_graph_worker.cli import main as dgw_main
from capture.sglang_flags import main as flags_main
from dual_graph_worker.engines.sglang.capture_config import (
    load_server_capture_config,
    plan_capture,
    sglang_model_shape,
    spec_list_warning,
)
from dual_graph_worker.core.settings import Settings, explicit_keys
from dual_graph_worker.engines.sglang.server_args_hook import fit_to_request_pool
from dual_graph_worker.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
ACC2 = ROOT / "results/capture/config_h200_llama3-8b_acc2.json"
H200 = GpuInfo("NVIDIA H200", "9.0")
ACC2_JSON = json.loads(ACC2.read_text())


def _llama3_8b(**target_overrides):
    """What SGLang's ModelConfig reports for Llama-3-8B and its EAGLE-3 draft (the attributes
    sglang_model_shape reads, checked against a real ModelConfig in the SGLang part below)."""
    target = SimpleNamespace(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128, vocab_size=128256,
                             dtype=torch.bfloat16,
                             hf_text_config=SimpleNamespace(intermediate_size=14336))
    for name, value in target_overrides.items():
        setattr(target, name, value)
    return target, SimpleNamespace(hidden_size=4096)


def _shape(target_overrides=None, **kwargs) -> dict:
    target, draft = _llama3_8b(**(target_overrides or {}))
    return sglang_model_shape(target, draft, **{"num_steps": 3, "attention_backend": "triton",
                                                **kwargs})


def _load(path=ACC2, gpu=H200, shape=None):
    return load_server_capture_config(str(path), gpu=gpu, shape=_shape() if shape is None else shape)


# ------------------------------------------------------------------------------ model shape

def test_sglang_shape_is_the_reference_shape_of_the_same_model():
    # Same keys and values as a reference-engine run of Llama-3-8B (capture.measure), so the
    # fingerprints agree and a config tuned there loads on an SGLang server of that shape.
    assert _shape() == LLAMA3_8B_EAGLE3_SHAPE
    assert model_fingerprint(_shape()) == ACC2_JSON["model"]["fingerprint"]


def test_reference_model_shape_uses_the_shared_builder():
    from dual_graph_worker.engines.reference.build import EngineSpec, engine_from_dummy
    from dual_graph_worker.engines.reference.config import tiny_shape

    engine = engine_from_dummy(tiny_shape(), EngineSpec(num_draft_tokens=3, max_requests=4,
                                                       max_context=32))
    assert set(model_shape(engine)) == set(LLAMA3_8B_EAGLE3_SHAPE)


# ------------------------------------------------------------------------------- applying

def test_good_config_sets_the_decode_pool_and_the_threshold():
    capture = _load()
    plan = plan_capture(Settings(), capture, frozenset(), str(ACC2))
    assert plan.decode_bs == tuple(ACC2_JSON["decode_bs"])
    assert plan.spec_bs == tuple(ACC2_JSON["spec_bs"])
    crossover = ACC2_JSON["tuning"]["crossover_bs"]
    assert crossover != Settings().threshold, "the test must see the threshold change"
    assert plan.config.threshold == crossover and not plan.threshold_explicit
    # Nothing else in the worker config moves.
    assert plan.config == Settings(threshold=crossover)
    assert f"threshold {crossover}" in plan.describe()


def test_decode_max_bs_caps_the_tuned_decode_list():
    plan = plan_capture(Settings(decode_max_bs=128), _load(), frozenset(), str(ACC2))
    assert plan.decode_bs == tuple(b for b in ACC2_JSON["decode_bs"] if b <= 128)


def test_explicit_threshold_wins_over_the_crossover(tmp_path):
    capture = _load()
    env = {"DGW_CAPTURE_CONFIG": str(ACC2), "DGW_THRESHOLD": "24"}
    plan = plan_capture(Settings.from_env(env), capture, explicit_keys(env), str(ACC2))
    assert plan.config.threshold == 24 and plan.threshold_explicit
    assert plan.decode_bs == tuple(ACC2_JSON["decode_bs"])      # the pools still apply
    # A threshold in the DGW_CONFIG file is explicit too; the env var alone set nothing else.
    f = tmp_path / "dgw.json"
    f.write_text(json.dumps({"threshold": 16, "capture_config": str(ACC2)}))
    env = {"DGW_CONFIG": str(f)}
    plan = plan_capture(Settings.from_env(env), capture, explicit_keys(env), str(ACC2))
    assert plan.config.threshold == 16 and plan.config.capture_config == str(ACC2)
    env = {"DGW_CAPTURE_CONFIG": str(ACC2), "DGW_THRESHOLD": ""}     # empty = unset
    assert "threshold" not in explicit_keys(env)
    plan = plan_capture(Settings.from_env(env), capture, explicit_keys(env), str(ACC2))
    assert plan.config.threshold == ACC2_JSON["tuning"]["crossover_bs"]


def test_capture_config_key_comes_from_env_or_file(tmp_path):
    assert Settings().capture_config is None
    assert Settings.from_env({"DGW_CAPTURE_CONFIG": "/x.json"}).capture_config == "/x.json"
    assert Settings.from_env({"DGW_CAPTURE_CONFIG": ""}).capture_config is None


# ------------------------------------------------------------------------------- refusals

def test_config_from_another_gpu_is_refused():
    with pytest.raises(ConfigError) as exc:
        _load(gpu=GpuInfo("NVIDIA B200", "10.0"))
    msg = str(exc.value)
    assert "NVIDIA H200" in msg and "NVIDIA B200" in msg          # both GPUs named
    assert "make capture-tune" in msg and "unset DGW_CAPTURE_CONFIG" in msg
    assert str(ACC2) in msg


@pytest.mark.parametrize("overrides, kwargs, named", [
    ({"num_hidden_layers": 16}, {}, "num_layers: 32 when tuned, 16 now"),
    ({"num_key_value_heads": 32}, {}, "num_kv_heads"),
    ({"dtype": torch.float16}, {}, "dtype: 'bfloat16' when tuned, 'float16' now"),
    ({}, {"num_steps": 5}, "num_draft_tokens"),
    ({}, {"attention_backend": "flashinfer"}, "attention_backend"),
    ({}, {"tp_size": 2}, "tp_size: '<absent>' when tuned, 2 now"),
    ({}, {"topk": 4}, "topk"),
])
def test_config_for_another_model_shape_is_refused(overrides, kwargs, named):
    with pytest.raises(ConfigError) as exc:
        _load(shape=_shape(overrides, **kwargs))
    msg = str(exc.value)
    assert named in msg and "for this model" in msg and "DGW_CAPTURE_CONFIG" in msg


def test_missing_or_garbage_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot read capture config .*missing.json"):
        _load(path=tmp_path / "missing.json")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON.*unset DGW_CAPTURE_CONFIG"):
        _load(path=garbage)
    other = tmp_path / "measurements.json"
    other.write_text(json.dumps({"schema": "dgw-capture-measurements/1"}))
    with pytest.raises(ConfigError, match="schema"):
        _load(path=other)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**ACC2_JSON, "decode_bs": [8, 4]}))
    with pytest.raises(ConfigError, match="ascending"):
        _load(path=broken)


# ------------------------------------------------------------------ spec pool: warning, flags

def test_spec_list_warning_names_both_lists():
    plan = plan_capture(Settings(), _load(), frozenset(), str(ACC2))
    assert spec_list_warning(ACC2_JSON["spec_bs"], plan) is None
    server = [1, 2, 4, 8, 16, 32, 48]
    msg = spec_list_warning(server, plan)
    assert msg is not None
    assert str(server) in msg and str(ACC2_JSON["spec_bs"]) in msg
    assert "DGW_CAPTURE_CONFIG" in msg


def test_spec_list_warning_ignores_what_the_request_pool_clamps():
    plan = plan_capture(Settings(), _load(), frozenset(), str(ACC2))

    def fit(sizes):
        return fit_to_request_pool(sizes, max_requests=32, alignment=1)

    clamped_server = [b for b in ACC2_JSON["spec_bs"] if b <= 32]
    assert spec_list_warning(clamped_server, plan, fit=fit) is None
    assert spec_list_warning([1, 2, 4, 8, 16, 32], plan, fit=fit) is not None


def test_capture_flags_cli_prints_a_complete_launch_line(capsys):
    assert flags_main([str(ACC2)]) == 0
    out = capsys.readouterr().out.splitlines()
    launch = next(line for line in out if "sglang.launch_server" in line)
    assert launch.startswith(f"DGW_CAPTURE_CONFIG={ACC2} python -m sglang.launch_server")
    for flag in ("--speculative-algorithm DUAL_GRAPH_EAGLE3", "--speculative-num-steps 3",
                 "--speculative-num-draft-tokens 4", "--attention-backend triton"):
        assert flag in launch
    assert "--cuda-graph-bs-decode" not in launch          # the plugin sets the spec list
    assert any("reference engine" in line for line in out)       # honest about the source
    # The one-line form, for $(dgw capture-flags --server-args F), through the dgw entry point.
    assert dgw_main(["capture-flags", "--server-args", str(ACC2)]) == 0
    assert capsys.readouterr().out.startswith("--speculative-algorithm DUAL_GRAPH_EAGLE3 ")
    # With the model paths, the line runs as copied.
    assert flags_main([str(ACC2), "--model-path", "/m/llama", "--draft-model-path", "/m/e3"]) == 0
    assert "--model-path /m/llama --speculative-draft-model-path /m/e3 " in capsys.readouterr().out
    # A path with a space stays one argument when the line is pasted into a shell.
    assert flags_main([str(ACC2), "--model-path", "/my models/llama"]) == 0
    assert "--model-path '/my models/llama' " in capsys.readouterr().out
    # --server-args prints no paths: asking for both is one line, not a silent drop.
    with pytest.raises(SystemExit) as stop:
        dgw_main(["capture-flags", "--server-args", str(ACC2), "--model-path", "/m"])
    assert stop.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_capture_flags_cli_fails_cleanly_on_a_bad_file(tmp_path, capsys):
    assert dgw_main(["capture-flags", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope.json" in err and "Traceback" not in err


# ============================================================ with SGLang 0.5.17 (CPU only)

@pytest.fixture
def sglang_registered(supported_sglang):
    from dual_graph_worker.engines.sglang.plugin import register

    register()


def _server_args(tmp_path, **extra):
    import sys

    from sglang.srt.server_args import ServerArgs

    sys.path.insert(0, str(ROOT))
    from bench.sglang.model_configs import toy_shapes, write_eagle3_draft_config, \
        write_llama_config

    shapes = toy_shapes(vocab=256)
    target = write_llama_config(tmp_path / "target", shapes)
    draft = write_eagle3_draft_config(tmp_path / "draft", shapes)
    return ServerArgs(model_path=str(target), device="cuda", load_format="dummy",
                      skip_tokenizer_init=True, speculative_algorithm="DUAL_GRAPH_EAGLE3",
                      speculative_draft_model_path=str(draft), speculative_num_steps=3,
                      speculative_eagle_topk=1, speculative_num_draft_tokens=4, **extra)


def test_the_config_sets_sglangs_spec_list_at_argument_validation(sglang_registered, tmp_path,
                                                                  monkeypatch):
    default = _server_args(tmp_path / "default").cuda_graph_config.decode.bs
    monkeypatch.setenv("DGW_CAPTURE_CONFIG", str(ACC2))
    sa = _server_args(tmp_path)
    assert sa.cuda_graph_config.decode.bs == ACC2_JSON["spec_bs"] != default


def test_validator_rejects_a_broken_capture_config_at_launch(sglang_registered, tmp_path,
                                                             monkeypatch):
    monkeypatch.setenv("DGW_CAPTURE_CONFIG", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="DGW_CAPTURE_CONFIG=.*missing.json"):
        _server_args(tmp_path)


def test_sglang_model_config_has_the_attributes_the_shape_reads(sglang_registered, tmp_path):
    from sglang.srt.configs.model_config import ModelConfig

    mc = ModelConfig.from_server_args(_server_args(tmp_path))
    shape = sglang_model_shape(mc, SimpleNamespace(hidden_size=mc.hidden_size), num_steps=3,
                               attention_backend="triton")
    assert shape["num_layers"] == mc.num_hidden_layers and shape["dtype"] == "bfloat16"
    assert isinstance(shape["intermediate_size"], int) and shape["head_dim"] > 0


def test_worker_applies_the_capture_config_before_capture(sglang_registered, monkeypatch,
                                                          caplog):
    from dual_graph_worker.engines.sglang import decode_pool
    from dual_graph_worker.engines.sglang.worker import DualGraphEagleWorker

    monkeypatch.setenv("DGW_CAPTURE_CONFIG", str(ACC2))
    monkeypatch.delenv("DGW_THRESHOLD", raising=False)
    monkeypatch.delenv("DGW_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(GpuInfo, "from_torch", classmethod(lambda cls, index=0: H200))
    monkeypatch.setattr(decode_pool, "fit_to_server_request_pool",
                        lambda mr, sizes: fit_to_request_pool(sizes, max_requests=256,
                                                              alignment=1))
    target, draft = _llama3_8b()
    server_args = SimpleNamespace(tp_size=1, cuda_graph_config=SimpleNamespace(
        decode=SimpleNamespace(bs=[1, 2, 4, 8, 16, 32, 48])))
    mr = SimpleNamespace(server_args=server_args, model_config=target,
                         decode_attention_backend_str="triton")
    w = object.__new__(DualGraphEagleWorker)
    w.settings = Settings.from_env({"DGW_CAPTURE_CONFIG": str(ACC2)})
    w._draft_worker = SimpleNamespace(draft_runner=SimpleNamespace(model_config=draft))
    w.speculative_num_steps, w.topk = 3, 1
    w._is_rank0, w._graphs_enabled = True, True
    with caplog.at_level(logging.INFO):
        decode_bs = w._apply_capture_config(mr)
    assert decode_bs == tuple(ACC2_JSON["decode_bs"])
    assert w.settings.threshold == ACC2_JSON["tuning"]["crossover_bs"]
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and r.name.startswith("dual_graph_worker")]
    # A spec list other than the config's (the plugin sets it at argument validation) is named.
    assert len(warnings) == 1 and "[1, 2, 4, 8, 16, 32, 48]" in warnings[0]
    # Another GPU: refused before anything is allocated.
    monkeypatch.setattr(GpuInfo, "from_torch",
                        classmethod(lambda cls, index=0: GpuInfo("NVIDIA B200", "10.0")))
    w.settings = Settings.from_env({"DGW_CAPTURE_CONFIG": str(ACC2)})
    with pytest.raises(ConfigError, match="B200"):
        w._apply_capture_config(mr)
