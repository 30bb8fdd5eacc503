"""One engine, one process: start sglang.Engine once, run every task on it, write JSON as it goes.

Run by run_sglang_suite.py, policy_matrix.py and capture_compare.py (`run_child`), and by
interleave.py (`Child`, then `serve`), as ``python -m bench.sglang.engine_child SPEC.json``. A
process per engine because (1) SGLANG_SIMULATE_ACC_LEN is read when spec_utils is imported, so
engines with and without it must not share an interpreter, and exiting frees every GPU byte before
the next engine starts; (2) a crash (an illegal memory access, say) then costs one phase, not the
suite. The env in the spec is applied before SGLang is imported; SGLang's scheduler processes
(spawn) inherit it.

Spec keys: name, engine_kwargs, env, tasks, result_path, shim_dir, repo_root; optionally cpus
(this process and SGLang's pinned), inbox (tasks served one at a time after `tasks`: serve),
freeze_gc (each sweep freezes the engine's collectors once warm: SGLang's Engine.freeze_gc).
Task kinds: "sweep" (batch of c requests at once per concurrency; with "prefill_probe" the same
batch shape is also timed generating one token, so the report can split off the decode steps),
"exact" (staggered async
requests, outputs returned), "ramp" (closed-loop clients following a concurrency profile),
"multiturn" (conversations resending their history), "set_accept" (acc_control.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional, TypeVar

from bench.sglang.host_speed import Hogs, probe_ms
from bench.sglang.workload import random_prompts
from dual_graph_worker.core.gc_pauses import GcPauses
from dual_graph_worker.core.jsonio import write_json

REPO_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")
# An engine process's first ~35 steps run slow on the H200 (bs-1 spec 7.2-8.5 ms, 6.6 steady):
# this warm-up (18-64 steps, by mode and acceptance) and the shapes' after it take them, so no
# engine's first cell (nor the worker's estimates) holds them.
WARMUP_TOKENS = 64
# Seed offset of a short cell's later runs: with C < 400 and at most 9 runs they stay apart
# from each other and below the probe's (+4000) and warm-up's (+7000) offsets.
REPEAT_SEED_STRIDE = 400
MAX_RUNS = 9


def _gpu_field(field: str, index: str = "0") -> Optional[str]:
    """One nvidia-smi field of a GPU (no CUDA context in this process); None without."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}",
                              "--format=csv,noheader,nounits", "-i", index],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0].strip() or None
    except Exception:
        return None


def gpu_name() -> str:
    """The first GPU's name, for a report's header ("unknown GPU" without one)."""
    return _gpu_field("name") or "unknown GPU"


def gpu_total_mib() -> float | None:
    """The first GPU's memory (None without one)."""
    return _gpu_mib("memory.total")


def gpu_used_mib() -> float | None:
    """Device-wide used memory."""
    return _gpu_mib("memory.used")


def _gpu_mib(field: str) -> float | None:
    try:
        return float(_gpu_field(field) or "")
    except ValueError:
        return None


