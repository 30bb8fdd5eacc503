"""Every ``DGW_*`` setting in one typed registry: name, type, default, bounds, help.

The registry is the only source of truth: `Settings` is built from it, the parser and the
launch-time validation read it, and docs/settings.md is generated from it (`dgw settings`).
Values come from, in increasing precedence: the defaults, the JSON object in the file named by
``DGW_CONFIG``, and individual ``DGW_*`` environment variables. Every scheduler process (one per
TP rank) reads the same environment, so every rank builds the same policy.
"""

from __future__ import annotations

import difflib
import enum
import math
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any, Mapping, Optional, Sequence

from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.jsonio import read_json_object

CONFIG_FILE_ENV = "DGW_CONFIG"
# Set by nsys when it injects its NVTX listener; read as-is (a profiler's, not a setting).
NSYS_NVTX_INJECTION_ENV = "NVTX_INJECTION64_PATH"
# Where built C loops are kept (the XDG base-directory rule's, read as-is: no setting).
CACHE_HOME_ENV = "XDG_CACHE_HOME"
ENV_PREFIX = "DGW_"
MEASURE = "measure"


class RowLoops(str, enum.Enum):
    AUTO = "auto"            # the C loops where they build, else Python's (one warning)
    C = "c"                  # the C loops, or a ConfigError naming why they cannot build
    PYTHON = "python"        # the same loops in Python: slower, nothing to build


class PolicyKind(str, enum.Enum):
    GOODPUT = "goodput"      # the measured-goodput controller (controller.py)
    THRESHOLD = "threshold"  # speculate while bs <= threshold
    SPEC = "spec"            # pinned: speculate wherever the spec pool covers the batch
    DECODE = "decode"        # pinned: never speculate (the plain-server baseline)
    CYCLE = "cycle"          # profiling aid: a fixed spec/decode schedule


@dataclass(frozen=True)
class Setting:
    key: str                      # field of Settings and key of the DGW_CONFIG file
    env: str                      # environment variable
    kind: Any                     # int, float, bool, str, or an Enum class
    default: Any
    help: str
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    optional: bool = False        # None ("unset") is allowed

    def parse(self, raw: Any, source: str) -> Any:
        """`raw` (a JSON value or an environment string) as this setting's type, or ConfigError
        naming the setting, the value and what would be accepted."""
        where = f"{source}: {self.env}" if source != self.env else self.env
        if self.optional and (raw is None or (isinstance(raw, str) and raw.strip().lower()
                                              in ("", "none"))):
            return None
        try:
            value = _PARSERS[self.kind if self.kind in _PARSERS else enum.Enum](self, raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}={raw!r} is not valid: {exc}; expected {self.expects()}"
                              ) from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.minimum is not None and value < self.minimum:
                raise ConfigError(f"{where}={raw!r} is below its minimum {self.minimum:g}; "
                                  f"expected {self.expects()}")
            if self.maximum is not None and value > self.maximum:
                raise ConfigError(f"{where}={raw!r} is above its maximum {self.maximum:g}; "
                                  f"expected {self.expects()}")
        return value

    def read(self, environ: Mapping[str, str]) -> Any:
        """This setting's value as `Settings.from_env` resolves it (its variable, else its key
        in the DGW_CONFIG file, else its default), the others unchecked: for a reader that
        needs one setting before the rest."""
        raw = environ.get(self.env, "")
        if raw != "":
            return self.parse(raw, self.env)
        path, file = _config_file(environ)
        if file is not None and self.key in file:
            return self.parse(file[self.key], f"{CONFIG_FILE_ENV}={path}: {self.key}")
        return self.default

    def expects(self) -> str:
        if isinstance(self.kind, type) and issubclass(self.kind, enum.Enum):
            return "one of " + ", ".join(m.value for m in self.kind)
        what = {int: "an integer", float: "a finite number", bool: "1/0 or true/false",
                str: "a string"}[self.kind]
        lo = "" if self.minimum is None else f" >= {self.minimum:g}"
        hi = "" if self.maximum is None else f" <= {self.maximum:g}"
        return what + lo + (" and" if lo and hi else "") + hi + (" (or unset)" if self.optional
                                                                 else "")


