"""The core's C loops, built on first use: compiled with the C compiler Python was built with
into a cache keyed by the source, the flags and the interpreter, then imported. Every later
process, every TP rank included, imports the cached build. Triton builds its launchers the same
way, so a host that runs SGLang has the compiler."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

from dual_graph_worker.core.errors import DualGraphError
from dual_graph_worker.core.settings import cache_home

# No contraction into fused multiply-adds: every operation rounds as Python's does.
_FLAGS = ("-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")


class NativeBuildError(DualGraphError):
    """The C loops could not be built here (no compiler, no Python headers)."""


def load(source: Path, name: str) -> ModuleType:
    """The extension module `name` (its PyInit_<name>) built from `source`, from the cache when
    built before; NativeBuildError where it cannot be built."""
    built = cached_path(source, name)
    try:
        if not built.exists():
            _build(source, built)
    except OSError as e:
        raise NativeBuildError(f"cannot write the C loops' cache {built.parent}: {e.strerror}; "
                               "set XDG_CACHE_HOME to a writable folder, or DGW_ROW_LOOPS=python"
                               ) from None
    try:
        spec = importlib.util.spec_from_file_location(name, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as e:
        raise NativeBuildError(f"cannot load {built}: {e}; delete it to rebuild, or set "
                               "DGW_ROW_LOOPS=python") from None
    return module


def cached_path(source: Path, name: str) -> Path:
    """Where `source`'s build for this interpreter is cached."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    try:
        text = source.read_bytes()
        key = hashlib.sha256(b"\0".join([text, " ".join(_FLAGS).encode(), sys.version.encode(),
                                         suffix.encode()])).hexdigest()[:16]
        return cache_home() / "native" / f"{name}-{key}{suffix}"
    except (OSError, RuntimeError) as e:          # no source shipped; no home to cache in
        raise NativeBuildError(f"cannot build {source.name}: {e}; reinstall the package, or "
                               "set DGW_ROW_LOOPS=python") from None


def _build(source: Path, built: Path) -> None:
    """Compiles into a temporary file beside `built`, then renames it: ranks building at once
    each rename a whole file. Python's own compiler first, then `cc`."""
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise NativeBuildError(f"no Python.h under {include}: install the Python development "
                               "headers (e.g. python3-dev), or set DGW_ROW_LOOPS=python")
    built.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=built.suffix, dir=built.parent)
    os.close(fd)
    extra = ["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else []
    failures = []
    try:
        for compiler in dict.fromkeys([sysconfig.get_config_var("CC") or "cc", "cc"]):
            command = [*shlex.split(compiler), *_FLAGS, *extra, f"-I{include}", str(source),
                       "-o", tmp]
            try:
                done = subprocess.run(command, capture_output=True, text=True)
            except OSError as e:
                failures.append(f"{command[0]}: {e.strerror}")
                continue
            if done.returncode == 0:
                os.chmod(tmp, 0o755)                    # other users of a shared cache load it
                os.replace(tmp, built)
                return
            lines = done.stderr.strip().splitlines() or ["no message"]
            failures.append(f"{command[0]}: " + next((line for line in lines if "error" in line),
                                                     lines[0]))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    raise NativeBuildError(f"no C compiler could build {source.name} ({'; '.join(failures)}): "
                           "install one (gcc), or set DGW_ROW_LOOPS=python")
