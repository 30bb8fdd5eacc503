"""GPU: a tuned capture config against the worker's default capture lists, side by side on
SGLang 0.5.17 (`make capture-compare`).

1. The worker with its default lists (SGLang's speculative list, capped where DGW_SPEC_MAX_BS is
   set; the plain server's decode list): start-up, the pools' graph memory and capture time
   (SGLang's own per-runner figures), tok/s per concurrency.
2. `capture-tune` on the measurements (bench/sglang/capture_measure.py) under the given budgets,
   each lowered to what the tuner's model charges for the default lists (a tuned server never
   spends more than the one it replaces, in the units the tuner checks), batch sizes weighted
   as the default server ran them (its step log) unless --distribution names another.
3. The worker with that config (DGW_CAPTURE_CONFIG), the same figures.
Llama-3-8B shape, DUMMY weights, accept length FORCED (SGLANG_SIMULATE_ACC_LEN). Writes
DIR/compare.json, DIR/report.md, DIR/compare.png, DIR/config.json, DIR/tune.txt.

    python -m bench.sglang.capture_compare --out DIR --measurements M.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Optional

from bench.sglang.capture_measure import POOL_RUNNERS, pool_sum, together_bytes
from bench.sglang.engine_child import run_child
from bench.sglang.matrix_records import Workload, workload_arg
from bench.sglang.model_configs import engine_kwargs, llama3_8b_shapes, write_dummy_pair
from bench.sglang.policy_matrix import sweep_task
from capture.config import build_capture_config, save_capture_config
from capture.distribution import parse_distribution
from capture.measurements import Measurements, load_measurements
from capture.tuner import TuningError, modelled_cost, tune
from capture.units import parse_size
from dual_graph_worker.core.argtypes import OneLineParser, positive_int
from dual_graph_worker.core.errors import ConfigError, DualGraphError
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.settings import BY_KEY, Settings, settings_env

SERVED = "served"


def pool_cost(server_info: dict) -> dict:
    """The two pools' graph memory (bytes) and capture seconds a server reported."""
    mem = ((server_info or {}).get("memory_usage") or {}).get("graph") or {}
    secs = ((server_info or {}).get("startup_time") or {}).get("cuda_graph") or {}
    return {"graph_bytes": together_bytes(server_info), "capture_s": pool_sum(secs),
            "by_runner": {k: {"gb": mem.get(k), "s": secs.get(k)} for k in POOL_RUNNERS
                          if k in mem or k in secs}}


def summary(name: str, res: dict) -> dict:
    """One engine's row: start-up, pools, the lists it captured, tok/s per concurrency."""
    info = res.get("server_info") or {}
    tok_s: dict[int, list[float]] = {}
    for task in (res.get("tasks") or {}).values():
        for p in (task or {}).get("points", []):
            tok_s.setdefault(int(p["concurrency"]), []).append(float(p["tok_s"]))
    return {"engine": name, "ok": bool(res.get("ok")), "startup_s": res.get("startup_s"),
            **pool_cost(info), "pools": info.get("dual_graph_pools"),
            "tok_s": {c: statistics.median(v) for c, v in sorted(tok_s.items())},
            "tok_s_runs": {c: v for c, v in sorted(tok_s.items())},
            "error": res.get("error")}


def compare(default: dict, tuned: dict) -> dict:
    """tuned / default for every figure both have."""
    def ratio(a, b):
        return None if a in (None, 0) or b is None else round(b / a, 4)
    return {"startup": ratio(default["startup_s"], tuned["startup_s"]),
            "graph_bytes": ratio(default["graph_bytes"], tuned["graph_bytes"]),
            "capture_s": ratio(default["capture_s"], tuned["capture_s"]),
            "tok_s": {c: ratio(default["tok_s"].get(c), tuned["tok_s"].get(c))
                      for c in default["tok_s"] if c in tuned["tok_s"]}}


