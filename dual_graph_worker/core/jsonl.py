"""Reading the JSONL logs the worker appends to while it serves (step log, stall trace)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Iterator

from dual_graph_worker.core.errors import ConfigError


def json_lines(path: str | Path) -> Iterator[dict]:
    """Each line of `path` (gzipped when it ends in .gz) that holds a JSON object. Other lines
    are skipped: the writer may be half-way through the last one while a reader looks, and a
    server restarted on the same log leaves its torn line mid-file. Skipped lines before the
    last are counted in one warning line on stderr; a file that is no text is a ConfigError."""
    skipped = torn = 0
    try:
        with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    record = None
                if isinstance(record, dict):
                    skipped, torn = skipped + torn, 0
                    yield record
                elif line.strip():
                    torn += 1
    except (UnicodeDecodeError, gzip.BadGzipFile) as exc:
        raise ConfigError(f"{path} is not a JSONL log ({exc}); pass a log the worker "
                          "wrote") from exc
    if skipped:
        print(f"warning: {path}: skipped {skipped} line(s) that hold no JSON object",
              file=sys.stderr)
