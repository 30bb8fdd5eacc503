"""Measured step costs from a worker's step log (DGW_STEP_LOG "cost" events), grouped by mode,
padded batch size and the step's place in its run since the last switch, with the steps whose
cost also held the next batch's launch (a switch, a catch-up, a prefill: overlap scheduling)
apart: whether steps near a switch cost more than the steady ones, and by how much (also within
each run, against its own steady steps). With
--cells (an engine's JSON from the policy matrix, whose points carry their wall-clock window):
per cell, the steps by mode and reason, median step ms per (mode, padded bs), catch-ups and
prefill seconds, and in a cell that mostly decoded what speculating cost beyond decoding the
same tokens (a re-measurement's whole price): where a cell's time went. The controller's cost terms, where the log has them
("estimates" lines, every 64 steps), follow as a table over time; with --host-speed, the spec
steps over time beside the host's speed. Stretches of a few slow steps in a row are listed with
the catch-up or prefill before each. With --trace, the log's batch
costs in order as the replay trace tests/test_controller_h200_trace.py reads.

    python -m bench.sglang.step_costs STEP_LOG [--cells DIR/dual.json] [--out FILE.md]
                                      [--host-speed DIR/host-speed.jsonl]
                                      [--trace FILE.json.gz --source TEXT]

With --out, the grouped step costs also go to FILE.json and a plot to FILE.png.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from bisect import bisect_right
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np

from bench.plots import Panel, Series, line_chart
from bench.sglang import host_speed
from dual_graph_worker.core.argtypes import OneLineParser, output_file
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.jsonio import read_json_object, write_json
from dual_graph_worker.core.jsonl import json_lines

PLACES = ("1st", "2nd-4th", "5th+", "carries next")


def _place(index_in_run: int) -> str:
    return PLACES[0] if index_in_run == 0 else PLACES[1] if index_in_run < 4 else PLACES[2]


def _step_runs(events: Iterable[dict]) -> Iterator[tuple[int, int, dict]]:
    """(run, place in it from 0, event) of each step cost; a run ends where the mode changes."""
    run, place, last_mode = -1, 0, None
    for e in events:
        if e.get("event") != "cost" or e.get("kind") != "StepTime":
            continue
        if e["mode"] != last_mode:
            run, place, last_mode = run + 1, 0, e["mode"]
        else:
            place += 1
        yield run, place, e


def _clean(e: dict) -> bool:
    """A step's own cost: no catch-up in it, and it held no next launch."""
    return not e.get("catch_up_tokens") and not e.get("carries_next")


def group_costs(events: Iterable[dict]) -> dict[tuple[str, int, str], list[float]]:
    """(mode, padded bs, place in run) -> step seconds, catch-up steps left out."""
    out: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    for _, place, e in _step_runs(events):
        if not e.get("catch_up_tokens"):
            label = PLACES[3] if e.get("carries_next") else _place(place)
            out[(e["mode"], int(e["padded_bs"]), label)].append(float(e["seconds"]))
    return out


