"""`make serve-bench`: plain SGLang, EAGLE-3 and the dual-graph worker as HTTP servers, measured
the way SGLang users compare servers.

    python -m bench.sglang.serve_bench --out DIR [--engines plain,eagle3,dual]
        [--concurrency 1,4,16,64,128,256] [--input-len 256] [--output-len 256] [--accept 3.0]
        [--model PATH --draft PATH]

Each engine is one `python -m sglang.launch_server` (radix cache on, as SGLang ships) serving
`python -m sglang.benchmark.serving --dataset-name random-ids` at every --max-concurrency in
turn; after each level the server's /metrics is scraped for the worker's dgw_* series (and, with
--forward-seconds, every server's GPU-busy seconds of the level by forward kind). Without
--model the target is a Llama-3-8B-shaped checkpoint with DUMMY weights and a word-level
tokenizer, and acceptance is FORCED with SGLANG_SIMULATE_ACC_LEN (dummy weights accept
nothing); the report says so. Writes DIR/serve-bench.json, DIR/report.md and DIR/serve-bench.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[2]

from bench.sglang.model_configs import (
    accept_problem,
    engine_attention_backend,
    llama3_8b_shapes,
    spec_kwargs,
    write_dummy_pair,
    write_word_tokenizer,
)
from bench.sglang import soak, step_costs
from bench.sglang.engine_child import gpu_name
from bench.sglang.matrix_records import ENGINES
from bench.sglang.plugin_shim import ensure_plugin_discoverable
from dual_graph_worker.core.argtypes import OneLineParser
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.jsonio import write_json
from dual_graph_worker.core.jsonl import json_lines
from dual_graph_worker.core.settings import assignments, settings_env

# bench_serving's result keys the table keeps, in its order.
FIELDS = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
          "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "p99_tpot_ms", "accept_length",
          "completed", "duration")


# Every server's flags but the attention backend's.
SERVER_FLAGS = ("--cuda-graph-max-bs", "256", "--enable-metrics")


def server_flags(attention_backend: str) -> tuple[str, ...]:
    """The servers' flags with the attention backend asked for ('default': SGLang's)."""
    backend = engine_attention_backend(attention_backend)
    return SERVER_FLAGS if backend is None else ("--attention-backend", backend, *SERVER_FLAGS)


@dataclass(frozen=True)
class ServeBenchConfig:
    out: Path
    engines: tuple[str, ...] = ENGINES
    concurrency: tuple[int, ...] = (1, 4, 16, 64, 128, 256)
    input_len: int = 256
    output_len: int = 256
    accept: Optional[float] = 3.0
    model: Optional[str] = None
    draft: Optional[str] = None
    port: int = 30000
    prompts_per_level: int = 4
    min_prompts: int = 16
    start_timeout_s: float = 600.0
    server_args: tuple[str, ...] = server_flags("triton")
    soak: Optional[soak.SoakConfig] = None
    resume: bool = False
    dual_env: tuple[tuple[str, str], ...] = ()     # DGW_* settings of the worker's server
    step_log: bool = False                          # the worker writes OUT/dual.steps.jsonl
    forward_seconds: bool = False                   # every server times its forwards (below)

    @property
    def dummy(self) -> bool:
        return self.model is None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @functools.cached_property
    def vocab(self) -> int:
        """The target's vocabulary size (read once): the soak draws prompt ids below it."""
        if self.dummy:
            return llama3_8b_shapes().vocab_size
        config = json.loads((Path(self.model) / "config.json").read_text())
        vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        if not vocab:
            raise SystemExit(f"error: {self.model}/config.json has no vocab_size; the soak "
                             "draws prompt ids below it")
        return int(vocab)

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, self.prompts_per_level * concurrency)


@dataclass
class ServePoint:
    engine: str
    concurrency: int
    metrics: dict = field(default_factory=dict)
    dgw: dict = field(default_factory=dict)
    forward_s: dict = field(default_factory=dict)   # the level's GPU-busy seconds by kind
    decode_steps: Optional[float] = None            # the level's decode steps (a verify is one)
    error: Optional[str] = None


def server_command(kind: str, cfg: ServeBenchConfig, target: str, draft: str) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", target,
           "--host", "127.0.0.1", "--port", str(cfg.port), *cfg.server_args]
    if cfg.dummy:
        cmd += ["--load-format", "dummy"]
    return cmd if kind == "plain" else cmd + _flags(spec_kwargs(kind, Path(draft)))


