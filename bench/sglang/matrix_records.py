"""The policy matrix's records: the workloads that make its columns, the settings that define
its servers (and those a matrix predates, read from its note), an engine run's results as
records, an interleaved cell's rounds and a cell's processes merged into one record, baselines
filled from another run, and the ratios worker / max(plain, EAGLE-3) with their other readings.
policy_matrix.py files them as it runs; merge_matrix.py merges several calls' files.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from bench.sglang.engine_child import median_run, summed_deltas
from dual_graph_worker.core.errors import ConfigError

# The matrix's engines: plain SGLang, its EAGLE-3, the dual-graph worker.
ENGINES = ("plain", "eagle3", "dual")

@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    concurrency: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.input_len}x{self.output_len}"

    def to_json(self) -> dict:
        return {"input_len": self.input_len, "output_len": self.output_len,
                "concurrency": list(self.concurrency)}

    @classmethod
    def from_json(cls, d: dict) -> "Workload":
        return cls(d["input_len"], d["output_len"], tuple(d["concurrency"]))

    @classmethod
    def parse(cls, text: str) -> "Workload":
        """'256x256@1,4,8' -> Workload(256, 256, (1, 4, 8))."""
        try:
            shape, levels = text.split("@")
            i, o = shape.split("x")
            conc = tuple(int(c) for c in levels.split(","))
            if min(int(i), int(o), *conc) < 1:
                raise ValueError
            return cls(int(i), int(o), conc)
        except ValueError:
            raise ConfigError(f"bad workload {text!r}; write IN x OUT @ C,C,... as "
                              "256x256@1,4,8") from None


@dataclass(frozen=True)
class Repeats:
    """A cell whose first run is shorter than `short_s` runs `runs` times in all (fresh
    prompts each time); its tok/s is their median."""

    short_s: float = 2.0
    runs: int = 3


def workload_arg(text: str) -> Workload:
    """argparse type of a --workload: Workload.parse, its refusal as argparse's one line."""
    try:
        return Workload.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def merged_workloads(earlier: list[dict], workloads: list[Workload]) -> list[Workload]:
    """The columns of a matrix built over several runs into one DIR: each workload's levels,
    those of earlier runs included, in the order first seen."""
    merged: dict[str, Workload] = {}
    for w in [Workload.from_json(d) for d in earlier] + workloads:
        old = merged.get(w.name)
        levels = sorted(set(w.concurrency) | set(old.concurrency if old else ()))
        merged[w.name] = Workload(w.input_len, w.output_len, tuple(levels))
    return list(merged.values())


# How the engines came up, not what they are: calls that differ only here may be merged.
LAUNCHED_TOGETHER = " (launched together)"

# What a matrix without a "settings" record was measured with (every run before it: triton).
SETTINGS_BEFORE = {"attention_backend": "triton", "dual_env": {},
                   "short_cells": {"below_s": 0.0, "runs": 1}, "host_load": 0,
                   "interleave": False, "rounds": 1, "pin_cpus": None, "freeze_gc": False}


def short_pools(kv_pools: dict, asked: Optional[int]) -> str:
    """Empty where every engine got the KV pool asked of it (or none was asked); else a line
    naming each engine's pool, for the report's top and the heatmap: an engine short of KV
    retracts and queues requests, so its cells at high concurrency measure memory, not the
    policy (SGLang shrinks a pool when memory is short, with a warning only)."""
    short = {name: got for name, got in kv_pools.items()
             if asked and got is not None and got < asked}
    if not short:
        return ""
    pools = ", ".join(f"{name} {got if got is not None else '?'}"
                      for name, got in sorted(kv_pools.items()))
    return (f"NOT LIKE FOR LIKE: KV pools of {pools} tokens, {asked} asked of each; "
            f"{', '.join(sorted(short))} short: its cells at high concurrency measure memory, "
            "not the policy")


def settings_in_note(note: str) -> dict:
    """The GPU, radix cache and accept sampling of a matrix whose settings predate them, read
    from its note, which has named them from the first run (None where it does not)."""
    radix = True if "radix cache on" in note else False if "radix cache off" in note else None
    # Before --acc-sampling the note named no sampling: SGLang's own draw was the only one.
    acc = ("diffused" if "error-diffused" in note else
           "sglang" if "drawn at random" in note or "switched in-process)" in note else None)
    return {"radix_cache": radix, "acc_sampling": acc,
            "gpu": note.split(",", 1)[0] if note else None}


def stored_settings(matrix: dict) -> dict:
    """A matrix's settings, those its file predates at what they were then."""
    return (SETTINGS_BEFORE | settings_in_note(matrix.get("note") or "")
            | (matrix.get("settings") or {}))


