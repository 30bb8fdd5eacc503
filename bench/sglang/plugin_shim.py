"""Make the plugin's entry point visible without installing the project.

SGLang finds plugins with importlib.metadata.entry_points(group="sglang.srt.plugins") in the
main process and again in every spawned scheduler process. On the GPU machine the project is a
copied work tree (not pip-installed), so this writes a minimal ``*.dist-info`` (METADATA +
entry_points.txt) into a folder that goes on sys.path and PYTHONPATH, next to the repo root.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from pathlib import Path

GROUP = "sglang.srt.plugins"
NAME = "dual_graph_worker"
TARGET = "dual_graph_worker.engines.sglang.plugin:register"
# Benchmark only (acc_control.py): always from the shim, never installed with the project.
BENCH_NAME = "dgw_bench_acc_control"
BENCH_TARGET = "bench.sglang.acc_control:register"


def pythonpath_env(repo_root: str | Path) -> dict[str, str]:
    """This process's environment with `repo_root` first on PYTHONPATH, for a child process
    that must import the project (and so the plugin) from the work tree."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo_root)] + rest))


def plugin_visible() -> bool:
    return any(ep.name == NAME and ep.value == TARGET
               for ep in importlib.metadata.entry_points(group=GROUP))


def write_entry_point_shim(folder: str | Path, plugin: bool = True) -> Path:
    """The shim's dist-info: the bench's accept-length control, and the plugin itself unless
    `plugin` is False (the project is installed)."""
    folder = Path(folder)
    info = folder / "dual_graph_worker_shim-0.1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: dual-graph-worker-shim\nVersion: 0.1.0\n")
    entries = [f"{BENCH_NAME} = {BENCH_TARGET}"] + ([f"{NAME} = {TARGET}"] if plugin else [])
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n" + "\n".join(entries) + "\n")
    return folder


def ensure_plugin_discoverable(shim_folder: str | Path, repo_root: str | Path) -> str:
    """Return how the plugin is found: "installed" or "shim" (after installing the shim)."""
    root = str(Path(repo_root).resolve())
    if root not in sys.path:
        sys.path.insert(0, root)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    installed = plugin_visible()
    shim = str(write_entry_point_shim(shim_folder, plugin=not installed).resolve())
    sys.path.insert(0, shim)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [shim, root] + [p for p in parts if p not in (shim, root)])
    importlib.invalidate_caches()
    if installed:
        return "installed"
    if not plugin_visible():
        raise RuntimeError(f"entry point {GROUP}:{NAME} still not visible after writing the "
                           f"shim in {shim}; install the project (pip install -e .)")
    return "shim"
