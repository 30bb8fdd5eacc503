"""BENCHMARK ONLY: the host's speed over a run, and a load that slows the host on purpose.

The policy matrix runs its engines one after another on a VM whose CPUs the host shares, so a
slow spell of the host can land on one engine's cells and not another's. ``Sampler`` runs a side
process that times a fixed piece of Python, then sleeps PERIOD_S (``{"t", "ms"}`` lines, with
``Placement``'s: which CPU each engine's scheduler ran on and every CPU's steal); ``during``
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
from typing import Optional, Sequence

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


SCHEDULER_COMM = "sglang::schedul"     # setproctitle's name, as /proc keeps 15 characters
RESCAN_EVERY = 8                        # samples between looks for new scheduler processes


def _stat_fields(pid: int) -> Optional[list[str]]:
    """/proc/PID/stat after the command name (fields 3 on), None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def scheduler_pids() -> list[int]:
    """The SGLang scheduler processes running now (every engine's, any parent)."""
    pids = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == SCHEDULER_COMM:
                pids.append(int(comm.parent.name))
        except (OSError, ValueError):
            continue
    return sorted(pids)


def cpu_steal() -> dict[int, int]:
    """Per CPU, the ticks its vCPU has waited on the host so far (/proc/stat's steal)."""
    out = {}
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            name, *values = line.split()
            if name.startswith("cpu") and name != "cpu" and len(values) >= 8:
                out[int(name[3:])] = int(values[7])
    except (OSError, ValueError):
        return {}
    return out


class Placement:
    """Where each engine's serving thread ran between two samples, and how long the host kept
    that CPU from the guest: per scheduler process (pid, its parent: the engine process, the
    CPU its main thread last ran on, the CPU ticks it used), and every CPU's steal ticks."""

    def __init__(self) -> None:
        self._pids: list[int] = []
        self._ticks: dict[int, int] = {}
        self._steal = cpu_steal()
        self._n = 0

    def sample(self) -> dict:
        if self._n % RESCAN_EVERY == 0:
            self._pids = scheduler_pids()
        self._n += 1
        sched = []
        for pid in self._pids:
            f = _stat_fields(pid)
            if f is None or len(f) < 37:
                continue
            ticks = int(f[11]) + int(f[12])
            sched.append([pid, int(f[1]), int(f[36]), ticks - self._ticks.get(pid, ticks)])
            self._ticks[pid] = ticks
        steal, before = cpu_steal(), self._steal
        self._steal = steal
        return {"sched": sched,
                "steal": {cpu: n - before[cpu] for cpu, n in steal.items()
                          if cpu in before and n > before[cpu]}}


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


def read(path: Path) -> list[tuple[float, float]]:
    """(wall time, probe ms) samples of a sampler's file, in order ([] without one)."""
    if not Path(path).exists():
        return []
    return [(d["t"], d["ms"]) for d in json_lines(path) if "t" in d and "ms" in d]


def read_placement(path: Path) -> list[dict]:
    """The samples of a sampler's file that carry Placement's fields, in order."""
    if not Path(path).exists():
        return []
    return [d for d in json_lines(path) if "t" in d and "sched" in d]


def placement_during(samples: Sequence[dict], engine_pid: int, t0: float,
                     t1: float) -> Optional[dict]:
    """Where the scheduler of the engine process `engine_pid` ran in ``[t0, t1]``: the CPUs it
    was seen on and the steal ticks of those CPUs; None where no sample saw it."""
    inside = [d for d in samples if t0 <= d["t"] <= t1]
    cpus = sorted({cpu for d in inside for _, parent, cpu, _ in d["sched"]
                   if parent == engine_pid})
    if not cpus:
        return None
    steal = sum(n for d in inside for cpu, n in d.get("steal", {}).items() if int(cpu) in cpus)
    return {"cpus": cpus, "steal": steal}


def during(samples: Sequence[tuple[float, float]], t0: float, t1: float,
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
