"""Host time of one catch-up pass's indices: computed on the host and uploaded at once (what
the worker does when the batch has host lengths) against computed by ~25 small device ops.

    python -m bench.catch_up_indices [--device cuda] [--iters 300] [--out out/catch-up-indices]

A switch into speculation is host-bound at small batches (the catch-up's draft extend is
eager), so launches are what it pays. Both paths run alternately on the same inputs; the
figure is the median host microseconds per call (no device sync inside the timing). Prints a
table, writes JSON and a bar plot. Random KV-slot table, no model: indices only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dual_graph_worker.core.errors import report_user_errors
from dual_graph_worker.core.argtypes import OneLineParser, output_dir, positive_int, torch_device
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.engines.sglang.catch_up import build_catch_up_indices, plan_passes

SHAPES = ((1, 1), (1, 8), (8, 4), (64, 4), (64, 32))     # (requests behind, tokens each)


def _time(fn, iters: int) -> float:
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def measure(requests: int, tokens: int, device: str, iters: int) -> dict:
    rng = np.random.default_rng(requests * 100 + tokens)
    req_to_token = torch.randint(1, 1 << 20, (512, 4096), dtype=torch.int32, device=device)
    rows = rng.choice(512, size=requests, replace=False)
    counts = [tokens] * requests
    ends = (rng.integers(tokens, 2048, size=requests)).tolist()
    (segments,) = plan_passes(counts, 8192)
    positions = list(range(requests))
    rows_d = torch.as_tensor(rows, device=device)
    ends_d = torch.as_tensor(ends, device=device)

    def host():
        build_catch_up_indices(segments, counts=counts, batch_positions=positions,
                               req_to_token=req_to_token, rows_cpu=rows, ends_cpu=ends)

    def on_device():
        build_catch_up_indices(segments, counts=counts, batch_positions=positions,
                               req_to_token=req_to_token, req_pool_indices=rows_d, ends=ends_d)

    for fn in (host, on_device):       # warm: allocator, pinned blocks, kernels
        for _ in range(20):
            fn()
    host_us, device_us = [], []
    for _ in range(3):                 # alternate, so a slow spell falls on both
        host_us.append(_time(host, iters))
        device_us.append(_time(on_device, iters))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    h, d = statistics.median(host_us), statistics.median(device_us)
    return {"requests": requests, "tokens_each": tokens, "host_us": round(h, 1),
            "device_us": round(d, 1), "device_over_host": round(d / h, 2)}


def _plot(rows: list[dict], path: Path, note: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = [f"{r['requests']} x {r['tokens_each']}" for r in rows]
    x = np.arange(len(rows))
    fig = Figure(figsize=(7, 3.2))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.bar(x - 0.2, [r["host_us"] for r in rows], 0.4, label="host-computed, one upload")
    ax.bar(x + 0.2, [r["device_us"] for r in rows], 0.4, label="device ops")
    ax.set_xticks(x, labels)
    ax.set_xlabel("requests behind x tokens each")
    ax.set_ylabel("host us per pass (median)")
    ax.set_title(note, fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(prog="python -m bench.catch_up_indices", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=torch_device,
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=positive_int, default=300)
    ap.add_argument("--out", type=output_dir, default="out/catch-up-indices")
    args = ap.parse_args(argv)
    out = Path(args.out)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    note = f"catch-up indices, host us per pass, {name}, torch {torch.__version__}"
    rows = [measure(r, t, args.device, args.iters) for r, t in SHAPES]
    print(note)
    print(" requests x tokens   host-computed us   device-ops us   device / host")
    for r in rows:
        print(f"{r['requests']:9d} x {r['tokens_each']:<6d} {r['host_us']:16.1f} "
              f"{r['device_us']:15.1f} {r['device_over_host']:15.2f}")
    write_json({"note": note, "device": args.device, "iters": args.iters, "rows": rows},
               out / "catch-up-indices.json")
    _plot(rows, out / "catch-up-indices.png", note)
    print(f"wrote {out}/catch-up-indices.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(report_user_errors(main))
