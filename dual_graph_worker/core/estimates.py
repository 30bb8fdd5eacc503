"""What the goodput controller believes, as typed records: its step times, its batch costs,
its acceptance and its exploration accounts. Reported (the step log, /get_server_info, the
demo's JSON), never read back by a decision; `Estimates.to_json` is the flat form they print."""

from __future__ import annotations

from typing import NamedTuple, Optional


class KeyEstimate(NamedTuple):
    """One measured (mode, padded bs): its JSON form is the list of these, in this order."""

    seconds: float
    samples: int
    prior: Optional[float]
    context_tokens: float                     # the mean context its seconds are at
    s_per_context_token: float


class StepTimeEstimates(NamedTuple):
    step_s: dict[str, dict[int, KeyEstimate]]   # mode -> padded bs, the measured keys only
    context_s_per_token: dict[str, float]     # mode -> pooled over its sizes


class BatchCostEstimates(NamedTuple):
    prompt_per_output: float                  # prompt tokens per output token of newcomers
    replaced: float                           # share of joining requests that took a place
    draft_prefill_s_per_token: float          # delta
    catch_up_fixed_s: float
    catch_up_s_per_token: float               # kappa: the draft's whole layer, a token
    catch_up_reach_tokens: Optional[float]    # kappa's sizes end here (None: no end)
    catch_up_far_s_per_token: float           # a token beyond them
    switch_s: float
    kv_catch_up_fixed_s: Optional[float] = None         # catch-ups filling K/V alone (None:
    kv_catch_up_s_per_token: Optional[float] = None     # none seen, or no such engine)


class AcceptanceEstimates(NamedTuple):
    fresh_accept: float                       # what a request not measured yet accepts
    own_accept_weight: float                  # a full EMA's weight against all requests'
    own_accept_weight_first: float            # a first estimate's
    own_accept_weight_first_below: float = 1.0    # a first estimate's below all requests'
    own_accept_weight_first_above: float = 1.0    # ... and above it


class Estimates(NamedTuple):
    step_times: StepTimeEstimates
    batch_costs: BatchCostEstimates
    acceptance: AcceptanceEstimates
    run_len: float                            # steps a mode recently ran between switches
    explore_allowance_steps: float
    explore_debt_steps: float

    def to_json(self) -> dict:
        return {**self.step_times._asdict(), **self.batch_costs._asdict(),
                **self.acceptance._asdict(), "run_len": self.run_len,
                "explore_allowance_steps": self.explore_allowance_steps,
                "explore_debt_steps": self.explore_debt_steps}
