"""What a worker did, as running totals: steps by mode and reason, switches, catch-ups,
deferred prefills, and acceptance over speculative steps only. Host integers updated at
launch and completion; metrics exporters and server-info read snapshots."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.planner import StepPlan
from dual_graph_worker.core.policy import Reason

# (mode, reason) -> their values: an enum's .value is a descriptor call, twice a step.
_LABELS = {(m, r): (m.value, r.value) for m in Mode for r in Reason}


@dataclass
class WorkerCounters:
    steps: Counter = field(default_factory=Counter)    # (mode.value, reason.value) -> steps
    switches: int = 0
    catch_ups: int = 0
    catch_up_tokens: int = 0
    prefills: int = 0
    deferred_prefills: int = 0
    prefill_tokens: int = 0
    spec_requests: int = 0          # request-steps of speculative steps
    spec_tokens: int = 0            # tokens those request-steps accepted (bonus included)
    output_tokens: int = 0
    mode: Mode | None = None

    def launched(self, plan: StepPlan, catch_up_tokens: int = 0) -> None:
        self.steps[_LABELS[plan.mode, plan.reason]] += 1
        if self.mode is not None and plan.mode is not self.mode:
            self.switches += 1
        self.mode = plan.mode
        if catch_up_tokens:
            self.catch_ups += 1
            self.catch_up_tokens += int(catch_up_tokens)

    def prefilled(self, tokens: int, deferred: bool) -> None:
        self.prefills += 1
        self.deferred_prefills += int(deferred)
        self.prefill_tokens += int(tokens)

    def completed(self, mode: Mode, requests: int, tokens: int) -> None:
        self.output_tokens += int(tokens)
        if mode is Mode.SPEC:
            self.spec_requests += int(requests)
            self.spec_tokens += int(tokens)

    @property
    def spec_accept_len(self) -> float | None:
        """Accepted tokens per request per speculative step; decode steps left out."""
        return self.spec_tokens / self.spec_requests if self.spec_requests else None

    def steps_by_mode(self) -> dict[str, int]:
        out: Counter = Counter()
        for (mode, _), n in self.steps.items():
            out[mode] += n
        return dict(out)

    def to_json(self) -> dict:
        return {"steps": self.steps_by_mode(),
                "steps_by_reason": {f"{m}/{r}": n for (m, r), n in sorted(self.steps.items())},
                "switches": self.switches, "catch_ups": self.catch_ups,
                "catch_up_tokens": self.catch_up_tokens, "prefills": self.prefills,
                "deferred_prefills": self.deferred_prefills,
                "prefill_tokens": self.prefill_tokens, "output_tokens": self.output_tokens,
                "spec_accept_len": self.spec_accept_len,
                "mode": None if self.mode is None else self.mode.value}
