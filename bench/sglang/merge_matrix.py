"""One policy matrix from several calls on one machine, each measuring every engine on its own
cells (the device's per-call limit splits a matrix): records, ratios, report and heatmap as
policy_matrix writes them. A cell measured by two calls, or whose engines come from different
calls, is an error: no ratio mixes calls.

    python -m bench.sglang.merge_matrix --out DIR IN_DIR IN_DIR ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from bench.sglang.policy_matrix import (cell_key, fill_from, heatmap, merged_workloads,
                                       per_cell_median, ratios, report)


def merge(parts: list[tuple[str, dict]]) -> dict:
    """`parts`: (call name, its policy-matrix.json); raises ValueError on mixed settings or a
    cell measured twice."""
    first = parts[0][1]
    records, workload_lists, seen = [], [], {}
    for name, m in parts:
        if m.get("settings") != first.get("settings") or m["note"] != first["note"]:
            raise ValueError(f"{name} was measured with other settings than {parts[0][0]}")
        for r in m["records"]:
            if "from" in r:           # a baseline filled from another run: below
                continue
            key = cell_key(r) + (r.get("process"),)
            if key in seen:
                raise ValueError(f"{name} and {seen[key]} both measured {key}")
            seen[key] = name
            records.append(r | {"call": name})
        workload_lists += m["workloads"]
    # Filled baselines only where no part measured the cell (the first part's, if several).
    filled: dict[tuple, dict] = {}
    for _, m in parts:
        for r in m["records"]:
            if "from" in r:
                filled.setdefault(cell_key(r), r)
    records = fill_from(records, list(filled.values()), "")
    workloads = merged_workloads(workload_lists, [])
    cells = ratios(per_cell_median(records))
    calls = {r["call"] for r in records if "call" in r}
    for c in cells:
        cell = (c["input_len"], c["output_len"], c["concurrency"])
        calls_of_cell = {call for key, call in seen.items()
                         if key[2:5] == cell and key[1] in (None, c["accept_len"])}
        if len(calls_of_cell) > 1:
            raise ValueError(f"cell {c} mixes calls {sorted(calls_of_cell)}")
    accepts = sorted({a for _, m in parts for a in m["accepts"]})
    note = f"{first['note']}; merged from {len(calls)} calls on one machine: " \
           + ", ".join(sorted(calls))
    return {"note": note, "accepts": accepts,
            "workloads": [w.__dict__ | {"concurrency": list(w.concurrency)} for w in workloads],
            "records": records, "cells": cells, "settings": first.get("settings"),
            "startup_s": {name: m.get("startup_s") for name, m in parts}}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sglang.merge_matrix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("parts", nargs="+", help="folders holding a policy-matrix.json each")
    args = ap.parse_args(argv)
    try:
        parts = [(Path(p).name, json.loads((Path(p) / "policy-matrix.json").read_text()))
                 for p in args.parts]
        matrix = merge(parts)
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "policy-matrix.json").write_text(json.dumps(matrix, indent=1))
    columns = merged_workloads(matrix["workloads"], [])
    text = report(matrix["cells"], matrix["accepts"], columns, matrix["note"])
    (out / "report.md").write_text(text)
    heatmap(matrix["cells"], matrix["accepts"], columns, out / "heatmap.png", matrix["note"])
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