def _flags(kwargs: dict) -> list[str]:
    """sglang.Engine keyword arguments as launch_server flags: num_steps=3 -> --num-steps 3."""
    return [a for k, v in kwargs.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def client_command(cfg: ServeBenchConfig, concurrency: int, tokenizer: str, out_file: Path,
                   tag: str) -> list[str]:
    return [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang",
            "--host", "127.0.0.1", "--port", str(cfg.port), "--tokenizer", tokenizer,
            "--model", tokenizer,
            "--dataset-name", "random-ids", "--random-input-len", str(cfg.input_len),
            "--random-output-len", str(cfg.output_len), "--random-range-ratio", "1.0",
            "--num-prompts", str(cfg.num_prompts(concurrency)),
            "--max-concurrency", str(concurrency), "--seed", str(concurrency),
            "--warmup-requests", "1", "--disable-tqdm", "--tag", tag,
            "--output-file", str(out_file)]


CLIENT_STUBS = Path(__file__).resolve().parent / "client_stubs"


def client_env(env: dict) -> dict:
    """bench_serving's environment: the `datasets` stand-in where the real one is missing."""
    import importlib.util

    if importlib.util.find_spec("datasets") is not None:
        return env
    path = env.get("PYTHONPATH")
    return env | {"PYTHONPATH": str(CLIENT_STUBS) + (os.pathsep + path if path else "")}


def last_error(log_text: str) -> str:
    """The last line of a traceback or error in a client's output, for the report."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    hits = [ln for ln in lines if "Error" in ln or "error" in ln or ln.startswith("Exception")]
    return (hits or lines or [""])[-1][:300]


def read_results(path: Path) -> dict[str, dict]:
    """bench_serving's JSONL (one line appended per run) -> {tag: the kept fields}."""
    rows = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        rec = json.loads(line)
        rows[rec.get("tag")] = {k: rec.get(k) for k in FIELDS}
    return rows


def dgw_series(metrics_text: str) -> dict[str, float]:
    """The worker's series from a /metrics page: name{labels} -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name.startswith("dgw_") and not s.name.endswith("_created"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def metric_total(metrics_text: str, family: str) -> float:
    """Sum of one counter family's samples (every label set) on a /metrics page."""
    return sum(counter_by_label(metrics_text, family, "").values())


# SGLang's device timer: CUDA events around every forward, summed per kind into
# sglang:forward_execution_seconds_total{category}. Set alike for every server.
FORWARD_TIMER_ENV = {"SGLANG_ENABLE_METRICS_DEVICE_TIMER": "1"}


def counter_by_label(metrics_text: str, family: str, label: str) -> dict[str, float]:
    """One counter family's samples on a /metrics page, summed per value of `label`."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for f in text_string_to_metric_families(metrics_text):
        for s in f.samples:
            if s.name == f"{family}_total":
                key = s.labels.get(label, "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def forward_seconds(metrics_text: str) -> dict[str, float]:
    """A server's GPU-busy seconds so far by forward kind, from its /metrics page."""
    return counter_by_label(metrics_text, "sglang:forward_execution_seconds", "category")


def decode_steps(metrics_text: str) -> float:
    """A server's decode steps so far, from its /metrics page: SGLang counts each decode
    result it processes (a speculative verify is one), graph-replayed or not."""
    passes = counter_by_label(metrics_text, "sglang:cuda_graph_passes", "mode")
    return sum(v for mode, v in passes.items() if mode.startswith("decode"))


def write_dummy_checkpoints(folder: Path) -> tuple[str, str]:
    shapes = llama3_8b_shapes()
    target, draft = write_dummy_pair(folder, shapes)
    write_word_tokenizer(target, shapes.vocab_size)
    return str(target), str(draft)


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _wait_ready(cfg: ServeBenchConfig, proc: subprocess.Popen) -> None:
    deadline = time.time() + cfg.start_timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            _get(f"{cfg.url}/health_generate", timeout=30)
            return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"server not ready after {cfg.start_timeout_s:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    """The server's whole process group, even when its leader already exited (its scheduler
    children would keep holding GPU memory from the next server)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=60)
            _group_gone(proc.pid, timeout=30)
            return
        except subprocess.TimeoutExpired:
            pass                          # the next signal


