"""The arguments every toy side-by-side run (`dgw demo`, `dgw accept-shift`) takes."""

from __future__ import annotations

import argparse

from dual_graph_worker.engines.reference.build import default_device
from dual_graph_worker.core.argtypes import int_range, output_dir, positive_int, torch_device
from dual_graph_worker.engines.reference.toy import TOY_MAX_HIDDEN


def add_toy_run_args(ap: argparse.ArgumentParser, out: str) -> None:
    """The arguments every toy side-by-side run (`dgw demo`, `dgw accept-shift`) takes."""
    ap.add_argument("--input-len", type=positive_int, default=16)
    ap.add_argument("--output-len", type=positive_int, default=48)
    ap.add_argument("--hidden", type=int_range(8, TOY_MAX_HIDDEN), default=256,
                    help="toy model width (= vocab), a multiple of 8")
    ap.add_argument("--device", type=torch_device, default=default_device(), help="cpu or cuda[:N]")
    ap.add_argument("--out", type=output_dir, default=out)