def report(rows: list[dict], ratios: Optional[dict], note: str,
           predicted_bytes: Optional[int] = None) -> str:
    """`predicted_bytes`: the tuner's memory model of the tuned lists, set against what the
    tuned server measured (the model guides the choice; the measured figure is the result)."""
    def mib(b):
        return "-" if b is None else f"{b / 2**20:.0f} MiB"

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    levels = sorted({c for r in rows for c in r["tok_s"]})
    lines = [f"# Tuned capture config vs the worker's default lists\n\n{note}\n",
             "| engine | start-up | pools' graph memory | pools' capture | spec bs | decode bs | "
             + " | ".join(f"tok/s C={c}" for c in levels) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(levels)]
    for r in rows:
        pools = r.get("pools") or {}
        lines.append(
            f"| {r['engine']} | {num(r['startup_s'], '.1f')} s | {mib(r['graph_bytes'])} | "
            f"{num(r['capture_s'], '.2f')} s | {len(pools.get('spec_bs') or [])} sizes, top "
            f"{max(pools.get('spec_bs') or [0])} | {len(pools.get('decode_bs') or [])} sizes, top "
            f"{max(pools.get('decode_bs') or [0])} | "
            + " | ".join(num(r["tok_s"].get(c), ".0f") for c in levels) + " |")
    if ratios:
        lines.append(f"| tuned / default | {num(ratios['startup'], '.3f')} | "
                     f"{num(ratios['graph_bytes'], '.3f')} | {num(ratios['capture_s'], '.3f')} "
                     "| | | " + " | ".join(num(ratios["tok_s"].get(c), ".3f") for c in levels)
                     + " |")
    measured = next((r["graph_bytes"] for r in rows if r["engine"] == "tuned"), None)
    if predicted_bytes and measured:
        lines.append(f"\nThe tuner's memory model put the tuned lists at {mib(predicted_bytes)}; "
                     f"the tuned server measured {mib(measured)} "
                     f"({measured / predicted_bytes:.2f}x the model).")
    for r in rows:
        if r.get("pools"):
            lines.append(f"\n{r['engine']}: spec bs {r['pools']['spec_bs']}, decode bs "
                         f"{r['pools']['decode_bs']}")
        if r.get("error"):
            lines.append(f"\n{r['engine']}: {r['error']}")
    return "\n".join(lines) + "\n"