def _group_gone(pgid: int, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise subprocess.TimeoutExpired(f"process group {pgid}", timeout)


@contextmanager
def launched(kind: str, cfg: ServeBenchConfig, target: str, draft: str, env: dict,
             log_path: Path, extra_args: tuple[str, ...] = ()):
    """One launch_server process, ready to serve; stopped (its whole group) on leaving."""
    started = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*server_command(kind, cfg, target, draft), *extra_args],
                                env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            _wait_ready(cfg, proc)
            print(f"[serve-bench] {log_path.stem} ready in {time.time() - started:.0f} s",
                  flush=True)
            yield proc
        finally:
            _stop(proc)


def engine_env(kind: str, cfg: ServeBenchConfig) -> dict:
    env = dict(os.environ)
    if cfg.accept is not None and kind != "plain":
        env["SGLANG_SIMULATE_ACC_LEN"] = str(cfg.accept)
    if cfg.forward_seconds:
        env |= FORWARD_TIMER_ENV
    if kind == "dual":
        env |= dict(cfg.dual_env)
        if cfg.step_log:
            env |= settings_env(step_log=step_log_path(cfg))
    return env


def step_log_path(cfg: ServeBenchConfig) -> Path:
    return (cfg.out / "dual.steps.jsonl").resolve()


def run_engine(kind: str, cfg: ServeBenchConfig, target: str, draft: str,
               soak_ref: Optional[dict] = None) -> list[ServePoint]:
    """bench_serving at every level; with soak_ref (plain only) also the soak's T=0 reference."""
    env = engine_env(kind, cfg)
    clients = client_env(env)
    raw = cfg.out / "raw" / f"{kind}.jsonl"
    raw.parent.mkdir(parents=True, exist_ok=True)
    # bench_serving appends: an earlier run's line of a tag would pass for a client that failed.
    raw.unlink(missing_ok=True)
    log_path = cfg.out / f"{kind}.server.log"
    points = []
    try:
        with launched(kind, cfg, target, draft, env, log_path):
            for c in cfg.concurrency:
                tag = f"{kind}-c{c}"
                client_log = cfg.out / f"{tag}.client.log"
                before = _get(f"{cfg.url}/metrics") if cfg.forward_seconds else ""
                with open(client_log, "w") as log:
                    rc = subprocess.call(client_command(cfg, c, target, raw, tag),
                                         env=clients, stdout=log,
                                         stderr=subprocess.STDOUT)
                point = ServePoint(kind, c, read_results(raw).get(tag, {}))
                page = _get(f"{cfg.url}/metrics")
                point.dgw = dgw_series(page)
                if cfg.forward_seconds:
                    busy = forward_seconds(before)
                    point.forward_s = {k: v - busy.get(k, 0.0)
                                       for k, v in forward_seconds(page).items()}
                    point.decode_steps = decode_steps(page) - decode_steps(before)
                if rc != 0 or not point.metrics:
                    point.error = (f"client exited with {rc}: "
                                   f"{last_error(client_log.read_text(errors='replace'))}")
                print(f"[serve-bench] {tag}: {point.metrics.get('output_throughput')} tok/s"
                      + (f"; {point.error}" if point.error else ""), flush=True)
                points.append(point)
            if soak_ref is not None:
                soak_ref["outputs"] = soak.generate_batch(
                    cfg.url, soak.check_prompts(cfg.soak, cfg.vocab), cfg.soak.check_output_len)
    except Exception as exc:         # a benchmark reports a failed server, it does not die
        points.append(ServePoint(kind, 0, error=f"{type(exc).__name__}: {exc}"))
        print(f"[serve-bench] {kind}: {exc} (see {log_path})", flush=True)
    return points


SOAK_ENV = settings_env(policy="cycle", min_dwell_steps=4)
# Small KV pool so SGLang retracts; chunked prefill so long prompts span several chunks.
SOAK_ARGS = ("--chunked-prefill-size", "512", "--max-total-tokens", "16384")


