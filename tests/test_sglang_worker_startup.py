"""The SGLang worker's start-up functions (engines/sglang/worker_startup.py) on CPU: the GPU
start-up that calls them cannot run here, so each is checked on its own."""

from __future__ import annotations

import logging

import pytest
import torch

from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.policy import same_rank
from dual_graph_worker.core.settings import Settings
from dual_graph_worker.engines.sglang import worker_startup as ws


def test_one_rank_reduces_to_itself():
    assert ws.tp_mean(None) is same_rank
    assert ws.tp_mean(type("G", (), {"world_size": 1})()) is same_rank


def _model(dtype=torch.float32, hidden=8, layers=2):
    m = torch.nn.Module()
    m.embed_tokens = torch.nn.Embedding(4, hidden)
    m.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False)
                                   for _ in range(layers))
    return m.to(dtype) if dtype.is_floating_point else m


def test_draft_share_is_the_draft_part_of_the_per_token_weights_made_common(caplog):
    seen = []

    def reduce(vec):
        seen.append(vec)
        return [v / 2 for v in vec]

    target, draft = _model(layers=3), _model(layers=1)
    assert ws.common_draft_share(target, draft, reduce) == pytest.approx(0.25 / 2)
    assert seen == [[pytest.approx(0.25)]]
    # Integer (packed) weights: no floor, said once in the log.
    draft.layers[0].weight = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.int8),
                                                requires_grad=False)
    with caplog.at_level(logging.INFO):
        assert ws.common_draft_share(target, draft, same_rank) == 0.0
    assert "quantized weights" in caplog.text


def test_no_stall_watch_unless_asked(tmp_path):
    assert ws.start_stall_watch(Settings.from_env({})) is None
    path = tmp_path / "stall.jsonl"
    watch = ws.start_stall_watch(Settings.from_env({"DGW_STALL_TRACE": str(path)}))
    try:
        assert watch is not None
    finally:
        watch.stop()


def test_allocator_stats_are_empty_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ws.allocator_stats() == {}


def test_no_capture_config_reads_nothing():
    def shape():
        raise AssertionError("the model shape is read only for a config")

    assert ws.apply_capture_config(Settings.from_env({}), None, shape, is_rank0=True,
                                   graphs_enabled=True) is None


def test_a_capture_probe_never_installed_is_a_config_error(supported_sglang, monkeypatch):
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import (
        FullCudaGraphBackend,
    )

    monkeypatch.setattr(FullCudaGraphBackend, "_dgw_capture_probe", None, raising=False)

    def shape():
        raise AssertionError("the model shape is read only once the probe is found")

    with pytest.raises(ConfigError, match="DGW_CAPTURE_PROBE is set but no capture"):
        ws.close_capture_probe(shape, (1, 2), (1, 2, 4), is_rank0=True)
