"""Reading the JSONL logs the worker appends to while it serves (step log, stall trace)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterator


def json_lines(path: str | Path) -> Iterator[dict]:
    """Each line of `path` (gzipped when it ends in .gz) as a dict. A line that does not parse
    is skipped: the writer may be half-way through the last one while a reader looks."""
    with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as fh:
        for line in fh:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
