"""Each request of one `dgw demo` phase, drawn as the demo draws it (its seeds and arguments),
with the accept lengths its speculative steps draw on the toy chain, every step speculative:
which requests hold a phase's speculative lead, at given step times. A phase where the dynamic
worker trails static speculation may owe the whole lead to one request it did not measure in
time. The draws are the chain's own (no model runs); the step times are the user's.

    python -m bench.demo_requests [demo arguments] [--phase 0] [--spec-ms 13.25]
                                  [--decode-ms 7.02] [--regression N]

Prints a table per request; writes OUT/requests.json and OUT/requests.png (OUT: --out). With
--regression N, also N random requests of the phase's lengths: the slope of the mean of a
request's later draws on its first four's, the weight a first estimate deserves against all
requests' mean (what the controller's own_accept_weight_first learns), and on each side of
the first estimates' mean how far they spread beyond four draws' noise and what the requests
went on to accept (what the controller's weights by side learn).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

from bench.plots import Panel, Series, line_chart
from dual_graph_worker.core.errors import report_user_errors
from dual_graph_worker.core.argtypes import int_range, positive_float
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.provenance import command_line
from bench.reference.demo import parser as demo_parser, ramp_phase
from bench.reference.loadgen import request_streams
from dual_graph_worker.engines.reference.toy import AGREEMENT_LEVELS, toy_permutations
from bench.reference.toy_args import toy_context

FIRST_DRAWS = 4      # the controller's first estimate of a request is the mean of these


class RequestDraws(NamedTuple):
    prompt_end: int            # the prompt's last token, where its chain starts
    tokens: int                # output tokens after the prefill's one
    draws: list[int]           # accept length of each speculative step

    def seconds(self, spec_s: float, decode_s: float) -> tuple[float, float]:
        return len(self.draws) * spec_s, self.tokens * decode_s


def chain_draws(p: np.ndarray, agree: np.ndarray, last_token: int, output_len: int,
                num_draft_tokens: int) -> RequestDraws:
    """The accept lengths of a request on the toy chain: the draft proposes s(a), which is p(a)
    where `agree[a]`; each step accepts its agreeing run (at most K) and the bonus token, no
    more than the tokens left."""
    token, made, draws = int(p[last_token]), 1, []
    while made < output_len:
        accept, x = 1, token
        while accept <= num_draft_tokens and agree[x]:
            accept, x = accept + 1, int(p[x])
        accept = min(accept, output_len - made)
        for _ in range(accept):
            token = int(p[token])
        draws.append(accept)
        made += accept
    return RequestDraws(last_token, output_len - 1, draws)


def _chain(args) -> tuple[np.ndarray, np.ndarray]:
    """The toy target's chain p and where the draft agrees with it."""
    perms = toy_permutations(args.hidden, AGREEMENT_LEVELS[args.agreement])
    return perms.p.numpy(), (perms.p == perms.s).numpy()


def phase_requests(args, index: int) -> list[RequestDraws]:
    """The requests of the demo's phase `index`, as its PhaseRun (seed `index`) draws them."""
    phase = ramp_phase(args, args.ramp[index])
    rng, len_rng = request_streams(index)
    p, agree = _chain(args)
    lens = phase.output_lens(len_rng, phase.num_requests)
    prompts = rng.integers(0, args.hidden, size=(phase.num_requests, args.input_len))
    return [chain_draws(p, agree, int(prompt[-1]), n, args.num_draft_tokens)
            for prompt, n in zip(prompts, lens)]


def first_and_later(args, requests: int, seed: int = 0) -> tuple[list, list, list]:
    """Over `requests` random requests with the phase's output lengths (those with at least
    twice FIRST_DRAWS steps): each one's first FIRST_DRAWS draws, their mean and the mean of
    its later draws."""
    rng = np.random.default_rng(seed)
    p, agree = _chain(args)
    firsts, first, later = [], [], []
    for n in ramp_phase(args, 1).output_lens(rng, requests):
        draws = chain_draws(p, agree, int(rng.integers(args.hidden)), n,
                            args.num_draft_tokens).draws
        if len(draws) >= 2 * FIRST_DRAWS:
            firsts.append(draws[:FIRST_DRAWS])
            first.append(float(np.mean(draws[:FIRST_DRAWS])))
            later.append(float(np.mean(draws[FIRST_DRAWS:])))
    return firsts, first, later


def first_estimate_slope(first: list, later: list) -> Optional[float]:
    """The least-squares slope of the requests' later means on their first estimates; None
    where fewer than two first estimates differ (a draft that always or never agrees)."""
    if len(set(first)) < 2:
        return None
    return float(np.polyfit(first, later, 1)[0])


