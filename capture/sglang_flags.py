"""`dgw capture-flags CONFIG`: the SGLang launch line that runs a tuned capture config.

The server reads the config itself (dual_graph_worker.engines.sglang.capture_config, at start-up);
this command only prints what to start it with: DGW_CAPTURE_CONFIG and the speculative flags the
config was tuned with. docs/sglang-0.5.17.md §2, "A tuned capture config".
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

from dual_graph_worker.core.argtypes import OneLineParser
from dual_graph_worker.core.capture_schema import ServingCapture, load_capture
from dual_graph_worker.engines.sglang.capture_config import CAPTURE_CONFIG_ENV

# Placeholders of a launch line printed without the models' paths.
_TARGET, _DRAFT = "TARGET", "EAGLE3_DRAFT"


class CaptureFlags(NamedTuple):
    """How to start an SGLang server that runs a capture config's pools: the plugin reads both
    lists from the config (the spec list through SGLang's arguments, the decode list itself)."""

    env: tuple[tuple[str, str], ...]    # DGW_* settings for the worker
    server_args: tuple[str, ...]        # the speculative flags the config was tuned with

    def render(self, capture: ServingCapture, target: str = _TARGET,
               draft: str = _DRAFT) -> str:
        env = " ".join(f"{name}={shlex.quote(value)}" for name, value in self.env)
        lines = [f"# spec pool bs={list(capture.spec_bs)}, decode pool bs="
                 f"{list(capture.decode_bs)}: the plugin applies both at start-up; the goodput "
                 "controller chooses the mode per step",
                 f"{env} python -m sglang.launch_server --model-path {shlex.quote(target)} "
                 f"--speculative-draft-model-path {shlex.quote(draft)} "
                 f"{' '.join(self.server_args)}",
                 f"# tuned on {capture.gpu.describe()} for model shape "
                 f"{capture.model.fingerprint}, accept length {capture.accept_len:g}; measured "
                 + ("on this worker's SGLang graphs (make capture-measure ENGINE=sglang)"
                    if capture.measured_on == "sglang" else
                    "on the reference engine's graphs (capture.measure), not SGLang's")]
        if capture.synthetic:
            lines.append("# WARNING: tuned on SYNTHETIC measurements (tests and demos only)")
        return "\n".join(lines)


def capture_flags(capture: ServingCapture, path: str) -> CaptureFlags:
    """The environment and flags that make a server run the config at `path`."""
    k = capture.num_draft_tokens
    flags = ("--speculative-algorithm", "DUAL_GRAPH_EAGLE3", "--speculative-num-steps", str(k),
             "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(k + 1),
             "--attention-backend", capture.model.shape.get("attention_backend", "triton"))
    return CaptureFlags(((CAPTURE_CONFIG_ENV, str(path)),), flags)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``dgw capture-flags CONFIG``: what to pass to SGLang and the worker for a capture config."""
    ap = OneLineParser(
        prog="dgw capture-flags",
        description="Print the launch line that runs a tuned capture config: DGW_CAPTURE_CONFIG "
                    "and the speculative flags it was tuned with. The GPU / model-shape check "
                    "happens when the server starts.")
    ap.add_argument("config", help="capture config JSON (make capture-tune)")
    ap.add_argument("--server-args", action="store_true",
                    help="print only the SGLang flags, for $(dgw capture-flags --server-args F)")
    ap.add_argument("--model-path", default=_TARGET, help="the target model, for the line")
    ap.add_argument("--draft-model-path", default=_DRAFT,
                    help="the EAGLE-3 draft model, for the line")
    args = ap.parse_args(argv)
    if args.server_args and (args.model_path != _TARGET or args.draft_model_path != _DRAFT):
        ap.error("--server-args prints only the speculative flags; drop --model-path and "
                 "--draft-model-path, or --server-args for the whole launch line")
    path = str(Path(args.config).resolve())   # the server may start from another directory
    capture = load_capture(path)    # a ConfigError here is one line from `dgw`
    flags = capture_flags(capture, path)
    print(" ".join(flags.server_args) if args.server_args
          else flags.render(capture, args.model_path, args.draft_model_path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