def _int(s: Setting, raw: Any) -> int:
    if isinstance(raw, bool):
        raise ValueError("a boolean is not a count")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float):
        if raw.is_integer():
            return int(raw)
        raise ValueError("not a whole number")
    text = str(raw).strip()
    if not text.lstrip("+-").isdigit():
        raise ValueError("not an integer")
    return int(text)


def _float(s: Setting, raw: Any) -> float:
    if isinstance(raw, bool):
        raise ValueError("a boolean is not a number")
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError("not finite")
    return value


def _bool(s: Setting, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean")


def _str(s: Setting, raw: Any) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError("an empty or non-string value")
    return raw


def _enum(s: Setting, raw: Any) -> enum.Enum:
    if isinstance(raw, s.kind):
        return raw
    if not isinstance(raw, str):
        raise ValueError("not a name")
    return s.kind(raw.strip().lower())


_PARSERS: Mapping[type, Any] = MappingProxyType(
    {int: _int, float: _float, bool: _bool, str: _str, enum.Enum: _enum})

def _setting(env: str, default: Any, help: str, *, minimum: Optional[float] = None,
             maximum: Optional[float] = None) -> Any:
    """A Settings field whose registry entry (env name, bounds, help) rides in its metadata."""
    return field(default=default, metadata={"env": env, "help": help, "minimum": minimum,
                                            "maximum": maximum})


@dataclass(frozen=True)
class Settings:
    policy: PolicyKind = _setting(
        "DGW_POLICY", PolicyKind.GOODPUT,
        "how each step's mode is chosen: goodput (measured controller), threshold, spec or "
        "decode (pinned), cycle (profiling aid)")
    threshold: int = _setting("DGW_THRESHOLD", 32, "threshold policy: speculate while the "
                              "running batch is at most this", minimum=0)
    band: int = _setting("DGW_BAND", 2, "threshold policy: hysteresis band around the "
                         "threshold", minimum=0)
    min_dwell_steps: int = _setting("DGW_MIN_DWELL", 8, "steps a mode runs before the policy "
                                    "may switch (cycle: steps per phase)", minimum=0)
    margin: float = _setting("DGW_MARGIN", 0.03, "goodput: relative win the other mode needs "
                             "before a switch", minimum=0.0, maximum=1.0)
    explore_budget: float = _setting("DGW_EXPLORE_BUDGET", 0.01, "goodput: share of step "
                                     "time spent re-measuring the mode not chosen",
                                     minimum=0.0, maximum=0.5)
    explore_steps: int = _setting("DGW_EXPLORE_STEPS", 4, "goodput: consecutive steps of one "
                                  "re-measurement", minimum=1, maximum=64)
    explore_cap: float = _setting("DGW_EXPLORE_CAP", 0.0, "goodput: dearest re-measurement "
                                  "made, in explore-steps of the current mode (0: none dearer "
                                  "than the bank is ruled out; it runs into debt)", minimum=0.0)
    stale_after: int = _setting("DGW_STALE_AFTER", 256, "goodput: steps after which a mode's "
                                "step time near this batch size is re-measured", minimum=1)
    sync_every: int = _setting("DGW_SYNC_EVERY", 8, "goodput: steps between exchanges of the "
                               "ranks' measurements", minimum=1, maximum=1024)
    ema_alpha: float = _setting("DGW_EMA_ALPHA", 0.2, "goodput: weight of one new step-time "
                                "sample", minimum=0.001, maximum=1.0)
    switch_horizon: int = _setting("DGW_SWITCH_HORIZON", 64, "goodput: steps a switch's "
                                   "catch-up cost is spread over", minimum=1)
    draft_floor: bool = _setting("DGW_DRAFT_FLOOR", True, "goodput: a draft token costs no "
                                 "less than the draft's share of the weights of a prefill "
                                 "token (0: as measured, whatever small catch-ups fit)")
    row_loops: RowLoops = _setting("DGW_ROW_LOOPS", RowLoops.AUTO, "goodput: the loops over "
                                   "a batch's requests: auto (C where a compiler builds them), "
                                   "c, or python (slower)")
    calibration: str = _setting("DGW_CALIBRATION", MEASURE, "goodput prior: 'measure' (graph "
                                "replays at start-up) or a calibration JSON path")
    calibrate_iters: int = _setting("DGW_CALIBRATE_ITERS", 5, "timed replays per graph when "
                                    "measuring the prior", minimum=1, maximum=1000)
    spec_max_bs: Optional[int] = _setting("DGW_SPEC_MAX_BS", None, "SGLang: largest batch the "
                                          "spec pool captures (unset: the server's speculative "
                                          "list, as EAGLE-3's; a capture config's spec list "
                                          "replaces it)", minimum=1)
    decode_max_bs: Optional[int] = _setting("DGW_DECODE_MAX_BS", None, "SGLang: largest batch "
                                            "the decode pool captures (unset: the server's)",
                                            minimum=1)
    capture_config: Optional[str] = _setting("DGW_CAPTURE_CONFIG", None, "tuned capture "
                                             "config JSON (make capture-tune)")
    continuity: Continuity = _setting("DGW_CONTINUITY", Continuity.LAZY_CATCH_UP,
                                          "draft state while decoding: lazy-catch-up or "
                                          "keep-current")
    lazy_stash_mb: int = _setting("DGW_LAZY_STASH_MB", 0, "lazy-catch-up: stash size in MiB "
                                  "(0: 40% of the GPU memory free after start-up)", minimum=0)
    defer_draft_prefill: bool = _setting("DGW_DEFER_DRAFT_PREFILL", True, "lazy-catch-up: "
                                         "prompts joining a decoding batch skip the draft's "
                                         "prefill")
    catch_up_kv_only: bool = _setting("DGW_CATCH_UP_KV_ONLY", False, "lazy-catch-up: the "
                                      "draft's K/V alone at backlog positions, its whole layer "
                                      "only at each request's last")
    catch_up_kv_check: bool = _setting("DGW_CATCH_UP_KV_CHECK", False, "with "
                                       "DGW_CATCH_UP_KV_ONLY: also run the draft's whole layer "
                                       "over every split pass and log how far the filled K/V "
                                       "were from its (a check: doubles a catch-up's work)")
    draft_extend_graphs: bool = _setting("DGW_DRAFT_EXTEND_GRAPHS", True, "keep-current: "
                                         "replay the one-token draft extend from CUDA graphs")
    step_log: Optional[str] = _setting("DGW_STEP_LOG", None, "JSONL path: one line per decode "
                                       "step")
    stall_trace: Optional[str] = _setting("DGW_STALL_TRACE", None, "JSONL path: the "
                                          "scheduler thread's stack while no step starts")
    stall_trace_s: float = _setting("DGW_STALL_TRACE_S", 1.0, "seconds without a step that "
                                    "count as a stall", minimum=0.001, maximum=3600.0)
    capture_probe: Optional[str] = _setting("DGW_CAPTURE_PROBE", None, "SGLang: JSON path: "
                                            "capture time, own-pool bytes and replay time of "
                                            "every graph captured (make capture-measure "
                                            "ENGINE=sglang; needs room: no pool is shared)")
    nvtx: bool = _setting("DGW_NVTX", True, "emit NVTX ranges when a profiler listens")
    profile_steady_after_steps: Optional[int] = _setting(
        "DGW_PROFILE_STEADY_AFTER_STEPS", None, "profiling: mark steady state before decode "
        "step N+1", minimum=0)
    profile_steps: Optional[int] = _setting("DGW_PROFILE_STEPS", None, "profiling: nsys "
                                            "capture range of this many steady steps",
                                            minimum=1)

    def __post_init__(self) -> None:
        for s in REGISTRY:
            value = getattr(self, s.key)
            # Re-parse constructor values so a Settings built in code obeys the same rules and
            # holds the same types ("cycle" becomes PolicyKind.CYCLE).
            if not (value is None and s.optional):
                parsed = s.parse(value, s.env)
                if parsed != value:
                    raise ConfigError(f"{s.env}={value!r} is not valid; expected {s.expects()}")
                object.__setattr__(self, s.key, parsed)
        if self.policy is PolicyKind.CYCLE and self.min_dwell_steps < 1:
            raise ConfigError("DGW_POLICY=cycle holds each mode for DGW_MIN_DWELL steps, which "
                              f"must be >= 1, got {self.min_dwell_steps}")
        if None not in (self.spec_max_bs, self.decode_max_bs) and \
                self.decode_max_bs < self.spec_max_bs:
            raise ConfigError(f"DGW_DECODE_MAX_BS={self.decode_max_bs} is below "
                              f"DGW_SPEC_MAX_BS={self.spec_max_bs}: the decode pool must cover "
                              "every batch the spec pool does; raise the first or lower the second")
        if self.profile_steps is not None and self.profile_steady_after_steps is None:
            raise ConfigError(f"DGW_PROFILE_STEPS={self.profile_steps} needs "
                              "DGW_PROFILE_STEADY_AFTER_STEPS, the step the profiling window "
                              "starts after; set it, or unset DGW_PROFILE_STEPS")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "Settings":
        """The file's values under the variables': checked together, so a variable may fix
        what the file alone would get wrong."""
        given = user_settings(environ)
        values = _parsed(given.file, f"{CONFIG_FILE_ENV}={given.file_path}") \
            if given.file is not None else {}
        return cls(**values | {BY_ENV[env].key: BY_ENV[env].parse(raw, env)
                               for env, raw in given.env.items()})

    def to_json(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}


def _registry() -> tuple[Setting, ...]:
    hints = typing.get_type_hints(Settings)
    out = []
    for f in fields(Settings):
        kind, args = hints[f.name], typing.get_args(hints[f.name])
        optional = type(None) in args
        if optional:
            kind = next(a for a in args if a is not type(None))
        m = f.metadata
        out.append(Setting(f.name, m["env"], kind, f.default, m["help"], m["minimum"],
                           m["maximum"], optional))
    return tuple(out)


REGISTRY: tuple[Setting, ...] = _registry()
BY_KEY: Mapping[str, Setting] = MappingProxyType({s.key: s for s in REGISTRY})
BY_ENV: Mapping[str, Setting] = MappingProxyType({s.env: s for s in REGISTRY})


@dataclass(frozen=True)
class UserSettings:
    """What the user set, before parsing: the DGW_CONFIG file's object and the DGW_* variables."""

    file: Optional[Mapping[str, Any]]
    file_path: Optional[str]
    env: Mapping[str, str]          # DGW_* name -> raw value (non-empty ones only)

    def keys(self) -> frozenset[str]:
        return frozenset(set(self.file or ()) | {BY_ENV[e].key for e in self.env})


def read_setting(key: str) -> Any:
    """Setting `key` as this process's environment resolves it (Setting.read), the others
    unread: for a caller that needs one setting and no Settings."""
    return BY_KEY[key].read(os.environ)


def cache_home() -> Path:
    """This package's cache folder: $XDG_CACHE_HOME/dual-graph-worker, else ~/.cache/..."""
    base = os.environ.get(CACHE_HOME_ENV) or str(Path.home() / ".cache")
    return Path(base) / "dual-graph-worker"


def nsys_injected() -> bool:
    """Whether nsys injected its NVTX listener into this process (a profiler's variable, read
    as-is: no setting)."""
    return bool(os.environ.get(NSYS_NVTX_INJECTION_ENV))


def user_settings(environ: Mapping[str, str]) -> UserSettings:
    """Refuses an unknown DGW_* variable (naming the closest known one), so a misspelt setting
    never leaves the default in place silently."""
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in BY_ENV
                     and k != CONFIG_FILE_ENV and environ[k] != "")
    if unknown:
        raise ConfigError(f"unknown setting {unknown[0]}{_closest(unknown[0], BY_ENV)}; "
                          "`dgw settings` lists every DGW_* variable")
    path, file = _config_file(environ)
    return UserSettings(file, path, {k: v for k, v in environ.items() if k in BY_ENV and v != ""})