def run_soak_server(cfg: ServeBenchConfig, target: str, draft: str,
                    reference: Optional[list]) -> dict:
    """The worker under the soak: acceptance NOT forced (its T=0 answers must equal plain's),
    a policy switching every 4 steps, a KV pool small enough to retract, radix cache on."""
    env = dict(os.environ) | SOAK_ENV
    env.pop("SGLANG_SIMULATE_ACC_LEN", None)
    log_path = cfg.out / "soak.server.log"
    requests = soak.make_requests(cfg.soak, cfg.vocab)
    out: dict = {"server_env": SOAK_ENV, "server_args": list(SOAK_ARGS)}
    try:
        prompts = soak.check_prompts(cfg.soak, cfg.vocab)
        with launched("dual", cfg, target, draft, env, log_path, SOAK_ARGS) as proc:
            # Without plain's answers, the server's own before the soak are the reference.
            fresh = soak.generate_batch(cfg.url, prompts, cfg.soak.check_output_len)
            res = soak.run_soak(cfg.url, cfg.soak, requests, alive=lambda: proc.poll() is None)
            quiet, page = [], ""
            try:
                quiet = soak.generate_batch(cfg.url, prompts, cfg.soak.check_output_len)
                page = _get(f"{cfg.url}/metrics")
            except Exception as exc:     # the soak's counts stand; the server did not
                res.first_error = res.first_error or f"after the soak: {exc!r}"
            out["dgw"] = dgw_series(page)
            out["retracted_requests"] = metric_total(page, "sglang:num_retracted_requests")
            out["alive_at_end"] = proc.poll() is None
    except Exception as exc:
        print(f"[serve-bench] soak: {exc!r} (see {log_path})", flush=True)
        return out | {"error": f"{type(exc).__name__}: {exc}"}
    log_text = log_path.read_text(errors="replace")
    out["leak_reports"] = sum(line.count("memory leak detected") + line.count("double free")
                              + line.count("use-after-free") for line in log_text.splitlines())
    out["retraction_logs"] = log_text.count("KV cache pool is full. Retract")
    against = "plain" if reference else "itself before the soak"
    reference = reference or fresh
    checks = {f"quiet vs {against}": soak.agreement(reference, dict(enumerate(quiet))),
              f"under load vs {against}": soak.agreement(reference, res.loaded_check_outputs)}
    out |= soak.summary(cfg.soak, res, checks)
    print(f"[serve-bench] soak: {res.sent} sent, {res.completed} completed, {res.aborted} "
          f"aborted, {res.errors} errors in {res.seconds:.0f} s; leak reports "
          f"{out['leak_reports']}; " + "; ".join(a.line(k) for k, a in checks.items()),
          flush=True)
    return out


def report(cfg: ServeBenchConfig, points: list[ServePoint]) -> str:
    by = {(p.engine, p.concurrency): p.metrics for p in points if p.metrics}
    forced = (f"accept length FORCED to {cfg.accept} (SGLANG_SIMULATE_ACC_LEN); "
              if cfg.accept is not None else "")
    weights = "DUMMY weights, " if cfg.dummy else ""
    worker = " ".join(f"{k}={v}" for k, v in cfg.dual_env)
    lines = [f"# serve-bench: {cfg.input_len} in / {cfg.output_len} out, random-ids",
             "", f"{gpu_name()}, {weights}{forced}radix cache on; server flags "
             f"`{' '.join(cfg.server_args)}`" + (f"; the worker's server with `{worker}`."
                                                if worker else "."),
             "", "| engine | C | req/s | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | "
             "TPOT p50 | TPOT p99 | accept |", "|" + "---|" * 11]
    for p in points:
        m = p.metrics
        if not m:
            lines.append(f"| {p.engine} | {p.concurrency} | {p.error} |" + " |" * 8)
            continue
        cells = [f"{m[k]:.2f}" if isinstance(m.get(k), (int, float)) else "-"
                 for k in FIELDS[:9]]
        engine = p.engine + (f" ({p.error})" if p.error else "")
        lines.append(f"| {engine} | {p.concurrency} | " + " | ".join(cells) + " |")
    ratios = []
    for c in cfg.concurrency:
        dual = by.get(("dual", c), {}).get("output_throughput")
        base = {e: by.get((e, c), {}).get("output_throughput") for e in ("plain", "eagle3")}
        if dual:
            ratios.append(f"| {c} | " + " | ".join(
                "not measured" if v is None else f"{dual / v:.3f}" if v > 0 else "made 0 tok/s"
                for v in base.values()) + " |")
    if ratios:
        lines += ["", "dual / each baseline, output tok/s:", "", "| C | / plain | / EAGLE-3 |",
                  "|---|---|---|", *ratios]
    return "\n".join(lines + busy_table(points)) + "\n"


