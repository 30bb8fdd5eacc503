"""The worker's Prometheus series, next to SGLang's own on /metrics (``--enable-metrics``).

SGLang runs prometheus_client in multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set before the
scheduler processes start); series made in a scheduler process show on the server's /metrics.
Counters are pushed from the worker's host totals every few completed steps, not per step.

    dgw_steps_total{mode, reason}        decode-family steps the worker ran, by mode and reason
    dgw_switches_total                   mode switches
    dgw_catch_ups_total, dgw_catch_up_tokens_total
    dgw_prefills_total{draft}            prefill batches; draft="deferred" skipped the draft
    dgw_output_tokens_total
    dgw_spec_mode                        1 while speculating, 0 while decoding
    dgw_spec_accept_length               accepted tokens per request per speculative step
                                         (decode-mode steps left out, unlike SGLang's own)
    dgw_expected_goodput_tokens_per_s{mode}   the controller's estimate of each mode
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from dual_graph_worker.core.counters import WorkerCounters
from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.policy import PolicyState

PUSH_EVERY = 32


class PrometheusSeries:
    def __init__(self, labels: dict[str, str], registry: Optional[Any] = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        reg = registry if registry is not None else REGISTRY
        names = sorted(labels)
        self._labels = labels

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            return Counter(name, doc, names + list(extra), registry=reg)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()):
            return Gauge(name, doc, names + list(extra), registry=reg,
                         multiprocess_mode="mostrecent")

        self.steps = counter("dgw_steps_total", "Decode-family steps by mode and reason",
                             ("mode", "reason"))
        self.switches = counter("dgw_switches_total", "Mode switches")
        self.catch_ups = counter("dgw_catch_ups_total", "Lazy catch-ups")
        self.catch_up_tokens = counter("dgw_catch_up_tokens_total", "Draft tokens caught up")
        self.prefills = counter("dgw_prefills_total", "Prefill batches", ("draft",))
        self.output_tokens = counter("dgw_output_tokens_total", "Tokens emitted by decode steps")
        self.spec_mode = gauge("dgw_spec_mode", "1 while speculating, 0 while decoding")
        self.accept = gauge("dgw_spec_accept_length",
                            "Accepted tokens per request per speculative step")
        self.goodput = gauge("dgw_expected_goodput_tokens_per_s",
                             "The controller's expected tokens/s of each mode", ("mode",))
        self._pushed = WorkerCounters()

    def push(self, counters: WorkerCounters, state: Optional[PolicyState]) -> None:
        """Add what happened since the last push; set the gauges."""
        lb = self._labels
        last, self._pushed = self._pushed, copy.deepcopy(counters)
        for (mode, reason), n in counters.steps.items():
            if n > last.steps[mode, reason]:
                self.steps.labels(**lb, mode=mode, reason=reason).inc(n - last.steps[mode, reason])
        for series, now, before in (
                (self.switches.labels(**lb), counters.switches, last.switches),
                (self.catch_ups.labels(**lb), counters.catch_ups, last.catch_ups),
                (self.catch_up_tokens.labels(**lb), counters.catch_up_tokens,
                 last.catch_up_tokens),
                (self.output_tokens.labels(**lb), counters.output_tokens, last.output_tokens),
                (self.prefills.labels(**lb, draft="deferred"), counters.deferred_prefills,
                 last.deferred_prefills),
                (self.prefills.labels(**lb, draft="run"),
                 counters.prefills - counters.deferred_prefills,
                 last.prefills - last.deferred_prefills)):
            if now > before:
                series.inc(now - before)
        if counters.mode is not None:
            self.spec_mode.labels(**lb).set(1.0 if counters.mode is Mode.SPEC else 0.0)
        if counters.spec_accept_len is not None:
            self.accept.labels(**lb).set(counters.spec_accept_len)
        if state is not None:
            for mode, value in (("spec", state.spec_goodput), ("decode", state.decode_goodput)):
                if value is not None:
                    self.goodput.labels(**lb, mode=mode).set(value)
