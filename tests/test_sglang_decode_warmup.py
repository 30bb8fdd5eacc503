"""The start-up call that builds the decode path's JIT kernel (decode_warmup.py)."""

import torch

from dual_graph_worker.engines.sglang.decode_warmup import (
    DECODE_SEQ_LENS_DTYPE,
    warm_decode_positions,
)


def test_warmup_calls_clamp_position_on_the_decode_dtype():
    seen = []

    def clamp(seq_lens):
        seen.append((seq_lens.dtype, seq_lens.device.type, seq_lens.tolist()))
        return (seq_lens - 1).clamp(min=0)

    out = warm_decode_positions("cpu", clamp)
    assert seen == [(torch.int64, "cpu", [1, 2])]
    assert out.tolist() == [0, 1]


def test_warmup_calls_the_function_sglang_decode_steps_call(supported_sglang, monkeypatch):
    # ForwardBatch.init_new looks clamp_position up in its module at call time; the warm-up
    # must call that same name (CUDA JIT on a GPU, the native version here).
    from sglang.srt.model_executor import forward_batch_info

    calls = []
    real = forward_batch_info.clamp_position
    monkeypatch.setattr(forward_batch_info, "clamp_position",
                        lambda s: calls.append(s.dtype) or real(s))
    assert warm_decode_positions("cpu").tolist() == [0, 1]
    assert calls == [DECODE_SEQ_LENS_DTYPE]


def test_decode_dtype_is_the_schedule_batch_dtype(supported_sglang):
    # ScheduleBatch builds seq_lens as int64 (schedule_batch.py); a decode step's view keeps it.
    import inspect

    from sglang.srt.managers import schedule_batch

    assert "seq_lens, dtype=torch.int64" in inspect.getsource(schedule_batch.ScheduleBatch)
    assert DECODE_SEQ_LENS_DTYPE is torch.int64


def test_worker_warms_the_decode_path_before_capturing_its_pool(supported_sglang, monkeypatch):
    from types import SimpleNamespace

    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    from dual_graph_worker.engines.sglang import worker as worker_mod

    order = []

    class Stop(Exception):
        pass

    monkeypatch.setattr(EAGLEWorkerV2, "init_cuda_graphs", lambda self: order.append("spec"))
    monkeypatch.setattr(worker_mod, "warm_decode_positions",
                        lambda device: order.append(("warm", device)))

    def build_pool(mr, sizes):
        order.append("decode pool")
        raise Stop

    monkeypatch.setattr(worker_mod, "build_decode_pool", build_pool)
    w = object.__new__(worker_mod.DualGraphEagleWorker)
    w._target_worker = SimpleNamespace(model_runner=SimpleNamespace(device="cuda"))
    w._graphs_enabled, w._decode_bs = True, (1, 2)
    try:
        w.init_cuda_graphs()
    except Stop:
        pass
    assert order == ["spec", ("warm", "cuda"), "decode pool"]
