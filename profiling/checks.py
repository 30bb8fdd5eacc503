"""The steady-state checks. Each takes a `Timeline` and a `CheckConfig` and returns one outcome.

graph_launches_per_stage, eager_kernels_in_graph_steps, no_capture_instantiate_malloc,
switch_adds_no_api_calls, gpu_identity: what each asserts and why is in docs/design.md,
"Seeing what the worker does" (profile checks).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from dual_graph_worker.core import nvtx_names as names
from profiling import api_names, engines
from profiling.events import GpuInfo
from profiling.timeline import DEFAULT_WARMUP_STEPS, Step, Timeline, Track

GRAPH_LAUNCHES = "graph_launches_per_stage"
EAGER_KERNELS = "eager_kernels_in_graph_steps"
NO_CAPTURE = "no_capture_instantiate_malloc"
SWITCH_COST = "switch_adds_no_api_calls"
GPU_IDENTITY = "gpu_identity"
CHECK_NAMES = (GRAPH_LAUNCHES, EAGER_KERNELS, NO_CAPTURE, SWITCH_COST, GPU_IDENTITY)

DEFAULT_MAX_EAGER_KERNELS = 4


@dataclass(frozen=True)
class CheckConfig:
    warmup_steps: int = DEFAULT_WARMUP_STEPS  # steady state without a steady_state_begin mark
    max_eager_kernels: int = DEFAULT_MAX_EAGER_KERNELS  # per graph step
    num_draft_tokens: Optional[int] = None  # overrides config:num_draft_tokens
    expect_sm: Optional[str] = None  # "SM90", "9.0" or "90"; None: report only
    engine: Optional[str] = None  # expectation profile (profiling.engines); None: config:engine


@dataclass(frozen=True)
class CheckOutcome:
    name: str
    passed: bool
    detail: str  # one line
    violations: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # context for the report (kernel names, unverified cases, ...)


def _where(tl: Timeline, step: Step) -> str:
    return f"step #{step.index} {step.label} @ {tl.ms(step.start_ns):.3f} ms"


def _track_prefix(tl: Timeline, track: Track) -> str:
    return f"[{track.name}] " if len(tl.tracks) > 1 else ""


def num_draft_tokens(tl: Timeline, cfg: CheckConfig) -> Optional[int]:
    if cfg.num_draft_tokens is not None:
        return cfg.num_draft_tokens
    raw = tl.config.get(names.CONFIG_NUM_DRAFT_TOKENS)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def engine_profile(tl: Timeline, cfg: CheckConfig) -> engines.EngineProfile:
    return engines.resolve(cfg.engine, tl.config)


def _stage_calls(spans: list) -> dict[int, str]:
    """{id of a call: its stage} for the calls inside `spans` (EngineProfile.stated_spans: the
    stages its engine states as deliberate eager work; eager_spans: those and the graph stages
    it runs eagerly)."""
    return {id(c): s.name for s in spans for c in s.calls}


def _stage_label(stage: str) -> str:
    return f"stage {stage}"


def _no_steps_outcome(name: str, tl: Timeline) -> Optional[CheckOutcome]:
    if not tl.steps:
        hint = "; ".join(tl.trace.warnings) or "was the worker run with NVTX ranges on?"
        return CheckOutcome(name, False, f"no dgw step ranges in the trace ({hint})")
    if not any(t.steady_steps for t in tl.tracks):
        sources = "; ".join(sorted({t.steady_source for t in tl.tracks}))
        return CheckOutcome(name, False, f"no step in steady state ({sources})")
    return None


def _limit(lines: Sequence[str], n: int = 20) -> str:
    shown = "; ".join(lines[:n])
    return shown + (f"; ... {len(lines) - n} more" if len(lines) > n else "")


def check_graph_launches(tl: Timeline, cfg: CheckConfig) -> CheckOutcome:
    missing = _no_steps_outcome(GRAPH_LAUNCHES, tl)
    if missing:
        return missing
    k = num_draft_tokens(tl, cfg)
    profile = engine_profile(tl, cfg)
    violations: list[str] = []
    graph_steps: Counter = Counter()
    eager_steps: Counter = Counter()
    # graph id -> (mode, stage) -> [where it was launched]
    graph_users: dict[int, dict[tuple[str, str], list[str]]] = defaultdict(
        lambda: defaultdict(list))
    for track in tl.tracks:
        pre = _track_prefix(tl, track)
        for step in track.steady_steps:
            if not step.graph:
                eager_steps[step.mode] += 1
                continue
            graph_steps[step.mode] += 1
            where = pre + _where(tl, step)
            expected = profile.expected_stages(step.mode, k, tl.config)
            if expected is None:
                violations.append(f"{where}: unknown mode {step.mode!r}")
                continue
            required, allowed = expected
            eager = profile.eager_in(step.mode)
            graph_spans = [s for s in step.stages
                           if s.name in names.GRAPH_STAGES and s.name not in eager]
            seen = Counter(s.name for s in graph_spans)
            for stage in sorted(required - set(seen)):
                violations.append(f"{where}: missing stage {stage}")
            for stage in sorted(set(seen) - allowed):
                violations.append(f"{where}: stage {stage} does not belong to mode {step.mode}")
            for stage, n in sorted(seen.items()):
                if n > 1:
                    violations.append(f"{where}: stage {stage} ran {n} times")
            in_stages = 0
            for span in graph_spans:
                launches = [c for c in span.calls if api_names.is_graph_launch(c.name)]
                in_stages += len(launches)
                if len(launches) != 1:
                    violations.append(f"{where}: stage {span.name} has {len(launches)} graph "
                                      "launches, expected 1")
                for c in launches:
                    gid = tl.trace.graph_id(c)
                    if gid is not None:
                        graph_users[gid][(step.mode, span.name)].append(where)
            stray = sum(api_names.is_graph_launch(c.name) for c in step.calls) - in_stages
            if stray:
                violations.append(f"{where}: {stray} graph launches outside the "
                                  f"{'/'.join(names.GRAPH_STAGES)} stages")
    violations += _graphs_with_two_roles(graph_users)
    n_graph, n_eager = sum(graph_steps.values()), sum(eager_steps.values())
    counts = ", ".join(f"{m} {n}" for m, n in sorted(graph_steps.items())) or "none"
    detail = (f"{n_graph} graph steps checked ({counts}); {n_eager} eager steps reported"
              + (f" ({', '.join(f'{m} {n}' for m, n in sorted(eager_steps.items()))})"
                 if n_eager else "")
              + f"; K={k if k is not None else 'unknown'}")
    notes = []
    if k is None:
        notes.append("num_draft_tokens unknown (no config:num_draft_tokens mark): the draft "
                     "stage was accepted as optional in spec steps")
    if graph_users:
        notes.append(f"{len(graph_users)} distinct graphs launched in steady state, each "
                     "checked to serve one (mode, stage)")
    if n_graph == 0:
        violations.append("no graph step in steady state: every step ran eagerly")
    if violations:
        detail = f"{len(violations)} violations: {_limit(violations, 3)}"
    return CheckOutcome(GRAPH_LAUNCHES, not violations, detail, tuple(violations), tuple(notes))


def _graphs_with_two_roles(users: dict[int, dict[tuple[str, str], list[str]]]) -> list[str]:
    """A captured graph replays one (mode, stage) only; launches in any other role are wrong
    (e.g. a decode step that runs the verify graph because the decode pool was not installed).
    The role with the most launches is taken as the graph's own."""
    out = []
    for gid, roles in sorted(users.items()):
        if len(roles) < 2:
            continue
        (own_mode, own_stage), own = max(roles.items(), key=lambda kv: len(kv[1]))
        for (mode, stage), wheres in sorted(roles.items()):
            if (mode, stage) == (own_mode, own_stage):
                continue
            out.append(f"{wheres[0]}: stage {stage} launched graph {gid}, which {own_mode} steps "
                       f"launch as their {own_stage} graph ({len(own)} times)"
                       + (f"; {len(wheres) - 1} more such launches" if len(wheres) > 1 else ""))
    return out