def report(groups: dict[tuple[str, int, str], list[float]]) -> str:
    lines = ["| mode | padded bs | " + " | ".join(f"{p}: median ms (n)" for p in PLACES) + " |",
             "|---|---|" + "---|" * len(PLACES)]
    for mode, bs in sorted({(m, b) for m, b, _ in groups}):
        cells = []
        for p in PLACES:
            xs = groups.get((mode, bs, p), [])
            cells.append(f"{1e3 * statistics.median(xs):.2f} ({len(xs)})" if xs else "-")
        lines.append(f"| {mode} | {bs} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cells(engine: dict) -> list[tuple[str, dict, Optional[float]]]:
    """(label, point, forced accept length or None) per measured cell of an engine_child
    result, in run order."""
    out, accept = [], None
    for name, task in (engine.get("tasks") or {}).items():
        if "accept_len" in task and "points" not in task:
            accept = task["accept_len"]
            continue
        for p in task.get("points", []):
            label = (f"a{accept:g} " if accept is not None else "") + \
                f"{task['input_len']}x{task['output_len']} C={p['concurrency']}" + \
                (f" round {name.partition('#r')[2]}" if "#r" in name else "")
            out.append((label, p, accept))
    return sorted(out, key=lambda c: c[1]["t_start"])


def own_choice(steps: dict[str, list[float]], bs: int, accept: Optional[float]) -> str:
    """Each mode's ms per output token from the cell's own median steps (the size with most
    samples; spec at the forced accept length), and the faster: whether the worker's choice
    matched its own process's speeds, whatever another engine's process ran at."""
    per_token = {}
    for mode, tokens in (("s", (accept or 0.0) * bs), ("d", float(bs))):
        sizes = [v for k, v in steps.items() if k[0] == mode and len(v) >= 3]
        if sizes and tokens > 0:
            per_token[mode] = 1e3 * statistics.median(max(sizes, key=len)) / tokens
    if len(per_token) < 2:
        return "-"
    faster = min(per_token, key=per_token.get)
    return f"{per_token['s']:.3f} / {per_token['d']:.3f}: {faster}"


def launch_medians(log: list[dict]) -> dict[tuple[str, int], float]:
    """Per (mode, padded bs), the median host time of SGLang's forward call over the log."""
    launches: dict[tuple[str, int], list[float]] = defaultdict(list)
    for e in log:
        if e.get("launch_us"):
            launches[(e["mode"], e["padded_bs"])].append(e["launch_us"])
    return {k: statistics.median(v) for k, v in launches.items()}


def speculation_over_decoding(inside: list[dict]) -> Optional[float]:
    """Seconds a cell that mostly decoded spent speculating beyond decoding the same tokens, over
    all its runs: its spec steps, and the decode steps that held a switch into speculation (the
    next batch cost being a spec step's: a catch-up's launch, not a prefill's), less the decode
    steps they stand for (a spec step: its tokens a request, at the decode size its batch ran
    at) at the cell's median clean decode step of that size (of any size where it has under 3).
    None where the cell mostly speculated or has no clean decode step: a re-measurement's whole
    price."""
    records = [e for e in inside if "step" in e]
    costs = [e for e in inside if e.get("event") == "cost"]
    clean: dict[int, list[float]] = defaultdict(list)
    for e in costs:
        if e["kind"] == "StepTime" and e["mode"] == "decode" and not e.get("carries_next") \
                and not e.get("catch_up_tokens"):
            clean[e["padded_bs"]].append(e["seconds"])
    spec = [e for e in records if e["mode"] == "spec" and e.get("bs")]
    if not clean or 2 * len(spec) >= len(records):
        return None
    every = statistics.median(v for vs in clean.values() for v in vs)
    step = {bs: statistics.median(v) if len(v) >= 3 else every for bs, v in clean.items()}
    decode_at = {e.get("bs"): e["padded_bs"] for e in records if e["mode"] == "decode"}
    spent = replaced = 0.0
    for e, nxt in zip(costs, costs[1:] + [{}]):
        if e["kind"] != "StepTime":
            continue
        if e["mode"] == "spec":
            spent += e["seconds"]
        elif e.get("carries_next") and nxt.get("kind") == "StepTime" and nxt["mode"] == "spec":
            spent += e["seconds"]
            replaced += step.get(e["padded_bs"], every)
    for e in spec:
        replaced += e["tokens"] / e["bs"] * step.get(decode_at.get(e["bs"]), every)
    return spent - replaced


def longest_idle(costs: list[dict], spans: list[list[float]]) -> Optional[tuple[float, str]]:
    """The longest stretch of a cell's runs (`spans`, [start, end] each) in which the worker
    ran no step and no prefill, and where it lay (head: before the first, tail: after the
    last, gap: between two, run: a whole run): a head or tail is the client's and the
    tokenizer manager's time, a gap SGLang's scheduler's between two batches too. None without
    a timed step or prefill in any run."""
    busy = sorted((e["t"] - e["seconds"], e["t"]) for e in costs
                  if e.get("kind") in ("StepTime", "PrefillTime"))
    stretches = []
    for start, end in spans:
        mine = [b for b in busy if start <= b[1] and b[0] <= end]
        if not mine:
            stretches.append((end - start, "run"))
            continue
        stretches += [(mine[0][0] - start, "head"), (end - max(e for _, e in mine), "tail")]
        reach = mine[0][1]
        for b0, b1 in mine[1:]:
            stretches.append((b0 - reach, "gap"))
            reach = max(reach, b1)
    if not busy or not stretches:
        return None
    length, where = max(stretches)
    return max(length, 0.0), where


def cell_lines(log: list[dict], point: dict) -> list[dict]:
    """The step log's lines from a cell's start to its end (`point`: the engine JSON's)."""
    return [e for e in log if point["t_start"] <= e.get("t", -1) <= point["t_end"]]


def cell_report(log: list[dict], engine: dict) -> str:
    """One row per cell from the step log's lines (step records and events). How fast its
    spec steps' host work ran: the median of their launch times over their sizes' medians in
    the whole log (at small batches a spec step is mostly that host time)."""
    lines = ["| cell | tok/s | wall s | steps by mode/reason | median step ms (n) by mode+bs | "
             "own ms/token, spec / decode: faster | catch-ups: n, tokens, ms | prefill s | "
             "spec launch / its size's median | speculation over decoding: ms over the runs "
             "(share of their seconds) | longest idle ms (where) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    typical = launch_medians(log)
    for label, p, accept in cells(engine):
        inside = cell_lines(log, p)
        reasons: dict[str, int] = defaultdict(int)
        slowdown = []
        for e in inside:
            if "step" in e:
                reasons[f"{e['mode']}/{e['reason']}"] += 1
                if e.get("launch_us") and e["mode"] == "spec":
                    slowdown.append(e["launch_us"] / typical[(e["mode"], e["padded_bs"])])
        costs = [e for e in inside if e.get("event") == "cost"]
        steps: dict[str, list[float]] = defaultdict(list)
        ups = []
        for e in costs:
            if e["kind"] != "StepTime":
                continue
            if e.get("catch_up_tokens"):
                ups.append((e["catch_up_tokens"], e["seconds"]))
            elif not e.get("carries_next"):
                steps[f"{e['mode'][0]}{e['padded_bs']}"].append(e["seconds"])
        med = ", ".join(f"{k} {1e3 * statistics.median(v):.2f} ({len(v)})"
                        for k, v in sorted(steps.items()) if len(v) >= 3)
        prefill = sum(e["seconds"] for e in costs if e["kind"] == "PrefillTime")
        up = (f"{len(ups)}, {sum(t for t, _ in ups)}, {1e3 * sum(s for _, s in ups):.1f}"
              if ups else "-")
        over = speculation_over_decoding(inside)
        idle = longest_idle(costs, p.get("runs_t") or [[p["t_start"], p["t_end"]]])
        wall = p.get("seconds_total") or p["seconds"]
        lines.append(f"| {label} | {p['tok_s']:.0f} | {p['seconds']:.2f} | "
                     + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
                     + f" | {med} | {own_choice(steps, p['concurrency'], accept)} | {up} | "
                     f"{prefill:.3f} | "
                     + (f"{statistics.median(slowdown):.2f} |" if slowdown else "- |")
                     + (" - |" if over is None else f" {1e3 * over:.0f}"
                        + (f" ({over / wall:.1%}) |" if wall else " |"))
                     + (" - |" if idle is None else f" {1e3 * idle[0]:.0f} ({idle[1]}) |"))
    return "\n".join(lines) + "\n"


def kv_check_report(log: list[dict]) -> str:
    """DGW_CATCH_UP_KV_CHECK's catch-ups: how far the K/V-only fill's K/V were from the whole
    layer's (largest relative difference of a catch-up's split passes); empty without them."""
    checked = [e for e in log if e.get("event") == "catch_up" and e.get("kv_error") is not None]
    if not checked:
        return ""
    errors = [e["kv_error"] for e in checked]
    return ("\nK/V-only catch-ups checked against the whole layer (DGW_CATCH_UP_KV_CHECK): "
            f"{len(checked)} catch-ups, {sum(e['tokens'] for e in checked)} tokens; largest "
            f"relative K/V difference: median {statistics.median(errors):.2e}, "
            f"max {max(errors):.2e}\n")


def prefill_choices(inside: list[dict]) -> Optional[str]:
    """A cell's prefill_choice lines as one table cell: how many prefills ran the draft's prefill
    of how many, how many of them previewed the policy (the rest could not defer), and what the
    first preview saw (the batch it grew to, the requests queued behind it, the prompt tokens
    priced) and priced (both modes' goodputs, tok/s)."""
    chosen = [e for e in inside if e.get("event") == "prefill_choice"]
    if not chosen:
        return None
    previews = [e for e in chosen if "bs" in e]
    text = f"{sum(e['draft'] for e in chosen)} / {len(chosen)}, {len(previews)} previewed"
    if not previews:
        return text
    first = previews[0]
    spec, decode = first.get("goodput_spec"), first.get("goodput_decode")
    priced = "-" if spec is None or decode is None else f"{spec:.0f} / {decode:.0f}"
    return (f"{text}; bs {first['bs']}, {first['queued']} queued, {first['priced_tokens']} "
            f"tokens, {priced}")


def prefill_report(log: list[dict], engine: dict) -> str:
    """Per cell, its prefills' draft choices (prefill_choices); empty for a log without them
    (a worker that wrote none)."""
    rows = []
    for label, p, _ in cells(engine):
        got = prefill_choices(cell_lines(log, p))
        if got is not None:
            rows.append(f"| {label} | {got} |")
    if not rows:
        return ""
    return ("\nEach cell's prefills: those that ran the draft's prefill (the rest deferred it) of "
            "all, and how many previewed the policy (the rest could not defer); the first "
            "preview: the batch it grew to, the requests queued behind it, the prompt tokens "
            "priced, speculation's / decoding's priced tok/s.\n\n"
            "| cell | drafted / prefills, previewed; the first preview |\n|---|---|\n"
            + "\n".join(rows) + "\n")


# The controller's scalar cost terms a step log's "estimates" lines carry, as table columns:
# key, heading, scale, format.
ESTIMATE_COLUMNS = (("prompt_per_output", "prompt / output", 1.0, "{:.2f}"),
                    ("replaced", "prompts replacing", 1.0, "{:.2f}"),
                    ("draft_prefill_s_per_token", "draft prefill us/token", 1e6, "{:.2f}"),
                    ("catch_up_fixed_s", "catch-up fixed ms", 1e3, "{:.3f}"),
                    ("catch_up_s_per_token", "catch-up us/token", 1e6, "{:.2f}"),
                    ("kv_catch_up_fixed_s", "K/V-only catch-up fixed ms", 1e3, "{:.3f}"),
                    ("kv_catch_up_s_per_token", "K/V-only catch-up us/token", 1e6, "{:.2f}"),
                    ("switch_s", "switch ms", 1e3, "{:.3f}"),
                    ("fresh_accept", "new request accept", 1.0, "{:.2f}"),
                    ("own_accept_weight", "own accept weight", 1.0, "{:.2f}"),
                    ("run_len", "run length", 1.0, "{:.1f}"),
                    ("explore_allowance_steps", "explore allowance", 1.0, "{:.2f}"),
                    ("explore_debt_steps", "explore debt", 1.0, "{:.2f}"),
                    ("alloc_retries", "cudaMalloc retries", 1.0, "{:.0f}"),
                    ("reserved_gib", "reserved GiB", 1.0, "{:.1f}"))


def estimates_report(log: list[dict], rows: int = 40) -> str:
    """The controller's cost terms over time (at most `rows` of its lines, evenly spaced)."""
    lines = [e for e in log if e.get("event") == "estimates"]
    if not lines:
        return ""
    t0 = lines[0]["t"]
    picked = lines[::max(1, -(-len(lines) // rows))]
    out = ["| s since first | " + " | ".join(c[1] for c in ESTIMATE_COLUMNS) + " |",
           "|---|" + "---|" * len(ESTIMATE_COLUMNS)]
    for e in picked:
        cells = ["-" if e.get(key) is None else fmt.format(scale * e[key])
                 for key, _, scale, fmt in ESTIMATE_COLUMNS]
        out.append(f"| {e['t'] - t0:.1f} | " + " | ".join(cells) + " |")
    return (f"\nThe controller's cost terms ({len(picked)} of {len(lines)} lines):\n\n"
            + "\n".join(out) + "\n")


def host_report(log: list[dict]) -> str:
    """The worker's own host time per step, by mode and padded batch: before the launch
    (plan_us) and in the verify hook (hook_us), median and 99th percentile, and SGLang's
    launch of the step (launch_us, in logs that have it); the step log writer's slow writes.
    Empty for a log without them."""
    by: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for d in log:
        if "step" in d and "plan_us" in d:
            by.setdefault((d["mode"], d["padded_bs"]), []).append(
                (d["plan_us"], d["hook_us"], d.get("launch_us", float("nan"))))
    if not by:
        return ""
    lines = ["\nThe worker's host time per step (us, median / p99), and SGLang's launch:\n",
             "| mode | padded bs | steps | before launch | verify hook | launch |",
             "|---|---|---|---|---|---|"]
    for (mode, pb), v in sorted(by.items()):
        plan, hook, launch = (np.array(x) for x in zip(*v))
        lines.append(f"| {mode} | {pb} | {len(v)} | {_spread_us(plan)} | {_spread_us(hook)} | "
                     f"{_spread_us(launch)} |")
    writes = [d for d in log if d.get("event") == "log_writes"]
    if writes:
        lines.append(f"\nStep log writes over 1 ms (off the serving thread): "
                     f"{sum(d['slow'] for d in writes)} of {writes[-1]['lines']}, the slowest "
                     f"{max(d['max_ms'] for d in writes):.1f} ms.")
    return "\n".join(lines) + "\n"


def _spread_us(values: np.ndarray) -> str:
    values = values[~np.isnan(values)]
    return f"{np.median(values):.0f} / {np.percentile(values, 99):.0f}" if values.size else "-"


# A run's settling steps (these places since its switch) against its next steady ones.
SETTLING, SETTLED = (2, 8), (9, 16)


def settling_ratios(events: Iterable[dict]) -> dict[str, list[float]]:
    """mode -> per run after a switch and padded size in it with steps at SETTLING places and at
    least 4 at SETTLED places: the mean seconds of the first over that of the second (catch-up
    steps and those holding the next launch left out). Within one run, so a slow spell at
    another time in the log never reads as a switch's cost; the log's first run (the process's
    slow first steps) is no switch's."""
    runs: dict[int, list[tuple[str, int, int, float]]] = defaultdict(list)
    for run, place, e in _step_runs(events):
        if run and place < SETTLED[1] and _clean(e):
            runs[run].append((e["mode"], int(e["padded_bs"]), place + 1, float(e["seconds"])))
    out: dict[str, list[float]] = defaultdict(list)
    for steps in runs.values():
        for bs in {b for _, b, _, _ in steps}:
            early = [s for _, b, p, s in steps if b == bs and SETTLING[0] <= p <= SETTLING[1]]
            late = [s for _, b, p, s in steps if b == bs and SETTLED[0] <= p <= SETTLED[1]]
            if early and len(late) >= 4:
                out[steps[0][0]].append((sum(early) / len(early)) / (sum(late) / len(late)))
    return out


def settling_report(events: Iterable[dict]) -> str:
    ratios = settling_ratios(events)
    if not ratios:
        return ""
    lines = [f"\nA switch's settling steps: per run, its places {SETTLING[0]}-{SETTLING[1]} over "
             f"its places {SETTLED[0]}-{SETTLED[1]} at the same size\n",
             "| mode | runs x sizes | median | 10th-90th percentile |", "|---|---|---|---|"]
    for mode, xs in sorted(ratios.items()):
        lo, hi = np.percentile(xs, [10, 90])
        lines.append(f"| {mode} | {len(xs)} | {statistics.median(xs):.3f} | "
                     f"{lo:.3f}-{hi:.3f} |")
    return "\n".join(lines) + "\n"


SPELL_BIN_S = 5.0


def spells_report(log: list[dict], host: Sequence[host_speed.HostSample]) -> str:
    """Over time (SPELL_BIN_S bins from the log's first cost): the worker's spec steps at sizes
    up to 16 over their size's median in the whole log, its planning us, SGLang's launch us (nan
    in logs without it) and the side sampler's host probe ms (host_speed.py): a slow spell of
    the steps that neither the probe nor the launch shares lies on the device."""
    costs = [e for _, _, e in _step_runs(log)
             if e["mode"] == "spec" and e["padded_bs"] <= 16 and _clean(e)]
    if not costs or not host:
        return ""
    by_size: dict[int, list[float]] = defaultdict(list)
    for e in costs:
        by_size[e["padded_bs"]].append(e["seconds"])
    median = {b: statistics.median(v) for b, v in by_size.items()}
    t0 = costs[0]["t"]
    columns = ("ratio", "plan_us", "launch_us", "host_ms")
    bins: dict[int, dict[str, list[float]]] = defaultdict(lambda: {c: [] for c in columns})

    def at(t: float) -> dict[str, list[float]]:
        return bins[int((t - t0) // SPELL_BIN_S)]

    for e in costs:
        at(e["t"])["ratio"].append(e["seconds"] / median[e["padded_bs"]])
    for d in log:
        if "step" in d and d.get("mode") == "spec" and "plan_us" in d and d["t"] >= t0:
            at(d["t"])["plan_us"].append(d["plan_us"])
            at(d["t"])["launch_us"] += [d["launch_us"]] if "launch_us" in d else []
    for t, ms in host:
        if t >= t0:
            at(t)["host_ms"].append(ms)
    rows = [(k, *(statistics.median(b[c]) if b[c] else float("nan") for c in columns))
            for k, b in sorted(bins.items()) if len(b["ratio"]) >= 20 and b["host_ms"]]
    if not rows:
        return ""
    lines = [f"\nSpec steps (padded bs <= 16) over their size's median, by {SPELL_BIN_S:g} s of "
             "the run, beside the worker's planning, SGLang's launch and the host probe:\n",
             "| s | spec step / median | planning us | launch us | host probe ms |",
             "|---|---|---|---|---|"]
    lines += [f"| {k * SPELL_BIN_S:.0f} | {r:.3f} | {p:.0f} | "
              f"{'-' if np.isnan(la) else f'{la:.0f}'} | {h:.1f} |" for k, r, p, la, h in rows]
    if len(rows) >= 8:
        corr = np.corrcoef([r[1] for r in rows], [r[4] for r in rows])[0, 1]
        lines.append(f"\nCorrelation of the step ratio with the host probe over the bins: "
                     f"{corr:+.2f}.")
    return "\n".join(lines) + "\n"


# A stretch: this many clean steps of one mode in a row, each this much over its own median.
STRETCH_STEPS = 3
STRETCH_RATIO = 1.15
# A context holds its own median from this many clean steps (a spell is seldom as long).
STRETCH_KNOWN = 32


def _context_bucket(e: dict) -> tuple[str, int, int]:
    """(mode, padded bs, context tokens' power of two): steps alike but for noise."""
    return e["mode"], int(e["padded_bs"]), int(e.get("kv_tokens") or 0).bit_length()


def slow_stretches(log: list[dict]) -> list[dict]:
    """Runs of at least STRETCH_STEPS clean steps in a row, each at least STRETCH_RATIO times
    the median of its mode, padded size and context (a power of two) over the whole log (where
    that holds fewer than STRETCH_KNOWN steps, the nearest shorter context's), with the
    catch-up or prefill the step log shows last before the run: a few slow steps the
    controller may learn as the cost of their context."""
    steps = [e for _, _, e in _step_runs(log)]
    by: dict[tuple, list[float]] = defaultdict(list)
    for e in steps:
        if _clean(e):
            by[_context_bucket(e)].append(e["seconds"])
    known = {k: statistics.median(v) for k, v in by.items() if len(v) >= STRETCH_KNOWN}
    # A context met too rarely to hold its own median takes the nearest shorter one's: the
    # steps of a spell at a new context would otherwise be their own reference.
    median = {k: known.get(k) or next((known[k[:2] + (b,)] for b in range(k[2] - 1, -1, -1)
                                       if k[:2] + (b,) in known), None) for k in by}
    runs: list[list[dict]] = [[]]
    for e in steps:
        if not _clean(e):                  # a catch-up's own step neither joins nor ends a run
            continue
        ref = median.get(_context_bucket(e))
        slow = ref is not None and e["seconds"] >= STRETCH_RATIO * ref
        if runs[-1] and (not slow or runs[-1][-1]["mode"] != e["mode"]):
            runs.append([])
        if slow:
            runs[-1].append(e)
    stretches = [r for r in runs if len(r) >= STRETCH_STEPS]
    before = [e for e in log if e.get("event") == "catch_up"
              or (e.get("event") == "cost" and e.get("kind") == "PrefillTime")]
    times = [e["t"] for e in before]
    out = []
    for r in stretches:
        first = r[0]
        k = bisect_right(times, first["t"])
        out.append({"t": first["t"], "mode": first["mode"], "padded_bs": int(first["padded_bs"]),
                    "kv_tokens": first.get("kv_tokens"), "steps": len(r),
                    "ratio": statistics.median(e["seconds"] / median[_context_bucket(e)]
                                               for e in r),
                    "after": _came_before(before[k - 1], first["t"]) if k else "-"})
    return out


def _came_before(e: dict, t: float) -> str:
    """A catch-up event or prefill cost as the stretch table names it."""
    what = f"prefill of {e['tokens']}"
    if e.get("event") == "catch_up":
        layer = "K/V only" if "kv" in e.get("host_us", {}) else "whole layer"
        what = f"catch-up of {e['tokens']} ({layer})"
    return f"{what}, {t - e['t']:.2f} s before"


def stretches_report(log: list[dict], engine: Optional[dict] = None) -> str:
    """slow_stretches as a table, each in its cell where the engine's JSON is given."""
    rows = slow_stretches(log)
    if not rows:
        return ""
    spans = [(p["t_start"], p["t_end"], label) for label, p, _ in cells(engine)] if engine \
        else []
    t0 = next(e["t"] for e in log if "t" in e)
    lines = [f"\nStretches of {STRETCH_STEPS}+ clean steps in a row at >= {STRETCH_RATIO:g}x "
             "the median of their mode, size and context (power of two) over the log, and what "
             "the log shows last before each:\n",
             "| s | cell | mode+bs | context | steps | median ratio | after |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cell = next((label for a, b, label in spans if a <= r["t"] <= b), "-")
        lines.append(f"| {r['t'] - t0:.1f} | {cell} | {r['mode'][0]}{r['padded_bs']} | "
                     f"{r['kv_tokens']} | {r['steps']} | {r['ratio']:.2f} | {r['after']} |")
    return "\n".join(lines) + "\n"


def full_report(log: list[dict], engine: Optional[dict] = None,
                host: Optional[Sequence[host_speed.HostSample]] = None) -> str:
    """The per-place table of a step log's lines, with the engine's JSON the per-cell one, the
    worker's host time per step, and the controller's cost terms over time where the log has
    them."""
    text = report(group_costs(log)) + settling_report(log)
    if engine is not None:
        text += "\n" + cell_report(log, engine) + prefill_report(log, engine)
    return text + host_report(log) + spells_report(log, host or []) \
        + stretches_report(log, engine) + estimates_report(log) + kv_check_report(log)


def trace(log: list[dict], source: str) -> dict:
    """Every batch cost the controller observed, in order, with the worker's graph lists, its
    start-up prior and the draft's share of the weights (where its log has it): step rows
    [s/d, padded bs, seconds, catch-up tokens, carries next, context tokens, bs], prefill rows
    [p, tokens, seconds, draft]."""
    ready = next((e for e in log if e.get("event") == "ready"), None)
    if ready is None:
        raise ValueError("no 'ready' line: not a worker's step log from its start")
    costs = []
    for e in log:
        if e.get("event") != "cost":
            continue
        if e.get("kind") == "StepTime":
            costs.append([e["mode"][0], e["padded_bs"], e["seconds"], e["catch_up_tokens"],
                          int(e["carries_next"]), e["kv_tokens"], e.get("bs", 0)])
        elif e.get("kind") == "PrefillTime":
            costs.append(["p", e["tokens"], e["seconds"], int(e["draft"])])
    engine = {k: ready[k] for k in ("draft_share", "catch_up_work") if ready.get(k) is not None}
    return {"source": source, "num_steps": ready["num_steps"], "spec_bs": ready["spec_bs"],
            "decode_bs": ready["decode_bs"], "costs": costs, "calibration": ready["calibration"],
            **engine}


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(prog="python -m bench.sglang.step_costs", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step_log")
    ap.add_argument("--cells", metavar="ENGINE_JSON",
                    help="the worker's engine JSON of the same run (policy matrix DIR/dual.json)")
    ap.add_argument("--out", type=output_file,
                    help="also write the report here (FILE.md), with FILE.json and FILE.png")
    ap.add_argument("--trace", type=output_file, metavar="FILE.json.gz",
                    help="write the replay trace here")
    ap.add_argument("--source", default="", help="the trace's provenance line")
    ap.add_argument("--host-speed", metavar="JSONL",
                    help="the matrix's host-speed samples (DIR/host-speed.jsonl): the worker's "
                         "spec steps over time beside the host's speed")
    args = ap.parse_args(argv)
    if args.out and Path(args.out).suffix == ".json":
        ap.error(f"--out {args.out}: the report is markdown and its grouped costs go to "
                 "FILE.json beside it; pass FILE.md")
    if not Path(args.step_log).is_file():
        ap.error(f"{args.step_log}: no such step log; run the worker with DGW_STEP_LOG=PATH")
    engine = None
    if args.cells:
        try:
            engine = read_json_object(args.cells, "--cells",
                                      "pass the policy matrix's DIR/dual.json of the same run")
        except ConfigError as e:
            ap.error(str(e))
    if args.host_speed and not Path(args.host_speed).is_file():
        ap.error(f"--host-speed {args.host_speed}: no such file")
    try:
        costs, text, rows = _analyse(args, engine)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        ap.error(f"{args.step_log}: not a worker step log from its start ({type(e).__name__}: "
                 f"{e}); pass a DGW_STEP_LOG file (and --cells, --host-speed of the same run)")
    return _write(args, costs, text, rows)


def _analyse(args: argparse.Namespace, engine: Optional[Mapping]
             ) -> tuple[Optional[dict], Optional[str], Optional[list[dict]]]:
    """main's reading of the step log: the trace (--trace), the report and its rows (--out, or
    without --trace); None for what was not asked."""
    log = list(json_lines(args.step_log))                        # step records and events
    costs = trace(log, args.source) if args.trace else None
    if args.trace and not args.out:
        return costs, None, None
    text = full_report(log, engine, host_speed.read(args.host_speed) if args.host_speed else None)
    rows = [{"mode": m, "padded_bs": b, "place": p, "steps": len(xs),
             "median_ms": 1e3 * statistics.median(xs)}
            for (m, b, p), xs in sorted(group_costs(log).items())] if args.out else None
    return costs, text, rows


def _write(args: argparse.Namespace, costs: Optional[dict], text: Optional[str],
           rows: Optional[list[dict]]) -> int:
    """main's writing of what _analyse made."""
    if costs is not None:
        Path(args.trace).parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(args.trace, "wt") as f:
            json.dump(costs, f, separators=(",", ":"))
        print(f"wrote {args.trace}: {len(costs['costs'])} costs")
    if text is None:
        return 0
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        write_json(rows, out.with_suffix(".json"))
        _plot(rows, out.with_suffix(".png"))
    print(text, end="")
    return 0


def _plot(rows: list[dict], path: Path) -> Path:
    series = []
    for mode in sorted({r["mode"] for r in rows}):
        for place in PLACES:
            mine = [r for r in rows if r["mode"] == mode and r["place"] == place]   # bs sorted
            if mine:
                series.append(Series(f"{mode}, {place}", [r["padded_bs"] for r in mine],
                                     [r["median_ms"] for r in mine],
                                     dashed=place != PLACES[2]))
    return line_chart(path, "Measured step costs by place in the run since the last switch "
                      "(catch-up steps left out)", "padded batch size",
                      [Panel("median ms a step", series, log_y=True)], log2_x=True)


if __name__ == "__main__":
    raise SystemExit(main())
