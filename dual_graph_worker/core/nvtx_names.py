"""The NVTX naming convention of the worker: one place that formats and parses every name.

The emitter (``dual_graph_worker.core.nvtx``) formats names with these functions and the checker
parses them back with ``parse``, so the two cannot drift apart. All names live in the NVTX domain
``DOMAIN``. The table of names: docs/design.md, "Seeing what the worker does".
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional, Union

from dual_graph_worker.core.modes import Stage

DOMAIN = "dgw"

# Stages that replay exactly one captured graph each; derived from the runtime's own enum.
GRAPH_STAGES: tuple[str, ...] = tuple(s.value for s in Stage)
# Host-side bookkeeping after the replays; may launch a few small eager kernels.
BOOKKEEPING_STAGES: tuple[str, ...] = ("accept", "commit")
# Work a step runs eagerly on purpose, named so the checker can state it rather than count it
# as glue: lazy catch-up's draft extend over the backlog (the draft work decode-mode steps
# deferred; the SGLang worker's lazy_sync.py), at the first spec step after decode steps.
CATCH_UP = "catch_up"
EAGER_STAGES: tuple[str, ...] = (CATCH_UP,)
STAGES: tuple[str, ...] = GRAPH_STAGES + BOOKKEEPING_STAGES + EAGER_STAGES

STEADY_STATE = "steady_state_begin"

# Config keys the checker reads; the worker may emit others, which are reported as-is.
CONFIG_ENGINE = "engine"
CONFIG_ATTENTION_BACKEND = "attention_backend"
CONFIG_NUM_DRAFT_TOKENS = "num_draft_tokens"
CONFIG_GPU_NAME = "gpu_name"
CONFIG_COMPUTE_CAPABILITY = "compute_capability"  # "9.0"; a fallback when the report has none
CONFIG_CONTINUITY = "continuity"  # draft continuity: which graph stages a decode step has
CONFIG_POLICY = "policy"          # the mode policy (reported, not checked)


def _text(value: object) -> str:
    # Mode and Stage are str enums; format their value, never "Mode.SPEC".
    return str(getattr(value, "value", value))


def step_name(mode: object, padded_bs: int, graph: bool) -> str:
    return f"step:{_text(mode)}:{'' if graph else 'eager-'}bs{int(padded_bs)}"


def stage_name(stage: object) -> str:
    return f"stage:{_text(stage)}"


def switch_name(old: object, new: object) -> str:
    return f"switch:{_text(old)}->{_text(new)}"


def capture_name(label: object) -> str:
    return f"capture:{_text(label)}"


def config_name(key: str, value: object) -> str:
    return f"config:{key}={_text(value)}"


class StepName(NamedTuple):
    mode: str
    padded_bs: int
    graph: bool


class StageName(NamedTuple):
    stage: str


class SwitchName(NamedTuple):
    old: str
    new: str


class CaptureName(NamedTuple):
    label: str


class SteadyStateName(NamedTuple):
    pass


class ConfigName(NamedTuple):
    key: str
    value: str


ParsedName = Union[StepName, StageName, SwitchName, CaptureName, SteadyStateName, ConfigName]

_STEP = re.compile(r"step:(?P<mode>[A-Za-z0-9_]+):(?P<eager>eager-)?bs(?P<bs>\d+)")
_STAGE = re.compile(r"stage:(?P<stage>[A-Za-z0-9_]+)")
_SWITCH = re.compile(r"switch:(?P<old>[A-Za-z0-9_]+)->(?P<new>[A-Za-z0-9_]+)")
_CAPTURE = re.compile(r"capture:(?P<label>.+)")
_CONFIG = re.compile(r"config:(?P<key>[A-Za-z0-9_.\-]+)=(?P<value>.*)")


def parse(text: Optional[str]) -> Optional[ParsedName]:
    """The structured meaning of a dgw name, or None for any other text."""
    if not text:
        return None
    text = text.strip()
    if text == STEADY_STATE:
        return SteadyStateName()
    m = _STEP.fullmatch(text)
    if m:
        return StepName(m["mode"], int(m["bs"]), m["eager"] is None)
    m = _STAGE.fullmatch(text)
    if m:
        return StageName(m["stage"])
    m = _SWITCH.fullmatch(text)
    if m:
        return SwitchName(m["old"], m["new"])
    m = _CONFIG.fullmatch(text)
    if m:
        return ConfigName(m["key"], m["value"].strip())
    m = _CAPTURE.fullmatch(text)
    if m:
        return CaptureName(m["label"])
    return None
