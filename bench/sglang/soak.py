"""The soak: many requests of random lengths against one HTTP server, some aborted at random
moments, some sharing prefixes (radix hits), with idle pauses so SGLang's own idle leak check
runs; a sampled set of T=0 check prompts is compared token for token with another server's
answers. Driven by serve_bench (`--soak N`), which owns the servers.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 10_000
    concurrency: int = 128
    short_input: tuple[int, int] = (8, 128)
    long_input: tuple[int, int] = (600, 1200)   # several prefill chunks at --chunked-prefill-size 512
    long_share: float = 0.1
    output_len: tuple[int, int] = (1, 48)
    abort_share: float = 0.15
    abort_within_s: float = 0.6
    prefix_share: float = 0.25
    prefixes: int = 32
    prefix_len: int = 64
    check_every: int = 100
    check_input_len: int = 96
    check_output_len: int = 32
    idle_every: int = 2500
    idle_s: float = 3.0
    seed: int = 0

    @property
    def num_checks(self) -> int:
        return max(1, self.requests // self.check_every)


@dataclass(frozen=True)
class SoakRequest:
    index: int
    input_ids: tuple[int, ...]
    max_new_tokens: int
    abort_after_s: Optional[float] = None
    check: Optional[int] = None   # index into the check prompts

    @property
    def rid(self) -> str:
        # Fixed width: SGLang aborts every request whose rid starts with the one named, so
        # aborting soak-5 would also abort soak-50..59.
        return f"soak-{self.index:08d}"


@dataclass
class SoakResult:
    sent: int = 0
    completed: int = 0
    aborted: int = 0
    abort_too_late: int = 0
    errors: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    idle_pauses: int = 0
    first_error: Optional[str] = None
    loaded_check_outputs: dict = field(default_factory=dict)


def check_prompts(cfg: SoakConfig, vocab: int) -> list[list[int]]:
    rng = random.Random(cfg.seed + 1)
    return [[rng.randrange(10, vocab) for _ in range(cfg.check_input_len)]
            for _ in range(cfg.num_checks)]


def make_requests(cfg: SoakConfig, vocab: int) -> list[SoakRequest]:
    rng = random.Random(cfg.seed)
    checks = check_prompts(cfg, vocab)
    prefixes = [[rng.randrange(10, vocab) for _ in range(cfg.prefix_len)]
                for _ in range(cfg.prefixes)]
    out = []
    for i in range(cfg.requests):
        if i % cfg.check_every == 0 and i // cfg.check_every < len(checks):
            k = i // cfg.check_every
            out.append(SoakRequest(i, tuple(checks[k]), cfg.check_output_len, check=k))
            continue
        lo, hi = cfg.long_input if rng.random() < cfg.long_share else cfg.short_input
        n = rng.randint(lo, hi)
        head = rng.choice(prefixes) if rng.random() < cfg.prefix_share else []
        ids = head + [rng.randrange(10, vocab) for _ in range(max(1, n - len(head)))]
        abort = (rng.uniform(0.0, cfg.abort_within_s) if rng.random() < cfg.abort_share
                 else None)
        out.append(SoakRequest(i, tuple(ids), rng.randint(*cfg.output_len), abort))
    return out


def _payload(ids, max_new_tokens: int, rid: Optional[str] = None) -> dict:
    body = {"input_ids": list(ids), "sampling_params": {
        "temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    return body | ({"rid": rid} if rid else {})


def _json_or_none(body: str) -> Optional[dict]:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


async def _one(session, url: str, req: SoakRequest, res: SoakResult) -> None:
    import aiohttp

    async def abort_later():
        await asyncio.sleep(req.abort_after_s)
        async with session.post(f"{url}/abort_request", json={"rid": req.rid}) as r:
            await r.read()

    aborter = asyncio.create_task(abort_later()) if req.abort_after_s is not None else None
    res.sent += 1
    try:
        async with session.post(f"{url}/generate", json=_payload(
                req.input_ids, req.max_new_tokens, req.rid)) as r:
            body = await r.text()
        data = _json_or_none(body)
        reason = (((data or {}).get("meta_info") or {}).get("finish_reason") or {}).get("type")
        # SGLang answers an abort with an abort finish (200) or, for some, a 400 naming it.
        aborted = reason == "abort" or (r.status == 400 and "abort" in body.lower())
        if req.abort_after_s is not None and aborted:
            res.aborted += 1
        elif r.status == 200 and reason in ("length", "stop"):
            res.completed += 1
            res.output_tokens += len(data.get("output_ids") or [])
            res.abort_too_late += req.abort_after_s is not None
            if req.check is not None:
                res.loaded_check_outputs[req.check] = list(data["output_ids"])
        else:
            raise RuntimeError(f"HTTP {r.status}, finish {reason!r}: {body[:200]}")
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError, KeyError,
            TypeError) as exc:
        res.errors += 1
        res.first_error = res.first_error or f"request {req.index}: {exc!r}"
    finally:
        if aborter is not None and not aborter.done():
            aborter.cancel()                # finished first: the abort would come too late


async def _soak(url: str, cfg: SoakConfig, requests: list[SoakRequest],
                alive) -> SoakResult:
    import aiohttp

    res = SoakResult()
    gate = asyncio.Semaphore(cfg.concurrency)
    timeout = aiohttp.ClientTimeout(total=600)

    async def gated(session, req):
        async with gate:
            await _one(session, url, req, res)

    started = time.perf_counter()
    # No connection cap: aborts must not queue behind the generates they abort.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for lo in range(0, len(requests), cfg.idle_every):
            wave = requests[lo:lo + cfg.idle_every]
            await asyncio.gather(*(gated(session, r) for r in wave))
            # Idle: SGLang's scheduler runs its strict memory-leak check when nothing runs.
            await asyncio.sleep(cfg.idle_s)
            res.idle_pauses += 1
            if not alive():
                res.first_error = res.first_error or "server process exited during the soak"
                break
    res.seconds = time.perf_counter() - started
    return res


def run_soak(url: str, cfg: SoakConfig, requests: list[SoakRequest], alive) -> SoakResult:
    return asyncio.run(_soak(url, cfg, requests, alive))


async def _batch(url: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async with session.post(f"{url}/generate",
                                json=_payload(prompts, max_new_tokens)) as r:
            data = json.loads(await r.text())
    if not isinstance(data, list):
        raise RuntimeError(f"batch generate answered {str(data)[:200]}")
    return [list(d["output_ids"]) for d in data]


def generate_batch(url: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """All prompts in one request, T=0: the same batch on both servers being compared."""
    return asyncio.run(_batch(url, prompts, max_new_tokens))


@dataclass(frozen=True)
class Agreement:
    equal: int
    compared: int
    first_mismatch: Optional[int] = None

    def line(self, what: str) -> str:
        where = "" if self.first_mismatch is None else f", first mismatch at check {self.first_mismatch}"
        return f"{what}: {self.equal} / {self.compared} equal{where}"


def agreement(reference: list[list[int]], got: dict[int, list[int]]) -> Agreement:
    keys = sorted(k for k in got if k < len(reference))
    bad = [k for k in keys if got[k] != reference[k]]
    return Agreement(len(keys) - len(bad), len(keys), bad[0] if bad else None)


def summary(cfg: SoakConfig, res: SoakResult, checks: dict) -> dict:
    return {"config": asdict(cfg), "result": asdict(res) | {"loaded_check_outputs": None},
            "checks": {k: asdict(v) for k, v in checks.items()}}