def sides(firsts: list, first: list, later: list) -> dict:
    """Below and above the first estimates' mean: the requests, their mean squared distance
    from it beyond four draws' noise (one draw's variance within a request over
    FIRST_DRAWS), and the mean of their later draws."""
    if not first:
        empty = {"requests": 0, "spread_beyond_noise": None, "later_mean": None}
        return {"centre": None, "noise": None, "below": empty, "above": dict(empty)}
    x, y = np.array(first), np.array(later)
    centre = float(np.mean(x))
    noise = float(np.mean([np.var(f, ddof=1) for f in firsts])) / FIRST_DRAWS
    out = {"centre": centre, "noise": noise}
    for name, keep in (("below", x < centre), ("above", x >= centre)):
        there = bool(keep.any())
        out[name] = {"requests": int(keep.sum()),
                     "spread_beyond_noise": float(np.mean((x[keep] - centre) ** 2) - noise)
                     if there else None,
                     "later_mean": float(np.mean(y[keep])) if there else None}
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = demo_parser()
    ap.prog = "python -m bench.demo_requests"
    ap.description = __doc__
    ap.add_argument("--phase", type=int_range(0), default=0, help="the ramp's phase, from 0")
    ap.add_argument("--spec-ms", type=positive_float, default=13.25,
                    help="a speculative step's ms (the demo's bs-1 steps on this CPU: 13.25)")
    ap.add_argument("--decode-ms", type=positive_float, default=7.02,
                    help="a decode step's ms (7.02 likewise)")
    ap.add_argument("--regression", type=int_range(0), default=0, metavar="N",
                    help="also the first-estimate slope over N random requests (0: off)")
    args = ap.parse_args(argv)
    if args.phase >= len(args.ramp):
        ap.error(f"--phase {args.phase}: the ramp has phases 0-{len(args.ramp) - 1}")
    toy_context(ap, args.hidden, args.input_len, args.output_len, args.output_spread,
                args.num_draft_tokens, "--input-len, --output-len or --output-spread")
    spec_s, decode_s = args.spec_ms / 1e3, args.decode_ms / 1e3
    requests = phase_requests(args, args.phase)
    print(f"phase {args.phase} (c={args.ramp[args.phase]}) of `dgw demo`: toy chain draws, every "
          f"step speculative; spec {args.spec_ms:g} ms, decode {args.decode_ms:g} ms a step "
          "(GIVEN, not measured)")
    print("  req  tokens  spec steps  first 4  the rest  spec/decode time")
    rows = []
    for i, r in enumerate(requests):
        spec, decode = r.seconds(spec_s, decode_s)
        first = statistics.fmean(r.draws[:FIRST_DRAWS])     # every output decodes (>= 2 tokens)
        rest = statistics.fmean(r.draws[FIRST_DRAWS:]) if len(r.draws) > FIRST_DRAWS else None
        ratio = spec / decode
        rows.append({"request": i, "tokens": r.tokens, "draws": r.draws, "first_mean": first,
                     "rest_mean": rest, "spec_over_decode": ratio})
        print(f"{i:5d} {r.tokens:7d} {len(r.draws):11d} {_num(first, 8)} {_num(rest, 9)} "
              f"{_num(ratio, 17)}")
    spec, decode = (sum(x) for x in zip(*(r.seconds(spec_s, decode_s) for r in requests)))
    speedup = decode / spec
    print(f"the phase: speculation {speedup:.3f}x decode's speed")
    slope, by_side = None, None
    if args.regression:
        firsts, first, later = first_and_later(args, args.regression)
        slope, by_side = first_estimate_slope(first, later), sides(firsts, first, later)
        print(f"over {args.regression} random requests, later draws on the first "
              f"{FIRST_DRAWS}: " + ("no slope (first estimates do not differ)" if slope is None
                                    else f"slope {slope:.3f}"))
        print(f"  first estimates' mean {_num(by_side['centre'], 0)}, four draws' noise "
              f"{_num(by_side['noise'], 0)}; side: requests, spread beyond that noise, later mean")
        for name in ("below", "above"):
            side = by_side[name]
            print(f"  {name}: {side['requests']}, {_num(side['spread_beyond_noise'], 5)}, "
                  f"{_num(side['later_mean'], 4)}")
    out = Path(args.out)
    write_json({"command": command_line("python -m bench.demo_requests", argv),
                "phase": args.phase, "concurrency": args.ramp[args.phase],
                "spec_ms": args.spec_ms, "decode_ms": args.decode_ms,
                "speculation_speedup": speedup, "first_estimate_slope": slope,
                "first_estimates_by_side": by_side,
                "requests": rows}, out / "requests.json")
    xs = [r["request"] for r in rows]
    png = line_chart(out / "requests.png", f"dgw demo phase {args.phase}: each request's "
                     "speculative time over its decode time (toy chain draws)", "request", [
                         Panel("spec / decode time", [Series("request", xs, [
                             _nan(r["spec_over_decode"]) for r in rows], joined=False)],
                               lines=((1.0, "a tie"),)),
                         Panel("mean accept length", [
                             Series("first 4 draws", xs, [_nan(r["first_mean"]) for r in rows],
                                    joined=False),
                             Series("the rest", xs, [_nan(r["rest_mean"]) for r in rows],
                                    joined=False)])], integer_x=True)
    print(f"wrote {out / 'requests.json'} and {png}")
    return 0


def _num(value: Optional[float], width: int) -> str:
    return f"{'-' if value is None else f'{value:.2f}':>{width}s}"


def _nan(value: Optional[float]) -> float:
    return np.nan if value is None else value


if __name__ == "__main__":
    raise SystemExit(report_user_errors(main))
