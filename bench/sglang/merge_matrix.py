"""One policy matrix from several calls, each measuring every engine on its own cells (the device's
per-call limit splits a matrix; the calls may run on different machines): records, ratios, report
and heatmap as policy_matrix writes them. A cell measured by two calls, or whose engines come
from different calls, is an error: no ratio mixes calls. With --processes each call is one
process of every engine, as `policy_matrix --processes N` runs them: a cell measured by several
calls reads each engine's median over them, and each call must have measured all of the cell's
engines.

With --latest a worker cell measured by several calls is rated by the last of them (in the
order given) alone: its EAGLE-3 and plain records at that cell from earlier calls are dropped,
so a matrix can be brought up to date cell by cell after the worker changed.

With --swap ENGINE=DIR (one part) one engine's records come from DIR, another pass of that
engine on the same machine with the same settings (engines run in turn, one call each): a matrix
of the part's other engines and that pass. A worker pass may differ in its own DGW_* settings
(policy_matrix --dual-env): that is how a setting is rated against the same baselines, and the
matrix then carries the pass's. With --some-cells the pass may cover some of the part's cells
(one accept length, say): the matrix then rates those alone.

    python -m bench.sglang.merge_matrix --out DIR [--processes | --latest]
                                        [--swap ENGINE=DIR ... [--some-cells]] IN_DIR IN_DIR ...
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Optional

from bench.sglang.matrix_records import (ENGINES, LAUNCHED_TOGETHER, READINGS, cell_key,
                                         merged_workloads, per_cell_median, ratios, readings,
                                         repeated, short_pools, stored_settings,
                                         with_rounds_asked)
from bench.sglang.matrix_report import heatmap, matrix_report
from dual_graph_worker.core.argtypes import OneLineParser, output_dir
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.jsonio import read_json_object, write_json

# What merge reads of each part, and of each of its records.
PART_KEYS = {"note": str, "accepts": list, "workloads": list, "records": list}
RECORD_KEYS = ("engine", "accept_len", "input_len", "output_len", "concurrency", "tok_s")
WORKLOAD_KEYS = ("input_len", "output_len", "concurrency")


def read_part(folder: str) -> tuple[str, dict]:
    """(the part's name, its policy-matrix.json); ConfigError naming the folder and what is
    wrong."""
    path = Path(folder) / "policy-matrix.json"
    fix = "pass folders that policy_matrix --out wrote"
    m = read_json_object(path, f"part {folder}'s matrix", fix)
    for key, kind in PART_KEYS.items():
        if not isinstance(m.get(key), kind):
            raise ConfigError(f"part {folder}: {path} has no {key!r} {kind.__name__}; {fix}")
    for field, need in (("records", RECORD_KEYS), ("workloads", WORKLOAD_KEYS)):
        for r in m[field]:
            if not isinstance(r, dict) or (missing := [k for k in need if k not in r]):
                what = f"lacks {missing[0]!r}" if isinstance(r, dict) else "is no JSON object"
                raise ConfigError(f"part {folder}: one of the {field} in {path} {what}; {fix}")
    pools, asked = m.get("kv_pools") or {}, m.get("kv_asked")
    if not isinstance(pools, dict) or not (asked is None or isinstance(asked, int)):
        raise ConfigError(f"part {folder}: {path} has kv_pools {pools!r} and kv_asked {asked!r}, "
                          f"not an engine -> tokens object and a token count; {fix}")
    if short := short_pools(pools, asked):
        raise ConfigError(f"part {folder}: {short}; leave it out, or measure it again with "
                          "memory for every engine's pool")
    return Path(folder).name, m


def merge(parts: list[tuple[str, dict]], processes: bool = False, latest: bool = False) -> dict:
    """`parts`: (call name, its policy-matrix.json); raises ValueError on mixed settings, an
    engine two calls measured at one accept length (without `processes` or `latest`), a
    worker cell whose baseline only another call measured, or two parts of one name."""
    names = [name for name, _ in parts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"two parts are named {twice[0]!r} (a part is named by its folder): "
                         "their records would read as one call's; copy one to another name")
    first = parts[0][1]
    records, workload_lists = [], []
    for name, m in parts:
        # With --processes a cell's median spans calls, which must then time cells alike.
        if not _same_servers(m, first, processes):
            raise ValueError(f"{name} was measured with other settings than {parts[0][0]}")
        records += with_rounds_asked([r | {"call": name} for r in m["records"]
                                      if "from" not in r], m.get("settings"))
        workload_lists += m["workloads"]
    superseded, cells_again = _superseded(records) if latest else ([], 0)
    if superseded:
        dropped = {id(r) for r in superseded}
        records = [r for r in records if id(r) not in dropped]
    calls_of = _calls_of(records, processes)
    # Filled baselines only where no part measured the cell: the first such part's, each of its
    # processes (a part filled from a matrix run with --processes rates their median).
    filled: dict[tuple, list[dict]] = {}
    for name, m in parts:
        mine: dict[tuple, list[dict]] = {}
        for r in m["records"]:
            if "from" in r and cell_key(r) not in calls_of and cell_key(r) not in filled:
                mine.setdefault(cell_key(r), []).append(r)
        filled |= mine
    cells, other, any_repeats = [], {key: [] for key in READINGS}, repeated(records)
    for key, calls in calls_of.items():
        engine, a, i, o, c = key
        if engine != "dual":
            continue
        # Each engine's median over the calls that ran the worker here, a part's processes too.
        wanted = {key, ("eagle3", a, i, o, c), ("plain", None, i, o, c)}
        own = [r for r in records if r["call"] in calls and cell_key(r) in wanted]
        here = own + [r for k in wanted for r in filled.get(k, [])]
        cells += ratios(per_cell_median(here))
        if any_repeats:
            for reading, read in readings(here).items():
                other[reading] += read
    merged_calls = sorted({r["call"] for r in records})
    records += [r for rs in filled.values() for r in rs]
    how = " (each one process of every engine; a cell several measured reads their median)" \
        if processes else ""
    together = [name for name, m in parts if LAUNCHED_TOGETHER in m["note"]]
    note = f"{_servers_note(first)}; merged from {len(merged_calls)} calls{how}: " \
        + ", ".join(merged_calls) \
        + (f"; engines launched together in {', '.join(together)}" if together else "")
    if superseded:
        note += (f"; {cells_again} worker cells measured again by a later call, which rates "
                 f"them ({len(superseded)} earlier records dropped)")
    workloads = merged_workloads(workload_lists, [])
    return {"note": note, "accepts": sorted({a for _, m in parts for a in m["accepts"]}),
            "workloads": [w.to_json() for w in workloads],
            "records": records, "cells": cells,
            **{key: c for key, c in other.items() if c},
            # How short cells were repeated is each call's own (without --processes every ratio
            # is within a call).
            "settings": _servers(first) | {"short_cells": {
                name: (m.get("settings") or {}).get("short_cells") for name, m in parts}},
            "startup_s": {name: m.get("startup_s") for name, m in parts}}


def _same_servers(a: dict, b: dict, processes: bool = False) -> bool:
    """Two matrices measured on servers alike (with `processes`, their cells timed alike too)."""
    read = _settings if processes else _servers
    return read(a) == read(b) and _servers_note(a) == _servers_note(b)


def _servers(matrix: dict) -> dict:
    """The settings that make the servers what they are (not how cells were repeated)."""
    before = _settings(matrix)
    settings = {k: before[k] for k in ("host_load", "interleave", "pin_cpus", "radix_cache",
                                       "acc_sampling", "gpu", "freeze_gc")} \
        | (matrix.get("settings") or {})
    return {k: v for k, v in settings.items() if k not in ("short_cells", "rounds")}


def _settings(matrix: dict) -> dict:
    """Every setting of the matrix, those it predates as its note (less how its engines were
    launched) tells them."""
    note = (matrix.get("note") or "").replace(LAUNCHED_TOGETHER, "")
    return stored_settings(matrix | {"note": note})


# The note's account of the worker's DGW_* settings (policy_matrix's), which a worker pass may
# change (swapped).
_WORKER_CLAUSE = re.compile(r"worker at its defaults(?: \+ \{[^}]*\})?")


def _worker_free(matrix: dict) -> dict:
    """`matrix` as its baselines' servers were, whatever the worker's own settings."""
    settings = {k: v for k, v in (matrix.get("settings") or {}).items() if k != "dual_env"}
    return matrix | {"settings": settings,
                     "note": _WORKER_CLAUSE.sub("worker at its defaults", matrix["note"])}


def _with_worker_of(note: str, settings: dict, other: dict) -> tuple[str, dict]:
    """A matrix's `note` and `settings` with `other`'s worker settings."""
    worker = _WORKER_CLAUSE.search(other["note"])
    if worker:
        note = _WORKER_CLAUSE.sub(worker.group(0), note)
    return note, settings | {"dual_env": stored_settings(other)["dual_env"]}


def _servers_note(matrix: dict) -> str:
    """The matrix's note less how its engines were launched."""
    return matrix["note"].replace(LAUNCHED_TOGETHER, "")


def _superseded(records: list[dict]) -> tuple[list[dict], int]:
    """The records a later call replaced, and how many worker cells: at each worker cell
    (accept, workload, C) several calls measured, the worker's and EAGLE-3's of every call but
    the last, and an earlier call's plain record there once none of its worker cells at that
    workload and C is kept. Raises ValueError where the last call did not measure both of the
    cell's baselines itself (the cell an earlier call measured whole would go for one that
    cannot be rated)."""
    calls: dict[tuple, list[str]] = {}
    for r in records:                        # in the parts' order: the last call wins
        if r["engine"] == "dual":
            calls.setdefault(cell_key(r)[1:], []).append(r["call"])
    measured = {(r["call"], *cell_key(r)) for r in records}
    again = {cell: names[-1] for cell, names in calls.items() if len(set(names)) > 1}
    for (a, i, o, c), name in again.items():
        for need in (("plain", None, i, o, c), ("eagle3", a, i, o, c)):
            if (name, *need) not in measured:
                raise ValueError(f"{name} measured the worker at {(a, i, o, c)} again but not "
                                 f"its {need[0]} baseline: --latest would drop the whole cell "
                                 "an earlier call measured")
    gone = [r for r in records if r["engine"] != "plain"
            and again.get(cell_key(r)[1:], r["call"]) != r["call"]]
    dropped = {id(r) for r in gone}
    ran = {(r["call"], *cell_key(r)[2:]) for r in records if r["engine"] == "dual"}
    unrated = ran - {(r["call"], *cell_key(r)[2:]) for r in records
                     if r["engine"] == "dual" and id(r) not in dropped}
    return gone + [r for r in records if r["engine"] == "plain"
                   and (r["call"], *cell_key(r)[2:]) in unrated], len(again)


def _calls_of(records: list[dict], processes: bool) -> dict[tuple, set]:
    """The calls that measured each (engine, accept, cell); raises ValueError where a worker
    cell's baseline was measured, but not by every call that ran the worker there (its ratio
    would mix calls), or, without `processes`, an engine at one accept length by two calls
    (plain may be: each call rates its own accept lengths)."""
    calls: dict[tuple, set] = {}
    for r in records:
        calls.setdefault(cell_key(r), set()).add(r["call"])
    for key, measured in calls.items():
        engine, a, i, o, c = key
        if engine != "plain" and len(measured) > 1 and not processes:
            raise ValueError(f"{sorted(measured)} all measured {engine} at {(a, i, o, c)}")
        if engine != "dual":
            continue
        for need in (("plain", None, i, o, c), ("eagle3", a, i, o, c)):
            others = calls.get(need, set())
            if others and not measured <= others:
                raise ValueError(f"the worker at {(a, i, o, c)} was measured by "
                                 f"{sorted(measured)}, its {need[0]} baseline by "
                                 f"{sorted(others)}: that ratio would mix calls")
    return calls


def swapped(part: tuple[str, dict], swaps: list[tuple[str, str]],
            some_cells: bool = False) -> tuple[str, dict]:
    """`part` with each (engine, folder) of `swaps` giving that engine's records: those of the
    pass in the folder (read_part), which must have been measured as the part was, at each of
    the part's cells (with `some_cells`, the cells it measured: the others are dropped); the
    note names the passes."""
    base, matrix = part
    records, note, settings = matrix["records"], matrix["note"], matrix.get("settings") or {}
    for engine, folder in swaps:
        name, other = read_part(folder)
        mine = [r for r in other["records"] if r["engine"] == engine and "from" not in r]
        if not mine:
            raise ConfigError(f"--swap {engine}={folder}: its matrix holds no {engine} records; "
                              "name the folder of that engine's pass")
        worker = engine == "dual"
        if not (_same_servers(_worker_free(other), _worker_free(matrix)) if worker
                else _same_servers(other, matrix)):
            raise ConfigError(f"--swap {engine}={folder}: measured with other settings than "
                              f"{base}")
        before = [r for r in records if r["engine"] == engine and "from" not in r]
        missing = sorted({cell_key(r) for r in before} - {cell_key(r) for r in mine}, key=str)
        if missing and some_cells:
            kept = {cell_key(r)[1:] for r in mine}
            records = [r for r in records if r["engine"] == "plain" or cell_key(r)[1:] in kept]
            matrix = matrix | {"accepts": sorted({a for a, *_ in kept})}
            note += f"; only the {len(kept)} cells {name} measured"
        elif missing:
            raise ConfigError(f"--swap {engine}={folder}: the pass lacks {len(missing)} of "
                              f"{base}'s {engine} cells (first: {missing[0][1:]}); swap a pass "
                              "of every cell, or pass --some-cells to rate the cells it has")
        records = [r for r in records if r["engine"] != engine] + mine
        note += f"; {engine} from {name}"
        if worker:
            note, settings = _with_worker_of(note, settings, other)
    return base, matrix | {"records": records, "note": note, "settings": settings}


def parsed_swaps(given: list[str], parts: int, some_cells: bool) -> list[tuple[str, str]]:
    """--swap's ENGINE=DIR values as (engine, folder), each engine once, over one part; with
    `some_cells`, the worker's pass alone."""
    if given and parts > 1:
        raise ConfigError("--swap takes one part: a pass's cells would be rated against "
                          "several calls' baselines")
    swaps = []
    for swap in given:
        engine, sep, folder = swap.partition("=")
        if not sep or engine not in ENGINES:
            raise ConfigError(f"--swap {swap}: expected ENGINE=DIR with ENGINE one of "
                              f"{', '.join(ENGINES)}")
        swaps.append((engine, folder))
    if len({engine for engine, _ in swaps}) < len(swaps):
        raise ConfigError("--swap names one engine twice: swap each engine once")
    if some_cells and (not swaps or any(engine != "dual" for engine, _ in swaps)):
        raise ConfigError("--some-cells rates a worker pass's cells: name it with --swap dual=DIR "
                          "(alone: a baseline's pass of some cells would leave the others "
                          "unrated)")
    return swaps


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(prog="python -m bench.sglang.merge_matrix", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=output_dir, required=True, help="folder to write into")
    ap.add_argument("--processes", action="store_true",
                    help="each call is one process of every engine: cells measured by several "
                         "read each engine's median")
    ap.add_argument("--latest", action="store_true",
                    help="a worker cell several calls measured is rated by the last of them "
                         "(in the order given); the earlier calls' records there are dropped")
    ap.add_argument("--swap", action="append", default=[], metavar="ENGINE=DIR",
                    help="ENGINE's records from DIR's matrix (another pass of it), not the parts'")
    ap.add_argument("--some-cells", action="store_true",
                    help="with --swap: a pass of some of the part's cells, the matrix rates those")
    ap.add_argument("parts", nargs="+", help="folders holding a policy-matrix.json each")
    args = ap.parse_args(argv)
    if args.processes and args.latest:
        print("error: --processes reads a cell's median over calls, --latest its last call: "
              "pick one", file=sys.stderr)
        return 2
    try:
        swaps = parsed_swaps(args.swap, len(args.parts), args.some_cells)
        parts = [read_part(p) for p in args.parts]
        if swaps:
            parts = [swapped(parts[0], swaps, args.some_cells)]
        matrix = merge(parts, args.processes, args.latest)
    except ValueError as err:          # ConfigError is one
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    write_json(matrix, out / "policy-matrix.json")
    columns = merged_workloads(matrix["workloads"], [])
    text = matrix_report(matrix["cells"], {key: matrix.get(key) for key in READINGS},
                         matrix["records"], matrix["accepts"], columns, matrix["note"])
    (out / "report.md").write_text(text)
    heatmap(matrix["cells"], matrix["accepts"], columns, out / "heatmap.png", matrix["note"])
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
