"""The arguments every toy side-by-side run (`dgw demo`, `dgw accept-shift`) takes."""

from __future__ import annotations

import argparse

from dual_graph_worker.core.argtypes import int_range, output_dir, positive_int, torch_device
from dual_graph_worker.core.errors import DualGraphError
from dual_graph_worker.engines.reference.build import default_device
from bench.reference.loadgen import MIN_OUTPUT_LEN, output_range
from dual_graph_worker.engines.reference.config import TOY_MAX_HIDDEN
from dual_graph_worker.engines.reference.toy import toy_configs


def add_toy_run_args(ap: argparse.ArgumentParser, out: str) -> None:
    """The arguments every toy side-by-side run (`dgw demo`, `dgw accept-shift`) takes."""
    ap.add_argument("--input-len", type=positive_int, default=16)
    ap.add_argument("--output-len", type=int_range(MIN_OUTPUT_LEN), default=48)
    ap.add_argument("--hidden", type=int_range(8, TOY_MAX_HIDDEN), default=256,
                    help="toy model width (= vocab), a multiple of 8")
    ap.add_argument("--device", type=torch_device, default=default_device(), help="cpu or cuda[:N]")
    ap.add_argument("--out", type=output_dir, default=out)


def toy_context(ap: argparse.ArgumentParser, hidden: int, input_len: int, output_len: int,
                spread: float, num_draft_tokens: int, lower: str) -> int:
    """The context a toy run's requests need; the parser's one-line error where the toy width
    is no model or the run does not fit its context (`lower`: the flags that shrink it)."""
    try:
        limit = toy_configs(hidden)[0].max_position_embeddings
    except DualGraphError as exc:
        ap.error(f"--hidden: {exc}")
    longest = output_range(output_len, spread)[1]
    context = needed_context(input_len, output_len, spread, num_draft_tokens)
    if context > limit:
        ap.error(f"--input-len + the longest output ({longest}) + the draft tokens + 4 = "
                 f"{context} is over the toy model's context of {limit}; lower {lower}")
    return context


def needed_context(input_len: int, output_len: int, spread: float, num_draft_tokens: int) -> int:
    """A toy run's longest request: its prompt, its longest output, and one spec step's room."""
    return input_len + output_range(output_len, spread)[1] + num_draft_tokens + 4
