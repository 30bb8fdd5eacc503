"""A tuned capture config (capture/config.py, ``make capture-tune``) applied to the SGLang worker.

Read from ``DGW_CAPTURE_CONFIG`` before any graph is captured: it sets the decode pool's batch
sizes and the threshold policy's threshold, refuses a config tuned for another GPU or model
shape, and, since the spec pool is SGLang's to capture, warns when the server's spec list is not
the config's (``dgw capture-flags``, capture/sglang_flags.py, prints the flags that match it).
Nothing here imports SGLang. docs/sglang-0.5.17.md §2, "A tuned capture config", says why and
where its numbers fall short.
"""

from __future__ import annotations

from dataclasses import replace
from typing import AbstractSet, Any, Callable, Mapping, NamedTuple, Optional, Sequence

from dual_graph_worker.core.capture_schema import (GpuInfo, ServingCapture, build_model_shape,
                                                   load_capture)
from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.row_state import loops_in_c
from dual_graph_worker.core.settings import BY_KEY, MEASURE, PolicyKind, Settings, check_output
from dual_graph_worker.engines.sglang.server_args_hook import cap_batch_sizes
from dual_graph_worker.core.errors import ConfigError, StaleConfig

CAPTURE_CONFIG_ENV = BY_KEY["capture_config"].env
THRESHOLD_ENV = BY_KEY["threshold"].env
CALIBRATION_ENV = BY_KEY["calibration"].env


class CapturePlan(NamedTuple):
    """What a capture config changes in the worker, decided before any capture."""

    source: str
    config: Settings            # threshold = crossover unless set explicitly
    decode_bs: tuple[int, ...]      # the decode pool, before fitting to the request pool
    spec_bs: tuple[int, ...]        # what SGLang's spec list should be (the worker cannot set it)
    threshold_explicit: bool        # True: the user's threshold was kept over the crossover

    def describe(self) -> str:
        why = ("kept: set explicitly" if self.threshold_explicit
               else f"the config's crossover; set {THRESHOLD_ENV} to override")
        return (f"capture config {self.source}: decode pool bs={list(self.decode_bs)}, "
                f"threshold {self.config.threshold} ({why})")


def sglang_model_shape(target: Any, draft: Any, *, num_steps: int, attention_backend: str,
                       tp_size: int = 1, topk: int = 1) -> dict:
    """The capture fingerprint's shape of an SGLang server, from its ModelConfigs.

    `target` / `draft` are ``model_runner.model_config`` objects (anything with their
    attributes); `num_steps` is SGLang's ``speculative_num_steps`` (K, the draft steps; not
    ``speculative_num_draft_tokens`` = K+1). tp_size and topk enter the shape only when they
    differ from what the reference engine records (TP 1, a topk-1 chain): each changes every
    graph's per-GPU work, so a config tuned without them must not match.
    """
    extra: dict[str, int] = {}
    if tp_size != 1:
        extra["tp_size"] = int(tp_size)
    if topk != 1:
        extra["topk"] = int(topk)
    hf = getattr(target, "hf_text_config", None)
    return build_model_shape(
        hidden_size=target.hidden_size, num_layers=target.num_hidden_layers,
        num_heads=target.num_attention_heads, num_kv_heads=target.num_key_value_heads,
        head_dim=target.head_dim, intermediate_size=getattr(hf, "intermediate_size", None),
        vocab_size=target.vocab_size, dtype=target.dtype, draft_hidden_size=draft.hidden_size,
        num_draft_tokens=int(num_steps), attention_backend=str(attention_backend), **extra)


def load_server_capture_config(path: str, *, gpu: Optional[GpuInfo] = None,
                               shape: Optional[Mapping[str, Any]] = None) -> ServingCapture:
    """Read `path`, refusing a malformed file or one tuned for another GPU / model shape.
    Without `gpu` / `shape` only the file itself is checked (the launch-time check)."""
    try:
        return load_capture(path, expected_gpu=gpu, expected_shape=shape)
    except (ConfigError, StaleConfig) as exc:
        # StaleConfig too: to the server both are a setting to fix before it can start.
        raise ConfigError(f"{CAPTURE_CONFIG_ENV}={path}: {exc}; or unset {CAPTURE_CONFIG_ENV} "
                          "to run with the default pools and threshold") from exc


def check_setting_files(config: Settings) -> None:
    """The files the settings name, read as the server will read them, and the controller's C
    loops, built (ConfigError if one cannot be): at launch, before any weights load, and by
    `dgw settings --check`."""
    if config.capture_config is not None:
        load_server_capture_config(config.capture_config)
    for key in ("step_log", "stall_trace"):
        if getattr(config, key):
            check_output(key, getattr(config, key))
    if config.policy is PolicyKind.GOODPUT:
        loops_in_c(config.row_loops)
    if config.calibration != MEASURE:
        try:
            CalibrationTable.load(config.calibration)
        except ConfigError as exc:
            raise ConfigError(f"{CALIBRATION_ENV}={config.calibration}: {exc}; or unset "
                              f"{CALIBRATION_ENV} to measure the prior at start-up") from exc


def plan_capture(config: Settings, capture: ServingCapture, explicit: AbstractSet[str],
                 source: str) -> CapturePlan:
    """Apply `capture` to `config`; `explicit`: the keys the user set (settings.explicit_keys)."""
    decode_bs = (capture.decode_bs if config.decode_max_bs is None
                 else tuple(cap_batch_sizes(capture.decode_bs, config.decode_max_bs)))
    keep = "threshold" in explicit
    new = config if keep else replace(config, threshold=capture.crossover_bs)
    return CapturePlan(source, new, decode_bs, capture.spec_bs, keep)


def spec_list_warning(server_bs: Sequence[int], plan: CapturePlan,
                      fit: Callable[[Sequence[int]], Sequence[int]] = list) -> Optional[str]:
    """A warning when the spec pool SGLang captures is not the config's, or None.

    `server_bs` is SGLang's list (``cuda_graph_config.decode.bs``, which the plugin set from the
    config when it handled the server arguments: spec_algo.DualGraphEagle3Spec.handle_server_args);
    `fit` clamps a list to the request pool as SGLang's runners do, and is applied to both, so a
    small request pool alone never triggers the warning.
    """
    have, want = sorted(set(fit(server_bs))), sorted(set(fit(plan.spec_bs)))
    if have == want:
        return None
    return (f"dual-graph: the server captures its speculative pool at bs={have}, but "
            f"{plan.source} was tuned for bs={want}: was {CAPTURE_CONFIG_ENV} set in the "
            "launching shell (the plugin sets SGLang's list from it before the scheduler starts)?")