def _tree_cpu_s() -> Optional[float]:
    """CPU seconds (user + system) of this process and its descendants (the engine's scheduler
    and detokenizer), from /proc; None where /proc cannot be read."""
    try:
        children, cpu = {}, {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            pid = int(stat.parent.name)
            children.setdefault(int(fields[1]), []).append(pid)
            cpu[pid] = int(fields[11]) + int(fields[12])
        ticks, todo = 0, [os.getpid()]
        while todo:
            pid = todo.pop()
            ticks += cpu.get(pid, 0)
            todo += children.get(pid, [])
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _gpu_state() -> dict:
    """SM clock (MHz), temperature (C) and power (W) of the engine's GPU just after a cell (a
    state, not the cell's average: an idle GPU lowers its clock within ~100 ms)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    fields = ("clocks.sm", "temperature.gpu", "power.draw")
    got = (_gpu_field(",".join(fields), first if first.isdigit() else "0") or "").split(",")
    out = {}
    for name, value in zip(("sm_mhz", "temp_c", "power_w"), got):
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def _internal_state(info: dict) -> dict:
    """The first scheduler's internal state in a get_server_info() answer ({} if none)."""
    states = info.get("internal_states") or [{}]
    return states[0] if isinstance(states, list) and states else {}


def _server_info(engine) -> dict:
    try:
        info = engine.get_server_info()
    except Exception as exc:          # informational only
        return {"error": repr(exc)}
    st = _internal_state(info)
    return {"memory_usage": st.get("memory_usage"), "startup_time": info.get("startup_time"),
            "effective_max_running_requests": st.get("effective_max_running_requests_per_dp"),
            "max_running_requests": info.get("max_running_requests"),
            "speculative_algorithm": info.get("speculative_algorithm"),
            "dual_graph_pools": (st.get("dual_graph") or {}).get("pools"),
            "version": info.get("version")}


def _dual_state(engine) -> Optional[dict]:
    """The dual-graph worker's counters (hooks.py, /get_server_info), None for other engines."""
    try:
        state = _internal_state(engine.get_server_info())
    except Exception:
        return None
    return state.get("dual_graph")


# The worker's counters a point reports as what it did meanwhile: totals, and totals by name.
COUNTS = ("switches", "catch_ups", "catch_up_tokens", "prefills", "deferred_prefills")
COUNTS_BY = ("steps", "steps_by_reason")


def _counter_delta(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """What the worker did during one point: steps by mode and reason, catch-ups, prefills."""
    if not before or not after:
        return after
    out = {k: after[k] for k in ("accept_len_estimate", "expected_goodput_spec",
                                 "expected_goodput_decode", "mode", "estimates") if k in after}
    for key in COUNTS:
        out[key] = after.get(key, 0) - before.get(key, 0)
    for key in COUNTS_BY:
        b, a = before.get(key) or {}, after.get(key) or {}
        out[key] = {k: a[k] - b.get(k, 0) for k in a if a[k] - b.get(k, 0)}
    return out


def summed_deltas(deltas: list[Optional[dict]]) -> dict:
    """Points' _counter_delta over one span: the counts summed, the state as after the last."""
    out = dict(deltas[-1] or {})
    for key in COUNTS:
        out[key] = sum((d or {}).get(key, 0) for d in deltas)
    for key in COUNTS_BY:
        total: dict[str, int] = {}
        for d in deltas:
            for k, v in ((d or {}).get(key) or {}).items():
                total[k] = total.get(k, 0) + v
        out[key] = total
    return out


def median_run(runs: list[T], speed: Callable[[T], float]) -> T:
    """The run a cell reads: the median by `speed`, the slower middle one of an even count."""
    return sorted(runs, key=speed)[(len(runs) - 1) // 2]


def sampling(max_new_tokens: int) -> dict:
    return {"max_new_tokens": int(max_new_tokens), "temperature": 0.0, "ignore_eos": True}


def _as_list(out) -> list:
    return out if isinstance(out, list) else [out]


def run_sweep(engine, task: dict, emit) -> dict:
    res = {"input_len": task["input_len"], "output_len": task["output_len"], "points": []}
    # A round of an interleaved cell (its `first_run`) draws the prompts of that run.
    last_run = task.get("first_run", 0) + task.get("short_cell_runs", 1)
    if last_run > 1 and not (max(task["concurrency"], default=0) < REPEAT_SEED_STRIDE
                             and last_run <= MAX_RUNS):
        raise ValueError(f"short-cell repeats and rounds need C < {REPEAT_SEED_STRIDE} and at "
                         f"most {MAX_RUNS} runs (fresh prompts each), not C="
                         f"{max(task['concurrency'], default=0)} and run {last_run}")
    if task.get("warmup", True):
        engine.generate(input_ids=random_prompts(2, 16, task["vocab"], seed=99),
                        sampling_params=sampling(WARMUP_TOKENS))
    if task.get("warm_shapes"):
        # Every batch shape once, short answers, before any is timed: an engine's first batch
        # of a shape pays one-time costs (kernel builds, allocator growth) a server pays once.
        t1 = time.perf_counter()
        for c in task["concurrency"]:
            engine.generate(input_ids=random_prompts(c, task["input_len"], task["vocab"],
                                                     seed=task.get("seed", 1000) + 7000 + c),
                            sampling_params=sampling(min(16, task["output_len"])))
        res["warm_shapes_seconds"] = time.perf_counter() - t1
    if task.get("freeze_gc"):
        # Once warm, as SGLang's Engine.freeze_gc asks: what start-up and the warm-up built
        # leaves every later collection, in this process, the scheduler and the detokenizer.
        engine.freeze_gc()
        res["gc_frozen"] = True
    # This process runs SGLang's tokenizer manager: a full collection here while a batch starts
    # or ends stalls the cell, whatever the scheduler does. Each cell records its pauses.
    pauses = GcPauses().start()
    try:
        for c in task["concurrency"] if task.get("timed", True) else ():
            res["points"].append(_sweep_point(engine, task, c, pauses))
            emit(res)
    finally:
        pauses.stop()
    return res


def _sweep_point(engine, task: dict, c: int, pauses: GcPauses) -> dict:
    """One concurrency of a sweep: its timed runs, the machine around them (this process's
    collection pauses included) and the worker's counters."""
    probe_s = None
    if task.get("prefill_probe"):
        # The same batch shape generating one token: the prefill (and first step) alone.
        # Fresh prompts (other seed) so the radix cache cannot shorten the prefill. Run
        # first: one-token requests take no decode step, so the dual worker's policy state
        # (which decides whether a prefill's draft prefill is deferred) is the one the
        # previous point left for both runs, and the probe times the main run's prefill.
        probe = random_prompts(c, task["input_len"], task["vocab"],
                               seed=task.get("seed", 1000) + 4000 + c)
        t1 = time.perf_counter()
        engine.generate(input_ids=probe, sampling_params=sampling(1))
        probe_s = time.perf_counter() - t1
    before = _dual_state(engine)
    host_ms, cpu0 = probe_ms(), _tree_cpu_s()
    pauses.take()
    t0w = time.time()
    load = int(task.get("host_load", 0))
    runs, spans = [], []
    with Hogs(load):
        # A short cell is a few hundred steps: one slow spell of the host moves it by
        # percents, so it runs again (fresh prompts) and reads the median run.
        while not runs or (runs[0][0] < task.get("short_cell_s", 0.0)
                           and len(runs) < task.get("short_cell_runs", 1)):
            t_run = time.time()
            runs.append(_timed_batch(engine, task, c, task.get("first_run", 0) + len(runs)))
            spans.append([round(t_run, 3), round(time.time(), 3)])
    cpu1, gc_ms = _tree_cpu_s(), pauses.take()
    # The median run (the slower middle one of an even count) is the cell's figure; the
    # machine record and the worker's counters span every run (`*_total`).
    speeds = [tokens / dt for dt, tokens in runs]
    dt, tokens = median_run(runs, lambda r: r[1] / r[0])
    point = {"concurrency": c, "seconds": dt, "output_tokens": tokens, "tok_s": tokens / dt,
             "t_start": t0w, "t_end": time.time(), "runs_t": spans,
             "machine": {"host_probe_ms": host_ms, **_gpu_state(),
                         "cpu_s": None if None in (cpu0, cpu1) else cpu1 - cpu0,
                         "bench_gc_ms": gc_ms}}
    if len(runs) > 1:
        point |= {"runs_tok_s": [round(x, 2) for x in speeds],
                  "seconds_total": sum(r[0] for r in runs),
                  "output_tokens_total": sum(r[1] for r in runs)}
    if load:
        point["host_load"] = load
    if probe_s is not None:
        point["prefill_only_seconds"] = probe_s
    if before is not None:
        point["dual_graph"] = _counter_delta(before, _dual_state(engine))
    return point


def _timed_batch(engine, task: dict, c: int, run: int) -> tuple[float, int]:
    """One batch of `c` requests at once: (seconds, output tokens). Fresh prompts for every
    run of every task: a repeated one would be served from the radix cache."""
    prompts = random_prompts(c, task["input_len"], task["vocab"],
                             seed=task.get("seed", 1000) + c + REPEAT_SEED_STRIDE * run)
    t0 = time.perf_counter()
    outs = _as_list(engine.generate(input_ids=prompts,
                                    sampling_params=sampling(task["output_len"])))
    return time.perf_counter() - t0, sum(len(o["output_ids"]) for o in outs)


async def _staggered(engine, requests) -> list[list[int]]:
    async def one(delay, prompt, n):
        await asyncio.sleep(delay)
        out = await engine.async_generate(input_ids=prompt, sampling_params=sampling(n))
        return list(out["output_ids"])
    return await asyncio.gather(*(one(d, p, n) for d, p, n in requests))


def run_exact(engine, task: dict, emit) -> dict:
    requests = [(float(d), list(p), int(n)) for d, p, n in task["requests"]]
    t0 = time.time()
    outputs = engine.loop.run_until_complete(_staggered(engine, requests))
    return {"outputs": outputs, "t_start": t0, "t_end": time.time()}


async def _ramp(engine, profile, prompt_len, out_lens, vocab) -> list[dict]:
    done: list[dict] = []
    seed = [0]

    async def client(deadline):
        while time.time() < deadline:
            seed[0] += 1
            n = out_lens[seed[0] % len(out_lens)]
            prompt = random_prompts(1, prompt_len, vocab, seed=5000 + seed[0])[0]
            t0 = time.time()
            out = await engine.async_generate(input_ids=prompt, sampling_params=sampling(n))
            done.append({"t_start": t0, "t_end": time.time(),
                         "tokens": len(out["output_ids"])})

    for level, hold in profile:
        start = time.time()
        await asyncio.gather(*(client(start + hold) for _ in range(level)))
        done.append({"phase": level, "t_start": start, "t_end": time.time()})
    return done


def run_ramp(engine, task: dict, emit) -> dict:
    events = engine.loop.run_until_complete(
        _ramp(engine, task["profile"], task["input_len"], task["output_lens"], task["vocab"]))
    return {"profile": task["profile"], "events": events}


def run_multiturn(engine, task: dict, emit) -> dict:
    """Conversations whose every turn resends the whole history plus a short user message, so
    each turn's prompt is the previous turn's prefix (the radix cache serves it) followed by
    the previous answer. All conversations' turn k go out as one batch."""
    histories = [list(p) for p in task["prompts"]]
    turns = []
    for k, user in enumerate(task["user_messages"]):
        prompts = [h + list(user[i]) for i, h in enumerate(histories)] if k else histories
        outs = _as_list(engine.generate(input_ids=prompts,
                                        sampling_params=sampling(task["output_len"])))
        turns.append({"prompts": prompts, "outputs": [list(o["output_ids"]) for o in outs],
                      "cached_tokens": [int((o.get("meta_info") or {}).get("cached_tokens", 0))
                                        for o in outs]})
        histories = [p + list(o["output_ids"]) for p, o in zip(prompts, outs)]
        emit({"turns": turns})
    return {"turns": turns}


def run_set_accept(engine, task: dict, emit) -> dict:
    """Benchmark only: the forced accept length from now on (acc_control.py)."""
    from bench.sglang.acc_control import ENV, set_accept

    acks = set_accept(os.environ[ENV], float(task["accept_len"]))
    return {"accept_len": float(task["accept_len"]), "acks": len(acks)}


TASKS = {"sweep": run_sweep, "exact": run_exact, "ramp": run_ramp,
         "set_accept": run_set_accept, "multiturn": run_multiturn}


class Child:
    """One engine process started from the parent: FOLDER/NAME.spec.json (`spec`: name,
    engine_kwargs, env, tasks, optionally inbox; plus the paths main() needs) run by this module,
    its output in FOLDER/NAME.log, its result in FOLDER/NAME.json."""

    def __init__(self, folder: Path, spec: dict, *, shim_dir: Path,
                 python: str = sys.executable) -> None:
        from bench.sglang.plugin_shim import pythonpath_env

        self.name = spec["name"]
        spec_path, self.result_path = folder / f"{self.name}.spec.json", folder / f"{self.name}.json"
        spec = spec | {"result_path": str(self.result_path), "shim_dir": str(shim_dir),
                       "repo_root": str(REPO_ROOT)}
        spec_path.write_text(json.dumps(spec, indent=1))
        self.result_path.unlink(missing_ok=True)      # an earlier run's into the same folder
        self._log = open(folder / f"{self.name}.log", "w")
        self.proc = subprocess.Popen([python, "-m", "bench.sglang.engine_child", str(spec_path)],
                                     cwd=REPO_ROOT, env=pythonpath_env(REPO_ROOT),
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def result(self) -> dict:
        """What the child has written so far ({"name": NAME, "ok": False} before that)."""
        try:
            return json.loads(self.result_path.read_text())
        except (OSError, json.JSONDecodeError):
            return {"name": self.name, "ok": False}

    def wait(self, timeout: float) -> dict:
        """Its result with "returncode": its exit status, or "timeout" (then it is killed)."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            rc = "timeout"
        except BaseException:         # an interrupted parent takes its engine down with it
            self.stop()
            raise
        finally:
            self._log.close()
        return self.result() | {"returncode": rc}

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def run_child(folder: Path, spec: dict, *, shim_dir: Path, timeout: float,
              python: str = sys.executable) -> dict:
    """One engine process run to its end (Child): its result, with "returncode"."""
    return Child(folder, spec, shim_dir=shim_dir, python=python).wait(timeout)


def serve(engine, inbox: Path, record, extra: Optional[dict] = None) -> int:
    """Tasks one at a time from INBOX/NNNN.json (written whole by the parent), each (with
    `extra`'s keys) answered in INBOX/NNNN.out.json and passed to `record`, until an "exit"
    task; 1 if the parent goes."""
    parent, n = os.getppid(), 0
    while os.getppid() == parent:
        path = inbox / f"{n:04d}.json"
        if not path.exists():
            time.sleep(0.005)
            continue
        task = json.loads(path.read_text())
        if task["kind"] == "exit":
            return 0
        try:
            answer = TASKS[task["kind"]](engine, task | (extra or {}), lambda partial: None)
        except Exception as exc:
            answer = {"error": repr(exc), "traceback": traceback.format_exc()[-4000:]}
        write_json(answer, inbox / f"{n:04d}.out.json")
        record(task["name"], answer)
        n += 1
    return 1


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.update({k: str(v) for k, v in spec.get("env", {}).items()})
    sys.path.insert(0, spec["repo_root"])
    from bench.sglang.plugin_shim import ensure_plugin_discoverable

    if spec.get("cpus"):
        # Inherited by SGLang's scheduler and detokenizer processes.
        os.sched_setaffinity(0, spec["cpus"])
    result = {"name": spec["name"], "ok": False, "env": spec.get("env", {}),
              "engine_kwargs": spec["engine_kwargs"], "tasks": {},
              "cpus": sorted(os.sched_getaffinity(0)), "pid": os.getpid()}
    out = spec["result_path"]
    try:
        result["plugin"] = ensure_plugin_discoverable(spec["shim_dir"], spec["repo_root"])
    except Exception as exc:
        result["plugin"] = f"error: {exc}"
    write_json(result, out)
    before = gpu_used_mib()
    t0 = time.perf_counter()
    try:
        import sglang

        engine = sglang.Engine(**spec["engine_kwargs"])
    except BaseException as exc:
        result["error"] = f"engine start failed: {exc!r}"
        result["traceback"] = traceback.format_exc()[-6000:]
        result["startup_s"] = time.perf_counter() - t0
        write_json(result, out)
        return 2
    result["startup_s"] = time.perf_counter() - t0
    # Each sweep freezes the collector once warm (run_sweep), as a tuned server does.
    frozen = {"freeze_gc": True} if spec.get("freeze_gc") else {}
    if frozen and not hasattr(engine, "freeze_gc"):
        result["error"] = ("this SGLang's Engine has no freeze_gc (0.5.17 has): run without "
                           "--freeze-gc")
        write_json(result, out)
        _shut(engine)
        return 2
    after = gpu_used_mib()
    result["gpu_used_mib"] = {"before": before, "after_start": after}
    result["server_info"] = _server_info(engine)
    write_json(result, out)
    rc = 0
    for task in spec["tasks"]:
        name = task["name"]

        def emit(partial, _name=name):
            result["tasks"][_name] = partial
            write_json(result, out)

        try:
            emit(TASKS[task["kind"]](engine, task | frozen, emit))
        except BaseException as exc:
            result["tasks"][name] = {"error": repr(exc), "traceback": traceback.format_exc()[-4000:]}
            write_json(result, out)
            rc = 3
            break
    if rc == 0 and spec.get("inbox"):
        def record(name, answer):
            # Cells served one by one share their task's name: their points go together, and a
            # failed one keeps the points before it.
            kept = result["tasks"].get(name)
            if kept is None or "points" not in kept:
                result["tasks"][name] = answer
            else:
                kept["points"] += answer.get("points", [])
                kept.update({"error": answer["error"]} if "error" in answer else {})
            write_json(result, out)
        rc = serve(engine, Path(spec["inbox"]), record, frozen)
    result["ok"] = rc == 0
    write_json(result, out)
    _shut(engine)
    return rc


def _shut(engine) -> None:
    try:
        engine.shutdown()
    except Exception:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
