"""BENCHMARK ONLY: where each engine's SGLang scheduler runs, and what the host takes from the
guest's CPUs (/proc): `Placement` samples both for the host-speed sampler's lines; a matrix run
reads each run's from them (`placement_during`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from dual_graph_worker.core.jsonl import json_lines

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
    """Where each engine's scheduler ran between two samples, and how long the host kept CPUs
    from the guest: per scheduler process [pid, its parent (the engine process), the CPU its
    main thread (the serving thread) last ran on, the CPU ticks the process used], and every
    CPU's steal ticks."""

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


def read_placement(path: Path) -> list[dict]:
    """The samples of a sampler's file that carry Placement's fields, in order."""
    if not Path(path).exists():
        return []
    return [d for d in json_lines(path) if "t" in d and "sched" in d]


def placement_during(samples: Sequence[dict], engine_pid: int, t0: float,
                     t1: float) -> Optional[dict]:
    """Where the scheduler of the engine process `engine_pid` ran in ``[t0, t1]``: the CPUs it
    was seen on and the steal ticks of those CPUs (the first sample's from the one before it);
    None where no sample saw it."""
    inside = [d for d in samples if t0 <= d["t"] <= t1]
    cpus = sorted({cpu for d in inside for _, parent, cpu, _ in d["sched"]
                   if parent == engine_pid})
    if not cpus:
        return None
    steal = sum(n for d in inside for cpu, n in d.get("steal", {}).items() if int(cpu) in cpus)
    return {"cpus": cpus, "steal": steal}
