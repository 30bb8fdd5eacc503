"""Worker settings SGLang's own arguments cannot carry: env vars, or a JSON file (`DGW_CONFIG`).

SGLang's ServerArgs is a closed dataclass, so a plugin cannot add flags. Settings come from, in
increasing precedence: the defaults below, the JSON object in the file named by ``DGW_CONFIG``,
and individual ``DGW_*`` environment variables. Every scheduler process (one per TP rank) reads
the same environment, so every rank builds the same policy.

| key (JSON)           | env var              | default   | meaning                                      |
|----------------------|----------------------|-----------|----------------------------------------------|
| policy               | DGW_POLICY           | threshold | threshold, goodput, spec (pinned), decode    |
|                      |                      |           | or cycle (a profiling aid, see below)        |
| threshold            | DGW_THRESHOLD        | 32        | speculate while running bs <= threshold      |
| band                 | DGW_BAND             | 2         | hysteresis band around the threshold         |
| min_dwell_steps      | DGW_MIN_DWELL        | 8         | steps a mode runs before it may switch       |
| margin               | DGW_MARGIN           | 0.05      | goodput: relative win needed to switch       |
| probe_every          | DGW_PROBE_EVERY      | 64        | goodput: one spec step every N decode steps  |
| ema_alpha            | DGW_EMA_ALPHA        | 0.1       | goodput: accept-length EMA weight            |
| spec_max_bs          | DGW_SPEC_MAX_BS      | 48        | largest batch the spec pool captures         |
| decode_max_bs        | DGW_DECODE_MAX_BS    | (server)  | largest batch the decode pool captures       |
| capture_config       | DGW_CAPTURE_CONFIG   | (off)     | tuned capture config JSON (see below)        |
| calibration          | DGW_CALIBRATION      | measure   | goodput table: "measure" or a JSON path      |
| calibrate_iters      | DGW_CALIBRATE_ITERS  | 5         | timed replays per graph when measuring       |
| step_log             | DGW_STEP_LOG         | (off)     | JSONL path: one line per decode step         |
| continuity           | DGW_CONTINUITY       | lazy-catch-up | or keep-current (see below)              |
| lazy_stash_mb        | DGW_LAZY_STASH_MB    | 0 (auto)  | lazy-catch-up: stash size (MiB), see below   |
| defer_draft_prefill  | DGW_DEFER_DRAFT_PREFILL | 1      | lazy-catch-up: prefills admitted in decode   |
|                      |                      |           | mode skip the draft's prefill (see below)    |
| draft_extend_graphs  | DGW_DRAFT_EXTEND_GRAPHS | 1      | keep-current: replay the one-token draft     |
|                      |                      |           | extend from CUDA graphs (0: run it eagerly)  |
| stall_trace          | DGW_STALL_TRACE      | (off)     | diagnostic JSONL: the scheduler thread's     |
|                      |                      |           | stack while no step starts (stall_watch.py)  |
| stall_trace_s        | DGW_STALL_TRACE_S    | 1.0       | gap (s) without a step that counts as stall  |

Why threshold by default: on the H200 (DESIGN.md) an EAGLE-3 step at bs 32 cost ~2.8x a plain
decode step end to end, far more than its graph replays alone suggest (CPU-side tree/sampling
work and the draft stages are not in the verify graph). A goodput policy fed replay timings
would therefore over-predict speculation. The threshold (32, between the measured crossovers
at accept length 2.0 and 3.0) is deterministic on every rank and needs no calibration;
``policy=goodput`` is available and uses a table measured by timing graph replays at start-up
(or loaded from ``calibration``).

Tuned capture config (``capture_config``: a file from ``make capture-tune``; capture_config.py).
At start-up the worker refuses it (ConfigError) if it was tuned on another GPU or model shape;
otherwise the decode pool captures the config's decode list (capped at ``decode_max_bs`` when
set) and the threshold becomes the config's crossover. Precedence for ``threshold``: an explicit
value (``DGW_THRESHOLD``, or ``threshold`` in the ``DGW_CONFIG`` file) > the capture config's
crossover > the default 32. The spec pool's sizes are SGLang's (``--cuda-graph-bs-decode``,
fixed before the worker exists): ``dgw capture-flags CONFIG`` prints the flag, and the worker
warns when the server's list differs. Every capture config so far was measured by
``capture.measure`` on the reference engine's graphs, not SGLang's.

Draft continuity (DESIGN.md "Draft state across switches"). ``lazy-catch-up`` (the default
since the H200 run of bench/results/sglang/bench-run2: 0.961-0.973 of max(plain, EAGLE-3) at
concurrency 64-256 against keep-current's 0.887-0.893, within 1-2% of it below) only stashes the
target's EAGLE-3 features of each decode-mode token and catches the draft up in one draft extend
before the next speculative step (lazy_sync.py); ``lazy_stash_mb`` bounds the stash (0: 40% of
the GPU memory free after start-up), a full stash first drops the cells of finished requests
(a compaction, no draft work) and only when the live backlog itself fills it catches up early
(a "forced" catch-up). ``defer_draft_prefill`` extends this to prompts: a prefill that joins
a running batch the policy will decode (at the batch size the prefill grows it to) stashes the
prompt's features instead of running EAGLE's draft prefill
(bench4 on the H200: the decode phase was within 0.1-2.1% of plain SGLang, the prefill phase
4-6% slower, EAGLE's draft over every prompt token). It needs the radix cache off
(``--disable-radix-cache``; lazy_sync.py says why) and is skipped otherwise.
``keep-current`` runs a one-token draft extend in every decode-mode step (draft_sync.py),
replayed from width-1 draft-extend CUDA graphs captured next to the decode pool
(draft_extend_graph.py; ``draft_extend_graphs=0`` runs it eagerly). Graphing it did not help
(0.883-0.891 eager vs 0.887-0.893 graphed, same run): its cost is the draft's own work and the
~30 small eager kernels of SGLang's draft-extend preparation, not the launches of one layer.

``policy=cycle`` is a profiling aid, never a serving policy (cycle_policy.py): whatever the load,
it speculates for ``min_dwell_steps`` steps, decodes as long, then alternates every step for
twice that, and repeats, so one batch of requests yields held steps of both modes and switches
at one batch size (``python -m profiling.sglang_workload`` runs it under nsys).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional

from dual_graph_worker.continuity import Continuity
from dual_graph_worker.engines.sglang.cycle_policy import CyclePolicy
from dual_graph_worker.errors import ConfigError
from dual_graph_worker.modes import Mode
from dual_graph_worker.policy import (
    CalibrationTable,
    GoodputPolicy,
    ModePolicy,
    PinnedPolicy,
    ThresholdPolicy,
)

CONFIG_FILE_ENV = "DGW_CONFIG"
MEASURE = "measure"


class PolicyKind(str, enum.Enum):
    THRESHOLD = "threshold"
    GOODPUT = "goodput"
    SPEC = "spec"        # pinned: static EAGLE-3 inside the spec pool, decode beyond it
    DECODE = "decode"    # pinned: never speculate (the plain-server baseline)
    CYCLE = "cycle"      # profiling aid (cycle_policy.py): a fixed spec/decode schedule


# JSON key -> env var. One table so the docs, the parser and the tests cannot drift.
ENV_VARS: Mapping[str, str] = {
    "policy": "DGW_POLICY",
    "threshold": "DGW_THRESHOLD",
    "band": "DGW_BAND",
    "min_dwell_steps": "DGW_MIN_DWELL",
    "margin": "DGW_MARGIN",
    "probe_every": "DGW_PROBE_EVERY",
    "ema_alpha": "DGW_EMA_ALPHA",
    "spec_max_bs": "DGW_SPEC_MAX_BS",
    "decode_max_bs": "DGW_DECODE_MAX_BS",
    "capture_config": "DGW_CAPTURE_CONFIG",
    "calibration": "DGW_CALIBRATION",
    "calibrate_iters": "DGW_CALIBRATE_ITERS",
    "step_log": "DGW_STEP_LOG",
    "continuity": "DGW_CONTINUITY",
    "lazy_stash_mb": "DGW_LAZY_STASH_MB",
    "defer_draft_prefill": "DGW_DEFER_DRAFT_PREFILL",
    "draft_extend_graphs": "DGW_DRAFT_EXTEND_GRAPHS",
    "stall_trace": "DGW_STALL_TRACE",
    "stall_trace_s": "DGW_STALL_TRACE_S",
}

# What the SGLang worker implements; Continuity.NONE (no draft state at all) is the reference
# engine's plain baseline, which an SGLang server gets by not speculating.
SGLANG_CONTINUITY = (Continuity.KEEP_CURRENT, Continuity.LAZY_CATCH_UP)


@dataclass(frozen=True)
class WorkerConfig:
    policy: PolicyKind = PolicyKind.THRESHOLD
    threshold: int = 32
    band: int = 2
    min_dwell_steps: int = 8
    margin: float = 0.05
    probe_every: int = 64
    ema_alpha: float = 0.1
    spec_max_bs: int = 48
    decode_max_bs: Optional[int] = None
    capture_config: Optional[str] = None
    calibration: str = MEASURE
    calibrate_iters: int = 5
    step_log: Optional[str] = None
    continuity: Continuity = Continuity.LAZY_CATCH_UP
    lazy_stash_mb: int = 0
    defer_draft_prefill: bool = True
    draft_extend_graphs: bool = True
    stall_trace: Optional[str] = None
    stall_trace_s: float = 1.0

    def __post_init__(self) -> None:
        if self.continuity not in SGLANG_CONTINUITY:
            raise ConfigError(f"continuity {self.continuity.value!r} is not available in the "
                              "SGLang worker (DGW_CONTINUITY); choose one of "
                              f"{[c.value for c in SGLANG_CONTINUITY]}")
        if self.lazy_stash_mb < 0:
            raise ConfigError(f"lazy_stash_mb must be >= 0 (0: auto), got {self.lazy_stash_mb} "
                              "(DGW_LAZY_STASH_MB)")
        if self.spec_max_bs < 1:
            raise ConfigError(f"spec_max_bs must be >= 1, got {self.spec_max_bs} "
                              "(DGW_SPEC_MAX_BS); use policy=decode to never speculate")
        if self.decode_max_bs is not None and self.decode_max_bs < 1:
            raise ConfigError(f"decode_max_bs must be >= 1, got {self.decode_max_bs} "
                              "(DGW_DECODE_MAX_BS); unset it to follow the server's decode max")
        if self.stall_trace_s <= 0:
            raise ConfigError(f"stall_trace_s must be > 0 seconds, got {self.stall_trace_s} "
                              "(DGW_STALL_TRACE_S)")
        if self.calibrate_iters < 1:
            raise ConfigError(f"calibrate_iters must be >= 1, got {self.calibrate_iters}")

    @property
    def needs_calibration(self) -> bool:
        return self.policy is PolicyKind.GOODPUT

    @property
    def lazy(self) -> bool:
        return self.continuity is Continuity.LAZY_CATCH_UP

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "config") -> "WorkerConfig":
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"{source}: unknown keys {unknown}; known keys are {sorted(known)}")
        values: dict[str, Any] = {}
        for key, raw in data.items():
            values[key] = _coerce(key, raw, source)
        return cls(**values)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "WorkerConfig":
        settings = _user_settings(environ)
        base = cls()
        if settings.file is not None:
            base = cls.from_mapping(settings.file,
                                    source=f"{CONFIG_FILE_ENV}={environ[CONFIG_FILE_ENV]}")
        overrides = {key: _coerce(key, raw, ENV_VARS[key]) for key, raw in settings.env.items()}
        return replace(base, **overrides)

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["policy"] = self.policy.value
        out["continuity"] = self.continuity.value
        return out


def explicit_keys(environ: Mapping[str, str]) -> frozenset[str]:
    """The keys a user set (in the DGW_CONFIG file or a DGW_* variable) rather than left at their
    defaults: a tuned capture config fills in only the others (``threshold`` today)."""
    settings = _user_settings(environ)
    return frozenset(set(settings.file or ()) | set(settings.env))


class _UserSettings(NamedTuple):
    file: Optional[Mapping[str, Any]]   # the DGW_CONFIG file's object, None without one
    env: dict[str, str]                 # key -> raw value of every non-empty DGW_* variable


def _user_settings(environ: Mapping[str, str]) -> _UserSettings:
    """What the user set, before coercion: one reading for WorkerConfig.from_env and
    explicit_keys, so the two cannot disagree on what counts as set."""
    path = environ.get(CONFIG_FILE_ENV)
    return _UserSettings(_read_json(path) if path else None,
                         {key: environ[env] for key, env in ENV_VARS.items()
                          if environ.get(env, "") != ""})


def _read_json(path: str) -> Mapping[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {CONFIG_FILE_ENV} file {path}: {exc.strerror}; "
                          f"fix the path or unset {CONFIG_FILE_ENV}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{CONFIG_FILE_ENV} file {path} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{CONFIG_FILE_ENV} file {path} must hold a JSON object, "
                          f"got {type(data).__name__}")
    return data


def _coerce(key: str, raw: Any, source: str) -> Any:
    try:
        if key == "policy":
            return PolicyKind(str(raw).strip().lower())
        if key == "continuity":
            return Continuity(str(raw).strip().lower())
        if key in ("margin", "ema_alpha", "stall_trace_s"):
            return float(raw)
        if key in ("calibration",):
            return str(raw)
        if key in ("step_log", "capture_config", "stall_trace"):
            return str(raw) if raw not in (None, "") else None
        if key in ("draft_extend_graphs", "defer_draft_prefill"):
            return _boolean(raw)
        if key == "decode_max_bs":
            return None if raw in (None, "", "none") else int(raw)
        return int(raw)
    except (TypeError, ValueError) as exc:
        choices = {"policy": f" (one of {[k.value for k in PolicyKind]})",
                   "continuity": f" (one of {[c.value for c in SGLANG_CONTINUITY]})"}.get(key, "")
        raise ConfigError(f"{source}: bad value {raw!r} for {key}{choices}") from exc


def _boolean(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {raw!r} (use 1/0, true/false)")


def build_policy(config: WorkerConfig, num_draft_tokens: int,
                 calibration: Optional[CalibrationTable]) -> ModePolicy:
    """The policy `config` names. `num_draft_tokens` is K, the most drafts a step can accept
    (SGLang's speculative_num_steps), so accept lengths lie in 1..K+1."""
    if config.policy is PolicyKind.THRESHOLD:
        return ThresholdPolicy(threshold=config.threshold, num_draft_tokens=num_draft_tokens,
                               band=config.band, min_dwell_steps=config.min_dwell_steps)
    if config.policy is PolicyKind.SPEC:
        return PinnedPolicy(Mode.SPEC, num_draft_tokens)
    if config.policy is PolicyKind.DECODE:
        return PinnedPolicy(Mode.DECODE, num_draft_tokens)
    if config.policy is PolicyKind.CYCLE:
        return CyclePolicy(hold=config.min_dwell_steps, num_draft_tokens=num_draft_tokens)
    if calibration is None:
        raise ConfigError("policy=goodput needs a calibration table: leave DGW_CALIBRATION="
                          "measure (timed at start-up) or point it at a JSON table, or set "
                          "DGW_POLICY=threshold")
    if calibration.num_draft_tokens != num_draft_tokens:
        raise ConfigError(f"calibration table is for K={calibration.num_draft_tokens} but the "
                          f"server speculates K={num_draft_tokens} steps; re-measure it "
                          "(DGW_CALIBRATION=measure)")
    return GoodputPolicy(calibration, margin=config.margin,
                         min_dwell_steps=config.min_dwell_steps,
                         probe_every=config.probe_every, ema_alpha=config.ema_alpha)