def other_settings(matrix: dict, settings: dict, keys: tuple[str, ...]) -> Optional[str]:
    """Why `matrix`'s records may not sit beside this run's, or None when they may."""
    theirs = stored_settings(matrix)
    diff = [k for k in keys if theirs.get(k) != settings[k]]
    if not diff:
        return None
    flags = {"attention_backend": "--attention-backend", "dual_env": "--dual-env",
             "short_cells": "--short-cell-s/--short-cell-runs", "host_load": "--host-load",
             "interleave": "--interleave", "rounds": "--rounds", "pin_cpus": "--pin-cpus",
             "radix_cache": "--radix-cache", "acc_sampling": "--acc-sampling", "gpu": "GPU",
             "freeze_gc": "--freeze-gc"}
    return (f"was measured with {', '.join(f'{flags[k]} {theirs[k]!r}' for k in diff)}: use "
            "the same or another --out")


def records(kind: str, res: dict, workloads: list[Workload]) -> list:
    out = []
    by_name = {w.name: w for w in workloads}
    for name, task in (res.get("tasks") or {}).items():
        if not isinstance(task, dict) or "points" not in task:
            continue
        name, _, round_ = name.partition("#r")
        accept, _, wname = name.partition("-") if kind != "plain" else (None, "", name)
        w = by_name.get(wname)
        if w is None:
            continue
        for p in task["points"]:
            rec = {"accept_len": None if accept is None else float(accept[1:]),
                   "input_len": w.input_len, "output_len": w.output_len,
                   "concurrency": int(p["concurrency"]), "engine": kind,
                   "tok_s": round(float(p["tok_s"]), 2), "seconds": round(p["seconds"], 4)}
            for key in ("runs_tok_s", "seconds_total", "output_tokens_total", "t_start",
                        "t_end", "runs_t", "host_load"):
                if key in p:
                    rec[key] = p[key]
            if p.get("dual_graph"):
                rec["dual_graph"] = p["dual_graph"]
            if p.get("machine"):
                rec["machine"] = p["machine"]
            if round_:
                rec |= {"round": int(round_), "output_tokens": p.get("output_tokens")}
            out.append(rec)
    return merged_rounds(out)


def merged_rounds(recs: list[dict]) -> list[dict]:
    """An interleaved cell's rounds as one record, as a short cell's repeats make one: the
    median round's tok/s (the slower middle one of an even count), every round's in
    `runs_tok_s` and its span in `runs_t` (`t_start`-`t_end` span them all, the other engines'
    turns between included); the machine as in the first round with the CPU time of all, the
    worker's counters summed and its cost model as after the last. A cell cut short (an engine
    gone, the budget spent) has fewer `rounds` than the run's."""
    groups: dict[tuple, list[dict]] = {}
    for r in recs:
        groups.setdefault(cell_key(r) + (r["engine"],), []).append(r)
    out = []
    for rs in groups.values():
        rounds = sorted((r for r in rs if "round" in r), key=lambda r: r["round"])
        out += [r for r in rs if "round" not in r]
        if not rounds:
            continue
        middle = median_run(rounds, lambda r: r["tok_s"])
        first, last = rounds[0], rounds[-1]
        merged = {k: v for k, v in first.items()
                  if k not in ("round", "dual_graph", "output_tokens")} | {
            "tok_s": middle["tok_s"], "seconds": middle["seconds"],
            "runs_tok_s": [r["tok_s"] for r in rounds],
            "runs_t": [[r["t_start"], r["t_end"]] for r in rounds],
            "t_end": last["t_end"], "rounds": len(rounds),
            "seconds_total": round(sum(r["seconds"] for r in rounds), 4),
            "output_tokens_total": sum(r["output_tokens"] or 0 for r in rounds)}
        cpu = [(r.get("machine") or {}).get("cpu_s") for r in rounds]
        if "machine" in first:
            machine = merged["machine"] = first["machine"] | {
                "cpu_s": None if None in cpu else sum(cpu),
                "bench_gc_ms": _summed_pauses([(r.get("machine") or {}).get("bench_gc_ms")
                                               for r in rounds])}
            if machine["bench_gc_ms"] is None:
                del machine["bench_gc_ms"]
        if "dual_graph" in last:
            merged["dual_graph"] = summed_deltas([r.get("dual_graph") for r in rounds])
        out.append(merged)
    return out


def _summed_pauses(rounds: list[Optional[dict]]) -> Optional[dict]:
    """Rounds' collection pauses (GcPauses.take's) as one: counts and times summed, the
    longest kept; None where a round has none."""
    if not rounds or None in rounds:
        return None
    return {gen: [sum(r[gen][0] for r in rounds), round(sum(r[gen][1] for r in rounds), 3),
                  max(r[gen][2] for r in rounds)] for gen in rounds[0]}