def check_eager_kernels(tl: Timeline, cfg: CheckConfig) -> CheckOutcome:
    missing = _no_steps_outcome(EAGER_KERNELS, tl)
    if missing:
        return missing
    profile = engine_profile(tl, cfg)
    stated = bool(profile.allowed_eager)
    violations: list[str] = []
    names_by_stage: dict[str, Counter] = defaultdict(Counter)
    by_family: dict[str, Counter] = defaultdict(Counter)     # family -> kernel name -> launches
    family_steps: dict[str, list[int]] = defaultdict(list)   # family -> launches per step
    per_step: list[int] = []
    eager_stages = profile.stated_eager_stages + profile.all_eager_stages()
    labels = [f.label for f in profile.allowed_eager] + [_stage_label(s) for s in eager_stages]
    for track in tl.tracks:
        pre = _track_prefix(tl, track)
        for step in track.steady_steps:
            if not step.graph:
                continue
            family_of = {}        # id of every kernel launch -> its label (None: unlisted)
            unlisted = []
            in_step: Counter = Counter()
            # Kernels of a stated eager stage (or a graph stage the engine runs eagerly here)
            # count under that stage, never as glue.
            in_stated = _stage_calls(profile.eager_spans(step))
            for c in step.calls:
                if not api_names.is_kernel_launch(c.name):
                    continue
                kname = tl.trace.kernel_name(c)
                if id(c) in in_stated:
                    label = _stage_label(in_stated[id(c)])
                else:
                    fam = profile.eager_family(kname, tl.trace.kernel_demangled_name(c))
                    label = fam.label if fam is not None else None
                family_of[id(c)] = label
                if label is None:
                    unlisted.append(c)
                else:
                    by_family[label][kname] += 1
                    in_step[label] += 1
            per_step.append(len(unlisted))
            for label in labels:
                family_steps[label].append(in_step[label])
            for span in step.stages:
                for c in span.calls:
                    if id(c) in family_of:
                        names_by_stage[span.name][tl.trace.kernel_name(c)] += 1
            for c in step.calls_outside_stages():
                if id(c) in family_of:
                    names_by_stage["(outside stages)"][tl.trace.kernel_name(c)] += 1
            if len(unlisted) > cfg.max_eager_kernels:
                kernels = Counter(tl.trace.kernel_name(c) for c in unlisted)
                listed = ", ".join(f"{n} x{c}" for n, c in kernels.most_common())
                violations.append(f"{pre}{_where(tl, step)}: {len(unlisted)} eager kernel "
                                  f"launches{' outside the stated set' if stated else ''} > "
                                  f"{cfg.max_eager_kernels} allowed ({listed})")
    notes = [f"{stage}: " + ", ".join(f"{n} x{c}" for n, c in counter.most_common())
             for stage, counter in sorted(names_by_stage.items())]
    for family in profile.allowed_eager:
        counts, launches = family_steps[family.label], by_family[family.label]
        notes.append(
            f"stated set `{family.label}` ({family.describe()}): "
            f"{sum(launches.values())} launches in {sum(1 for n in counts if n)} of "
            f"{len(counts)} graph steps, max {max(counts, default=0)} per step"
            + (": " + ", ".join(f"{n} x{c}" for n, c in launches.most_common())
               if launches else ""))
    for stage in eager_stages:
        label = _stage_label(stage)
        counts, launches = family_steps[label], by_family[label]
        if not launches:
            continue
        busy = [n for n in counts if n]
        why = profile.stated_eager_why if stage in profile.stated_eager_stages else \
            f"run eagerly by the engine here: {profile.eager_graph_why}"
        notes.append(
            f"stated stage `{stage}` ({why}): {sum(launches.values())} "
            f"launches in {len(busy)} of {len(counts)} graph steps, {min(busy)}-{max(busy)} "
            f"per step; most launched: "
            + ", ".join(f"{n} x{c}" for n, c in launches.most_common(8)))
    most = max(per_step, default=0)
    if stated:
        total = sum(sum(c.values()) for c in by_family.values())
        detail = (f"max {most} eager kernel launches outside the stated set in a graph step "
                  f"(allowed {cfg.max_eager_kernels}) over {len(per_step)} graph steps; "
                  f"{total} launches from the stated set ({profile.name})")
    else:
        detail = (f"max {most} eager kernel launches in a graph step (allowed "
                  f"{cfg.max_eager_kernels}) over {len(per_step)} graph steps")
    if violations:
        detail = f"{len(violations)} graph step(s) over the limit: {_limit(violations, 2)}"
    return CheckOutcome(EAGER_KERNELS, not violations, detail, tuple(violations), tuple(notes))