def assignments(items: Sequence[str]) -> dict[str, str]:
    """`DGW_NAME=VALUE` strings (a benchmark's worker variant) as an environment, each name and
    value checked as the worker would check them at launch."""
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith(ENV_PREFIX) or not value:
            raise ConfigError(f"{item!r} is no setting; write DGW_NAME=VALUE, e.g. "
                              "DGW_SPEC_MAX_BS=256")
        env[name] = value
    Settings.from_env(env)
    return env


def settings_env(**values: Any) -> dict[str, str]:
    """Registry keys and values (`min_dwell_steps=4`) as the DGW_* environment that sets them,
    for a benchmark launching a worker; an unknown key is a ConfigError naming it."""
    unknown = sorted(set(values) - set(BY_KEY))
    if unknown:
        raise ConfigError(f"unknown setting key {unknown[0]!r}{_closest(unknown[0], BY_KEY)}; "
                          "`dgw settings` lists every key")
    return {BY_KEY[key].env: str(_plain(value)) for key, value in values.items()}


def explicit_keys(environ: Mapping[str, str]) -> frozenset[str]:
    """The keys a user set rather than left at their defaults."""
    return user_settings(environ).keys()


def check_output(key: str, path: str) -> None:
    """ConfigError naming setting `key` where the file it names could not be written, creating
    nothing: it must be a writable file, or not exist under a writable folder."""
    env, target = BY_KEY[key].env, Path(path)
    if target.is_dir():
        raise ConfigError(f"{env}={path} is a folder; name a file in it, or unset {env}")
    existing = target if target.exists() else next(p for p in target.absolute().parents
                                                   if p.exists())
    if not (os.access(existing, os.W_OK) and (existing is target or existing.is_dir())):
        raise ConfigError(f"{env}={path}: {existing} is not writable; name a writable file, "
                          f"or unset {env}")


