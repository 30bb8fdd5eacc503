"""The policy a `Settings` names, built the same way for every engine.

A new policy is a class that satisfies `policy.ModePolicy` plus one `PolicyBuilder` in `BUILDERS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence

from dual_graph_worker.core.batch_costs import CatchUpWork
from dual_graph_worker.core.calibration import CalibrationTable
from dual_graph_worker.core.controller import ControllerConfig, GoodputController
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import ModePolicy
from dual_graph_worker.core.simple_policies import CyclePolicy, PinnedPolicy, ThresholdPolicy
from dual_graph_worker.core.settings import PolicyKind, Settings


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may know of the server it runs in."""

    num_draft_tokens: int                      # K: accept lengths lie in 1..K+1
    sizes: Mapping[Mode, Sequence[int]]        # captured batch sizes of each pool
    prior: Optional[CalibrationTable] = None   # start-up calibration (goodput's prior)
    defers_prefill: bool = False               # decode-mode prefills skip the draft's prefill
    max_rows: int = 0                          # request rows, for per-request acceptance
    draft_share: float = 0.0                   # draft_share() of the two models
    catch_up_work: Optional[CatchUpWork] = None  # catch-ups that fill the draft's K/V alone


def _goodput(s: Settings, ctx: PolicyContext) -> ModePolicy:
    config = ControllerConfig.from_settings(s, ctx.num_draft_tokens,
                                            defers_prefill=ctx.defers_prefill,
                                            max_rows=ctx.max_rows, draft_share=ctx.draft_share,
                                            catch_up_work=ctx.catch_up_work)
    return GoodputController(config, ctx.sizes, ctx.prior)


@dataclass(frozen=True)
class PolicyBuilder:
    build: Callable[[Settings, PolicyContext], ModePolicy]
    uses_prior: bool = False    # reads PolicyContext.prior: the engine calibrates at start-up


BUILDERS: Mapping[PolicyKind, PolicyBuilder] = MappingProxyType({
    PolicyKind.GOODPUT: PolicyBuilder(_goodput, uses_prior=True),
    PolicyKind.THRESHOLD: PolicyBuilder(lambda s, ctx: ThresholdPolicy(
        threshold=s.threshold, band=s.band, min_dwell_steps=s.min_dwell_steps,
        num_draft_tokens=ctx.num_draft_tokens)),
    PolicyKind.SPEC: PolicyBuilder(lambda s, ctx: PinnedPolicy(
        mode=Mode.SPEC, num_draft_tokens=ctx.num_draft_tokens)),
    PolicyKind.DECODE: PolicyBuilder(lambda s, ctx: PinnedPolicy(
        mode=Mode.DECODE, num_draft_tokens=ctx.num_draft_tokens)),
    PolicyKind.CYCLE: PolicyBuilder(lambda s, ctx: CyclePolicy(
        hold=s.min_dwell_steps, num_draft_tokens=ctx.num_draft_tokens)),
})


def build_policy(settings: Settings, ctx: PolicyContext) -> ModePolicy:
    return BUILDERS[settings.policy].build(settings, ctx)


def needs_prior(settings: Settings) -> bool:
    """Whether the policy `settings` names reads a start-up calibration (worth its replays)."""
    return BUILDERS[settings.policy].uses_prior