def busy_table(points: list[ServePoint]) -> list[str]:
    """Each level's GPU-busy seconds by forward kind against its duration (the rest: the
    host, the client, gaps), where the servers timed their forwards; and its decode steps with
    the output tokens each brought (fewer, fuller steps, or shorter ones)."""
    timed = [p for p in points if p.forward_s and p.metrics.get("duration")]
    if not timed:
        return []
    kinds = sorted({k for p in timed for k in p.forward_s})
    rows = ["", "GPU-busy seconds per level (SGLANG_ENABLE_METRICS_DEVICE_TIMER, every server):",
            "", "| engine | C | duration s | " + " | ".join(kinds)
            + " | busy / duration | decode steps | output tokens / step |",
            "|---|---|---|" + "---|" * (len(kinds) + 3)]
    for p in timed:
        busy = sum(p.forward_s.values())
        duration = p.metrics["duration"]
        tokens = p.metrics.get("output_throughput", 0.0) * duration
        steps, per_step = ("-", "-") if not p.decode_steps else \
            (f"{p.decode_steps:.0f}", f"{tokens / p.decode_steps:.1f}")
        rows.append(f"| {p.engine} | {p.concurrency} | {duration:.2f} | "
                    + " | ".join(f"{p.forward_s.get(k, 0.0):.2f}" for k in kinds)
                    + f" | {busy / duration:.3f} | {steps} | {per_step} |")
    return rows


def plot(cfg: ServeBenchConfig, points: list[ServePoint], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for engine in [e for e in ENGINES if any(p.engine == e for p in points)]:
        pts = [p for p in points if p.engine == engine and p.metrics]
        xs = [p.concurrency for p in pts]
        axes[0].plot(xs, [p.metrics["output_throughput"] for p in pts], "o-", label=engine)
        axes[1].plot(xs, [p.metrics["median_tpot_ms"] for p in pts], "o-", label=engine)
    for ax, label in zip(axes, ("output tok/s", "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("serve-bench" + (" (dummy weights, forced acceptance)" if cfg.dummy else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: Optional[list[str]] = None) -> ServeBenchConfig:
    ap = OneLineParser(prog="python -m bench.sglang.serve_bench", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/serve-bench")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--concurrency", default="1,4,16,64,128,256")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--accept", type=float, default=3.0,
                    help="forced accept length with dummy weights; ignored with --model")
    ap.add_argument("--model", help="a real target checkpoint (then --draft is required)")
    ap.add_argument("--draft", help="its EAGLE-3 draft")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--prompts-per-level", type=int, default=4,
                    help="prompts per level = max(--min-prompts, this x concurrency)")
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--resume", action="store_true",
                    help="keep the points of other engines already in OUT/serve-bench.json (a "
                         "run cut short: measure only the engines it missed)")
    ap.add_argument("--attention-backend", default="triton",
                    help="the servers' --attention-backend; 'default' passes none, so SGLang "
                         "picks its own (fa3 on Hopper), as the README's launch line does")
    ap.add_argument("--dual-env", action="append", default=[], metavar="DGW_NAME=VALUE",
                    help="a setting of the worker's server (repeatable), e.g. "
                         "DGW_SPEC_MAX_BS=256")
    ap.add_argument("--step-log", action="store_true",
                    help="the worker writes OUT/dual.steps.jsonl (modes, measured costs, the "
                         "controller's cost terms; a little host time a step) and "
                         "OUT/step-costs.md")
    ap.add_argument("--forward-seconds", action="store_true",
                    help="every server times its forwards with CUDA events "
                         "(SGLANG_ENABLE_METRICS_DEVICE_TIMER=1) and the report tables each "
                         "level's GPU-busy seconds by forward kind against its duration")
    ap.add_argument("--soak", type=int, default=0, metavar="N",
                    help="after the engines, N requests against a worker under a switching "
                         "policy, random lengths and aborts; T=0 checks against plain")
    args = ap.parse_args(argv)
    engines = tuple(e for e in args.engines.split(",") if e)
    if bad := [e for e in engines if e not in ENGINES]:
        ap.error(f"unknown engine {bad[0]!r}; choose from {', '.join(ENGINES)}")
    try:
        levels = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError:
        ap.error(f"--concurrency {args.concurrency!r}: write integers separated by commas, "
                 "e.g. 1,16,128")
    if min(*levels, args.input_len, args.output_len, args.prompts_per_level,
           args.min_prompts) < 1:
        ap.error("--concurrency, --input-len, --output-len, --prompts-per-level and "
                 "--min-prompts must be >= 1")
    if args.soak < 0:
        ap.error("--soak wants a request count >= 0 (0: no soak)")
    if bool(args.model) != bool(args.draft):
        ap.error("--model and --draft go together (a real target and its EAGLE-3 draft)")
    for flag, folder in (("--model", args.model), ("--draft", args.draft)):
        if folder and not (Path(folder) / "config.json").is_file():
            ap.error(f"{flag} {folder}: no config.json there; pass a local checkpoint folder "
                     "(a hub id is not fetched here)")
    if not args.model and (err := accept_problem("--accept", [args.accept])):
        ap.error(err)
    try:
        dual_env = tuple(assignments(args.dual_env).items())
    except ConfigError as exc:
        ap.error(f"--dual-env: {exc}")
    return ServeBenchConfig(out=Path(args.out), engines=engines, concurrency=levels,
                            input_len=args.input_len, output_len=args.output_len,
                            accept=None if args.model else args.accept, model=args.model,
                            draft=args.draft, port=args.port,
                            prompts_per_level=args.prompts_per_level,
                            min_prompts=args.min_prompts,
                            soak=soak.SoakConfig(requests=args.soak) if args.soak else None,
                            resume=args.resume, server_args=server_flags(args.attention_backend),
                            dual_env=dual_env, step_log=args.step_log,
                            forward_seconds=args.forward_seconds)


