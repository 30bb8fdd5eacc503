"""Which SGLang release the plugin targets, and the check that says so clearly.

The worker subclasses SGLang internals (EAGLEWorkerV2, DecodeCudaGraphRunner) whose contracts were
verified line by line against one release; any other release may break them silently, so the
plugin refuses to register rather than run on an unverified version.
"""

from __future__ import annotations

import importlib.metadata
from typing import Optional

from dual_graph_worker.core.errors import DualGraphError

SUPPORTED_SGLANG_VERSION = "0.5.17"
INSTALL_HINT = "pip install 'dual-graph-worker[sglang]'"


class SGLangVersionError(DualGraphError, RuntimeError):
    """The installed SGLang is missing or is not the release this plugin was verified against."""


def installed_sglang_version() -> Optional[str]:
    """The installed SGLang version from package metadata (no import of SGLang itself)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_sglang_version(found: Optional[str]) -> None:
    """Raise `SGLangVersionError` naming the found and supported versions and the fix."""
    if found == SUPPORTED_SGLANG_VERSION:
        return
    what = "SGLang is not installed" if found is None else f"found SGLang {found}"
    raise SGLangVersionError(
        f"dual-graph-worker: {what}, but the DUAL_GRAPH_EAGLE3 plugin supports exactly "
        f"SGLang {SUPPORTED_SGLANG_VERSION} (it subclasses internals verified against that "
        f"release). Install the supported release with: {INSTALL_HINT}  "
        "(or uninstall dual-graph-worker to run this SGLang without the plugin).")