def plot(ratios: dict, path: Path, note: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6))
    FigureCanvasAgg(fig)
    a, b = fig.subplots(1, 2)
    names = ["graph memory", "capture time", "start-up"]
    vals = [ratios["graph_bytes"], ratios["capture_s"], ratios["startup"]]
    a.bar(names, [v or 0 for v in vals], color="tab:blue")
    a.axhline(1.0, color="k", lw=0.8)
    a.set_ylabel("tuned / default")
    a.set_title("start-up cost")
    levels = sorted(ratios["tok_s"])
    b.bar([f"C={c}" for c in levels], [ratios["tok_s"][c] or 0 for c in levels],
          color="tab:green")
    b.axhline(1.0, color="k", lw=0.8)
    b.axhline(0.99, color="r", lw=0.8, ls="--")
    b.set_ylim(0.9, 1.1)
    b.set_title("tok/s, tuned / default")
    fig.suptitle(note, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def sweeps(w: Workload, vocab: int, repeats: int) -> list[dict]:
    """The same batches for both engines: every concurrency `repeats` times, shapes warmed once."""
    return [sweep_task(w, f"r{i}", vocab, warm_shapes=i == 0, seed=1000 + 10_000 * i)
            for i in range(repeats)]


def budgets(default: dict, m: Measurements, memory_bytes: int,
            capture_s: float) -> tuple[int, float, str]:
    """The user's budgets, each lowered to what the default server's lists cost, and where that
    cost came from. The tuner checks its model against the caps, so the default lists are priced
    by the same model; the servers' measured figures are the result, compared afterwards. A
    default server that reported no lists, or lists outside the measurements, is priced by what
    it measured."""
    pools = default.get("pools") or {}
    try:
        cost = modelled_cost(m, pools["spec_bs"], pools["decode_bs"]) \
            if pools.get("spec_bs") and pools.get("decode_bs") else None
    except TuningError:
        cost = None
    if cost is None:
        mem, secs, source = default["graph_bytes"], default["capture_s"], \
            "what the default server measured"
    else:
        mem, secs, source = cost.memory_bytes, cost.capture_s, \
            "the tuner's model of the default lists"
    return min(memory_bytes, mem or memory_bytes), min(capture_s, secs or capture_s), source


def parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m bench.sglang.capture_compare",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--measurements", required=True,
                    help="measurements.json of `make capture-measure ENGINE=sglang`")
    ap.add_argument("--accept-len", type=float, default=3.0)
    ap.add_argument("--memory-budget", default="1GiB")
    ap.add_argument("--time-budget", type=float, default=30.0, help="seconds of capture")
    ap.add_argument("--distribution", default=SERVED,
                    help="batch sizes to tune for: 'served' (the default server's step log over "
                         "this workload) or any capture-tune distribution, e.g. uniform:1-256")
    ap.add_argument("--spec-max-bs", type=positive_int,
                    default=Settings.from_env(os.environ).spec_max_bs,
                    help="the tuned spec pool's cap (default: the worker's DGW_SPEC_MAX_BS; "
                         "unset: the replays' crossover)")
    ap.add_argument("--workload", type=workload_arg, default="256x256@1,16,64,256")
    ap.add_argument("--repeats", type=positive_int, default=2)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per engine")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    try:
        ap = parser()              # reads DGW_SPEC_MAX_BS: a bad value is one line
    except DualGraphError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args = ap.parse_args(argv)
    # The default engine runs the default lists whatever the calling shell exports.
    os.environ.pop(BY_KEY["capture_config"].env, None)
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    w = args.workload
    steps = work / "default.steps.jsonl"
    served = args.distribution == SERVED
    try:
        m = load_measurements(args.measurements)
        memory = parse_size(args.memory_budget)
        top = m.sizes(Mode.DECODE)[-1]
        dist = None if served else parse_distribution(args.distribution, max_bs=top)
        if not 1.0 <= args.accept_len <= m.num_draft_tokens + 1:
            raise ConfigError(f"--accept-len {args.accept_len:g} is outside 1..K+1 = "
                              f"1..{m.num_draft_tokens + 1} for these measurements")
        if not args.time_budget > 0:
            raise ConfigError(f"--time-budget {args.time_budget:g}: give seconds > 0, e.g. 30")
    except DualGraphError as exc:        # before any engine starts
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shapes = llama3_8b_shapes()
    target, draft = write_dummy_pair(work / "models", shapes)
    tasks = sweeps(w, shapes.vocab_size, args.repeats)

    def run(name: str, env: dict) -> dict:
        spec = {"name": name, "engine_kwargs": engine_kwargs("dual", target, draft, radix=True,
                                                             log_level="warning"),
                "env": {"SGLANG_SIMULATE_ACC_LEN": str(args.accept_len)} | env, "tasks": tasks}
        res = run_child(work, spec, shim_dir=work / "shim", timeout=args.timeout_s)
        print(f"[compare] {name}: rc={res['returncode']} startup={res.get('startup_s')}",
              flush=True)
        return summary(name, res)

    steps.unlink(missing_ok=True)                   # the step log appends
    rows = [run("default", settings_env(step_log=steps) if served else {})]
    if not rows[0]["ok"]:
        print(f"error: the default server failed ({rows[0]['error'] or 'see default.log'}); "
              "nothing to tune against", file=sys.stderr)
        write_json({"rows": rows, "error": "default server failed"}, work / "compare.json")
        return 1
    mem_cap, time_cap, priced_by = budgets(rows[0], m, memory, args.time_budget)
    try:
        dist = dist or parse_distribution(f"steplog:{steps}", max_bs=top)
        result = tune(m, mem_cap, time_cap, dist, args.accept_len, spec_max_bs=args.spec_max_bs)
    except DualGraphError as exc:
        print(f"error: tuning under the default lists' cost failed: {exc}", file=sys.stderr)
        write_json({"rows": rows, "error": str(exc)}, work / "compare.json")
        return 1
    config_path = work / "config.json"
    save_capture_config(build_capture_config(m, result), config_path)
    (work / "tune.txt").write_text(result.table() + "\n")
    print(result.table())
    rows.append(run("tuned", settings_env(capture_config=config_path)))
    ratios = compare(*rows) if all(r["ok"] for r in rows) else None
    lowered = [name for name, cap, given in (("memory", mem_cap, memory),
                                              ("capture time", time_cap, args.time_budget))
               if cap < given]
    note = (f"{m.gpu.describe()}, SGLang 0.5.17, Llama-3-8B shape, DUMMY weights, accept length "
            f"FORCED to {args.accept_len:g}, triton attention, radix cache on, {w.name} T=0 "
            f"ignore_eos, median of {args.repeats} batches per C; tuned under memory "
            f"{mem_cap / 2**20:.0f} MiB and capture {time_cap:.1f} s (given {args.memory_budget}, "
            f"{args.time_budget:g} s; lowered to the default lists' cost by {priced_by}: "
            f"{', '.join(lowered) or 'neither'}), batch sizes {dist.description}, spec pool <= "
            f"{args.spec_max_bs or 'the crossover'}")
    write_json({"note": note, "rows": rows, "ratios": ratios,
                "budgets": {"memory_bytes": mem_cap, "capture_s": time_cap,
                            "priced_by": priced_by},
                "tuned": {"spec_bs": list(result.spec_bs), "decode_bs": list(result.decode_bs),
                          "model_bytes": result.chosen.memory_bytes}},
               work / "compare.json")
    text = report(rows, ratios, note, result.chosen.memory_bytes)
    (work / "report.md").write_text(text)
    if ratios:
        plot(ratios, work / "compare.png", note)
    print(text)
    return 0 if ratios else 1


if __name__ == "__main__":
    raise SystemExit(main())