def main(argv: Optional[list[str]] = None) -> int:
    cfg = parse_args(argv)
    if cfg.soak is not None:
        _ = cfg.vocab       # a checkpoint without vocab_size is refused before any server starts
    cfg.out.mkdir(parents=True, exist_ok=True)
    ensure_plugin_discoverable(cfg.out / "shim", REPO_ROOT)
    target, draft = ((cfg.model, cfg.draft) if not cfg.dummy
                     else write_dummy_checkpoints(cfg.out / "checkpoints"))
    points = kept_points(cfg.out / "serve-bench.json", cfg) if cfg.resume else []
    soak_ref: Optional[dict] = {} if cfg.soak else None
    soaked: dict = {}
    if cfg.step_log and "dual" in cfg.engines:
        step_log_path(cfg).unlink(missing_ok=True)              # the worker's log appends
    for kind in cfg.engines:
        points += run_engine(kind, cfg, target, draft, soak_ref if kind == "plain" else None)
        write_results(cfg, points, soaked)
    if cfg.step_log and step_log_path(cfg).exists():
        costs = step_costs.full_report(list(json_lines(step_log_path(cfg))))
        (cfg.out / "step-costs.md").write_text(costs)
    if cfg.soak:
        soaked = run_soak_server(cfg, target, draft, (soak_ref or {}).get("outputs"))
        write_results(cfg, points, soaked)
    print((cfg.out / "report.md").read_text())
    soak_ok = not cfg.soak or soak_passed(soaked)
    return 0 if soak_ok and all(p.error is None for p in points) else 1


# Settings a resumed run may change: which servers it starts and how it reaches them.
_RESUME_FREE = ("out", "engines", "port", "start_timeout_s", "soak", "resume", "step_log")


