"""BENCHMARK ONLY: the host's speed over a run, and a load that slows the host on purpose.

The policy matrix runs its engines one after another on a VM whose CPUs the host shares, so a
slow spell of the host can land on one engine's cells and not another's. ``Sampler`` runs a side
process that times a fixed piece of Python, then sleeps PERIOD_S (``{"t", "ms"}`` lines, with
placement.py's fields: which CPU each engine's scheduler ran on, every CPU's steal); ``during``
reads the host's speed over one cell or run from them. ``Hogs(k)`` spins k processes while a cell
runs. On the H200 16 of them slowed the probe 1.9x but an engine's serving thread little (why
is not measured), so they load the host more than the serving thread.

    python -m bench.sglang.host_speed FILE [--period S]     # the sampler, until killed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

from bench.sglang.placement import Placement
from dual_graph_worker.core.jsonl import json_lines

PERIOD_S = 0.25
REPO_ROOT = Path(__file__).resolve().parents[2]


def probe_ms() -> float:
    """The median of three runs of a fixed piece of Python work, in ms: the host's speed now."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        sum(i * i for i in range(200_000))
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


class _Processes:
    """Child processes that live as long as a ``with`` block; each prints one byte once it runs
    (so the block starts with them running) and exits when its parent is gone."""

    def __init__(self, commands: Sequence[list[str]]) -> None:
        self._commands = commands
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> "_Processes":
        try:
            for c in self._commands:
                self._procs.append(subprocess.Popen(c, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.PIPE))
            for p in self._procs:
                p.stdout.read(1)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for p in self._procs:
            p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
        self._procs = []


class Sampler(_Processes):
    """The host-speed side process, appending to `path` for as long as the block runs: a probe,
    then `period_s` of sleep (~4-7% of one core on the H200's host)."""

    def __init__(self, path: Path, period_s: float = PERIOD_S) -> None:
        super().__init__([[sys.executable, "-m", "bench.sglang.host_speed",
                           str(Path(path).resolve()), "--period", str(period_s),
                           "--parent", str(os.getpid())]])


class Hogs(_Processes):
    """`count` processes spinning on the CPU for as long as the block runs (0: none)."""

    def __init__(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"host load must be >= 0 processes, got {count}")
        super().__init__([[sys.executable, "-c", _SPIN, str(os.getpid())]] * count)


# Spin until the parent goes: a hog must not outlive an engine process killed at its deadline.
_SPIN = ("import os, sys\np = int(sys.argv[1])\nsys.stdout.write('r')\nsys.stdout.flush()\n"
         "while os.getppid() == p:\n    pass\n")


class HostSample(NamedTuple):
    """One probe of the host's speed."""

    t: float        # wall time
    ms: float       # the probe's milliseconds


def read(path: Path) -> list[HostSample]:
    """A sampler's file's samples, in order ([] without one)."""
    if not Path(path).exists():
        return []
    return [HostSample(d["t"], d["ms"]) for d in json_lines(path) if "t" in d and "ms" in d]


def during(samples: Sequence[HostSample], t0: float, t1: float,
           within_s: float = 4 * PERIOD_S) -> Optional[float]:
    """The median probe ms taken in ``[t0, t1]``; for a span between two samples the nearest
    one's within `within_s` of it; else None (no sampler, or it had stopped)."""
    inside = [ms for t, ms in samples if t0 <= t <= t1]
    if inside:
        return round(statistics.median(inside), 2)
    near = [(min(abs(t - t0), abs(t - t1)), ms) for t, ms in samples]
    best = min(near, default=None)
    return None if best is None or best[0] > within_s else round(best[1], 2)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sglang.host_speed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--period", type=float, default=PERIOD_S)
    ap.add_argument("--parent", type=int,
                    help="the pid of the process that started it: stop once it is no longer "
                         "the parent")
    args = ap.parse_args(argv)
    parent = args.parent or os.getppid()
    sys.stdout.write("r")           # running (_Processes waits for it)
    sys.stdout.flush()
    placement = Placement()
    with open(args.file, "a") as fh:
        while os.getppid() == parent:
            fh.write(json.dumps({"t": time.time(), "ms": round(probe_ms(), 3)}
                                | placement.sample()) + "\n")
            fh.flush()
            time.sleep(args.period)
    return 0


if __name__ == "__main__":
    sys.exit(main())
