"""GPU: what every candidate graph of both pools costs on an SGLang 0.5.17 server running the
worker (`make capture-measure ENGINE=sglang`), in the tuner's measurements format.

Two engine starts on the same candidate lists: one with DGW_CAPTURE_PROBE (each graph in a pool
of its own: capture time, isolated pool bytes, replay time; capture_probe.py), one as served
(the pools' bytes captured together, from SGLang's own per-runner graph memory). Llama-3-8B
shape with DUMMY weights.

    python -m bench.sglang.capture_measure --out DIR     # DIR/measurements.json, logs, probe
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from bench.sglang.engine_child import run_child
from bench.sglang.model_configs import engine_kwargs, llama3_8b_shapes, write_dummy_pair
from capture.measure import CANDIDATES, save_dummy_measured
from capture.sglang_probe import measurements_from_probe
from dual_graph_worker.core.argtypes import OneLineParser, positive_int
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.settings import settings_env

# SGLang's per-runner graph memory (GB) that belongs to the two pools; prefill graphs do not.
POOL_RUNNERS = ("target_verify", "draft_decode", "draft_extend", "decode_pool", "draft_sync")


def pool_sum(by_runner: dict) -> Optional[float]:
    """The pools' share of a per-runner figure (SGLang's graph GB or capture seconds)."""
    got = [float(by_runner[k]) for k in POOL_RUNNERS
           if isinstance(by_runner.get(k), (int, float))]
    return sum(got) if got else None


def together_bytes(server_info: dict) -> Optional[int]:
    """The pools' graph memory captured together, from a server's memory_usage.graph (GB)."""
    gb = pool_sum(((server_info or {}).get("memory_usage") or {}).get("graph") or {})
    return None if gb is None else int(gb * 2**30)


def engine_spec(name: str, target: Path, draft: Path, sizes: list[int], env: dict,
                mem_fraction: float) -> dict:
    kwargs = engine_kwargs("dual", target, draft, radix=True, log_level="warning") | {
        "cuda_graph_bs_decode": sizes, "cuda_graph_max_bs_decode": max(sizes),
        "mem_fraction_static": mem_fraction}
    env = settings_env(spec_max_bs=max(sizes), decode_max_bs=max(sizes)) | env
    return {"name": name, "engine_kwargs": kwargs, "env": env, "tasks": []}


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(prog="python -m bench.sglang.capture_measure",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True,
                    help="folder: measurements.json (what capture-tune reads), the probe's "
                         "raw file (capture-probe.json), each engine's log and result")
    ap.add_argument("--max-bs", type=positive_int, default=256,
                    help="largest candidate batch size of both pools")
    ap.add_argument("--mem-fraction-static", type=float, default=0.6,
                    help="the probed server holds every graph's pool apart: leave it room")
    ap.add_argument("--no-together", action="store_true",
                    help="skip the second start (the pools' bytes captured together)")
    ap.add_argument("--timeout-s", type=float, default=420.0, help="per engine start")
    args = ap.parse_args(argv)
    sizes = [b for b in CANDIDATES if b <= args.max_bs]
    if not sizes:
        ap.error(f"--max-bs {args.max_bs} leaves no candidate batch size")
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = work / "measurements.json"
    target, draft = write_dummy_pair(work / "models", llama3_8b_shapes())
    # Not NAME.json of an engine below: run_child writes each engine's result there.
    probe_path = work / "capture-probe.json"
    probe_path.unlink(missing_ok=True)
    res = run_child(work, engine_spec("probe", target, draft, sizes,
                                      settings_env(capture_probe=probe_path),
                                      args.mem_fraction_static),
                    shim_dir=work / "shim", timeout=args.timeout_s)
    if not probe_path.exists():
        print(f"error: the probed server wrote no {probe_path} (rc={res.get('returncode')}; "
              f"see {work}/probe.log)", file=sys.stderr)
        return 1
    total = None
    if not args.no_together:
        served = run_child(work, engine_spec("together", target, draft, sizes, {},
                                             args.mem_fraction_static),
                           shim_dir=work / "shim", timeout=args.timeout_s)
        total = together_bytes(served.get("server_info") or {})
    try:
        m = measurements_from_probe(json.loads(probe_path.read_text()), total,
                                    where=f"capture probe {probe_path}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    png = save_dummy_measured(m, out, "Llama-3-8B")
    for mode in ("spec", "decode"):
        keys = [g for g in m.graphs if g.key.mode.value == mode]
        print(f"{mode}: {len(keys)} keys, {sum(g.pool_bytes for g in keys) / 2**20:.0f} MiB "
              f"alone, {sum(g.capture_s for g in keys):.1f} s capture")
    if total is not None:
        print(f"both pools captured together: {total / 2**20:.0f} MiB")
    if m.meta.get("incomplete_keys"):
        print(f"keys missing a stage (left out): {m.meta['incomplete_keys']}")
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
