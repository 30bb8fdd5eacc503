"""Reading and checking the project's JSON files (capture measurements and configs, calibration
tables, the DGW_CONFIG settings file): every problem becomes a ConfigError that names the file
or field, so the CLI can print one line instead of a traceback."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.modes import Mode


def read_json(path: str | Path, what: str, fix: str) -> Any:
    """`fix`: what to do about a file that cannot be read or parsed, ending each error."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}; {fix}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not a UTF-8 text file; {fix}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} {path} is not valid JSON (line {exc.lineno}, column "
                          f"{exc.colno}: {exc.msg}); {fix}") from exc


def write_json(data: Any, path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a reader never sees a half-written file.
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(p)


def check_schema(d: Mapping, expected: str, what: str) -> None:
    got = d.get("schema")
    if got != expected:
        raise ConfigError(f"{what} has schema {got!r}, expected {expected!r}: it was written by "
                          "another version of the tools, or is another kind of file")


def read_json_object(path: str | Path, what: str, fix: str) -> Mapping:
    """read_json, and a JSON object, or ConfigError naming `fix` either way."""
    data = read_json(path, what, fix)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what} {path} must be a JSON object, got "
                          f"{'nothing' if data is None else type(data).__name__}; {fix}")
    return data


def need_mapping(data: Any, where: str) -> Mapping:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a JSON object, got "
                          f"{'nothing' if data is None else type(data).__name__}")
    return data


def need_field(d: Mapping, name: str, typ: type, where: str) -> Any:
    if name not in d:
        raise ConfigError(f"{where}.{name} is missing")
    v = d[name]
    # bool is an int subclass in Python; a JSON true is never a valid count.
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise ConfigError(f"{where}.{name} must be {typ.__name__}, got {v!r}")
    return v


def need_number(d: Mapping, name: str, where: str, allow_zero: bool) -> float:
    if name not in d:
        raise ConfigError(f"{where}.{name} is missing")
    v = d[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{where}.{name} must be a finite number, got {v!r}")
    if v < 0 or (v == 0 and not allow_zero):
        raise ConfigError(f"{where}.{name} must be {'>= 0' if allow_zero else '> 0'}, got {v}")
    return float(v)


def need_int_list(d: Mapping, name: str, where: str) -> tuple[int, ...]:
    v = d.get(name)
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise ConfigError(f"{where}.{name} must be a list of integer batch sizes, got {v!r}")
    return tuple(v)


def need_mode(d: Mapping, where: str) -> Mode:
    """The 'mode' field as a dual_graph_worker Mode ('spec' or 'decode')."""
    try:
        return Mode(d.get("mode"))
    except ValueError:
        raise ConfigError(f"{where}.mode must be 'spec' or 'decode', got {d.get('mode')!r}") from None
