"""Which code made a result: recorded in every result file a tool writes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence


def checkout_commit() -> Optional[str]:
    """This checkout's commit (`-dirty` with uncommitted changes), None outside a git checkout
    (an installed package)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def command_line(prog: str, argv: Optional[Sequence[str]]) -> str:
    """The command that made a result: `prog` and its arguments (this process's where `argv`
    is None, as argparse reads them)."""
    return " ".join([prog, *(sys.argv[1:] if argv is None else argv)])
