"""The registered algorithm: a CustomSpecAlgo that SGLang treats exactly like EAGLE3.

It mirrors EAGLE3's predicates (SGLang dispatches on them, never on the type), adds the three
methods the scheduler calls unconditionally but CustomSpecAlgo lacks, runs EAGLE3's server-args
handling then server_args_hook.py's, and refuses the flags the worker does not support.
docs/sglang-0.5.17.md §1-2.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.settings import Settings
from dual_graph_worker.engines.sglang.continuity_launch import LAUNCH
from dual_graph_worker.engines.sglang.server_args_hook import apply_dual_graph_server_args

logger = logging.getLogger(__name__)

ALGORITHM_NAME = "DUAL_GRAPH_EAGLE3"

# (server-arg field, why it cannot run with the dual-graph worker). Checked by the validator in
# the main process, before any GPU work, so a bad combination fails at once with the reason.
_UNSUPPORTED_FLAGS: tuple[tuple[str, str], ...] = (
    ("enable_dp_attention", "each DP rank would pick its mode from its own batch size, and the "
                            "ranks' collectives would then disagree"),
    ("speculative_adaptive", "the dual-graph worker is itself the adaptive mechanism; drop "
                             "--speculative-adaptive (SGLang only honours it for EAGLE/EAGLE3)"),
    ("enable_two_batch_overlap", "the decode pool's batches are not split for two-batch overlap"),
    ("enable_pdmux", "PD multiplexing swaps per-stream attention backends that the decode pool "
                     "does not carry"),
    ("enable_lora", "LoRA's CUDA-graph batch info is sized once per runner; a second target "
                    "runner would resize it under the verify graphs"),
    ("enable_multi_layer_eagle", "the worker subclasses the single-layer EAGLEWorkerV2"),
    ("enable_attn_tp_input_scattered", "scattered attention input is switched off for EAGLE3 "
                                       "by name only; the dual worker has not been verified "
                                       "with it"),
)


def validate_server_args(server_args: Any) -> None:
    """Registered as the algorithm's validator (speculative_hook.py:129): main process, before
    the EAGLE handling. Raises with the flag to change."""
    for name, why in _UNSUPPORTED_FLAGS:
        if getattr(server_args, name, False):
            raise ConfigError(f"--speculative-algorithm {ALGORITHM_NAME} does not support "
                              f"--{name.replace('_', '-')}: {why}. Remove that flag, or use "
                              "--speculative-algorithm EAGLE3.")
    if (getattr(server_args, "pp_size", 1) or 1) > 1:
        raise ConfigError(f"--speculative-algorithm {ALGORITHM_NAME} does not support pipeline "
                          "parallelism (--pp-size > 1); SGLang's spec workers do not either")
    # Parse the worker settings here too, so a typo in DGW_* fails at launch, not in a
    # scheduler process after the weights are loaded.
    config = Settings.from_env(os.environ)
    LAUNCH[config.continuity].check_server_args(server_args)
    # The files only: a capture config's GPU and model shape are checked in each scheduler.
    from dual_graph_worker.engines.sglang.capture_config import check_setting_files

    check_setting_files(config)


def worker_factory(server_args: Any) -> type:
    """The registry calls this with the draft ServerArgs copy (scheduler.py:923); the class is
    imported lazily so registering does not import the GPU worker stack."""
    from dual_graph_worker.engines.sglang.worker import DualGraphEagleWorker

    return DualGraphEagleWorker


class DualGraphEagle3Spec(CustomSpecAlgo):
    """EAGLE3's predicates under a plugin name."""

    def is_eagle(self) -> bool:
        return True

    def is_eagle3(self) -> bool:
        return True

    def supports_grammar_overlap(self) -> bool:
        # EAGLE's verify advances the grammar FSM through the scheduler's barrier; the decode
        # path calls the same barrier before sampling (worker.py).
        return True

    def need_topk(self) -> bool:
        return True

    def carries_draft_hidden_states(self) -> bool:
        return True

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens,
                         needs_confidence_relay)

    def build_disagg_draft_input(self, batch, server_args, last_tokens_tensor, future_map):
        return SpeculativeAlgorithm.EAGLE3.build_disagg_draft_input(
            batch, server_args, last_tokens_tensor, future_map)

    def handle_server_args(self, server_args: Any) -> None:
        was_unset = server_args.max_running_requests is None
        # EAGLE3's own handling: steps/topk/tokens defaults, tokens = steps + 1 at topk 1,
        # mixed chunk off, rejection-sampling checks (speculative_hook.py:525-681).
        SpeculativeAlgorithm.EAGLE3.handle_server_args(server_args)
        config = Settings.from_env(os.environ)
        spec_bs = None
        if config.capture_config is not None:
            # The file only here; its GPU and model shape are checked in each scheduler.
            from dual_graph_worker.engines.sglang.capture_config import load_server_capture_config

            spec_bs = load_server_capture_config(config.capture_config).spec_bs
        adjustment = apply_dual_graph_server_args(
            server_args, spec_max_bs=config.spec_max_bs,
            max_running_requests_was_unset=was_unset,
            draft_valid_backend=LAUNCH[config.continuity].radix_backend, spec_bs=spec_bs)
        logger.info("%s: %s", ALGORITHM_NAME, adjustment.describe())