def per_cell_median(recs: list[dict]) -> list[dict]:
    """One record per (engine, cell): its processes' median run (median_run: the slower middle
    one of an even count, as rounds and repeats read), that process's record whole, every
    process's tok/s kept in `tok_s_processes` where there are several."""
    groups: dict[tuple, list[dict]] = {}
    for r in recs:
        groups.setdefault(cell_key(r) + (r.get("from"),), []).append(r)
    out = []
    for rs in groups.values():
        if len(rs) == 1:
            out.append(rs[0])
            continue
        out.append(median_run(rs, lambda r: r["tok_s"])
                   | {"tok_s_processes": [r["tok_s"] for r in rs]})
    return out


def cell_key(r: dict) -> tuple:
    """(engine, accept length (None for plain), input, output, concurrency) of a record."""
    return (r["engine"], r["accept_len"], r["input_len"], r["output_len"], r["concurrency"])


def fill_from(recs: list[dict], earlier: list[dict], source: str) -> list[dict]:
    """Records of an earlier run for the (engine, cell)s this run did not measure, each marked
    with its source: a baseline too slow to re-run where it loses by far, never the worker."""
    have = {cell_key(r) for r in recs}
    return recs + [{"from": source} | r for r in earlier       # a record's first source kept
                   if r["engine"] != "dual" and cell_key(r) not in have]


def ratios(recs: list[dict]) -> list[dict]:
    """worker / max(plain, EAGLE-3) per (accept, workload, concurrency) that all three ran;
    `cross_run` where a baseline was filled from another matrix (--fill-from); `rounds`, the
    fewest any of its engines ran, where they ran in rounds, and `cut_short` where that is
    fewer than their call asked."""
    plain = {(r["input_len"], r["output_len"], r["concurrency"]): r
             for r in recs if r["engine"] == "plain"}
    keyed = {cell_key(r): r for r in recs if r["engine"] != "plain"}
    out = []
    for (engine, a, i, o, c), rec in sorted(keyed.items(), key=lambda kv: str(kv[0])):
        if engine != "dual" or (i, o, c) not in plain or ("eagle3", a, i, o, c) not in keyed:
            continue
        base = (plain[(i, o, c)], keyed[("eagle3", a, i, o, c)])
        best = max(b["tok_s"] for b in base)
        cell = {"accept_len": a, "input_len": i, "output_len": o, "concurrency": c,
                "plain": base[0]["tok_s"], "eagle3": base[1]["tok_s"],
                "dual": rec["tok_s"], "ratio": round(rec["tok_s"] / best, 4)}
        if any("from" in b for b in base):
            cell["cross_run"] = True
        ran = [r["rounds"] for r in (rec, *base) if "rounds" in r]
        asked = [r["rounds_asked"] for r in (rec, *base) if "rounds_asked" in r]
        if ran:
            cell["rounds"] = min(ran)
            if asked and min(ran) < max(asked):
                cell["cut_short"] = True
        out.append(cell)
    return out


def repeated(recs: list[dict]) -> bool:
    return any("runs_tok_s" in r for r in recs)


def first_runs(recs: list[dict]) -> list[dict]:
    """The records with each repeated cell's tok/s its first run's (the worker's later runs
    find it warmed to that batch; the static engines keep no state)."""
    return [_one_run(r) | {"tok_s": r["runs_tok_s"][0]} if "runs_tok_s" in r else r
            for r in recs]


def best_runs(recs: list[dict]) -> list[dict]:
    """The records with each repeated cell's tok/s its fastest run's (its rounds, or its
    repeats in one process): a host's slow spells only ever slow a run, so this reading is the
    least exposed to them. A cell cut short keeps its mark: it had fewer runs to be fast in."""
    return [r | {"tok_s": max(r["runs_tok_s"])} if "runs_tok_s" in r else r for r in recs]


# The grid's other readings of repeated cells: the matrix JSON's key, the records' reading, and
# the report's heading. The grid itself (each engine's median run) is the one rated.
READINGS = {
    "cells_first_run": (first_runs, "Each repeated cell's first run alone"),
    "cells_best_run": (best_runs, "Each engine's fastest run of a cell (the reading least "
                                  "exposed to the host's slow spells)"),
}


def readings(recs: list[dict]) -> dict[str, list[dict]]:
    """Each of READINGS' cells of `recs`."""
    return {key: ratios(per_cell_median(read(recs))) for key, (read, _) in READINGS.items()}


def other_readings(recs: list[dict]) -> dict[str, list[dict]]:
    """READINGS' cells of `recs` ({} where no cell was repeated)."""
    if not repeated(recs):
        return {}
    return {key: c for key, c in readings(recs).items() if c}


def _one_run(rec: dict) -> dict:
    """A record read as one run: no round of it was cut short."""
    return {k: v for k, v in rec.items() if k not in ("rounds", "rounds_asked")}


def with_rounds_asked(recs: list[dict], settings: Optional[dict]) -> list[dict]:
    """Each of a call's records made of rounds with the rounds the call asked (its settings),
    so that a merged matrix tells a round cut short from a call that asked fewer."""
    asked = (settings or {}).get("rounds", 1)
    return [r | {"rounds_asked": asked} if "rounds" in r else r for r in recs]
