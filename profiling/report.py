"""What the checker tells a reader: a summary of the profile, the stdout table, the markdown."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from dual_graph_worker.core import nvtx_names as names
from profiling.checks import (CheckConfig, CheckOutcome, engine_profile, gpu_identity,
                              num_draft_tokens)
from profiling.engines import EngineProfile
from profiling.timeline import Timeline

_MAX_LISTED = 50


@dataclass(frozen=True)
class StepGroup:
    mode: str
    padded_bs: int
    graph: bool
    count: int
    median_us: float


@dataclass(frozen=True)
class GpuTimeGroup:
    """Median GPU time of what the steps of one kind launched (kernels and graph replays),
    split by whether the step ran a stated eager stage (`stage`, e.g. catch_up); a row with
    `only_stage` set times that stage's own launches."""

    mode: str
    padded_bs: int
    graph: bool
    stage: str          # "" : steps without a stated eager stage
    only_stage: bool
    count: int
    median_us: float


@dataclass(frozen=True)
class ProfileSummary:
    source: str
    gpus: tuple[str, ...]  # "NVIDIA H200 (SM90)"
    gpu_source: str
    engine: str
    expectation: str  # the engine profile the checks applied, and what it expects
    attention_backend: str
    num_draft_tokens: Optional[int]
    steady_windows: tuple[str, ...]  # one line per track
    steps_total: int
    steady_steps: int
    steady_eager_steps: int
    switches: int
    groups: tuple[StepGroup, ...]  # steady steps by (mode, bs, graph)
    warnings: tuple[str, ...]
    gpu_groups: tuple[GpuTimeGroup, ...] = ()   # empty: the source has no GPU timings


def summarize(tl: Timeline, cfg: CheckConfig) -> ProfileSummary:
    gpus, gpu_source = gpu_identity(tl)
    profile = engine_profile(tl, cfg)
    windows = []
    for t in tl.tracks:
        if t.steady_start_ns is None:
            windows.append(f"{t.name}: none ({t.steady_source})")
        else:
            windows.append(f"{t.name}: {tl.ms(t.steady_start_ns):.3f} ms to "
                           f"{tl.ms(t.steady_end_ns or t.steady_start_ns):.3f} ms "
                           f"({t.steady_source})")
    steady = [s for t in tl.tracks for s in t.steady_steps]
    by_key: dict[tuple, list[int]] = {}
    for s in steady:
        by_key.setdefault(s.key, []).append(s.duration_ns)
    groups = tuple(StepGroup(m, bs, g, len(d), statistics.median(d) / 1e3)
                   for (m, bs, g), d in sorted(by_key.items()))
    gpu_groups = _gpu_time_groups(tl, steady, profile)
    return ProfileSummary(
        source=tl.trace.source,
        gpus=tuple(f"{g.name} ({g.sm or 'SM?'})" for g in gpus),
        gpu_source=gpu_source,
        engine=tl.config.get(names.CONFIG_ENGINE, "?"),
        expectation=f"{profile.name} ({profile.summary})",
        attention_backend=tl.config.get(names.CONFIG_ATTENTION_BACKEND, "?"),
        num_draft_tokens=num_draft_tokens(tl, cfg),
        steady_windows=tuple(windows),
        steps_total=len(tl.steps),
        steady_steps=len(steady),
        steady_eager_steps=sum(not s.graph for s in steady),
        switches=sum(s.switch for s in steady),
        groups=groups,
        warnings=tl.trace.warnings + tl.config_conflicts,
        gpu_groups=gpu_groups,
    )


def _gpu_time_groups(tl: Timeline, steady, profile: EngineProfile) -> tuple[GpuTimeGroup, ...]:
    if not tl.trace.has_gpu_times:
        return ()
    gpu = tl.trace.gpu_time_ns
    samples: dict[tuple, list[int]] = {}
    for s in steady:
        stages = profile.stated_spans(s)
        stage = ",".join(sorted({sp.name for sp in stages}))
        samples.setdefault((s.mode, s.padded_bs, s.graph, stage, False), []).append(
            sum(gpu(c) for c in s.calls))
        if stages:
            samples.setdefault((s.mode, s.padded_bs, s.graph, stage, True), []).append(
                sum(gpu(c) for sp in stages for c in sp.calls))
    return tuple(GpuTimeGroup(m, bs, g, stage, only, len(v), statistics.median(v) / 1e3)
                 for (m, bs, g, stage, only), v in sorted(samples.items()))


