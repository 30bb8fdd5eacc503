"""`dgw accept-shift`: acceptance that changes while serving, with REAL acceptance.

A toy pair whose target chain has two cycles; the draft agrees on one (accept length K+1) and
never on the other (1), so a request's acceptance is set by the cycle its prompt ends in
(toy.two_cycle_permutations). Phases change the cycle new prompts end in (easy, hard, ...) at a
fixed concurrency; plain, static speculation and the dynamic worker run the same phases, taking
turns step by step (each on its own engine) so a slow spell of the machine falls on all. Per step
the driver records the dynamic worker's mode, the batch's share of easy requests and the
controller's estimates, and reports how many steps after the batch's mix turned its mode
followed. Phases do not drain: old and new requests share the batch while it turns over.
Every request's tokens are checked against the known chain. DGW_* settings apply to the
dynamic worker as on a server (e.g. DGW_EXPLORE_BUDGET).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from dual_graph_worker.core.errors import report_user_errors
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.settings import Settings
from dual_graph_worker.core.argtypes import OneLineParser, int_range, positive_int
from dual_graph_worker.engines.reference.build import engine_from_checkpoints
from bench.reference.loadgen import Phase, PhaseRun, run_side_by_side
from dual_graph_worker.engines.reference.toy import write_two_cycle_checkpoints
from bench.reference.variants import (TRIO, PoolSizes, build_trio, check_toy_settings,
                                      toy_engine_spec)
from dual_graph_worker.core.provenance import checkout_commit, command_line
from bench.reference.toy_args import add_toy_run_args, needed_context, toy_context

KINDS = ("easy", "hard")
# Requests finish at different steps, so the batch's mix turns gradually.
OUTPUT_SPREAD = 0.5


@dataclass(frozen=True)
class ShiftConfig:
    phases: tuple[str, ...] = ("easy", "hard", "easy", "hard")
    concurrency: int = 8
    requests_per_phase: int = 96
    input_len: int = 16
    output_len: int = 48
    hidden: int = 256
    num_draft_tokens: int = 3
    device: str = "cpu"


class ShiftingPrompts:
    """A prompt source whose prompts end in the easy or the hard cycle by phase: the first
    `per_phase` prompts in phase 0's cycle, the next in phase 1's, and so on, with no drain
    between phases (requests of two phases share the batch while it turns over)."""

    def __init__(self, phases: tuple[str, ...], per_phase: int, pools: dict[str, np.ndarray],
                 vocab: int) -> None:
        self.phases, self.per_phase, self.pools, self.vocab = phases, per_phase, pools, vocab
        self.issued = 0

    @property
    def phase(self) -> int:
        """The phase of the latest prompt issued (0 before any): what the batch now turns to."""
        return self._phase_of(max(self.issued - 1, 0))

    def _phase_of(self, prompt: int) -> int:
        return min(prompt // self.per_phase, len(self.phases) - 1)

    def __call__(self, rng: np.random.Generator, n: int, length: int) -> list:
        body = rng.integers(0, self.vocab, size=(n, length))
        for i in range(n):
            body[i, -1] = rng.choice(self.pools[self.phases[self._phase_of(self.issued)]])
            self.issued += 1
        return body.tolist()


def follow_steps(trace: list[dict]) -> list[dict]:
    """Per phase: the mode it settled in (majority of its second half), the step at which the
    batch's easy share crossed one half into this phase's kind, and how many steps later the
    settled mode began."""
    out = []
    phases = sorted({s["phase"] for s in trace})
    for k in phases:
        steps = [s for s in trace if s["phase"] == k]
        tail = [s["mode"] for s in steps[len(steps) // 2:]]
        settled = max(set(tail), key=tail.count)
        easy = steps[-1]["easy_share"] >= 0.5
        after = [s for s in trace if s["step"] >= steps[0]["step"]]
        cross = next((s["step"] for s in after if (s["easy_share"] >= 0.5) == easy), None)
        first = next((s["step"] for s in after if cross is not None and s["step"] >= cross
                      and s["mode"] == settled), None)
        out.append({"phase": k, "settled_mode": settled, "mix_crossed_at": cross,
                    "mode_from": first,
                    "steps_to_follow": None if first is None else first - cross})
    return out


def _shift_run(worker, cfg: ShiftConfig, pools: dict, easy: np.ndarray) -> tuple:
    """A PhaseRun over every phase and the per-step trace it fills (seconds: the worker's own)."""
    source = ShiftingPrompts(cfg.phases, cfg.requests_per_phase, pools, cfg.hidden)
    trace: list[dict] = []
    spent = [0.0]

    def record(result) -> None:
        firsts = result.token_ids[::result.stride].numpy()    # each request's first token
        state = worker.policy.state()
        trace.append({"step": len(trace), "phase": source.phase,
                      "seconds": run.seconds - spent[0], "tokens": int(result.accept_lens.sum()),
                      "mode": result.record.mode.value, "reason": result.record.reason.value,
                      "bs": result.record.bs, "accept": result.record.mean_accept_len,
                      "easy_share": float(np.mean(easy[firsts])) if len(firsts) else 0.0,
                      "est_accept": state.accept_len, "spec_goodput": state.spec_goodput,
                      "decode_goodput": state.decode_goodput})
        spent[0] = run.seconds

    phase = Phase(cfg.concurrency, cfg.requests_per_phase * len(cfg.phases), cfg.input_len,
                  cfg.output_len, output_spread=OUTPUT_SPREAD)
    run = PhaseRun(worker, phase, cfg.hidden, seed=0, collect_outputs=True, prompts=source,
                   on_step=record)
    return run, trace


def run_shift(cfg: ShiftConfig, settings: Settings = Settings(), log=print) -> dict:
    # The engines hold their weights once built: the checkpoints go with the run.
    with tempfile.TemporaryDirectory(prefix="dgw-shift-") as tmp:
        ckpt, perms, easy = write_two_cycle_checkpoints(Path(tmp), hidden=cfg.hidden)
        return _shifted(cfg, settings, log, ckpt, perms, easy)


def _shifted(cfg: ShiftConfig, settings: Settings, log, ckpt, perms, easy) -> dict:
    context = needed_context(cfg.input_len, cfg.output_len, OUTPUT_SPREAD, cfg.num_draft_tokens)
    spec = toy_engine_spec(cfg.device, cfg.num_draft_tokens, cfg.concurrency, context)
    easy_np = easy.numpy()
    pools = {"easy": np.flatnonzero(easy_np), "hard": np.flatnonzero(~easy_np)}

    def engine():
        return engine_from_checkpoints(ckpt.target, ckpt.drafts["two-cycle"], spec,
                                       note="toy checkpoint, two-cycle chain")

    sizes = PoolSizes.up_to(cfg.concurrency, cfg.concurrency)
    runs, traces = {}, {}
    for built in build_trio(engine, sizes, cuda=cfg.device.startswith("cuda"),
                            calib_context=cfg.input_len + cfg.output_len // 2, settings=settings):
        runs[built.name], traces[built.name] = _shift_run(built.worker, cfg, pools, easy_np)
    results = run_side_by_side(runs)
    exact = all(list(o.output) == perms.continuation(o.prompt[-1], o.requested)
                for r in results.values() for o in r.outputs)
    rows = []
    for k, kind in enumerate(cfg.phases):
        row = {"phase": k, "kind": kind}
        for name in TRIO:
            steps = [s for s in traces[name] if s["phase"] == k]
            seconds = sum(s["seconds"] for s in steps)
            # A phase all of whose prompts one admission issued with the next's has no steps.
            row[name] = {"tok_s": sum(s["tokens"] for s in steps) / seconds if steps else None,
                         "modes": {m: sum(s["mode"] == m for s in steps) for m in ("spec", "decode")}}
        measured = all(row[n]["tok_s"] for n in TRIO)
        row["dynamic_over_best"] = row["dynamic"]["tok_s"] / max(
            row["plain"]["tok_s"], row["static-spec"]["tok_s"]) if measured else None
        rows.append(row)
        if measured:
            log(f"{k:5d} {kind:>5s} | " + " | ".join(f"{row[n]['tok_s']:8.1f}" for n in TRIO)
                + f" | {row['dynamic_over_best']:6.3f} | {row['dynamic']['modes']}")
        else:
            log(f"{k:5d} {kind:>5s} | no steps of its own: its prompts joined with the next "
                "phase's")
    return {"config": cfg.__dict__ | {"phases": list(cfg.phases)},
            "settings": settings.to_json(), "phases": rows,
            "follow": follow_steps(traces["dynamic"]), "trace": traces["dynamic"],
            "tokens_equal_known_chain": exact,
            "acceptance": f"REAL: easy cycle accepts {cfg.num_draft_tokens + 1}, hard cycle 1"}


def plot(result: dict, path: Path) -> None:
    # matplotlib's object API on the Agg canvas: no pyplot, so no process-wide backend state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    trace = result["trace"]
    x = [s["step"] for s in trace]
    fig = Figure(figsize=(11, 6))
    FigureCanvasAgg(fig)
    a1, a2 = fig.subplots(2, 1, sharex=True)
    a1.plot(x, [s["easy_share"] for s in trace], color="gray", label="easy share of the batch")
    a1.scatter(x, [1.05 if s["mode"] == "spec" else -0.05 for s in trace], s=4,
               c=["tab:green" if s["mode"] == "spec" else "tab:blue" for s in trace],
               label="mode (top: spec, bottom: decode)")
    a1.set_ylabel("share / mode")
    a1.legend(fontsize=8, loc="center right")
    for name, color in (("spec_goodput", "tab:green"), ("decode_goodput", "tab:blue")):
        a2.plot(x, [s[name] for s in trace], color=color, label=f"expected {name[:-8]} tok/s")
    a2.set_ylabel("controller estimate (tok/s)")
    a2.set_xlabel("dynamic worker step")
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.grid(True, alpha=0.3)
        for f in result["follow"][1:]:
            if f["mix_crossed_at"] is not None:
                ax.axvline(f["mix_crossed_at"], color="k", lw=0.6, ls="--")
    fig.suptitle("acceptance shift: " + result["acceptance"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="dgw accept-shift", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", type=_phase_list, default="easy,hard,easy,hard",
                    help="the cycle new prompts end in, per phase: easy or hard, comma-separated")
    ap.add_argument("--concurrency", type=int_range(1, 256), default=8)
    ap.add_argument("--requests-per-phase", type=positive_int, default=96)
    add_toy_run_args(ap, out="out/accept-shift")
    return ap


def _phase_list(text: str) -> list[str]:
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    if not names or any(n not in KINDS for n in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated easy/hard, got {text!r}")
    return names


def main(argv: Optional[list[str]] = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    cfg = ShiftConfig(tuple(args.phases), args.concurrency, args.requests_per_phase,
                      args.input_len, args.output_len, args.hidden, device=args.device)
    toy_context(ap, cfg.hidden, cfg.input_len, cfg.output_len, OUTPUT_SPREAD,
                cfg.num_draft_tokens, "--input-len or --output-len")
    return report_user_errors(_run, cfg, Path(args.out), argv)


def _run(cfg: ShiftConfig, out: Path, argv: Optional[list[str]]) -> int:
    settings = Settings.from_env(os.environ)    # the dynamic worker's, as a server's
    check_toy_settings(settings)
    out.mkdir(parents=True, exist_ok=True)
    print(f"dgw accept-shift on {cfg.device}: toy two-cycle pair (hidden=vocab={cfg.hidden}), "
          f"C={cfg.concurrency}, {cfg.requests_per_phase} requests per phase; REAL acceptance")
    print(f"{'phase':>5} {'kind':>5} | " + " | ".join(f"{n:>8s}" for n in TRIO)
          + " | dyn/best | dynamic modes (steps)")
    t0 = time.perf_counter()
    result = run_shift(cfg, settings)
    result["command"] = command_line("dgw accept-shift", argv)
    result["commit"] = checkout_commit()
    result["seconds"] = time.perf_counter() - t0
    write_json(result, out / "accept-shift.json")
    plot(result, out / "accept-shift.png")
    for f in result["follow"]:
        print(f"phase {f['phase']}: settled in {f['settled_mode']}, "
              f"{f['steps_to_follow']} steps after the batch's mix crossed one half")
    verdict = "PASS" if result["tokens_equal_known_chain"] else "FAIL"
    print(f"tokens equal the known chain: {verdict}; wrote {out / 'accept-shift.json'} and .png")
    return 0 if result["tokens_equal_known_chain"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
