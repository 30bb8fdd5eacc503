"""Pure helpers of the suite: prompts, expected greedy continuations, comparisons, summaries.

No SGLang and no GPU here, so all of it is unit-tested on CPU.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

from dual_graph_worker.core.modes import Mode
from dual_graph_worker.core.results import StepRecord


def random_prompts(n: int, length: int, vocab: int, seed: int, low: int = 2) -> list[list[int]]:
    """Token-id prompts; ids start at `low` to stay clear of special ids 0 (bos) / 1 (eos)."""
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(n)]


def shared_prefix_prompts(prompts: Sequence[Sequence[int]], prefix_len: int) -> list[list[int]]:
    """The prompts with their first `prefix_len` ids replaced by the first prompt's, so a
    server with a prefix cache reuses that prefix's KV for every later request. Each prompt
    keeps its own last id (the constructed target's continuation depends on it alone)."""
    if prompts and not 0 <= prefix_len < min(len(p) for p in prompts):
        raise ValueError(f"prefix_len {prefix_len} must leave each prompt at least its last "
                         f"token (shortest prompt: {min(len(p) for p in prompts)} ids)")
    head = list(prompts[0][:prefix_len]) if prompts else []
    return [head + list(p[prefix_len:]) for p in prompts]


def greedy_chain(perm: Sequence[int], last_token: int, n: int) -> list[int]:
    """The constructed target's greedy continuation: next(t) = perm[t] (docs/design.md)."""
    out, t = [], last_token
    for _ in range(n):
        t = perm[t]
        out.append(t)
    return out


def permutation_from_lm_head(lm_head) -> list[int]:
    """p(t) = argmax_v lm_head[v, t]: the residual stream of token t is a multiple of e_t."""
    return lm_head.float().argmax(dim=0).tolist()


def load_toy_permutation(target_dir: str | Path) -> list[int]:
    from safetensors import safe_open

    files = sorted(Path(target_dir).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            if "lm_head.weight" in fh.keys():
                return permutation_from_lm_head(fh.get_tensor("lm_head.weight"))
    raise FileNotFoundError(f"no lm_head.weight in {[str(f) for f in files]} under "
                            f"{target_dir}: the constructed target must carry its permutation "
                            "as an untied lm_head (docs/design.md)")


@dataclass
class Exactness:
    requests: int = 0
    exact: int = 0
    tokens: int = 0
    matching_tokens: int = 0
    first_mismatches: list = field(default_factory=list)   # (request, position, want, got)

    @property
    def ok(self) -> bool:
        return self.requests > 0 and self.exact == self.requests

    def to_json(self) -> dict:
        return asdict(self) | {"ok": self.ok}


def compare_outputs(expected: Sequence[Sequence[int]], got: Sequence[Sequence[int]],
                    keep: int = 8) -> Exactness:
    if len(expected) != len(got):
        raise ValueError(f"{len(expected)} expected outputs but {len(got)} returned")
    rep = Exactness(requests=len(expected))
    for i, (want, have) in enumerate(zip(expected, got)):
        want, have = list(want), list(have)
        rep.tokens += len(want)
        same = sum(a == b for a, b in zip(want, have))
        rep.matching_tokens += same
        if want == have:
            rep.exact += 1
        elif len(rep.first_mismatches) < keep:
            pos = next((j for j, (a, b) in enumerate(zip(want, have)) if a != b),
                       min(len(want), len(have)))
            rep.first_mismatches.append((i, pos, want[pos] if pos < len(want) else None,
                                         have[pos] if pos < len(have) else None))
    return rep


@dataclass(frozen=True)
class StepSummary:
    steps: int
    spec_steps: int
    decode_steps: int
    switches: int
    switches_back: int          # decode -> spec: a draft that went through decode mode is used
    eager_steps: int
    spec_mean_accept: Optional[float]
    # Mean accept length of the first spec step after each decode->spec switch: with a
    # perfect draft it stays at K+1 only if the draft was kept current through decode mode.
    accept_after_switch_back: Optional[float]
    min_accept_after_switch_back: Optional[float]

    def to_json(self) -> dict:
        return asdict(self)


def summarize_steps(records: Iterable[StepRecord]) -> StepSummary:
    recs = sorted(records, key=lambda r: r.step)
    spec = [r for r in recs if r.mode is Mode.SPEC]
    switches = sum(a.mode is not b.mode for a, b in zip(recs, recs[1:]))
    back = [b.mean_accept_len for a, b in zip(recs, recs[1:])
            if a.mode is Mode.DECODE and b.mode is Mode.SPEC]
    return StepSummary(
        steps=len(recs), spec_steps=len(spec), decode_steps=len(recs) - len(spec),
        switches=switches, switches_back=len(back), eager_steps=sum(not r.graph for r in recs),
        spec_mean_accept=(sum(r.mean_accept_len for r in spec) / len(spec)) if spec else None,
        accept_after_switch_back=(sum(back) / len(back)) if back else None,
        min_accept_after_switch_back=min(back) if back else None)


def staggered_requests(prompts: Sequence[Sequence[int]], *, lengths: Sequence[int],
                       gap_s: float, waves: int = 1,
                       wave_gap_s: float = 0.0) -> list[tuple[float, list[int], int]]:
    """(start delay, prompt, max_new_tokens): arrivals spread out and lengths mixed so the
    running batch grows past and falls back below a threshold while requests are in flight.
    With `waves` > 1 the prompts arrive in that many bursts `wave_gap_s` apart, so the batch
    crosses the threshold up and down once per wave (spec -> decode -> spec ... switches)."""
    n = len(prompts)
    out = []
    for i, p in enumerate(prompts):
        wave = i * waves // n
        first = -(-wave * n // waves)                # index of the wave's first request
        out.append((wave * wave_gap_s + (i - first) * gap_s, list(p),
                    int(lengths[i % len(lengths)])))
    return out


def ramp_profile(levels: Sequence[int], hold_s: float) -> list[tuple[int, float]]:
    """Up then down through `levels`: [(concurrency, seconds)], e.g. 1,8,64 -> 1,8,64,8,1."""
    seq = list(levels) + list(reversed(levels[:-1]))
    return [(int(c), float(hold_s)) for c in seq]


def summarize_catch_ups(events: Iterable[dict]) -> dict:
    """Totals of the lazy-catch-up worker's ``catch_up`` step-log events (DGW_CONTINUITY=
    lazy-catch-up): how often the draft caught up, over how many tokens, how many of those
    were forced by a full stash, and how many backlogs of absent rows were dropped."""
    events = list(events)
    ups = [e for e in events if e.get("event") == "catch_up"]
    # The worker's running totals (deferred prefills, compactions, ...) ride on every
    # catch_up / compaction / deferred_prefill event; the last one holds them all.
    totals = next((e["totals"] for e in reversed(events) if isinstance(e.get("totals"), dict)),
                  {})
    return {"catch_ups": len(ups),
            "deferred_prefills": int(totals.get("deferred_prefills", 0)),
            "deferred_prefill_tokens": int(totals.get("deferred_prefill_tokens", 0)),
            "compactions": int(totals.get("compactions", 0)),
            "chunk_restarts": int(totals.get("chunk_restarts", 0)),
            "forced": sum(bool(e.get("forced")) for e in ups),
            "tokens": sum(int(e.get("tokens", 0)) for e in ups),
            "requests": sum(int(e.get("requests", 0)) for e in ups),
            "passes": sum(int(e.get("passes", 0)) for e in ups),
            "max_backlog": max((int(e.get("max_backlog", 0)) for e in ups), default=0),
            "orphans": sum(int(e.get("orphans", 0)) for e in ups)}


_DECODE_LOG = re.compile(
    r"Decode batch(?: \[\d+\])?, #running-req: (?P<bs>\d+),.*?"
    r"(?:accept len: (?P<accept>[0-9.]+),.*?)?"
    r"gen throughput \(token/s\): (?P<tput>[0-9.]+), #queue-req: (?P<queue>\d+)")


def parse_decode_log(lines: Iterable[str]) -> dict[int, list[float]]:
    """{running batch size: [gen throughput of each decode-mode log window]} from SGLang's own
    "Decode batch" log lines (scheduler metrics_reporter.py, one per ``decode_log_interval``
    decode steps, logged at INFO). Windows whose accept length is above 1 ran speculative steps
    and are left out: what remains times one token per request per step, so at a fixed batch
    size the throughputs of two engines compare their decode step times directly."""
    out: dict[int, list[float]] = {}
    for line in lines:
        m = _DECODE_LOG.search(line)
        if m is None:
            continue
        if m.group("accept") is not None and float(m.group("accept")) > 1.0:
            continue
        out.setdefault(int(m.group("bs")), []).append(float(m.group("tput")))
    return out
