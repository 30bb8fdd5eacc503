"""argparse `type=` functions for every command line of the project: a bad value stops the
parser with one line naming the flag (argparse adds it) and the accepted range, before any work.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Sequence


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, naming the flag and pointing at --help
    (argparse's own prints the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _in_range(cast: Callable[[str], Any], lo: Any, hi: Any, want: str) -> Callable[[str], Any]:
    """A `cast` of the text in [lo, hi] (hi None: no upper bound; NaN is in no range)."""

    def parse(text: str):
        try:
            value = cast(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if not (lo <= value and (hi is None or value <= hi)):
            raise argparse.ArgumentTypeError(f"expected {want}, got {value}")
        return value

    parse.__name__ = want
    return parse


def int_range(lo: int, hi: Optional[int] = None) -> Callable[[str], int]:
    """An integer in [lo, hi] (hi None: no upper bound)."""
    return _in_range(int, lo, hi, f"an integer >= {lo}" if hi is None
                     else f"an integer in [{lo}, {hi}]")


def float_range(lo: float, hi: float) -> Callable[[str], float]:
    """A number in [lo, hi]."""
    return _in_range(float, lo, hi, f"a number in [{lo:g}, {hi:g}]")


positive_int = int_range(1)
non_negative_int = int_range(0)
seed_int = int_range(0, 2**63 - 1)


def positive_float(text: str) -> float:
    """A finite number > 0 (no nan, no inf)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def unit_float(text: str) -> float:
    """A number in [0, 1)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """Comma-separated integers >= 1, e.g. 1,4,16."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers >= 1 such as 1,4,16, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    """Comma-separated numbers, e.g. 1.5,2 (their range is the caller's to judge)."""
    try:
        return [float(p) for p in str(text).split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers such as 1.5,2, got {text!r}") from None


def int_list_up_to(hi: int) -> Callable[[str], list[int]]:
    """Comma-separated integers in [1, hi]."""

    def parse(text: str) -> list[int]:
        values = int_list(text)
        if max(values) > hi:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers in [1, {hi}], got {text!r}")
        return values

    parse.__name__ = f"integers in [1, {hi}]"
    return parse


def name_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """Comma-separated names, each one of `choices`, no repeats."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in str(text).split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if not names or bad or len(set(names)) != len(names):
            what = (f"unknown {', '.join(repr(n) for n in bad)}" if bad else
                    "a name repeats" if names else "no name")
            raise argparse.ArgumentTypeError(
                f"{what} in {text!r}; pass comma-separated names from {', '.join(choices)}")
        return names

    parse.__name__ = "name list"
    return parse


def torch_device(text: str) -> str:
    """cpu or cuda[:N], with cuda checked against the GPUs torch can see."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use cpu or cuda[:N]") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r} needs a CUDA GPU and torch sees none (torch.cuda.is_available() is "
                "False); use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(
                f"{text!r}: torch sees {count} GPU(s), cuda:0..cuda:{count - 1}; pick one of them")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text!r} is not supported here; use cpu or cuda[:N]")
    return text


def _writable_ancestor(path: Path) -> Optional[str]:
    """Why `path` (a folder to create, or a file's parent) cannot be created, or None."""
    for parent in (path, *path.parents):
        if parent.exists():
            if not parent.is_dir():
                return f"{parent} is a file, not a folder"
            if not os.access(parent, os.W_OK | os.X_OK):
                return f"{parent} is not writable"
            return None
    return None


def output_dir(text: str) -> str:
    """A folder that exists or can be created (no file in the way)."""
    why = _writable_ancestor(Path(text))
    if why:
        raise argparse.ArgumentTypeError(f"cannot write into {text!r}: {why}; pass another folder")
    return text


def output_file(text: str) -> str:
    """A file path whose folder exists or can be created, and that is no folder itself."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r} is a folder; pass a file path, e.g. {path / 'out.json'}")
    why = _writable_ancestor(path.parent)
    if why:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {why}; pass another path")
    return text


def existing_file(text: str) -> str:
    """A file that exists (not a folder)."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist; check the path")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file; pass the file's path")
    return text
