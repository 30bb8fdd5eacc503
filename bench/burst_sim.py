"""SIMULATED: the goodput controller on a fresh server that admits a burst of prompts, as an HTTP
benchmark does (C requests at once, each finished request replaced), against the same simulated
server pinned to speculation or to decode. Step times are lines fitted to the H200's FA3 steps
(policy-matrix-fa3-run1: spec 6.4 ms + 0.091 ms a request, decode 4.8 + 0.024); the start-up
prior reads them low (replays miss host work), as on the GPU. It shows what the controller's
cost terms do while a burst is admitted; the GPU decides what a server does. With
--prompt-share steady the controller's prompt tokens per output token is held at the workload's
(an ablation: what the burst's transient share costs).

    python -m bench.burst_sim [--accept 3,2] [--concurrency 128] [--requests 256]
        [--prompt-share measured|steady] [--out PATH]
"""

from __future__ import annotations

import argparse
from types import MappingProxyType
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from dual_graph_worker.core.errors import report_user_errors
from dual_graph_worker.core.argtypes import OneLineParser, output_file
from dual_graph_worker.core.batch_costs import CatchUpWork
from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.controller import ControllerConfig, GoodputController
from dual_graph_worker.core.dispatch import DispatchTable
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.modes import GraphKey, Mode
from dual_graph_worker.core.planner import StepPlanner
from dual_graph_worker.core.policy import Admitted, PrefillTime, Reducer, StepTime, accepted
from dual_graph_worker.core.simple_policies import PinnedPolicy
from dual_graph_worker.core.settings import Settings

SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, *range(72, 257, 8))
K = 3
PREFILL_S_PER_TOKEN = 2.6e-6      # target prefill
DRAFT_S_PER_TOKEN = 1.0e-6        # the draft's extend over a token (prefill or catch-up)
CATCH_UP_FIXED_S = 2e-3
PREFILL_BATCH = 32                # requests a prefill admits (8192-token chunks of 256-token prompts)
PRIOR_SCALE = MappingProxyType({Mode.SPEC: 0.7, Mode.DECODE: 0.9})


def step_seconds(mode: Mode, padded_bs: int) -> float:
    return (6.4e-3 + 0.091e-3 * padded_bs) if mode is Mode.SPEC else (4.8e-3 + 0.024e-3 * padded_bs)


@dataclass(frozen=True)
class Workload:
    requests: int = 256
    concurrency: int = 128
    input_len: int = 256
    output_len: int = 256
    accept: int = 3


@dataclass
class Trace:
    tokens: int = 0
    seconds: float = 0.0
    modes: list[str] = field(default_factory=list)
    prompt_per_output: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


class SteadyPromptShare(GoodputController):
    """The ablation: the prompt share held at a fixed ratio after every exchange."""

    def __init__(self, ratio: float, *args) -> None:
        super().__init__(*args)
        self.ratio = ratio

    def exchange(self, reduce: Reducer) -> None:
        super().exchange(reduce)
        self._batch_costs.prompt_per_output = self.ratio


def sim_planner(sizes: dict[Mode, Sequence[int]], prior_s: Callable[[Mode, int], float],
                rows: int, pin: Optional[Mode], controller=GoodputController,
                settings: Settings = Settings(),
                catch_up_work: Optional[CatchUpWork] = None) -> StepPlanner:
    """A simulated server's planner over `sizes`: pinned to `pin`, else `controller` (a
    GoodputController class under `settings`) deferring the draft's prefill, with `prior_s` as
    its start-up calibration and `catch_up_work` as its engine's."""
    if pin:
        policy = PinnedPolicy(mode=pin)
    else:
        prior = {GraphKey(m, b): prior_s(m, b) for m, bs in sizes.items() for b in bs}
        policy = controller(ControllerConfig.from_settings(settings, K, defers_prefill=True,
                                                           max_rows=rows,
                                                           catch_up_work=catch_up_work),
                            sizes, CalibrationTable(prior, K))
    return StepPlanner(DispatchTable.build(sizes[Mode.SPEC], sizes[Mode.DECODE]), policy)


def planner(rows: int, pin: Optional[Mode], steady_share: Optional[float] = None) -> StepPlanner:
    steady = None if steady_share is None else partial(SteadyPromptShare, steady_share)
    return sim_planner({Mode.SPEC: SIZES, Mode.DECODE: SIZES},
                       lambda m, b: PRIOR_SCALE[m] * step_seconds(m, b), rows, pin,
                       steady or GoodputController)


