"""`Trace` -> steps, stages, gaps and the steady-state window: what the checks reason about.

Rules, so the checks stay simple:
- Only dgw names count (see `names`); when the trace knows NVTX domains and has a "dgw"
  domain, only that domain counts.
- A track is one (process, thread) that ran step ranges; marks apply to their process.
- An API call belongs to the step/stage whose interval holds its start, on the same thread.
  Calls nested inside another call on the same thread (a driver call made by a runtime call)
  are dropped, so nothing is counted twice.
- Steady state starts at the process's first `steady_state_begin` mark, or, without one, at
  the start of step number `warmup_steps`; it ends with the track's last step.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from dual_graph_worker.core import nvtx_names as names
from profiling.events import EventKind, Trace, TraceEvent

DEFAULT_WARMUP_STEPS = 10


@dataclass(frozen=True)
class StageSpan:
    name: str
    start_ns: int
    end_ns: int
    calls: tuple[TraceEvent, ...]


@dataclass(frozen=True)
class Step:
    index: int  # position in its track, warm-up steps included
    pid: Optional[int]
    tid: Optional[int]
    mode: str
    padded_bs: int
    graph: bool
    start_ns: int
    end_ns: int
    stages: tuple[StageSpan, ...]
    calls: tuple[TraceEvent, ...]
    gap_before: Optional[tuple[TraceEvent, ...]]  # calls since the previous step; None: first
    steady: bool
    switch: bool  # mode differs from the previous step's

    @property
    def label(self) -> str:
        return f"{self.mode}-{'' if self.graph else 'eager-'}bs{self.padded_bs}"

    @property
    def key(self) -> tuple[str, int, bool]:
        return self.mode, self.padded_bs, self.graph

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    def calls_outside_stages(self) -> tuple[TraceEvent, ...]:
        inside = {id(c) for s in self.stages for c in s.calls}
        return tuple(c for c in self.calls if id(c) not in inside)


@dataclass(frozen=True)
class Mark:
    text: str
    t_ns: int
    pid: Optional[int]


@dataclass(frozen=True)
class Track:
    pid: Optional[int]
    tid: Optional[int]
    steps: tuple[Step, ...]
    steady_start_ns: Optional[int]  # None: no step reached steady state
    steady_end_ns: Optional[int]
    steady_source: str
    steady_calls: tuple[TraceEvent, ...]  # every top-level call of the process in the window
    captures_in_steady: tuple[Mark, ...]
    switch_marks: tuple[Mark, ...]

    @property
    def steady_steps(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.steady)

    @property
    def name(self) -> str:
        return f"pid {self.pid} tid {self.tid}"


@dataclass(frozen=True)
class Timeline:
    tracks: tuple[Track, ...]
    config: Mapping[str, str]
    config_conflicts: tuple[str, ...]
    origin_ns: int
    trace: Trace

    @property
    def steps(self) -> tuple[Step, ...]:
        return tuple(s for t in self.tracks for s in t.steps)

    def ms(self, t_ns: int) -> float:
        """Milliseconds since the first event: how times are shown."""
        return (t_ns - self.origin_ns) / 1e6


class _Calls:
    """Top-level API calls of one thread (or process), sorted, with bisectable starts."""

    def __init__(self, calls: Sequence[TraceEvent]) -> None:
        self.calls = list(calls)
        self.starts = [c.start_ns for c in self.calls]

    def between(self, lo: int, hi: int, lo_open: bool = False) -> tuple[TraceEvent, ...]:
        i = bisect_right(self.starts, lo) if lo_open else bisect_left(self.starts, lo)
        j = bisect_right(self.starts, hi)
        return tuple(self.calls[i:j])


def _top_level(calls: list[TraceEvent]) -> list[TraceEvent]:
    calls.sort(key=lambda c: (c.start_ns, -c.end_ns))
    out: list[TraceEvent] = []
    top_end = None
    for c in calls:
        if top_end is not None and c.start_ns < top_end and c.end_ns <= top_end:
            continue  # nested inside the previous top-level call
        out.append(c)
        top_end = c.end_ns if top_end is None else max(top_end, c.end_ns)
    return out


def _dgw_events(trace: Trace) -> list[tuple[TraceEvent, names.ParsedName]]:
    nvtx = [e for e in trace.events if e.kind is not EventKind.API_CALL]
    if any(e.domain == names.DOMAIN for e in nvtx):
        nvtx = [e for e in nvtx if e.domain == names.DOMAIN]
    out = []
    for e in nvtx:
        parsed = names.parse(e.name)
        if parsed is not None:
            out.append((e, parsed))
    return out


def _config(marks: list[tuple[TraceEvent, names.ConfigName]]) -> tuple[dict[str, str], tuple[str, ...]]:
    config: dict[str, str] = {}
    conflicts = []
    for e, c in sorted(marks, key=lambda m: m[0].start_ns):
        if c.key in config and config[c.key] != c.value:
            conflicts.append(f"config:{c.key} changed from {config[c.key]!r} to {c.value!r}")
        config[c.key] = c.value  # the last value wins
    return config, tuple(conflicts)


def _same_thread(a: Optional[int], b: Optional[int]) -> bool:
    return a is None or b is None or a == b


def build_timeline(trace: Trace, warmup_steps: int = DEFAULT_WARMUP_STEPS) -> Timeline:
    dgw = _dgw_events(trace)
    config, conflicts = _config([(e, p) for e, p in dgw if isinstance(p, names.ConfigName)])

    by_thread: dict[tuple, list[TraceEvent]] = defaultdict(list)
    for e in trace.events:
        if e.kind is EventKind.API_CALL:
            by_thread[(e.pid, e.tid)].append(e)
    thread_calls = {k: _Calls(_top_level(v)) for k, v in by_thread.items()}
    process_calls: dict[Optional[int], _Calls] = {}
    for pid in {k[0] for k in thread_calls}:
        merged = [c for k, tc in thread_calls.items() if k[0] == pid for c in tc.calls]
        merged.sort(key=lambda c: c.start_ns)
        process_calls[pid] = _Calls(merged)

    steps_by_track: dict[tuple, list[tuple[TraceEvent, names.StepName]]] = defaultdict(list)
    stages_by_pid: dict[Optional[int], list[tuple[TraceEvent, names.StageName]]] = defaultdict(list)
    marks_by_pid: dict[Optional[int], list[tuple[TraceEvent, names.ParsedName]]] = defaultdict(list)
    for e, p in dgw:
        if isinstance(p, names.StepName) and e.kind is EventKind.NVTX_RANGE:
            steps_by_track[(e.pid, e.tid)].append((e, p))
        elif isinstance(p, names.StageName) and e.kind is EventKind.NVTX_RANGE:
            stages_by_pid[e.pid].append((e, p))
        elif isinstance(p, (names.SteadyStateName, names.SwitchName, names.CaptureName)):
            marks_by_pid[e.pid].append((e, p))

    tracks = []
    for (pid, tid), raw_steps in sorted(steps_by_track.items(), key=lambda kv: kv[1][0][0].start_ns):
        raw_steps.sort(key=lambda sp: sp[0].start_ns)
        calls = thread_calls.get((pid, tid)) or process_calls.get(pid) or _Calls(())
        marks = sorted(marks_by_pid.get(pid, []), key=lambda m: m[0].start_ns)
        steady_marks = [e.start_ns for e, p in marks if isinstance(p, names.SteadyStateName)]
        if steady_marks:
            steady_start: Optional[int] = steady_marks[0]
            source = "steady_state_begin mark"
        elif len(raw_steps) > warmup_steps:
            steady_start = raw_steps[warmup_steps][0].start_ns
            source = f"no steady_state_begin mark: after the first {warmup_steps} steps"
        else:
            steady_start = None
            source = (f"no steady_state_begin mark and only {len(raw_steps)} steps "
                      f"(<= {warmup_steps} warm-up steps)")

        stages = sorted((sp for sp in stages_by_pid.get(pid, []) if _same_thread(sp[0].tid, tid)),
                        key=lambda sp: sp[0].start_ns)
        stage_starts = [sp[0].start_ns for sp in stages]
        steps: list[Step] = []
        for i, (e, p) in enumerate(raw_steps):
            lo, hi = bisect_left(stage_starts, e.start_ns), bisect_right(stage_starts, e.end_ns)
            step_calls = calls.between(e.start_ns, e.end_ns)
            spans = []
            for se, sp in stages[lo:hi]:
                if se.end_ns <= e.end_ns:
                    inner = tuple(c for c in step_calls if se.start_ns <= c.start_ns <= se.end_ns)
                    spans.append(StageSpan(sp.stage, se.start_ns, se.end_ns, inner))
            prev = raw_steps[i - 1] if i else None
            gap = calls.between(prev[0].end_ns, e.start_ns, lo_open=True) if prev else None
            steps.append(Step(
                index=i, pid=pid, tid=tid, mode=p.mode, padded_bs=p.padded_bs, graph=p.graph,
                start_ns=e.start_ns, end_ns=e.end_ns, stages=tuple(spans), calls=step_calls,
                gap_before=gap,
                steady=steady_start is not None and e.start_ns >= steady_start,
                switch=prev is not None and prev[1].mode != p.mode))

        steady_end = raw_steps[-1][0].end_ns if steady_start is not None else None
        if steady_start is not None and steady_end is not None and steady_end >= steady_start:
            window = process_calls.get(pid, _Calls(())).between(steady_start, steady_end)
            captures = tuple(Mark(e.name, e.start_ns, pid) for e, p in marks
                             if isinstance(p, names.CaptureName)
                             and steady_start <= e.start_ns <= steady_end)
        else:
            window, captures = (), ()
        switches = tuple(Mark(e.name, e.start_ns, pid) for e, p in marks
                         if isinstance(p, names.SwitchName))
        tracks.append(Track(pid, tid, tuple(steps), steady_start, steady_end, source, window,
                            captures, switches))

    origin = min((e.start_ns for e in trace.events), default=0)
    return Timeline(tuple(tracks), config, conflicts, origin, trace)
