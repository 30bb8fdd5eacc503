"""`dgw bench`: tokens/s and time per output token across concurrency for every worker variant,
side by side in one process, plus graph-pool memory, capture time and the cost of a mode switch.

Default model: a Llama-3-8B-shaped target with an EAGLE-3-shaped draft, dummy weights, bf16,
Triton attention, accepted length FORCED (dummy weights accept ~nothing; the output says so).
`--model tiny` runs the same sweep on CPU for a quick look.
"""

from __future__ import annotations

import argparse
import gc
import platform
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dual_graph_worker.engines.reference.attention_choice import default_attention
from dual_graph_worker.engines.reference.build import EngineSpec, default_device, engine_from_dummy
from dual_graph_worker.engines.reference.config import MODEL_SHAPES, named_shape
from dual_graph_worker.core.argtypes import (OneLineParser, existing_file, int_list_up_to,
                                             int_range, name_list, output_dir, positive_float,
                                             positive_int)
from dual_graph_worker.core.errors import report_user_errors
from dual_graph_worker.core.jsonio import write_json
from bench.reference.loadgen import MIN_OUTPUT_LEN, Phase, run_phase
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.provenance import command_line
from dual_graph_worker.core.simple_policies import CyclePolicy, PinnedPolicy
from bench.reference.variants import VARIANTS, PoolSizes, build_variant
from dual_graph_worker.engines.reference.worker import DualGraphWorker, WorkerConfig
from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.core.settings import PolicyKind, Settings


def _release_memory() -> None:
    """After the caller dropped its last reference: what the workers' graphs held goes back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_switch(worker: DualGraphWorker, bs: int, steps: int, input_len: int, vocab: int) -> dict:
    """Host cost of choosing a mode, and step time when alternating vs holding each mode."""
    k = worker.k
    n = 20000
    t0 = time.perf_counter_ns()
    for i in range(n):
        mode = worker.planner.preview(bs)
        worker.dispatch.lookup(mode, bs)
    select_us = (time.perf_counter_ns() - t0) / n / 1e3
    out = {"bs": bs, "select_host_us": select_us}
    saved = worker.policy
    rng = np.random.default_rng(1)
    input_len = min(input_len, worker.table.max_context // 4)
    max_new = worker.table.max_context - input_len - k - 1
    steps = max(2, min(steps, max_new // (k + 1) - 4))
    for label, policy in (("spec", PinnedPolicy(mode=Mode.SPEC, num_draft_tokens=k)), ("decode", PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=k)),
                          ("alternate", CyclePolicy(hold=1, num_draft_tokens=k))):
        worker.policy = policy
        worker.add_requests(rng.integers(0, vocab, size=(bs, input_len)).tolist(), max_new)
        for _ in range(3):
            worker.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times = {Mode.SPEC: [], Mode.DECODE: []}
        for _ in range(steps):
            t = time.perf_counter()
            res = worker.step()
            times[res.record.mode].append(time.perf_counter() - t)
        for rid in list(worker.table.row_of_rid):
            worker.abort(rid)
        out[label] = {m.value: float(np.median(v)) * 1e3 for m, v in times.items() if v}
    worker.policy = saved
    held = (out["spec"]["spec"] + out["decode"]["decode"]) / 2
    alt = (out["alternate"]["spec"] + out["alternate"]["decode"]) / 2
    out["alternate_over_held"] = alt / held
    return out


def switch_bs(worker) -> int:
    """The batch the switch is measured at: 16, or the spec pool's top where it is smaller
    (above it a pinned spec step runs decode); 0 where the worker has no spec pool."""
    return min(16, worker.dispatch.max_spec_bs)


def measure_memory(engine, sizes: PoolSizes, dynamic_continuity: Continuity) -> dict:
    """Graph-pool memory and capture time: spec pool alone, decode pool alone, both in one pool."""
    out = {}
    for label, spec_bs, decode_bs in (("spec_only", sizes.spec, ()), ("decode_only", (), sizes.decode),
                                      ("both", sizes.spec, sizes.decode)):
        w = DualGraphWorker(engine, WorkerConfig(spec_bs, decode_bs, True, continuity=dynamic_continuity),
                            PinnedPolicy(mode=Mode.DECODE, num_draft_tokens=engine.limits.num_draft_tokens))
        rep = w.capture(progress=False)
        out[label] = {"pool_bytes": rep.pool_bytes, "capture_s": rep.total_seconds,
                      "graphs": sum(len([s for s in w.runner.graphs if s[0] == kc.key]) for kc in rep.keys),
                      "per_mode": rep.per_mode()}
        del w
        _release_memory()
    out["both_over_spec_only"] = out["both"]["pool_bytes"] / max(out["spec_only"]["pool_bytes"], 1)
    return out


# (column, numerator, denominators: the best of them) of the ratio table, where all ran.
_RATIOS = (("dynamic / max(plain, static-spec)", "dynamic", ("plain", "static-spec")),
           ("dual-off / plain", "dual-off", ("plain",)),
           ("verify-off (modelled upper bound) / plain", "verify-off", ("plain",)))


def _ratios(variants: dict, conc: list[int]) -> dict:
    """Each ratio per concurrency, printed as a table: end to end (prefills included: static
    spec's draft prefill and the dynamic worker's catch-ups alike) and over decode steps alone.
    verify-off is MODELLED (variants.py): an upper bound of SGLang's verify-path decode."""
    ratios, tables = {}, {}
    for key, label in (("tok_s", ""), ("step_tok_s", ", decode steps only")):
        tok = tables[key] = {name: [r[key] for r in rows] for name, rows in variants.items()}
        for title, num, dens in _RATIOS:
            if {num, *dens} <= tok.keys():
                ratios[title + label] = [a / max(ds) for a, *ds in
                                         zip(tok[num], *(tok[d] for d in dens))]
    tok = tables["tok_s"]
    print("\n| concurrency | " + " | ".join(f"{n} tok/s" for n in tok) + " | "
          + " | ".join(ratios) + " |")
    print("|---" * (1 + len(tok) + len(ratios)) + "|")
    for i, c in enumerate(conc):
        print(f"| {c} | " + " | ".join(f"{tok[n][i]:.0f}" for n in tok) + " | " +
              " | ".join(f"{ratios[r][i]:.3f}" for r in ratios) + " |")
    return ratios


