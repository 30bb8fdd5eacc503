"""Which code made a result: recorded in every result file a tool writes."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional


def checkout_commit() -> Optional[str]:
    """This checkout's commit (`-dirty` with uncommitted changes), None outside a git checkout
    (an installed package)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