def check_no_capture(tl: Timeline, cfg: CheckConfig) -> CheckOutcome:
    missing = _no_steps_outcome(NO_CAPTURE, tl)
    if missing:
        return missing
    violations: list[str] = []
    for track in tl.tracks:
        pre = _track_prefix(tl, track)
        found: dict[tuple[str, str], list[int]] = defaultdict(list)
        for c in track.steady_calls:
            category = api_names.forbidden_category(c.name)
            if category:
                found[(category, api_names.base_name(c.name))].append(c.start_ns)
        for (category, name), times in sorted(found.items()):
            violations.append(f"{pre}{category}: {name} x{len(times)} in steady state "
                              f"(first @ {tl.ms(min(times)):.3f} ms)")
        for m in track.captures_in_steady:
            violations.append(f"{pre}capture mark {m.text!r} in steady state @ "
                              f"{tl.ms(m.t_ns):.3f} ms")
    n_calls = sum(len(t.steady_calls) for t in tl.tracks)
    detail = (f"none in {n_calls} steady-state API calls" if not violations
              else f"{len(violations)} violations: {_limit(violations, 3)}")
    return CheckOutcome(NO_CAPTURE, not violations, detail, tuple(violations))


def _typical(counters: Sequence[Counter]) -> Counter:
    """Per API name, the (upper) median count over the given steps or gaps."""
    out: Counter = Counter()
    for name in set().union(*counters):
        values = sorted(c[name] for c in counters)
        out[name] = values[len(values) // 2]
    return out


def _extra(observed: Counter, typical: Counter) -> Counter:
    return Counter({n: c - typical[n] for n, c in observed.items() if c > typical[n]})


def _names(calls: Iterable) -> Counter:
    """API calls by base name, status polls left out (see api_names.POLLING)."""
    return Counter(n for n in (api_names.base_name(c.name) for c in calls)
                   if n not in api_names.POLLING)


def _polls(calls: Iterable) -> int:
    return sum(api_names.base_name(c.name) in api_names.POLLING for c in calls)


def _fmt(extra: Counter) -> str:
    return ", ".join(f"{n} +{c}" for n, c in sorted(extra.items()))


# Compared switch steps and gaps from which a lone event-pool growth counts as no switch's cost,
# and the most events that growth may create.
LONE_GROWTH_AMONG = 10
LONE_GROWTH_MAX = 2


def _lone_growth(found: list[tuple[str, Counter]], compared: int) -> set[int]:
    """The index in `found` (place, extra calls) of the one place whose extras are a few
    event-pool creations, when no other place adds any and at least LONE_GROWTH_AMONG were
    compared; else none."""
    growing = [i for i, (_, extra) in enumerate(found)
               if any(n in api_names.POOL_GROWTH for n in extra)]
    if compared < LONE_GROWTH_AMONG or len(growing) != 1:
        return set()
    extra = found[growing[0]][1]
    lone = set(extra) <= api_names.POOL_GROWTH and sum(extra.values()) <= LONE_GROWTH_MAX
    return set(growing) if lone else set()


def check_switch_cost(tl: Timeline, cfg: CheckConfig) -> CheckOutcome:
    missing = _no_steps_outcome(SWITCH_COST, tl)
    if missing:
        return missing
    found: list[tuple[str, Counter]] = []      # (where, API calls added there)
    unverified: list[str] = []
    n_switch = 0
    n_gaps = 0
    compared = 0               # switch steps and gaps that had a baseline
    polls = Counter()          # status polls: "switch steps" / "other steps" -> calls, steps
    stated = Counter()         # stated eager stages: steps that ran one, their API calls
    profile = engine_profile(tl, cfg)
    for track in tl.tracks:
        pre = _track_prefix(tl, track)
        steady = track.steady_steps
        base_by_key: dict[tuple, list[Counter]] = defaultdict(list)
        base_by_mode: dict[tuple, list[Counter]] = defaultdict(list)
        own: dict[int, Counter] = {}     # step -> its API calls outside stated eager stages
        for s in steady:
            kind = "switch" if s.switch else "other"
            polls[f"{kind} polls"] += _polls(s.calls)
            polls[f"{kind} steps"] += 1
            stated_ids = _stage_calls(profile.stated_spans(s))
            if stated_ids:
                stated[f"{kind} steps with"] += 1
                stated["calls"] += len(stated_ids)
            own[id(s)] = _names(c for c in s.calls if id(c) not in stated_ids)
            if not s.switch:
                base_by_key[s.key].append(own[id(s)])
                base_by_mode[(s.mode, s.graph)].append(own[id(s)])
        for s in steady:
            if not s.switch:
                continue
            n_switch += 1
            where = pre + _where(tl, s)
            baseline = base_by_key.get(s.key) or base_by_mode.get((s.mode, s.graph))
            if not baseline:
                unverified.append(f"{where}: no non-switch {s.mode} step to compare with")
                continue
            compared += 1
            extra = _extra(own[id(s)], _typical(baseline))
            if extra:
                found.append((f"{where} (switch into {s.mode}): API calls a typical "
                              f"{s.label} step does not make", extra))

        # Calls between steps: a gap is around a switch when the step after it or the step
        # before it is a switch step; every other steady gap is the baseline.
        steps = track.steps
        gaps = [(i, s) for i, s in enumerate(steps)
                if s.gap_before is not None and s.steady and steps[i - 1].steady]
        around = [(i, s) for i, s in gaps if s.switch or steps[i - 1].switch]
        base_gaps = [_names(s.gap_before) for i, s in gaps if not (s.switch or steps[i - 1].switch)]
        n_gaps += len(around)
        if around and not base_gaps:
            unverified.append(f"{pre}{len(around)} gaps around switches: no gap between two "
                              "non-switch steps to compare with")
        elif around:
            compared += len(around)
            typical = _typical(base_gaps)
            for i, s in around:
                extra = _extra(_names(s.gap_before), typical)
                if extra:
                    found.append((f"{pre}between step #{i - 1} {steps[i - 1].label} and "
                                  f"{_where(tl, s)}: API calls a typical gap between steps "
                                  "does not make", extra))
    lone = _lone_growth(found, compared)
    violations = [f"{where}: {_fmt(extra)}" for i, (where, extra) in enumerate(found)
                  if i not in lone]
    if n_switch == 0:
        detail = "no mode switch in steady state: nothing to compare"
    else:
        detail = (f"{n_switch} switch steps and {n_gaps} gaps around switches compared with "
                  "typical non-switch steps and gaps")
    if unverified:
        detail += f"; {len(unverified)} unverified (no baseline)"
    if violations:
        detail = f"{len(violations)} violations: {_limit(violations, 2)}"
    switch_marks = sum(len(t.switch_marks) for t in tl.tracks)
    notes = tuple(unverified) + (f"{switch_marks} switch marks, {n_switch} mode changes "
                                 "between steady steps",)
    notes += tuple(f"event-pool growth once among {compared} compared, not counted: "
                   f"{found[i][0]}: {_fmt(found[i][1])}" for i in sorted(lone))
    if stated["calls"]:
        notes += (f"stated eager stages ({', '.join(profile.stated_eager_stages)}; "
                  f"{profile.stated_eager_why}): {stated['calls']} API calls in "
                  f"{stated['switch steps with']} switch steps and {stated['other steps with']} "
                  "other steps, left out of the comparison",)
    if polls["switch polls"] or polls["other polls"]:
        per = {k: polls[f"{k} polls"] / max(polls[f"{k} steps"], 1) for k in ("switch", "other")}
        notes += (f"status polls (cudaEventQuery/StreamQuery, not compared): "
                  f"{polls['switch polls']} in {polls['switch steps']} switch steps "
                  f"({per['switch']:.1f} a step), {polls['other polls']} in "
                  f"{polls['other steps']} other steps ({per['other']:.1f} a step)",)
    return CheckOutcome(SWITCH_COST, not violations, detail, tuple(violations), notes)


def normalize_sm(text: str) -> str:
    """'SM90', 'sm_90', '9.0', '90' -> 'SM90'; '10.0' -> 'SM100'; '12.0' -> 'SM120'.
    ValueError, saying what to write, for anything else."""
    t = text.strip().upper().replace("SM_", "").replace("SM", "")
    m = re.fullmatch(r"(\d+)(?:\.(\d*))?", t)
    if not m:
        raise ValueError(f"{text!r} is not a GPU architecture like SM90, 9.0 or 90 (SM120 for a "
                         "12.0 GPU)")
    major, minor = m.groups()
    if minor is None and len(major) == 1:
        # No GPU is SM9: a lone digit is a major version missing its minor one.
        raise ValueError(f"{text!r} names no GPU architecture: write {major}.0 or {major}0 "
                         f"(SM{major}0)")
    return f"SM{int(major)}{int(minor or 0)}" if minor is not None else f"SM{int(major)}"


def gpu_identity(tl: Timeline) -> tuple[tuple[GpuInfo, ...], str]:
    """The GPUs from the report, else from config marks; and where they came from."""
    gpus = tl.trace.gpus
    if gpus and any(g.sm for g in gpus):
        return gpus, "report"
    name = tl.config.get(names.CONFIG_GPU_NAME)
    cc = tl.config.get(names.CONFIG_COMPUTE_CAPABILITY)
    if cc:
        try:
            sm = normalize_sm(cc)
            digits = sm[2:]
            fallback = GpuInfo(name or (gpus[0].name if gpus else "unknown GPU"),
                               int(digits[:-1]), int(digits[-1]))
            return (fallback,), "config marks"
        except ValueError:
            pass
    if gpus:
        return gpus, "report (no compute capability recorded)"
    if name:
        return (GpuInfo(name),), "config marks"
    return (), "none"


def check_gpu_identity(tl: Timeline, cfg: CheckConfig) -> CheckOutcome:
    gpus, source = gpu_identity(tl)
    shown = ", ".join(f"{g.name} ({g.sm or 'SM?'})" for g in gpus) or "unknown GPU"
    engine = tl.config.get(names.CONFIG_ENGINE, "?")
    backend = tl.config.get(names.CONFIG_ATTENTION_BACKEND, "?")
    detail = f"{shown} from {source}; engine {engine}; attention backend {backend}"
    violations: list[str] = []
    if cfg.expect_sm:
        want = normalize_sm(cfg.expect_sm)
        found = {g.sm for g in gpus if g.sm}
        if want not in found:
            violations.append(f"expected {want}, profile shows {', '.join(sorted(found)) or 'no SM'}")
            detail = f"{violations[0]}; {detail}"
    notes = tuple(tl.config_conflicts)
    return CheckOutcome(GPU_IDENTITY, not violations, detail, tuple(violations), notes)


CHECKS: tuple[Callable[[Timeline, CheckConfig], CheckOutcome], ...] = (
    check_graph_launches, check_eager_kernels, check_no_capture, check_switch_cost,
    check_gpu_identity,
)


def run_checks(tl: Timeline, cfg: CheckConfig) -> tuple[CheckOutcome, ...]:
    return tuple(check(tl, cfg) for check in CHECKS)
