"""BENCHMARK ONLY: switch SGLang's forced accept length inside a running engine.

SGLANG_SIMULATE_ACC_LEN is read once, into ``sglang.srt.speculative.spec_utils``, when the
scheduler process imports it; ``eagle_sample`` reads that module global at every verify. The
policy matrix runs one engine per kind for every accept length, so this entry point (loaded by
SGLang's plugin loader in every process, registered by plugin_shim) starts a thread in each
scheduler process that polls the file named by BENCH_ACC_FILE and sets the global, then writes
``<file>.ack-<pid>`` with the value it applied. Never part of a server.

With BENCH_ACC_SAMPLING=diffused it also replaces SGLang's per-step draw of a non-integer length
(floor or ceiling at random, "match-expected") by error diffusion: floor or ceiling so that the
running mean never strays from the target by more than one token over the steps so far (3.5:
3, 4, 3, 4, ...). Engines compared in one cell then run the same acceptance: random draws over
a short cell's few dozen steps realize lengths several percent apart.
"""

from __future__ import annotations

import os
import threading
import time

ENV = "BENCH_ACC_FILE"
SAMPLING_ENV = "BENCH_ACC_SAMPLING"
SAMPLINGS = ("diffused", "sglang")
POLL_S = 0.05


def register() -> None:
    path = os.environ.get(ENV)
    if not path or threading.current_thread() is not threading.main_thread():
        return
    if not _in_scheduler_process():
        return
    apply_sampling(os.environ.get(SAMPLING_ENV, "sglang"))
    threading.Thread(target=_follow, args=(path,), daemon=True, name="bench-acc").start()


def apply_sampling(kind: str) -> None:
    if kind not in SAMPLINGS:
        raise ValueError(f"{SAMPLING_ENV}={kind!r}: choose one of {', '.join(SAMPLINGS)}")
    if kind == "diffused":
        from sglang.srt.speculative import spec_utils

        # generate_simulated_accept_index looks the sampler up in its module at every verify.
        spec_utils._sample_simulated_acc_len = DiffusedAcceptance()


class DiffusedAcceptance:
    """SGLang's ``_sample_simulated_acc_len(simulate_acc_len, simulate_acc_method, max_len)``,
    deterministic: the target's floor or ceiling, whichever keeps the emitted total nearest
    target x steps; a new target starts afresh."""

    def __init__(self) -> None:
        self.target: float | None = None
        self.owed = 0.0

    def __call__(self, simulate_acc_len: float, simulate_acc_method: str = "",
                 max_len: int = 1 << 30) -> int:
        target = max(1.0, min(float(max_len), float(simulate_acc_len)))
        if target != self.target:
            self.target, self.owed = target, 0.0
        self.owed += target
        n = max(1, min(int(max_len), int(self.owed + 1e-9)))
        self.owed -= n
        return n


def _in_scheduler_process() -> bool:
    import multiprocessing

    return multiprocessing.parent_process() is not None


def _follow(path: str) -> None:
    from sglang.srt.speculative import spec_utils

    applied = None
    while True:
        try:
            with open(path) as fh:
                value = float(fh.read().strip())
        except (OSError, ValueError):
            value = None
        if value is not None and value != applied:
            spec_utils.SIMULATE_ACC_LEN = value
            applied = value
            with open(f"{path}.ack-{os.getpid()}", "w") as fh:
                fh.write(str(value))
        time.sleep(POLL_S)


def set_accept(path: str, value: float, timeout_s: float = 30.0) -> list[str]:
    """Write `value` and wait until every scheduler process acknowledged it; returns the ack
    files that confirmed it (never empty). TimeoutError after `timeout_s` when an ack is stale
    or none came (nobody listens, e.g. a plain engine)."""
    import glob

    with open(path + ".tmp", "w") as fh:
        fh.write(str(value))
    os.replace(path + ".tmp", path)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        acks = glob.glob(f"{path}.ack-*")
        ok = [a for a in acks if _read(a) == value]
        if acks and len(ok) == len(acks):
            return ok
        time.sleep(POLL_S)
    raise TimeoutError(f"accept length {value} not acknowledged by every scheduler process "
                       f"within {timeout_s} s ({path})")


def _read(path: str):
    try:
        with open(path) as fh:
            return float(fh.read().strip())
    except (OSError, ValueError):
        return None
