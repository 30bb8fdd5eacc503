"""What one full garbage collection costs a process that holds SGLang's modules, as the bench's
engine process does (it runs SGLang's tokenizer manager): the modules imported one after another,
each step's live objects and full-collection milliseconds, then the same after gc.freeze() (what
SGLang's Engine.freeze_gc and `policy_matrix --freeze-gc` do). A module that does not import here
is named and passed over. CPU only; prints a table, writes JSON and a plot beside it (.png).

    python -m bench.sglang.gc_cost [--out out/gc-cost.json] [--collections 3] [--modules A,B]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import platform
import statistics
import time
import warnings
from pathlib import Path

from bench.plots import Panel, Series, line_chart
from dual_graph_worker.core.argtypes import OneLineParser, int_range, output_file
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.provenance import checkout_commit, command_line

# In the order a server's main process brings them in.
MODULES = ("torch", "transformers", "sglang.srt.server_args", "sglang.srt.managers.io_struct",
           "sglang.srt.managers.scheduler", "sglang.srt.managers.tokenizer_manager",
           "sglang.srt.entrypoints.engine")


def full_collection_ms(collections: int) -> float:
    """The median milliseconds of `collections` full collections, back to back."""
    times = []
    for _ in range(collections):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m bench.sglang.gc_cost", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=output_file, default="out/gc-cost.json",
                    help="JSON to write (and the plot beside it, .png)")
    ap.add_argument("--collections", type=int_range(1, 50), default=3,
                    help="full collections timed a step (their median)")
    ap.add_argument("--modules", default=",".join(MODULES),
                    help="modules to import, in order (default: %(default)s)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")             # SGLang's CPU-platform warnings
    rows, missing = [], []
    for name in [m.strip() for m in args.modules.split(",") if m.strip()]:
        try:
            importlib.import_module(name)
        except Exception as exc:                  # a dependency this machine lacks
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
            continue
        gc.collect()
        rows.append({"imported": name, "objects": len(gc.get_objects()),
                     "full_gc_ms": round(full_collection_ms(args.collections), 2)})
    gc.freeze()
    frozen = {"objects_frozen": gc.get_freeze_count(),
              "full_gc_ms": round(full_collection_ms(args.collections), 3)}
    print(f"{'imported':40} {'objects':>9} {'full gc ms':>10}")
    for r in rows:
        print(f"{r['imported']:40} {r['objects']:9d} {r['full_gc_ms']:10.1f}")
    print(f"{'after gc.freeze()':40} {frozen['objects_frozen']:9d} {frozen['full_gc_ms']:10.3f}"
          "  (objects frozen)")
    for line in missing:
        print(f"not imported here: {line}")
    out = Path(args.out)
    write_json({"command": command_line("python -m bench.sglang.gc_cost", argv),
                "commit": checkout_commit(), "machine": platform.processor() or
                platform.machine(), "python": platform.python_version(),
                "collections": args.collections, "rows": rows, "frozen": frozen,
                "not_imported": missing}, out)
    png = line_chart(out.with_suffix(".png"), "One full collection as the heap grows "
                     f"(median of {args.collections})", "live objects",
                     [Panel("ms", [Series("before gc.freeze()", [r["objects"] for r in rows],
                                          [r["full_gc_ms"] for r in rows]),
                                   Series("after gc.freeze()", [frozen["objects_frozen"]],
                                          [frozen["full_gc_ms"]], joined=False)])])
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
