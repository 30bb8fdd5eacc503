"""Human units for the command line and tables: '4GiB' <-> bytes, '30s' <-> seconds."""

from __future__ import annotations

import math
import re

from dual_graph_worker.core.errors import ConfigError

# Lower-case suffix -> factor (_parse lower-cases the unit: '4gib' and '4GiB' agree); a bare
# number is bytes.
_SIZE_FACTORS = (
    ("", 1), ("b", 1),
    ("kib", 1 << 10), ("mib", 1 << 20), ("gib", 1 << 30), ("tib", 1 << 40),
    ("k", 1000), ("kb", 1000), ("m", 1000 ** 2), ("mb", 1000 ** 2),
    ("g", 1000 ** 3), ("gb", 1000 ** 3), ("t", 1000 ** 4), ("tb", 1000 ** 4),
)
_DURATION_FACTORS = (("", 1.0), ("s", 1.0), ("ms", 1e-3), ("min", 60.0), ("m", 60.0))
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def _parse(text: str, factors: tuple[tuple[str, float], ...], what: str, examples: str) -> float:
    m = _NUMBER_UNIT.match(str(text))
    table = dict(factors)
    if not m or m.group(2).lower() not in table:
        raise ConfigError(f"cannot read {what} {text!r}; write {examples}")
    value = float(m.group(1)) * table[m.group(2).lower()]
    if not 0 < value < math.inf:
        raise ConfigError(f"{what} {text!r} must be > 0 and finite")
    return value


def parse_size(text: str) -> int:
    """'4GiB' -> 4294967296, '512MiB', '1.5GB', '1048576' (bytes). Raises ConfigError."""
    return int(round(_parse(text, _SIZE_FACTORS, "size", "a number with an optional unit, "
                            "e.g. 4GiB, 512MiB, 1.5GB or 1073741824 (bytes)")))


def parse_duration(text: str) -> float:
    """'30' or '30s' -> 30.0, '500ms' -> 0.5, '2min' -> 120.0. Raises ConfigError."""
    return _parse(text, _DURATION_FACTORS, "duration",
                  "seconds with an optional unit, e.g. 30, 30s, 500ms or 2min")


def format_bytes(n: float) -> str:
    """Binary units, two decimals: 1536 -> '1.50 KiB'."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{int(n)} B"