def open_output(key: str, path: str) -> IO[str]:
    """The file setting `key` names (a diagnostic output), opened to append, its folder made;
    ConfigError naming the variable where it cannot be."""
    env = BY_KEY[key].env
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a")
    except OSError as exc:
        raise ConfigError(f"cannot open {env} file {path}: {exc.strerror or exc}; name a "
                          f"writable file or unset {env}") from None


def docs_table() -> str:
    """The markdown table of every setting (docs/settings.md is this, generated)."""
    rows = ["| variable | JSON key | default | accepts | meaning |", "|---|---|---|---|---|"]
    for s in REGISTRY:
        default = "unset" if s.default is None else _plain(s.default)
        rows.append(f"| `{s.env}` | `{s.key}` | `{default}` | {s.expects()} | {s.help} |")
    return "\n".join(rows) + "\n"


def _parsed(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    unknown = sorted(set(data) - set(BY_KEY))
    if unknown:
        raise ConfigError(f"{source}: unknown key {unknown[0]!r}{_closest(unknown[0], BY_KEY)}"
                          f"; known keys: {', '.join(BY_KEY)}")
    return {k: BY_KEY[k].parse(v, f"{source}: {k}") for k, v in data.items()}


def _closest(name: str, known: Mapping[str, Any]) -> str:
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _config_file(environ: Mapping[str, str]
                 ) -> tuple[Optional[str], Optional[Mapping[str, Any]]]:
    """The DGW_CONFIG file's path and object (None, None where the variable is unset)."""
    path = environ.get(CONFIG_FILE_ENV) or None
    if path is None:
        return None, None
    return path, read_json_object(path, f"{CONFIG_FILE_ENV} file",
                                  f"fix it or unset {CONFIG_FILE_ENV}")