def _verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def _headline(summary: ProfileSummary) -> str:
    k = summary.num_draft_tokens if summary.num_draft_tokens is not None else "?"
    return (f"{', '.join(summary.gpus) or 'unknown GPU'}; engine {summary.engine}; attention "
            f"{summary.attention_backend}; K={k}")


def format_table(outcomes: Sequence[CheckOutcome], summary: ProfileSummary,
                 width: int = 110) -> str:
    """The pass/fail table printed to stdout."""
    passed = all(o.passed for o in outcomes)
    name_w = max(len(o.name) for o in outcomes) if outcomes else 10
    lines = [f"dgw profile check: {_verdict(passed)}  ({_headline(summary)})",
             f"steady steps: {summary.steady_steps} ({summary.steady_eager_steps} eager), "
             f"switches: {summary.switches}",
             f"{'check':<{name_w}}  result  detail"]
    for o in outcomes:
        detail = o.detail if len(o.detail) <= width else o.detail[:width - 3] + "..."
        lines.append(f"{o.name:<{name_w}}  {_verdict(o.passed):<6}  {detail}")
    for w in summary.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(outcomes: Sequence[CheckOutcome], summary: ProfileSummary,
                    timeline_png: Optional[str]) -> str:
    passed = all(o.passed for o in outcomes)
    k = summary.num_draft_tokens if summary.num_draft_tokens is not None else "unknown"
    out = [f"# dgw profile check: {_verdict(passed)}", "",
           f"- Source: `{summary.source}`",
           f"- GPU: {', '.join(summary.gpus) or 'unknown'} (from {summary.gpu_source})",
           f"- Engine: {summary.engine}; attention backend: {summary.attention_backend}; "
           f"num_draft_tokens (K): {k}",
           f"- Expectation profile: {summary.expectation}",
           f"- Steps: {summary.steps_total} in the trace, {summary.steady_steps} in steady state "
           f"({summary.steady_eager_steps} eager), {summary.switches} mode switches",
           "- Steady state: " + ("; ".join(summary.steady_windows) or "no step ranges found"),
           "", "| check | result | detail |", "|---|---|---|"]
    out += [f"| {o.name} | {_verdict(o.passed)} | {_cell(o.detail)} |" for o in outcomes]
    for o in outcomes:
        if not (o.violations or o.notes):
            continue
        out += ["", f"## {o.name}: {_verdict(o.passed)}", ""]
        if o.violations:
            out.append(f"Violations ({len(o.violations)}):")
            out += [f"- {v}" for v in o.violations[:_MAX_LISTED]]
            if len(o.violations) > _MAX_LISTED:
                out.append(f"- ... {len(o.violations) - _MAX_LISTED} more")
        if o.notes:
            out += ([""] if o.violations else []) + ["Notes:"] + [f"- {n}" for n in o.notes]
    if summary.groups:
        out += ["", "## Steady-state steps", "",
                "| mode | padded bs | graph | steps | median step range, host (us) |", "|---|---|---|---|---|"]
        out += [f"| {g.mode} | {g.padded_bs} | {'yes' if g.graph else 'eager'} | {g.count} | "
                f"{g.median_us:.1f} |" for g in summary.groups]
    if summary.gpu_groups:
        out += ["", "## GPU time a step launched", "",
                "Kernels and graph replays launched inside each steady step, summed (GPU busy "
                "time, not wall time); steps that ran a stated eager stage are a row of their "
                "own, and that stage's own launches another.", "",
                "| mode | padded bs | graph | stated eager stage | what | steps | median GPU "
                "time (us) |", "|---|---|---|---|---|---|---|"]
        out += [f"| {g.mode} | {g.padded_bs} | {'yes' if g.graph else 'eager'} | "
                f"{g.stage or '-'} | {'the stage alone' if g.only_stage else 'whole step'} | "
                f"{g.count} | {g.median_us:.1f} |" for g in summary.gpu_groups]
    if timeline_png:
        out += ["", "## Timeline", "", f"![timeline]({timeline_png})"]
    if summary.warnings:
        out += ["", "## Warnings", ""] + [f"- {w}" for w in summary.warnings]
    return "\n".join(out) + "\n"
