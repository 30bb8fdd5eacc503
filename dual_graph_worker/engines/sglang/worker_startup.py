"""The worker's start-up computations that need no worker: a tuned capture config applied, the
capture probe's file, the draft's share of the weights, the TP mean, the stall watch, and the
allocator's numbers for the step log. worker.py calls them from __init__ / init_cuda_graphs."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from dual_graph_worker.core.batch_costs import draft_share
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.policy import Reducer, same_rank
from dual_graph_worker.core.settings import Settings, open_output
from dual_graph_worker.core.stall_watch import StallWatch

if TYPE_CHECKING:
    from dual_graph_worker.engines.sglang.capture_config import CapturePlan

logger = logging.getLogger(__name__)


def apply_capture_config(settings: Settings, mr: Any, shape: Callable[[], dict], *,
                         is_rank0: bool, graphs_enabled: bool) -> Optional[CapturePlan]:
    """DGW_CAPTURE_CONFIG (capture_config.py): refuse a config tuned for another GPU or model
    shape, warn when SGLang's spec list is not the tuned one; the CapturePlan (its settings and
    decode list), or None without a config. `shape` (model_shape) is called once a config is set."""
    path = settings.capture_config
    if path is None:
        return None
    from dual_graph_worker.core.capture_schema import GpuInfo
    from dual_graph_worker.core.settings import explicit_keys
    from dual_graph_worker.engines.sglang.capture_config import (
        load_server_capture_config,
        plan_capture,
        spec_list_warning,
    )
    from dual_graph_worker.engines.sglang.decode_pool import fit_to_server_request_pool

    sa = mr.server_args
    capture = load_server_capture_config(
        path, gpu=GpuInfo.from_torch(torch.cuda.current_device()), shape=shape())
    plan = plan_capture(settings, capture, explicit_keys(os.environ), path)
    if is_rank0:
        logger.info("dual-graph: %s", plan.describe())
    if is_rank0 and graphs_enabled:
        warning = spec_list_warning(sa.cuda_graph_config.decode.bs, plan,
                                    fit=lambda sizes: fit_to_server_request_pool(mr, sizes))
        if warning is not None:
            logger.warning(warning)
    return plan


def model_shape(mr: Any, draft_model_config: Any, *, num_steps: int, topk: int) -> dict:
    """This server's capture fingerprint shape (capture_config.sglang_model_shape); `mr` is the
    target's model runner."""
    from dual_graph_worker.engines.sglang.capture_config import sglang_model_shape

    return sglang_model_shape(mr.model_config, draft_model_config, num_steps=num_steps,
                              attention_backend=mr.decode_attention_backend_str,
                              tp_size=mr.server_args.tp_size, topk=topk)


def close_capture_probe(shape: Callable[[], dict], spec_bs: Sequence[int],
                        decode_bs: Sequence[int], *, is_rank0: bool) -> None:
    """DGW_CAPTURE_PROBE (capture_probe.py): every graph's replay time, then the file (rank 0).
    `shape` (model_shape) is called once the probe is found."""
    from dual_graph_worker.engines.sglang.capture_probe import (finish_capture_probe,
                                                                installed_capture_probe)

    probe = installed_capture_probe()
    if probe is None:
        raise ConfigError("DGW_CAPTURE_PROBE is set but no capture was probed: the plugin "
                          "installs the probe when it registers, so set it in the "
                          "environment that launches the server")
    finish_capture_probe(probe, write=is_rank0, model_shape=shape(),
                         spec_bs=spec_bs, decode_bs=decode_bs)
    if is_rank0:
        logger.info("dual-graph: capture probe: %d graphs -> %s", len(probe.records),
                    probe.path)


def common_draft_share(target: torch.nn.Module, draft: torch.nn.Module,
                       reduce: Reducer) -> float:
    """batch_costs.draft_share of this rank's shards, made common: the mean over TP ranks; 0
    (no floor) where either model holds integer weights, whose elements pack several."""
    params = [list(m.named_parameters()) for m in (target, draft)]
    if any(not p.is_floating_point() for ps in params for _, p in ps):
        logger.info("dual-graph: quantized weights: no floor on the draft's prefill rate")
        local = 0.0
    else:
        target_sizes, draft_sizes = ([(name, p.numel()) for name, p in ps] for ps in params)
        local = draft_share(target_sizes, draft_sizes)
    return float(reduce([local])[0])


def allocator_stats() -> dict:
    """The caching allocator's cudaMalloc retries so far (each frees cached blocks, syncing the
    device: steps that meet one run slow) and GiB reserved, for the step log; none without CUDA."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {"alloc_retries": stats.get("num_alloc_retries", 0),
            "reserved_gib": round(stats.get("reserved_bytes.all.current", 0) / 2**30, 2)}


def tp_world(tp_group: Any) -> int:
    """How many TP ranks `tp_group` holds: 1 without one."""
    return int(getattr(tp_group, "world_size", 1) or 1)


def tp_min(tp_group: Any, value: int) -> int:
    """The smallest of `value` over TP ranks, on the CPU group (gloo)."""
    if tp_world(tp_group) <= 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp_group.cpu_group)
    return int(t.item())


def tp_mean(tp_group: Any) -> Reducer:
    """The mean over TP ranks of a vector of local measurements, on the CPU group (gloo)."""
    world = tp_world(tp_group)
    if world <= 1:
        return same_rank
    import torch.distributed as dist

    def reduce(vec: list[float]) -> list[float]:
        t = torch.tensor(vec, dtype=torch.float64)
        dist.all_reduce(t, group=tp_group.cpu_group)
        return (t / world).tolist()

    return reduce


def start_stall_watch(settings: Settings) -> Optional[StallWatch]:
    """The diagnostic stall sampler DGW_STALL_TRACE asks for (rank 0 only), else None."""
    if not settings.stall_trace:
        return None
    out = open_output("stall_trace", settings.stall_trace)
    logger.info("dual-graph: stall watch on (>= %.2f s without a step) -> %s",
                settings.stall_trace_s, settings.stall_trace)
    return StallWatch(out, threshold_s=settings.stall_trace_s).start()
