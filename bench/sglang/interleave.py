"""BENCHMARK ONLY: the policy matrix with every engine up at once, each cell taken in turn.

Run one after another, the engines meet the machine at different times: a slow spell of a few
seconds lands on one engine's cells and not another's (results/sglang/runs.md). Here
every engine process is started first, one after another, each with the same KV pool
(ENGINE_KWARGS) and the same share of the memory free at its start; then each cell runs on one
engine after another, in an order that rotates from cell to cell, so that a spell falls on all
of them alike. engine_child serves the tasks one at a time from its inbox folder.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from bench.sglang.engine_child import Child
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.settings import settings_env

# Every engine the same KV pool, fitting a 256x512, 64x2112 or 128x1088-token cell with room;
# each keeps 20% of the memory free at its start as SGLang's runtime slack
# (kv_cache_configurator.py:1616-1625), so three engines fit one H200. An idle scheduler polls
# its sockets in a busy loop unless it sleeps on idle: the two waiting would spin two cores.
ENGINE_KWARGS = {"max_total_tokens": 160_000, "mem_fraction_static": 0.8, "sleep_on_idle": True}
# Two or three such engines fit a 141 GB H200, not an 80 GB H100: there one fails to start and
# another gets a tenth of its pool.
MIN_GPU_MIB = 120_000
# The worker sizes its lazy catch-up stash to a share of the memory free at its start: up first
# beside the others it would take tens of GB, so it is pinned to what it takes alone on an H200.
STASH_MB = 3700
DUAL_ENV = settings_env(lazy_stash_mb=STASH_MB)
POLL_S = 0.005


@dataclass(frozen=True)
class Phase:
    """One forced accept length: per engine kind the tasks that set it and warm up after it
    (untimed), then its cells (engine kind -> its task for that cell; plain only in the first
    phase)."""

    setup: dict[str, list[dict]]
    cells: list[dict[str, dict]]
    turns: tuple[int, ...]              # per cell, how far its engine order rotates

    def __post_init__(self) -> None:
        if len(self.turns) != len(self.cells):
            raise ValueError(f"a phase of {len(self.cells)} cells has {len(self.turns)} turns")


@dataclass(frozen=True)
class Plan:
    warm: dict[str, list[dict]]        # kind -> tasks before the first phase, untimed
    phases: list[Phase]


class EngineGone(RuntimeError):
    pass


@dataclass
class Engine:
    """A started engine process and how many tasks it has been given; what it measured is its
    own NAME.json (engine_child files each cell's points under its task's name)."""

    kind: str
    child: Child
    inbox: Path
    asked: int = 0

    def ask(self, task: dict, deadline: float) -> dict:
        """Run `task` on this engine and return its answer; EngineGone if the budget is spent,
        the process ends, or the task fails."""
        if time.time() > deadline:
            raise EngineGone(f"{self.kind}: the budget ran out before {task['name']}")
        n, self.asked = self.asked, self.asked + 1
        write_json(task, self.inbox / f"{n:04d}.json")
        answer = self.inbox / f"{n:04d}.out.json"
        while not answer.exists():
            if self.child.proc.poll() is not None:
                raise EngineGone(f"{self.kind} exited ({self.child.proc.returncode}) during "
                                 f"{task['name']}")
            if time.time() > deadline:
                raise EngineGone(f"{self.kind}: the budget ran out during {task['name']}")
            time.sleep(POLL_S)
        reply = json.loads(answer.read_text())
        if "error" in reply:
            raise EngineGone(f"{self.kind}: {task['name']} failed: {reply['error']}")
        return reply


def launch(kind: str, spec: dict, out: Path) -> Engine:
    """One engine process serving its inbox, just launched (wait_up: once it is up)."""
    inbox = out / f"{kind}.inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    for stale in inbox.glob("*.json"):
        stale.unlink()
    # Each its own entry-point shim: children launched together would write one file at once.
    return Engine(kind, Child(out, spec | {"name": kind, "tasks": [], "inbox": str(inbox)},
                              shim_dir=out / "shim" / kind), inbox)


def wait_up(launched: Engine, deadline: float) -> Engine:
    """The launched engine once it is up (EngineGone if it failed or the budget ran out)."""
    kind, child = launched.kind, launched.child
    try:
        while "startup_s" not in (written := child.result()) and child.proc.poll() is None \
                and time.time() < deadline:
            time.sleep(0.1)
    except BaseException:
        child.stop()
        raise
    if "startup_s" not in written or "error" in written:
        if child.proc.poll() is None:
            child.stop()
        raise EngineGone(f"{kind} did not start: {child.wait(1.0).get('error', 'no result')}")
    return launched


def kv_tokens(result: dict) -> Optional[int]:
    """The KV pool an engine got (SGLang shrinks it below max_total_tokens when memory is short,
    with a warning only)."""
    usage = (result.get("server_info") or {}).get("memory_usage") or {}
    return usage.get("token_capacity")


def run_all(specs: dict[str, dict], plan: Plan, out: Path, deadline: float,
            on_phase: Callable[[dict[str, dict]], None] = lambda results: None,
            together: bool = False) -> dict[str, dict]:
    """Every engine of `specs` (kind -> engine_child spec) through `plan`; per kind a result as
    engine_child writes one (its cells' points under their task names), with "error" where the
    engine failed or the budget ran out. `on_phase` gets the results so far after each phase.
    `together`: every engine launched at once, not each after the last is up (start-ups one
    after another take most of a short call); each then measures its memory while the others
    load, so the KV pools are checked after (kv_tokens)."""
    engines: dict[str, Engine] = {}
    failed: dict[str, dict] = {}
    done: dict[str, dict] = {}          # engines no later phase needed, stopped early
    # Otherwise each launched alone once the last is up, so each measures the memory the ones
    # before it left.
    pending: dict[str, Engine] = {}
    try:
        for kind, spec in specs.items() if together else ():
            pending[kind] = launch(kind, spec, out)
        for kind, spec in specs.items():
            try:
                engines[kind] = wait_up(pending.pop(kind, None) or launch(kind, spec, out),
                                        deadline)
            except EngineGone as exc:
                failed[kind] = {"tasks": {}, "error": str(exc)}
        for kind in list(engines):
            _each(engines, failed, kind, plan.warm.get(kind, []), deadline)
        for p, phase in enumerate(plan.phases):
            for kind in list(engines):
                _each(engines, failed, kind, phase.setup.get(kind, []), deadline)
            for i, cell in enumerate(phase.cells):
                kinds = [k for k in engines if k in cell]
                turn = phase.turns[i] % max(len(kinds), 1)
                for kind in kinds[turn:] + kinds[:turn]:
                    _each(engines, failed, kind, [cell[kind]], deadline)
            # An engine no later phase needs (plain after the first) stops now: idle, its
            # scheduler would still poll beside the others' cells.
            later = {k for q in plan.phases[p + 1:] for cell in q.cells for k in cell}
            for kind in [k for k in engines if k not in later]:
                done[kind] = _stop(engines.pop(kind), deadline)
            on_phase({k: e.child.result() for k, e in engines.items()} | done | failed)
    finally:
        for engine in pending.values():    # never waited on (the run was interrupted)
            engine.child.stop()
        results = {}
        for kind, engine in engines.items():
            try:
                results[kind] = _stop(engine, deadline)
            except BaseException as exc:       # stop the others all the same
                engine.child.stop()
                results[kind] = engine.child.result() | {"error": f"stopping: {exc!r}"}
    return results | done | failed


def _each(engines: dict[str, Engine], failed: dict[str, dict], kind: str, tasks: list[dict],
          deadline: float) -> None:
    """Run `tasks` on one engine; one that fails is stopped and set aside with its error."""
    engine = engines.get(kind)
    if engine is None:
        return
    try:
        for task in tasks:
            engine.ask(task, deadline)
    except EngineGone as exc:
        failed[kind] = _stop(engines.pop(kind), deadline, error=str(exc))


def _stop(engine: Engine, deadline: float, error: Optional[str] = None) -> dict:
    """Ask the engine to exit and wait for it (killed at once past the deadline); its result
    (start-up figures, the cells' points), with `error` also written to its NAME.json."""
    if engine.child.proc.poll() is None:
        write_json({"name": "exit", "kind": "exit"}, engine.inbox / f"{engine.asked:04d}.json")
    final = engine.child.wait(min(120.0, max(deadline - time.time(), 1.0)))
    if error:
        final["error"] = error
        write_json(final, engine.child.result_path)
    return final