def plot(results: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 5))
    FigureCanvasAgg(fig)
    ax, ax2 = fig.subplots(1, 2)
    conc = results["concurrency"]
    for name, rows in results["variants"].items():
        ax.plot(conc, [r["step_tok_s"] for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrency (requests)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{results['model']} ({results['acceptance']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    for label, vals in results["ratios"].items():
        ax2.plot(conc, vals, marker="o", label=label)
    ax2.axhline(0.98, color="gray", ls="--", lw=0.8)
    ax2.axhline(0.99, color="gray", ls=":", lw=0.8)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("concurrency (requests)")
    ax2.set_ylabel("ratio")
    ax2.set_title("ratios (targets: dynamic/best >= 0.98, off/plain >= 0.99)", fontsize=9)
    ax2.grid(True, alpha=0.3)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SPEC_MAX_BS = 256


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="dgw bench", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODEL_SHAPES), default="llama3-8b")
    ap.add_argument("--concurrency", type=int_list_up_to(512), default="1,2,4,8,16,32,64,128,256",
                    help="comma-separated integers >= 1")
    ap.add_argument("--input-len", type=positive_int, default=256)
    ap.add_argument("--output-len", type=int_range(MIN_OUTPUT_LEN), default=256)
    ap.add_argument("--requests-per-level", type=positive_float, default=1.0,
                    help="requests per concurrency level, as a multiple of the concurrency")
    ap.add_argument("--num-draft-tokens", type=int_range(1, 8), default=3)
    ap.add_argument("--accept-len", type=positive_int, default=3,
                    help="forced accepted length (1..K+1)")
    ap.add_argument("--spec-max-bs", type=positive_int,
                    help="top of the dynamic worker's spec pool (the goodput policy decides "
                         f"within it; default {SPEC_MAX_BS}); a --capture-config sets its own")
    ap.add_argument("--variants", type=name_list(VARIANTS), default=",".join(VARIANTS),
                    help="comma-separated, from " + ", ".join(VARIANTS))
    ap.add_argument("--dynamic-continuity", default="lazy-catch-up",
                    choices=[c.value for c in Continuity])
    ap.add_argument("--repeats", type=positive_int, default=1,
                    help="measurements per (variant, concurrency)")
    ap.add_argument("--capture-config", type=existing_file,
                    help="tuned capture config (make capture-tune) for the "
                         "dual-pool variants: its pools and calibration")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-switch", action="store_true")
    ap.add_argument("--out", type=output_dir, default="out/bench")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)   # bad values: usage and one error line, exit 2
    if args.accept_len > args.num_draft_tokens + 1:
        ap.error(f"--accept-len {args.accept_len} is more than K+1 = {args.num_draft_tokens + 1} "
                 "tokens a spec step can accept; lower it or raise --num-draft-tokens")
    if args.capture_config and args.spec_max_bs is not None:
        ap.error("--spec-max-bs and --capture-config both set the spec pool; pass one")
    context = _context_len(args)
    positions = named_shape(args.model).target.max_position_embeddings
    if context > positions:
        ap.error(f"--input-len + --output-len ({args.input_len} + {args.output_len}) need "
                 f"{context} positions, beyond the {args.model} shape's {positions}; lower them")
    if args.model == "llama3-8b" and not torch.cuda.is_available():
        ap.error("the Llama-3-8B-shaped bench needs a CUDA GPU; use --model tiny on CPU")
    return report_user_errors(_run, args, argv)


def _context_len(args: argparse.Namespace) -> int:
    """Positions a request can reach: its prompt, its output, a spec step's drafts, slack."""
    return args.input_len + args.output_len + args.num_draft_tokens + 8


def _run(args: argparse.Namespace, argv: Optional[list[str]]) -> int:
    device = default_device()
    cuda = device == "cuda"
    conc = args.concurrency
    max_bs = max(conc)
    pair = named_shape(args.model)
    ctx = _context_len(args)
    spec = EngineSpec(num_draft_tokens=args.num_draft_tokens, max_requests=max_bs, max_context=ctx,
                      device=device, dtype="bfloat16" if cuda else "float32",
                      attention=default_attention(device), forced_accept_len=args.accept_len)
    t0 = time.perf_counter()
    engine = engine_from_dummy(pair, spec)
    sizes = PoolSizes.up_to(max_bs, args.spec_max_bs or SPEC_MAX_BS)
    acceptance = f"accept length FORCED to {args.accept_len} (dummy weights), K={args.num_draft_tokens}"
    print(f"model: {args.model} dummy weights, {spec.dtype}, {spec.attention} attention; {acceptance}")
    print(f"engine ready in {time.perf_counter() - t0:.1f}s; pools: spec {sizes.spec}, decode {sizes.decode}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"model": f"{args.model} (dummy weights, {spec.dtype}, {spec.attention})",
               "acceptance": acceptance, "input_len": args.input_len, "output_len": args.output_len,
               "concurrency": conc, "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
               "torch": torch.__version__, "pools": {"spec": sizes.spec, "decode": sizes.decode},
               "variants": {}, "capture": {}, "command": command_line("dgw bench", argv)}
    vocab = pair.target.vocab_size
    names = args.variants
    # Build every variant first, then measure them interleaved at each concurrency (order
    # reversed on each repeat) so slow drifts of the machine hit all of them alike.
    tuned = None
    if args.capture_config:
        from dual_graph_worker.engines.reference.capture_config import tuned_pools
        tuned = tuned_pools(args.capture_config, engine)
        results["capture_config"] = {"path": args.capture_config, "spec": tuned.spec_bs,
                                     "decode": tuned.decode_bs}
        print(f"dual-pool variants' pools from {args.capture_config}: spec {list(tuned.spec_bs)}, "
              f"decode {list(tuned.decode_bs)}")
    built = {}
    for name in names:
        b = build_variant(name, engine, sizes, use_cuda_graphs=cuda,
                          calib_context=args.input_len + args.output_len // 2,
                          dynamic_continuity=Continuity(args.dynamic_continuity), progress=False,
                          tuned=tuned)
        built[name] = b
        if b.capture is not None:
            results["capture"][name] = {"seconds": b.capture.total_seconds,
                                        "pool_bytes": b.capture.pool_bytes,
                                        "per_mode": b.capture.per_mode()}
            print(f"{name}: captured {len(b.capture.keys)} keys in {b.capture.total_seconds:.1f}s, "
                  f"graph pool {b.capture.pool_bytes / 2**20:.0f} MiB")
        if b.calibration is not None:
            results["calibration"] = b.calibration.to_json()
        run_phase(b.worker, Phase(conc[0], conc[0], args.input_len, 8), vocab, seed=999)  # warm-up
    runs: dict[str, dict[int, list]] = {n: {c: [] for c in conc} for n in names}
    for rep in range(args.repeats):
        for c in conc:
            n_req = max(c, int(round(c * args.requests_per_level)))
            for name in (names if rep % 2 == 0 else names[::-1]):
                r = run_phase(built[name].worker, Phase(c, n_req, args.input_len, args.output_len),
                              vocab, seed=c)
                runs[name][c].append(r.to_json())
                print(f"  rep {rep} c={c:4d} {name:12s} {r.step_tok_s:9.1f} tok/s (decode) "
                      f"{r.tok_s:9.1f} (e2e)  tpot {r.tpot_s * 1e3:6.2f} ms  modes {r.modes}  "
                      f"accept {r.mean_accept_len:.2f}")
    for name in names:
        rows = []
        for c in conc:
            reps = runs[name][c]
            row = dict(reps[0])
            for key in ("step_tok_s", "tok_s", "tpot_ms"):
                row[key] = float(np.mean([r[key] for r in reps]))
            row["repeats"] = reps
            rows.append(row)
        results["variants"][name] = rows
    # The sweep's figures reach the disk before the extra measurements, which may fail.
    stem = f"bench_{args.model}_acc{args.accept_len}"
    results["ratios"] = _ratios(results["variants"], conc)
    write_json(results, out / f"{stem}.json")
    if "dynamic" in built and not args.skip_switch:
        results["switch"] = {}
        keep = build_variant("dynamic", engine, sizes, use_cuda_graphs=cuda, calib_context=64,
                             settings=Settings(policy=PolicyKind.THRESHOLD, threshold=1),
                             dynamic_continuity=Continuity.KEEP_CURRENT, progress=False)
        for label, w in (("lazy-catch-up", built["dynamic"].worker), ("keep-current", keep.worker)):
            bs = switch_bs(w)
            if not bs:
                continue
            sw = measure_switch(w, bs=bs, steps=20, input_len=64, vocab=vocab)
            results["switch"][label] = sw
            print(f"switch ({label}): select {sw['select_host_us']:.2f} us host; "
                  f"alternating/held step time {sw['alternate_over_held']:.3f}")
        del keep
        _release_memory()
    for b in built.values():
        b.worker.runner = None
    built.clear()
    _release_memory()
    if cuda and not args.skip_memory:
        results["memory"] = measure_memory(engine, sizes, Continuity(args.dynamic_continuity))
        m = results["memory"]
        print(f"\nmemory: spec only {m['spec_only']['pool_bytes'] / 2**20:.0f} MiB "
              f"({m['spec_only']['capture_s']:.1f}s), decode only {m['decode_only']['pool_bytes'] / 2**20:.0f} MiB "
              f"({m['decode_only']['capture_s']:.1f}s), both {m['both']['pool_bytes'] / 2**20:.0f} MiB "
              f"({m['both']['capture_s']:.1f}s): both/spec-only = {m['both_over_spec_only']:.3f}")
    write_json(results, out / f"{stem}.json")
    plot(results, out / f"{stem}.png")
    print(f"\nwrote {out / (stem + '.json')} and {out / (stem + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
