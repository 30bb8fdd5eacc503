"""The scripted workload that `dgw profile` runs under nsys (or torch.profiler).

Builds the reference engine and the dual-graph worker, captures both pools, warms up, marks
`steady_state_begin`, then holds spec mode, holds decode mode, and alternates modes every step,
so the checker can compare switch steps with held steps of the same batch size.

    nsys profile --trace=cuda,nvtx --cuda-graph-trace=graph -o R python -m profiling.workload
"""

from __future__ import annotations

import argparse
from typing import Optional

import numpy as np
import torch

from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.engines.reference.attention_choice import default_attention
from dual_graph_worker.engines.reference.build import EngineSpec, default_device, engine_from_dummy
from dual_graph_worker.engines.reference.config import MODEL_SHAPES, named_shape
from dual_graph_worker.core.argtypes import (OneLineParser, int_range, non_negative_int,
                                             output_file, positive_int)
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import DECIDED, Reason
from dual_graph_worker.core.simple_policies import PinnedPolicy
from dual_graph_worker.engines.reference.worker import DualGraphWorker, WorkerConfig


class ScriptedPolicy(PinnedPolicy):
    """Follows a fixed list of modes (then decode)."""

    def __init__(self, script: list[Mode], k: int) -> None:
        super().__init__(mode=Mode.DECODE, num_draft_tokens=k)
        self.script = list(script)

    def decide(self, inputs):
        mode = self.script.pop(0) if self.script else Mode.DECODE
        return DECIDED[mode, Reason.PINNED]


SPEC_POOL = (1, 2, 4, 8, 16)
DECODE_POOL = (1, 2, 4, 8, 16, 32)


def pools(bs: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (spec, decode) pools to capture: the usual small sizes plus `bs` itself, so every
    profiled step of either mode replays a graph (a step above a pool would run eagerly and
    fail the check for the workload's own reason)."""
    return tuple(sorted(set(SPEC_POOL) | {bs})), tuple(sorted(set(DECODE_POOL) | {bs}))


def script(hold: int, alternate: int) -> list[Mode]:
    return ([Mode.SPEC] * hold + [Mode.DECODE] * hold +
            [Mode.SPEC if i % 2 == 0 else Mode.DECODE for i in range(alternate)])


def run(model: str, bs: int, hold: int, alternate: int, warmup: int,
        continuity: Continuity, torch_profile: Optional[str] = None) -> None:
    device = default_device()
    cuda = device == "cuda"
    pair = named_shape(model)
    k = 3
    profiled = 2 * hold + alternate
    steps = 2 * warmup + profiled      # the warm-up alternates spec and decode
    ctx = 64 + steps * (k + 1) + k + 8
    engine = engine_from_dummy(pair, EngineSpec(num_draft_tokens=k, max_requests=max(bs, 32),
                                                max_context=ctx, device=device,
                                                dtype="bfloat16" if cuda else "float32",
                                                attention=default_attention(device),
                                                forced_accept_len=2))
    d = engine.describe()
    spec_bs, decode_bs = pools(bs)
    # No eager fallback: a profiled step without a graph is the workload's bug, said at once.
    worker = DualGraphWorker(engine, WorkerConfig(spec_bs, decode_bs, cuda, continuity=continuity,
                                                  allow_eager=False),
                             ScriptedPolicy([Mode.SPEC, Mode.DECODE] * warmup + script(hold, alternate), k))
    worker.capture(progress=False)
    rng = np.random.default_rng(0)
    worker.add_requests(rng.integers(0, pair.target.vocab_size, size=(bs, 64)).tolist(), steps * (k + 1))
    for _ in range(2 * warmup):
        worker.step()
    if cuda:
        torch.cuda.synchronize()

    warm_switches = worker.stats.switches

    def measured() -> None:
        worker.nvtx.mark_steady_state()     # after capture, prefill and warm-up steps
        for _ in range(profiled):
            worker.step()
        if cuda:
            torch.cuda.synchronize()

    if torch_profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            measured()
        prof.export_chrome_trace(torch_profile)
    else:
        measured()
    print(f"profiled {profiled} steps at bs={bs} ({model}, {d.attention_backend}, "
          f"graphs={cuda}); switches: {worker.stats.switches - warm_switches} (warm-up's "
          f"{warm_switches} apart)")


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(prog="python -m profiling.workload", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODEL_SHAPES), default="tiny")
    ap.add_argument("--bs", type=int_range(1, 512), default=8)
    ap.add_argument("--hold", type=positive_int, default=10)
    ap.add_argument("--alternate", type=positive_int, default=20)
    ap.add_argument("--warmup", type=non_negative_int, default=3)
    ap.add_argument("--continuity", default="keep-current",
                    choices=[c.value for c in Continuity])
    ap.add_argument("--torch-profile", type=output_file,
                    help="write a torch.profiler Chrome trace here instead of relying on an "
                         "external nsys")
    args = ap.parse_args(argv)
    if args.model == "llama3-8b" and not torch.cuda.is_available():
        ap.error("the Llama-3-8B-shaped workload needs a CUDA GPU; use --model tiny on CPU")
    run(args.model, args.bs, args.hold, args.alternate, args.warmup, Continuity(args.continuity),
        args.torch_profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
