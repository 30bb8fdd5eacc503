"""Where the host waits: the CUDA API calls inside chosen NVTX ranges, longest first.

    python -m profiling.host_waits REPORT [--range stage:catch_up] [--min-us 100] [--top 15]
                                   [--json FILE]

REPORT is what `profiling.check` reads (.nsys-rep, its SQLite export, a torch trace); the ranges
are the worker's `step:*` and `stage:*` ones. A range that launches for tens of microseconds but
lasts milliseconds is waiting; the call that holds the time (a stream synchronize, a pageable
copy, a host allocation) names the wait.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from dual_graph_worker.core import nvtx_names as names
from dual_graph_worker.core.argtypes import (OneLineParser, non_negative_float, output_file,
                                             positive_int)
from dual_graph_worker.core.jsonio import write_json
from profiling.api_names import base_name
from profiling.errors import ProfileInputError
from profiling.events import Trace
from profiling.timeline import build_timeline


@dataclass(frozen=True)
class RangeWaits:
    name: str
    start_ns: int
    duration_us: float
    api_us: float                 # time inside CUDA API calls
    calls: int
    long_calls: tuple[tuple[str, float], ...]   # (API, us) at or over the threshold


@dataclass(frozen=True)
class ApiTotal:
    api: str
    count: int
    median_us: float
    max_us: float
    total_us: float


@dataclass(frozen=True)
class HostWaits:
    range_prefix: str
    min_us: float
    ranges: tuple[RangeWaits, ...]
    by_api: tuple[ApiTotal, ...]  # every call inside the ranges, by total time

    def to_json(self) -> dict:
        return asdict(self)


def host_waits(trace: Trace, range_prefix: str, min_us: float = 100.0) -> HostWaits:
    """The worker's step and stage ranges (as the checker's timeline reads them: top-level calls
    only, a driver call inside a runtime call counted once) whose NVTX text starts with
    `range_prefix`, each with the API calls inside it."""
    ranges: list[RangeWaits] = []
    per_api: dict[str, list[float]] = {}
    steps = build_timeline(trace).steps
    spans = [(names.step_name(st.mode, st.padded_bs, st.graph), st.start_ns, st.end_ns, st.calls)
             for st in steps]
    spans += [(names.stage_name(sp.name), sp.start_ns, sp.end_ns, sp.calls)
              for st in steps for sp in st.stages]
    for name, start, end, calls in sorted(spans, key=lambda s: s[1]):
        if not name.startswith(range_prefix):
            continue
        durations = [(base_name(c.name), (c.end_ns - c.start_ns) / 1e3) for c in calls]
        for api, us in durations:
            per_api.setdefault(api, []).append(us)
        long_calls = tuple(sorted(((a, round(us, 1)) for a, us in durations if us >= min_us),
                                  key=lambda x: -x[1]))
        ranges.append(RangeWaits(name, start, round((end - start) / 1e3, 1),
                                 round(sum(us for _, us in durations), 1), len(calls),
                                 long_calls))
    by_api = tuple(sorted((ApiTotal(a, len(v), round(statistics.median(v), 1),
                                    round(max(v), 1), round(sum(v), 1))
                           for a, v in per_api.items()), key=lambda t: -t.total_us))
    return HostWaits(range_prefix, min_us, tuple(ranges), by_api)


def format_waits(w: HostWaits, top: int = 15) -> str:
    if not w.ranges:
        return f"no NVTX range starts with {w.range_prefix!r}"
    durations = [r.duration_us for r in w.ranges]
    lines = [f"{len(w.ranges)} ranges {w.range_prefix!r}: median {statistics.median(durations):.1f}"
             f" us, max {max(durations):.1f} us; API time median "
             f"{statistics.median(r.api_us for r in w.ranges):.1f} us",
             "", "| API | calls | median us | max us | total us |", "|---|---|---|---|---|"]
    lines += [f"| {t.api} | {t.count} | {t.median_us} | {t.max_us} | {t.total_us} |"
              for t in w.by_api[:top]]
    longest = sorted(w.ranges, key=lambda r: -r.duration_us)[:top]
    lines += ["", f"longest ranges (calls >= {w.min_us:g} us):", "",
              "| range | us | API us | calls | long calls |", "|---|---|---|---|---|"]
    lines += [f"| {r.name} | {r.duration_us} | {r.api_us} | {r.calls} | "
              f"{', '.join(f'{a} {us}' for a, us in r.long_calls) or '-'} |" for r in longest]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = OneLineParser(prog="python -m profiling.host_waits", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", type=Path)
    ap.add_argument("--range", default="stage:catch_up", help="NVTX range name prefix")
    ap.add_argument("--min-us", type=non_negative_float, default=100.0,
                    help="list calls at least this long")
    ap.add_argument("--top", type=positive_int, default=15)
    ap.add_argument("--json", type=output_file, help="also write the result here")
    args = ap.parse_args(argv)
    from profiling.check import load_trace

    try:
        with tempfile.TemporaryDirectory() as work:
            trace = load_trace(args.report, Path(work))
    except ProfileInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    waits = host_waits(trace, args.range, args.min_us)
    print(format_waits(waits, args.top))
    if args.json:
        write_json(waits.to_json(), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