def simulate(w: Workload, pin: Optional[Mode] = None, steady_share: bool = False) -> Trace:
    """The draft prefills every prompt (no prefill deferred); the controller is still built as
    deferring it (sim_planner's defers_prefill), so it prices the prompt share into speculation
    alone. A step into speculation first catches the draft up over what each row decoded
    meanwhile."""
    p = planner(w.concurrency, pin, w.input_len / w.output_len if steady_share else None)
    trace, waiting = Trace(), w.requests
    live = np.zeros(w.concurrency, bool)
    generated = np.zeros(w.concurrency, int)
    behind = np.zeros(w.concurrency, int)        # tokens the draft has not seen, per row
    while waiting or live.any():
        if (k := min(int((~live).sum()), waiting, PREFILL_BATCH)):
            new = np.flatnonzero(~live)[:k]
            live[new], generated[new], behind[new] = True, 0, 0
            waiting -= k
            seconds = k * w.input_len * (PREFILL_S_PER_TOKEN + DRAFT_S_PER_TOKEN)
            p.policy.observe(Admitted(k * w.input_len, new))
            p.policy.observe(PrefillTime(k * w.input_len, seconds, True))
            trace.seconds += seconds
        rows = np.flatnonzero(live)
        kv = int((w.input_len + generated[rows]).sum())
        caught_up = int(behind[rows].sum())
        plan = p.plan(len(rows), rows=rows, catch_up_tokens=caught_up, kv_tokens=kv)
        spec = plan.mode is Mode.SPEC
        caught_up = caught_up if spec else 0
        seconds = step_seconds(plan.mode, plan.padded_bs) + (
            CATCH_UP_FIXED_S + DRAFT_S_PER_TOKEN * caught_up if caught_up else 0.0)
        # Tokens each request received: a request stops at its output length, as a server's does.
        lens = np.minimum(w.accept if spec else 1, w.output_len - generated[rows])
        p.policy.observe(StepTime(plan.mode, plan.padded_bs, seconds, catch_up_tokens=caught_up,
                                  kv_tokens=kv))
        p.policy.observe(accepted(plan.mode, lens.astype(float), rows))
        trace.seconds += seconds
        trace.tokens += int(lens.sum())
        trace.modes.append(plan.mode.value[0])
        if pin is None and len(trace.modes) % 8 == 0:
            trace.prompt_per_output.append(round(p.policy.prompt_per_output(), 2))
        generated[rows] += lens
        behind[rows] = 0 if spec else behind[rows] + lens
        live[rows[generated[rows] >= w.output_len]] = False
    return trace


def plot(rows: list[dict], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 2.2 * len(rows)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), 1, squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        ax.step(range(len(row["modes"])), [m == "s" for m in row["modes"]], where="post",
                label="speculating")
        share = ax.twinx()
        share.plot([8 * (i + 1) for i in range(len(row["prompt_per_output"]))],
                   row["prompt_per_output"], color="tab:red", label="prompt tokens / output")
        ax.set_yticks([0, 1], ["decode", "spec"])
        share.set_ylabel("prompt / output", color="tab:red")
        ax.set_title(f"accept {row['accept']}: worker {row['ratio']:.3f} of the better static",
                     fontsize=9)
    axes[-1, 0].set_xlabel("decode step")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(prog="python -m bench.burst_sim", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--accept", default="3,2", help="forced accept lengths (integers), e.g. 3,2")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-share", choices=("measured", "steady"), default="measured",
                    help="steady: the controller's prompt share held at input / output length")
    ap.add_argument("--out", type=output_file, default="out/burst-sim.json")
    args = ap.parse_args(argv)
    try:
        accepts = [int(a) for a in args.accept.split(",")]
    except ValueError:
        ap.error(f"--accept wants integers like 3,2, got {args.accept!r}")
    if min(*accepts, args.concurrency, args.requests) < 1 or max(accepts) > K + 1 \
            or args.concurrency > max(SIZES):
        ap.error(f"--accept in 1..{K + 1}; --requests >= 1; --concurrency in 1..{max(SIZES)}")
    steady = args.prompt_share == "steady"
    print("SIMULATED server (step lines fitted to the H200's FA3 steps), not a measurement"
          + ("; ABLATION: prompt share held at input / output length" if steady else ""))
    rows = []
    for accept in accepts:
        w = Workload(args.requests, args.concurrency, accept=accept)
        spec, decode = (simulate(w, pin) for pin in (Mode.SPEC, Mode.DECODE))
        dual = simulate(w, steady_share=steady)
        best = max(spec.tok_s, decode.tok_s)
        modes = "".join(dual.modes)
        rows.append({"accept": accept, "spec_tok_s": round(spec.tok_s), "decode_tok_s":
                     round(decode.tok_s), "worker_tok_s": round(dual.tok_s),
                     "ratio": round(dual.tok_s / best, 3), "spec_steps": modes.count("s"),
                     "steps": len(modes), "modes": modes,
                     "prompt_per_output": dual.prompt_per_output})
        print(f"accept {accept}, C={w.concurrency}: spec {spec.tok_s:.0f}, decode "
              f"{decode.tok_s:.0f}, worker {dual.tok_s:.0f} tok/s = {dual.tok_s / best:.3f} of "
              f"the better; {modes.count('s')} of {len(modes)} steps speculative")
        print(f"  modes (s/d per step): {modes[:120]}")
        print(f"  prompt tokens per output token, per exchange: {dual.prompt_per_output[:16]}")
    out = Path(args.out)
    write_json({"simulated": True, "prompt_share": args.prompt_share, "rows": rows}, out)
    plot(rows, out.with_suffix(".png"), "SIMULATED burst, C=%d, %d requests, prompt share "
         "%s" % (args.concurrency, args.requests, args.prompt_share))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(report_user_errors(main))