def kept_points(path: Path, cfg: ServeBenchConfig) -> list[ServePoint]:
    """The points of a previous run into the same folder for engines this run does not
    measure; a previous run with other settings is refused (its ratios would mean nothing)."""
    if not path.exists():
        return []
    def refused(exc: Exception) -> SystemExit:
        return SystemExit(f"error: --resume: {path} is not a serve-bench result ({exc}); use "
                          "another --out")

    try:
        earlier = json.loads(path.read_text())
        config = earlier["config"]
        now = _config_json(cfg)
        # A setting added since that run was at its default there.
        config = _config_json(ServeBenchConfig(out=cfg.out)) | config
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise refused(exc) from None
    if diff := [k for k in now if k not in _RESUME_FREE and config.get(k) != now[k]]:
        raise SystemExit(f"error: --resume: {path} was measured with other settings "
                         f"({', '.join(f'{k}={config.get(k)!r}' for k in diff)}); resume with "
                         "the same ones or use another --out")
    try:
        return [ServePoint(**p) for p in earlier["points"] if p["engine"] not in cfg.engines]
    except (KeyError, TypeError, AttributeError) as exc:
        raise refused(exc) from None


def _config_json(cfg: ServeBenchConfig) -> dict:
    """The config as serve-bench.json stores it (tuples as lists), so a stored one compares."""
    return json.loads(json.dumps({k: str(v) if isinstance(v, Path) else v
                                  for k, v in asdict(cfg).items()}))


def soak_passed(soaked: dict) -> bool:
    """Alive, no leak report, no failed request, and quiet T=0 answers all equal."""
    quiet = [v for k, v in (soaked.get("checks") or {}).items() if k.startswith("quiet")]
    return bool(soaked.get("alive_at_end")) and not soaked.get("leak_reports") \
        and not (soaked.get("result") or {}).get("errors") \
        and all(v["equal"] == v["compared"] > 0 for v in quiet)


def write_results(cfg: ServeBenchConfig, points: list[ServePoint], soaked: dict) -> None:
    """Everything so far, after each server: a run cut short keeps what it measured (the
    JSON replaced whole, so a kill mid-write leaves the previous one for --resume)."""
    config = _config_json(cfg)
    config["engines"] = [e for e in ENGINES if e in cfg.engines or
                         any(p.engine == e for p in points)]
    write_json({"config": config, "points": [asdict(p) for p in points], "soak": soaked},
               cfg.out / "serve-bench.json")
    (cfg.out / "report.md").write_text(report(cfg, points) + soak_report(soaked, cfg.dummy))
    if any(p.metrics for p in points):
        plot(cfg, points, cfg.out / "serve-bench.png")


def soak_report(soaked: dict, dummy: bool) -> str:
    """`dummy`: the soak's server ran dummy weights (no --model)."""
    if not soaked:
        return ""
    if "error" in soaked:
        return f"\n## Soak\n\nserver failed: {soaked['error']}\n"
    r, c = soaked["result"], soaked["config"]
    rows = [("requests sent / completed / aborted / aborted too late / errors",
             f"{r['sent']} / {r['completed']} / {r['aborted']} / {r['abort_too_late']} / "
             f"{r['errors']}"),
            ("output tokens, seconds", f"{r['output_tokens']}, {r['seconds']:.0f}"),
            ("idle pauses (SGLang's strict leak check runs when idle)", str(r["idle_pauses"])),
            ("leak / double-free reports in the server log", str(soaked["leak_reports"])),
            ("server alive at the end", str(soaked["alive_at_end"])),
            ("retracted requests (sglang:num_retracted_requests_total)",
             f"{soaked.get('retracted_requests', 0):g}"),
            ("switches (dgw_switches_total)",
             f"{sum(v for k, v in soaked['dgw'].items() if k.startswith('dgw_switches_total')):g}")]
    rows += [(f"T=0 checks, {k}", f"{v['equal']} / {v['compared']}")
             for k, v in soaked["checks"].items()]
    if r["first_error"]:
        rows.append(("first error", r["first_error"]))
    return ("\n## Soak\n\n"
            f"The worker with {soaked['server_env']} and `{' '.join(soaked['server_args'])}`, "
            f"radix cache on, acceptance NOT forced ({'DUMMY' if dummy else 'real'} weights); "
            f"random input "
            f"{c['short_input']} or {c['long_input']} tokens, output {c['output_len']}, "
            f"{c['abort_share']:.0%} aborted within {c['abort_within_s']} s, "
            f"{c['prefix_share']:.0%} sharing one of {c['prefixes']} prefixes, "
            f"concurrency {c['concurrency']}.\n\n| what | figure |\n|---|---|\n"
            + "".join(f"| {a} | {b} |\n" for a, b in rows))


if __name__ == "__main__":
    raise SystemExit(main())
