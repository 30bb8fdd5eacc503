"""Synthetic worker profiles for the checker tests, written as an nsys SQLite export (same table
and column names as `nsys export --type sqlite`) or as a torch.profiler Chrome trace.

`ProfileBuilder` records one scenario on a fake clock; `standard_profile(violation)` is the
scenario the tests share: warm-up with allocation and graph capture, the steady_state_begin
mark, then blocks of spec and decode steps (one eager step among them), with at most one
planted violation.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from profiling import checks
from profiling.check import check_trace
from profiling.nsys_sqlite import load_sqlite
from profiling.api_names import base_name

PID = 4242
TID = 4243
GLOBAL_TID = (PID << 24) | TID
GLOBAL_PID = PID << 24
DGW_DOMAIN_ID = 1

GRAPH_LAUNCH = "cudaGraphLaunch_v10000"
LAUNCH_KERNEL = "cudaLaunchKernel_v7000"
MEMCPY = "cudaMemcpyAsync_v3020"
EVENT_RECORD = "cudaEventRecord_v3020"
STREAM_WAIT = "cudaStreamWaitEvent_v3020"
STREAM_SYNC = "cudaStreamSynchronize_v3020"
MALLOC = "cudaMalloc_v3020"
BEGIN_CAPTURE = "cudaStreamBeginCapture_v10000"
END_CAPTURE = "cudaStreamEndCapture_v10000"
INSTANTIATE = "cudaGraphInstantiateWithFlags_v11040"
EVENT_QUERY = "cudaEventQuery_v3020"
EVENT_CREATE = "cudaEventCreateWithFlags_v3020"

# Each fault `standard_profile` can plant, the one check that must catch it, and a phrase of
# the violation it reports.
PLANTED_FAULTS = (
    ("double_launch", checks.GRAPH_LAUNCHES, "stage verify has 2 graph launches"),
    ("missing_stage", checks.GRAPH_LAUNCHES, "missing stage draft_extend"),
    ("instantiate", checks.NO_CAPTURE, "cudaGraphInstantiateWithFlags x1"),
    ("malloc", checks.NO_CAPTURE, "allocation: cudaMalloc x1"),
    ("switch_extra_api", checks.SWITCH_COST, "cudaStreamSynchronize +1"),
    ("switch_gap_extra_api", checks.SWITCH_COST, "typical gap between steps"),
    ("eager_kernels", checks.EAGER_KERNELS, "6 eager kernel launches > 4 allowed"),
)
VIOLATIONS = tuple(fault for fault, _, _ in PLANTED_FAULTS)


@dataclass
class ApiCall:
    name: str  # as nsys spells it, with the version suffix
    start: int
    end: int
    corr: int
    kernel: Optional[str] = None  # eager launch: the kernel it ran (short name)
    graph_id: Optional[int] = None  # graph launch: the graph it replayed
    driver: bool = False  # a driver call nested in a runtime call
    demangled: Optional[str] = None  # eager launch: demangled name; default: a C++ signature


@dataclass
class Nvtx:
    text: str
    start: int
    end: Optional[int]  # None: a mark
    registered: bool = False  # message sent as a registered string (textId, NULL text)
    domain_id: int = DGW_DOMAIN_ID


@dataclass
class ProfileBuilder:
    gpu_name: str = "NVIDIA H200"
    compute: tuple[int, int] = (9, 0)
    t: int = 1_000_000
    apis: list[ApiCall] = field(default_factory=list)
    nvtx: list[Nvtx] = field(default_factory=list)
    last_mode: Optional[str] = None
    graph_ids: dict[tuple[str, int, str], int] = field(default_factory=dict)

    # -- primitives -------------------------------------------------------------------------
    def api(self, name: str, dur: int = 2_000, kernel: Optional[str] = None,
            graph_id: Optional[int] = None, nested_driver: Optional[str] = None,
            demangled: Optional[str] = None) -> None:
        call = ApiCall(name, self.t, self.t + dur, len(self.apis) + 1, kernel, graph_id,
                       demangled=demangled)
        self.apis.append(call)
        if nested_driver:
            self.apis.append(ApiCall(nested_driver, self.t + 100, self.t + dur - 100,
                                     len(self.apis) + 1, driver=True))
        self.t += dur + 500

    def mark(self, text: str) -> None:
        self.nvtx.append(Nvtx(text, self.t, None))
        self.t += 200

    @contextlib.contextmanager
    def range(self, text: str) -> Iterator[None]:
        item = Nvtx(text, self.t, None, registered=True)
        self.t += 300
        yield
        item.end = self.t
        self.nvtx.append(item)
        self.t += 300

    # -- worker-shaped pieces ---------------------------------------------------------------
    def config(self, key: str, value: object) -> None:
        self.mark(f"config:{key}={value}")

    def graph_id(self, mode: str, bs: int, stage: str) -> int:
        return self.graph_ids.setdefault((mode, bs, stage), len(self.graph_ids) + 1)

    def warmup(self, keys: tuple[tuple[str, int], ...], k: int) -> None:
        for _ in range(3):
            self.api(MALLOC, 20_000)
        for mode, bs in keys:
            for stage in _stages(mode, k):
                self.mark(f"capture:{mode}-bs{bs}-{stage}")
                self.api(BEGIN_CAPTURE)
                for i in range(3):
                    self.api(LAUNCH_KERNEL, kernel=f"captured_{stage}_{i}")
                self.api(END_CAPTURE)
                self.api(INSTANTIATE, 50_000)
                self.graph_id(mode, bs, stage)
        for mode, bs in keys:  # one warm-up replay of each pool, with a lazy allocation
            self.step(mode, bs, k=k)
            self.api(MALLOC, 20_000)

    def hand_over(self, mode: str, gap_extra: tuple[str, ...] = ()) -> None:
        """Between steps: the scheduler hands over the batch (an event record and a stream
        wait, plus `gap_extra` calls), and a switch mark when the mode changes."""
        self.api(EVENT_RECORD)
        self.api(STREAM_WAIT)
        for name in gap_extra:
            self.api(name)
        if self.last_mode is not None and self.last_mode != mode:
            self.mark(f"switch:{self.last_mode}->{mode}")
        self.last_mode = mode

    def step(self, mode: str, bs: int, *, graph: bool = True, k: int = 3,
             launches: Optional[dict[str, int]] = None, skip: tuple[str, ...] = (),
             extra_api: tuple[str, ...] = (), gap_extra: tuple[str, ...] = (),
             eager_kernels: int = 3, nested_driver: bool = False) -> None:
        launches = launches or {}
        self.hand_over(mode, gap_extra)
        text = f"step:{mode}:bs{bs}" if graph else f"step:{mode}:eager-bs{bs}"
        with self.range(text):
            self.api(MEMCPY)  # fill static inputs
            self.api(MEMCPY)
            for stage in _stages(mode, k):
                if stage in skip:
                    continue
                with self.range(f"stage:{stage}"):
                    if graph:
                        for _ in range(launches.get(stage, 1)):
                            self.api(GRAPH_LAUNCH, 3_000, graph_id=self.graph_id(mode, bs, stage),
                                     nested_driver="cuGraphLaunch" if nested_driver else None)
                    else:
                        for i in range(20):
                            self.api(LAUNCH_KERNEL, kernel=f"eager_{stage}_{i % 5}")
            for name in extra_api:
                self.api(name)
            with self.range("stage:accept"):
                for i in range(eager_kernels - 1):
                    self.api(LAUNCH_KERNEL, kernel="accept_kernel" if i else "argmax_kernel")
            with self.range("stage:commit"):
                self.api(LAUNCH_KERNEL, kernel="commit_kernel")
                self.api(MEMCPY)
                self.api(EVENT_RECORD)

    # -- writers ----------------------------------------------------------------------------
    def write_sqlite(self, path: Path, *, steady_mark_text: bool = True) -> Path:
        strings: dict[str, int] = {}

        def sid(s: str) -> int:
            return strings.setdefault(s, len(strings) + 1)

        conn = sqlite3.connect(path)
        conn.executescript(_SCHEMA)
        nvtx_rows = [(0, None, 75, None, None, None, "dgw", GLOBAL_TID, None, None, DGW_DOMAIN_ID,
                      None)]
        for n in self.nvtx:
            event_type = 34 if n.end is None else 60
            text, text_id = (None, sid(n.text)) if n.registered else (n.text, None)
            nvtx_rows.append((n.start, n.end, event_type, None, None, None, text, GLOBAL_TID,
                              GLOBAL_TID if n.end is not None else None, text_id, n.domain_id,
                              None))
        conn.executemany("INSERT INTO NVTX_EVENTS VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", nvtx_rows)
        conn.executemany(
            "INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?,?,?,?,?,?,?,?)",
            [(a.start, a.end, 1 if a.driver else 0, GLOBAL_TID, a.corr, sid(a.name), 0, None)
             for a in self.apis])
        kernels, graphs = [], []
        for a in self.apis:
            if a.kernel:
                k0 = a.end + 1_000
                kernels.append((k0, k0 + 4_000, 0, 1, None, 7, a.corr, GLOBAL_PID,
                                sid(a.demangled or f"void {a.kernel}<float>(float*)"),
                                sid(a.kernel), None, None))
            if a.graph_id:
                g0 = a.end + 1_000
                graphs.append((g0, g0 + 30_000, 0, 1, None, 7, a.corr, GLOBAL_PID, a.graph_id,
                               100 + a.graph_id))
        conn.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                         kernels)
        conn.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_GRAPH_TRACE VALUES (?,?,?,?,?,?,?,?,?,?)",
                         graphs)
        conn.executemany("INSERT INTO StringIds VALUES (?,?)",
                         [(i, s) for s, i in strings.items()])
        conn.execute("INSERT INTO TARGET_INFO_GPU VALUES (0, ?, '0000:19:00.0', 150000000000, 132,"
                     " 'GH100', ?, ?)", (self.gpu_name, *self.compute))
        conn.commit()
        conn.close()
        return path

    def write_chrome_trace(self, path: Path) -> Path:
        events = []
        for n in self.nvtx:
            if n.domain_id != DGW_DOMAIN_ID:  # Chrome traces have no NVTX domains
                continue
            dur = (n.end - n.start) / 1e3 if n.end is not None else 0.5
            events.append({"ph": "X", "cat": "user_annotation", "name": n.text, "pid": PID,
                           "tid": TID, "ts": n.start / 1e3, "dur": dur, "args": {}})
        for a in self.apis:
            events.append({"ph": "X", "cat": "cuda_driver" if a.driver else "cuda_runtime",
                           "name": base_name(a.name), "pid": PID, "tid": TID,
                           "ts": a.start / 1e3, "dur": (a.end - a.start) / 1e3,
                           "args": {"correlation": a.corr}})
            if a.kernel:
                events.append({"ph": "X", "cat": "kernel", "name": a.kernel, "pid": 0, "tid": 7,
                               "ts": (a.end + 1_000) / 1e3, "dur": 4.0,
                               "args": {"correlation": a.corr, "device": 0}})
        trace = {"schemaVersion": 1,
                 "deviceProperties": [{"id": 0, "name": self.gpu_name,
                                       "computeMajor": self.compute[0],
                                       "computeMinor": self.compute[1]}],
                 "traceEvents": events}
        path.write_text(json.dumps(trace), encoding="utf-8")
        return path


def _stages(mode: str, k: int) -> tuple[str, ...]:
    if mode == "decode":
        return ("decode",)
    return ("verify", "draft_extend") if k == 1 else ("draft", "verify", "draft_extend")


# The tables and columns of an nsys 2025-2026 SQLite export that the checker reads.
_SCHEMA = """
CREATE TABLE StringIds(id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE NVTX_EVENTS(start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL,
  rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER,
  endGlobalTid INTEGER, textId INTEGER, domainId INTEGER, jsonText TEXT);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME(start INTEGER NOT NULL, end INTEGER NOT NULL,
  eventClass INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL,
  returnValue INTEGER NOT NULL, callchainId INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL(start INTEGER NOT NULL, end INTEGER NOT NULL,
  deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, greenContextId INTEGER,
  streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
  demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL, graphNodeId INTEGER, graphId INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_GRAPH_TRACE(start INTEGER NOT NULL, end INTEGER NOT NULL,
  deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, greenContextId INTEGER,
  streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER, graphId INTEGER NOT NULL,
  graphExecId INTEGER);
CREATE TABLE TARGET_INFO_GPU(id INTEGER NOT NULL, name TEXT, busLocation TEXT, totalMemory INTEGER,
  smCount INTEGER, chipName TEXT, computeMajor INTEGER, computeMinor INTEGER);
"""

SPEC_BS = 4
DECODE_BS = 8
EAGER_BS = 64
K = 3
# Steady-state schedule: (mode, block length). Steps are numbered 0.. in steady state; the
# first step of each block after the first is a switch step.
BLOCKS = (("spec", 4), ("decode", 4), ("spec", 4), ("decode", 4), ("spec", 4))


def standard_profile(violation: Optional[str] = None, *, steady_mark: bool = True,
                     with_config: bool = True, k: int = K,
                     switch_polls: int = 0, gap_events_at: tuple[int, ...] = ()) -> ProfileBuilder:
    """The shared scenario; `violation` (one of VIOLATIONS) plants one fault; `switch_polls`
    adds that many cudaEventQuery calls to a switch step (and two to the gap before it);
    `gap_events_at` an event creation to the gap before each of those steps.

    Faults sit where only their own check can see them: in non-switch steps and in gaps
    between non-switch steps, except the two switch faults.
    """
    if violation is not None and violation not in VIOLATIONS:
        raise ValueError(violation)
    b = ProfileBuilder()
    if with_config:
        b.config("engine", "reference")
        b.config("attention_backend", "triton")
        b.config("num_draft_tokens", k)
    b.warmup((("spec", SPEC_BS), ("decode", DECODE_BS)), k)
    b.last_mode = None  # warm-up replays are not switches the tests reason about
    if steady_mark:
        b.mark("steady_state_begin")
    # Another library's range in the default NVTX domain that happens to look like a step:
    # the checker must ignore it because the dgw domain exists.
    noise = Nvtx("step:decode:bs999", b.t, None, domain_id=0)
    i = 0
    for mode, length in BLOCKS:
        for _ in range(length):
            kw: dict = {"k": k, "nested_driver": i % 3 == 0}
            if violation == "double_launch" and i == 1:
                kw["launches"] = {"verify": 2}
            if violation == "missing_stage" and i == 2:
                kw["skip"] = ("draft_extend",)
            if violation == "instantiate" and i == 6:
                kw["gap_extra"] = (INSTANTIATE,)
            if violation == "malloc" and i == 6:
                kw["extra_api"] = (MALLOC,)
            if violation == "switch_extra_api" and i == 8:
                kw["extra_api"] = (STREAM_SYNC,)
            if violation == "switch_gap_extra_api" and i == 8:
                kw["gap_extra"] = (STREAM_SYNC,)
            if switch_polls and i == 8:           # status polls only: not a violation
                kw["extra_api"] = (EVENT_QUERY,) * switch_polls
                kw["gap_extra"] = (EVENT_QUERY,) * 2
            if i in gap_events_at:
                kw["gap_extra"] = (EVENT_CREATE,)
            if violation == "eager_kernels" and i == 9:
                kw["eager_kernels"] = 6
            if mode == "decode" and i == 13:  # an eager step: reported, never failed
                b.step(mode, EAGER_BS, graph=False, **kw)
            else:
                b.step(mode, SPEC_BS if mode == "spec" else DECODE_BS, **kw)
            i += 1
    noise.end = b.t
    b.nvtx.append(noise)
    return b


# ----------------------------------------------------------------------------- SGLang worker
# A profile shaped like the SGLang worker's (bench.sglang.profile_workload under nsys with a
# cudaProfilerApi capture range): config marks, one slack step, steady_state_begin, then the
# cycle policy's schedule at one batch size. Spec steps run EAGLE-3's draft, verify and
# draft-extend graphs with SGLang's eager glue around them; decode steps run the decode graph
# and the width-1 draft-extend graph. Kernel names are the ones SGLang 0.5.17's source launches.

def _aten(op: str, functor: str) -> tuple[str, str]:
    return op, f"void at::native::{op}<4, at::native::{functor}, std::array<char*, 2ul> >(int)"


def _triton(name: str) -> tuple[str, str]:
    return name, name  # Triton kernels carry no C++ signature


FILL = _aten("vectorized_elementwise_kernel", "FillFunctor<long>")
ARGMAX = ("reduce_kernel", "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
          "at::native::ArgMaxOps<float>, unsigned int, long, 4> >(at::native::ReduceOp<float, "
          "at::native::ArgMaxOps<float>, unsigned int, long, 4>)")
GATHER = _aten("index_elementwise_kernel", "gpu_index_kernel")
CUMSUM = ("DeviceScanKernel", "void at_cuda_detail::cub::DeviceScanKernel<int*, int*>(int*)")
KV_INDICES = _triton("create_flashinfer_kv_indices_triton")

# stage -> eager kernels around its one graph launch: (before, after)
SGLANG_STAGE_KERNELS: dict[tuple[str, str], tuple[tuple, tuple]] = {
    ("spec", "draft"): ((_triton("assign_draft_cache_locs_contiguous"),
                         _triton("generate_draft_decode_kv_indices"), FILL),
                        (_triton("sgl_build_tree_kernel_efficient_triton"),)),
    ("spec", "verify"): ((KV_INDICES, CUMSUM, _triton("get_num_kv_splits_triton")),
                         (_triton("verify_tree_greedy_kernel_triton"), ARGMAX, GATHER)),
    ("spec", "draft_extend"): ((_triton("assign_extend_cache_locs"), FILL),
                               (GATHER, ARGMAX)),
    ("decode", "decode"): ((_triton("clamp_position_kernel"), KV_INDICES, CUMSUM), (ARGMAX,)),
    ("decode", "draft_extend"): ((FILL, KV_INDICES), (ARGMAX,)),
}

SGLANG_BS = 8
SGLANG_HOLD = 3
SGLANG_CYCLES = 2


def sglang_schedule(hold: int = SGLANG_HOLD, cycles: int = SGLANG_CYCLES) -> list[str]:
    """The cycle policy's modes, from the policy itself."""
    from dual_graph_worker.core.simple_policies import CyclePolicy

    policy = CyclePolicy(hold=hold)
    return [policy.mode_at(i).value for i in range(policy.period * cycles)]


SGLANG_FAULTS = (
    ("capture_in_steady", checks.NO_CAPTURE, "capture: cudaStreamBeginCapture x1"),
    ("decode_launches_verify_graph", checks.GRAPH_LAUNCHES,
     "which spec steps launch as their verify graph"),
    ("decode_verify_stage", checks.GRAPH_LAUNCHES, "stage verify does not belong to mode decode"),
    ("missing_draft_extend", checks.GRAPH_LAUNCHES, "missing stage draft_extend"),
    ("unlisted_eager_kernels", checks.EAGER_KERNELS,
     "5 eager kernel launches outside the stated set > 4 allowed"),
)
SGLANG_VIOLATIONS = tuple(fault for fault, _, _ in SGLANG_FAULTS)


def _sglang_stages(mode: str, continuity: str) -> tuple[str, ...]:
    if mode == "spec":
        return ("draft", "verify", "draft_extend")
    return ("decode",) if continuity == "lazy-catch-up" else ("decode", "draft_extend")


# Lazy catch-up's eager draft extend (one draft layer: GEMMs, norm, rotary, Triton extend
# attention, logits), as the first spec step after decode steps runs it.
CATCH_UP_KERNELS = (("nvjet_tst_128x64_64x4_1x2_h_bz_TNT", "nvjet_tst_128x64_64x4_1x2_h_bz_TNT"),
                    _triton("_fwd_kernel"), ("rmsnorm_kernel", "void rmsnorm_kernel<bf16>()"),
                    ("rotary_embedding_kernel", "void rotary_embedding_kernel<bf16>()"),
                    ("act_and_mul_kernel", "void act_and_mul_kernel<bf16>()"), GATHER, ARGMAX)


@dataclass(frozen=True)
class CatchUp:
    """A catch-up in a spec step: `kernels` eager launches, inside `stage:catch_up` unless
    `in_stage` is False; `malloc` adds a cudaMalloc inside it."""

    kernels: int = 24
    in_stage: bool = True
    malloc: bool = False


def _catch_up(b: ProfileBuilder, c: CatchUp) -> None:
    ctx = b.range("stage:catch_up") if c.in_stage else contextlib.nullcontext()
    with ctx:
        b.api(MEMCPY)                          # the catch-up indices, one pinned upload
        if c.malloc:
            b.api(MALLOC, 20_000)
        for i in range(c.kernels):
            short, full = CATCH_UP_KERNELS[i % len(CATCH_UP_KERNELS)]
            b.api(LAUNCH_KERNEL, kernel=short, demangled=full)


def sglang_step(b: ProfileBuilder, mode: str, bs: int = SGLANG_BS, *,
                continuity: str = "keep-current", skip: tuple[str, ...] = (),
                extra_stage: Optional[str] = None, graph_of: Optional[dict] = None,
                gap_extra: tuple[str, ...] = (), unlisted_kernels: int = 0,
                catch_up: Optional[CatchUp] = None, eager: tuple[str, ...] = ()) -> None:
    graph_of = graph_of or {}
    b.hand_over(mode, gap_extra)
    with b.range(f"step:{mode}:bs{bs}"):
        b.api(LAUNCH_KERNEL, kernel=FILL[0], demangled=FILL[1])   # idle-input / plan glue
        if catch_up is not None:
            _catch_up(b, catch_up)
        stages = _sglang_stages(mode, continuity) + ((extra_stage,) if extra_stage else ())
        for stage in stages:
            if stage in skip:
                continue
            before, after = SGLANG_STAGE_KERNELS.get((mode, stage), ((), ()))
            with b.range(f"stage:{stage}"):
                for short, full in before:
                    b.api(LAUNCH_KERNEL, kernel=short, demangled=full)
                b.api(MEMCPY)
                if stage in eager:          # the engine's own eager run of a graph stage
                    for short, full in CATCH_UP_KERNELS * 3:
                        b.api(LAUNCH_KERNEL, kernel=short, demangled=full)
                    continue
                key = graph_of.get(stage, (mode, bs, stage))
                b.api(GRAPH_LAUNCH, 3_000, graph_id=b.graph_id(*key))
                for short, full in after:
                    b.api(LAUNCH_KERNEL, kernel=short, demangled=full)
        for i in range(unlisted_kernels):
            b.api(LAUNCH_KERNEL, kernel=f"mystery_kernel_{i % 2}")


def sglang_profile(violation: Optional[str] = None, *, continuity: str = "keep-current",
                   hold: int = SGLANG_HOLD, cycles: int = SGLANG_CYCLES,
                   catch_up: CatchUp = CatchUp(), attention_backend: str = "triton",
                   eager: tuple[str, ...] = ()) -> ProfileBuilder:
    """The SGLang scenario; `violation` (one of SGLANG_VIOLATIONS) plants one fault in a
    non-switch step (or a gap between two), where only its own check can see it. With lazy
    catch-up continuity every spec step after a decode step runs `catch_up` first. The stages
    in `eager` run eager kernels instead of their graph in every spec step."""
    if violation is not None and violation not in SGLANG_VIOLATIONS:
        raise ValueError(violation)
    b = ProfileBuilder()
    # The capture range opens one step before the steady mark: config marks, a slack step and
    # a lazy allocation that must not count.
    b.config("engine", "sglang")
    b.config("attention_backend", attention_backend)
    b.config("num_draft_tokens", K)
    b.config("continuity", continuity)
    sglang_step(b, "spec", continuity=continuity)
    b.api(MALLOC, 20_000)
    b.mark("steady_state_begin")
    schedule = sglang_schedule(hold, cycles)
    hold_decode = hold + 1          # the second step of the first decode hold: not a switch
    for i, mode in enumerate(schedule):
        kw: dict = {"continuity": continuity, "eager": eager if mode == "spec" else ()}
        if continuity == "lazy-catch-up" and mode == "spec" and i and schedule[i - 1] == "decode":
            kw["catch_up"] = catch_up
        if violation == "capture_in_steady" and i == 1:
            kw["gap_extra"] = (BEGIN_CAPTURE, END_CAPTURE, INSTANTIATE)
        if i == hold_decode:
            if violation == "decode_launches_verify_graph":
                kw["graph_of"] = {"decode": ("spec", SGLANG_BS, "verify")}
            if violation == "decode_verify_stage":
                kw["extra_stage"] = "verify"
                kw["graph_of"] = {"verify": ("spec", SGLANG_BS, "verify")}
            if violation == "missing_draft_extend":
                kw["skip"] = ("draft_extend",)
            if violation == "unlisted_eager_kernels":
                kw["unlisted_kernels"] = 5
        sglang_step(b, mode, **kw)
    return b


def outcomes(path: Path, config: checks.CheckConfig = checks.CheckConfig()) -> dict:
    """{check name: its outcome} for the trace at `path`."""
    return {o.name: o for o in check_trace(load_sqlite(path), config)[1]}
