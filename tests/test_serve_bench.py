"""serve-bench's commands, its reading of bench_serving's JSONL and /metrics, its report."""

import dataclasses
import json

import pytest

from bench.sglang import serve_bench as sb


def _cfg(tmp_path, **kw):
    return sb.ServeBenchConfig(out=tmp_path, **kw)


def test_each_engine_gets_its_own_server_flags(tmp_path):
    cfg = _cfg(tmp_path)
    plain = sb.server_command("plain", cfg, "T", "D")
    eagle = sb.server_command("eagle3", cfg, "T", "D")
    dual = sb.server_command("dual", cfg, "T", "D")
    assert "--speculative-algorithm" not in plain and "--load-format" in plain
    assert eagle[eagle.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert eagle[eagle.index("--max-running-requests") + 1] == "256"
    assert dual[dual.index("--speculative-algorithm") + 1] == "DUAL_GRAPH_EAGLE3"
    assert "--max-running-requests" not in dual
    for cmd in (plain, eagle, dual):
        assert cmd[cmd.index("--attention-backend") + 1] == "triton"
        assert "--enable-metrics" in cmd and "--disable-radix-cache" not in cmd
    real = sb.server_command("dual", _cfg(tmp_path, model="M", draft="D"), "M", "D")
    assert "--load-format" not in real


def test_attention_backend_default_leaves_the_choice_to_sglang(tmp_path):
    """As the README's launch line: no --attention-backend, so SGLang picks (fa3 on Hopper)."""
    cfg = sb.parse_args(["--out", str(tmp_path), "--attention-backend", "default"])
    for kind in ("plain", "eagle3", "dual"):
        cmd = sb.server_command(kind, cfg, "T", "D")
        assert "--attention-backend" not in cmd and "--enable-metrics" in cmd
    cfg = sb.parse_args(["--out", str(tmp_path), "--attention-backend", "flashinfer"])
    cmd = sb.server_command("dual", cfg, "T", "D")
    assert cmd[cmd.index("--attention-backend") + 1] == "flashinfer"


def test_dual_env_reaches_only_the_workers_server_and_the_report(tmp_path):
    cfg = sb.parse_args(["--out", str(tmp_path), "--dual-env", "DGW_SPEC_MAX_BS=256"])
    assert sb.engine_env("dual", cfg)["DGW_SPEC_MAX_BS"] == "256"
    assert "DGW_SPEC_MAX_BS" not in sb.engine_env("eagle3", cfg)
    assert "DGW_SPEC_MAX_BS" not in sb.engine_env("plain", cfg)
    assert "worker's server with `DGW_SPEC_MAX_BS=256`" in sb.report(cfg, [])
    assert "worker's server" not in sb.report(_cfg(tmp_path), [])


def test_step_log_reaches_only_the_workers_server(tmp_path):
    cfg = sb.parse_args(["--out", str(tmp_path), "--step-log"])
    assert sb.engine_env("dual", cfg)["DGW_STEP_LOG"] == str((tmp_path / "dual.steps.jsonl")
                                                             .resolve())
    assert "DGW_STEP_LOG" not in sb.engine_env("eagle3", cfg)
    assert "DGW_STEP_LOG" not in sb.engine_env("dual", _cfg(tmp_path))


def test_client_sends_exact_lengths_and_enough_prompts(tmp_path):
    cfg = _cfg(tmp_path, input_len=128, output_len=64)
    cmd = sb.client_command(cfg, 64, "T", tmp_path / "x.jsonl", "dual-c64")
    arg = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert arg("--dataset-name") == "random-ids" and arg("--random-range-ratio") == "1.0"
    assert arg("--random-input-len") == "128" and arg("--random-output-len") == "64"
    assert arg("--max-concurrency") == "64" and arg("--num-prompts") == "256"
    one = sb.client_command(cfg, 1, "T", tmp_path / "x.jsonl", "dual-c1")
    assert one[one.index("--num-prompts") + 1] == str(cfg.min_prompts)


def test_results_are_read_by_tag_from_the_appended_jsonl(tmp_path):
    path = tmp_path / "raw.jsonl"
    recs = [{"tag": "dual-c1", "output_throughput": 210.5, "median_ttft_ms": 20.0,
             "server_info": {"big": "blob"}},
            {"tag": "dual-c4", "output_throughput": 800.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rows = sb.read_results(path)
    assert rows["dual-c1"]["output_throughput"] == 210.5
    assert "server_info" not in rows["dual-c1"] and rows["dual-c4"]["median_ttft_ms"] is None
    assert sb.read_results(tmp_path / "missing.jsonl") == {}


def test_the_workers_series_are_scraped_from_a_metrics_page():
    from prometheus_client import CollectorRegistry, generate_latest

    from dual_graph_worker.core.counters import WorkerCounters
    from dual_graph_worker.core.policy import PolicyState
    from dual_graph_worker.engines.sglang.metrics import PrometheusSeries

    reg = CollectorRegistry()
    series = PrometheusSeries({"tp_rank": "0"}, registry=reg)
    counters = WorkerCounters(switches=3, output_tokens=40)
    series.push(counters, PolicyState(3.0, spec_goodput=900.0, decode_goodput=800.0))
    page = generate_latest(reg).decode() + "sglang_other_total 5.0\n"
    got = sb.dgw_series(page)
    assert got["dgw_switches_total{tp_rank=0}"] == 3.0
    assert got["dgw_expected_goodput_tokens_per_s{mode=spec,tp_rank=0}"] == 900.0
    assert not any(k.startswith("sglang") or "_created" in k for k in got)


def test_forward_seconds_time_every_server_alike_and_table_each_level(tmp_path):
    """--forward-seconds: SGLang's device timer on in every server; a level's GPU-busy seconds
    by forward kind (the counter's rise over the level) against its duration."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    cfg = sb.parse_args(["--out", str(tmp_path), "--forward-seconds"])
    for kind in sb.ENGINES:
        assert sb.engine_env(kind, cfg)["SGLANG_ENABLE_METRICS_DEVICE_TIMER"] == "1"
    assert "SGLANG_ENABLE_METRICS_DEVICE_TIMER" not in sb.engine_env("dual", _cfg(tmp_path))
    reg = CollectorRegistry()
    busy = Counter("sglang:forward_execution_seconds", "GPU busy", ["category", "tp_rank"],
                   registry=reg)
    busy.labels(category="decode", tp_rank="0").inc(2.5)
    busy.labels(category="decode", tp_rank="1").inc(0.5)
    busy.labels(category="extend", tp_rank="0").inc(1.25)
    passes = Counter("sglang:cuda_graph_passes", "passes", ["mode", "tp_rank"], registry=reg)
    passes.labels(mode="decode_cuda_graph", tp_rank="0").inc(40)
    passes.labels(mode="decode_none", tp_rank="0").inc(2)
    passes.labels(mode="prefill_cuda_graph", tp_rank="0").inc(7)
    page = generate_latest(reg).decode()
    assert sb.counter_by_label(page, "sglang:forward_execution_seconds", "category") == {
        "decode": 3.0, "extend": 1.25}
    assert sb.decode_steps(page) == 42.0            # prefill passes are no decode steps
    m = {k: 1.0 for k in sb.FIELDS} | {"duration": 4.0, "output_throughput": 100.0}
    points = [sb.ServePoint("eagle3", 128, m, forward_s={"decode": 2.0, "extend": 1.0},
                            decode_steps=50.0),
              sb.ServePoint("dual", 128, m, forward_s={"decode": 2.5})]
    text = sb.report(cfg, points)
    assert ("| engine | C | duration s | decode | extend | busy / duration | decode steps | "
            "output tokens / step |") in text
    assert "| eagle3 | 128 | 4.00 | 2.00 | 1.00 | 0.750 | 50 | 8.0 |" in text
    assert "| dual | 128 | 4.00 | 2.50 | 0.00 | 0.625 | - | - |" in text
    assert "GPU-busy" not in sb.report(cfg, [sb.ServePoint("dual", 128, m)])


def test_report_shows_ratios_against_each_baseline_and_failures(tmp_path):
    cfg = _cfg(tmp_path, concurrency=(1, 128))
    m = lambda tps: {k: 1.0 for k in sb.FIELDS} | {"output_throughput": tps}  # noqa: E731
    points = [sb.ServePoint("plain", 1, m(200.0)), sb.ServePoint("eagle3", 1, m(400.0)),
              sb.ServePoint("dual", 1, m(396.0)), sb.ServePoint("plain", 128, m(10000.0)),
              sb.ServePoint("eagle3", 128, m(6000.0)), sb.ServePoint("dual", 128, m(9900.0)),
              sb.ServePoint("dual", 0, error="server exited with 1 before it was ready")]
    text = sb.report(cfg, points)
    assert "| 1 | 1.980 | 0.990 |" in text and "| 128 | 0.990 | 1.650 |" in text
    # A baseline that never ran (a server cut short) is said to be missing, not skipped.
    cut = sb.report(cfg, [p for p in points if p.engine != "eagle3"])
    assert "| 1 | 1.980 | not measured |" in cut
    zero = sb.report(cfg, [p for p in points if p.engine != "eagle3"]
                     + [sb.ServePoint("eagle3", 1, m(0.0))])
    assert "| 1 | 1.980 | made 0 tok/s |" in zero
    assert "FORCED to 3.0" in text and "DUMMY weights" in text
    assert "server exited with 1" in text
    sb.plot(cfg, points, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_resume_keeps_the_other_engines_points_of_a_run_cut_short(tmp_path):
    m = {k: 1.0 for k in sb.FIELDS} | {"output_throughput": 100.0}
    first = [sb.ServePoint("plain", 1, m), sb.ServePoint("eagle3", 1, m),
             sb.ServePoint("dual", 1, error="cut short")]
    sb.write_results(_cfg(tmp_path, concurrency=(1,)), first, {})
    again = _cfg(tmp_path, concurrency=(1,), engines=("dual",), resume=True, port=30001)
    kept = sb.kept_points(tmp_path / "serve-bench.json", again)
    assert [(p.engine, p.metrics) for p in kept] == [("plain", m), ("eagle3", m)]
    sb.write_results(again, kept + [sb.ServePoint("dual", 1, m)], {})
    merged = json.loads((tmp_path / "serve-bench.json").read_text())
    assert merged["config"]["engines"] == ["plain", "eagle3", "dual"]
    assert sb.kept_points(tmp_path / "none.json", again) == []
    # Points measured with other settings would make meaningless ratios: refused, one line.
    with pytest.raises(SystemExit, match="input_len=256"):
        sb.kept_points(tmp_path / "serve-bench.json",
                       _cfg(tmp_path, concurrency=(1,), engines=("dual",), input_len=512))
    # A run from before a setting existed resumes as if it had its default.
    older = json.loads((tmp_path / "serve-bench.json").read_text())
    del older["config"]["dual_env"]
    (tmp_path / "serve-bench.json").write_text(json.dumps(older))
    assert len(sb.kept_points(tmp_path / "serve-bench.json", again)) == 2
    with pytest.raises(SystemExit, match="dual_env"):
        sb.kept_points(tmp_path / "serve-bench.json",
                       dataclasses.replace(again, dual_env=(("DGW_SPEC_MAX_BS", "256"),)))
    (tmp_path / "serve-bench.json").write_text("{")
    with pytest.raises(SystemExit, match="not a serve-bench result"):
        sb.kept_points(tmp_path / "serve-bench.json", again)
    assert sb.parse_args(["--resume", "--engines", "dual"]).resume


@pytest.mark.parametrize("argv, message", [
    (["--engines", "plain,vllm"], "unknown engine 'vllm'"),
    (["--concurrency", "1,x"], "write integers separated by commas"),
    (["--concurrency", "0"], "must be >= 1"),
    (["--model", "M"], "--model and --draft go together"),
    (["--model", "meta-llama/Llama-3-8B", "--draft", "D"], "no config.json there"),
    (["--dual-env", "SPEC_MAX_BS=256"], "write DGW_NAME=VALUE"),
    (["--dual-env", "DGW_SPEC_MAX_B=256"], "DGW_SPEC_MAX_BS"),
])
def test_bad_arguments_get_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        sb.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_dummy_checkpoints_carry_a_tokenizer_that_round_trips(tmp_path):
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    target, draft = sb.write_dummy_checkpoints(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(target)
    ids = [3, 5, 128255, 1000, 77]
    assert tok.encode(tok.decode(ids)) == ids and tok.num_special_tokens_to_add() == 0
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"]


class SGLangStandIn:
    """The HTTP surface bench_serving's sglang backend uses, answering like a server that emits
    one word a token: /v1/models, streamed /generate, /get_server_info, /flush_cache."""

    def __init__(self):
        import asyncio

        from aiohttp import web
        from http_stand_in import serve_in_thread

        self.web, self.asyncio = web, asyncio
        self.port = serve_in_thread([
            web.get("/v1/models", self.answer({"data": [{"id": "stand-in"}]})),
            web.post("/generate", self.generate),
            web.get("/get_server_info", self.answer(
                {"internal_states": [{"avg_spec_accept_length": 3.0}]})),
            web.post("/flush_cache", self.answer({}))])

    def answer(self, body):
        async def handler(request):
            return self.web.json_response(body)
        return handler

    async def generate(self, request):
        body = await request.json()
        n = body["sampling_params"]["max_new_tokens"]
        resp = self.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(1, n + 1):
            await self.asyncio.sleep(0.001)
            chunk = {"text": "w " * k, "meta_info": {"completion_tokens": k}}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


def test_the_client_command_measures_a_server_in_this_environment(tmp_path):
    """bench_serving as serve-bench runs it (its environment included: the H200 image lacks
    Hugging Face `datasets`, which bench_serving imports at start-up) against a stand-in."""
    import os
    import subprocess
    import sys

    pytest.importorskip("sglang.benchmark")      # its serving module: in the child, stubbed
    pytest.importorskip("transformers")
    pytest.importorskip("aiohttp")
    server = SGLangStandIn()
    target, _ = sb.write_dummy_checkpoints(tmp_path / "ck")
    cfg = _cfg(tmp_path, input_len=16, output_len=8, port=server.port, min_prompts=4)
    raw = tmp_path / "raw.jsonl"
    env = sb.client_env(dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    run = subprocess.run(sb.client_command(cfg, 2, target, raw, "stand-in-c2"), env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, sb.last_error(run.stdout + run.stderr)
    row = sb.read_results(raw)["stand-in-c2"]
    assert row["completed"] == cfg.num_prompts(2) and row["output_throughput"] > 0
    assert row["median_itl_ms"] is not None


def test_a_failed_client_names_its_error():
    log = "Traceback (most recent call last):\n  File x\nModuleNotFoundError: No module named 'datasets'\n"
    assert sb.last_error(log) == "ModuleNotFoundError: No module named 'datasets'"


def test_a_failed_client_never_shows_an_earlier_runs_metrics(tmp_path, monkeypatch):
    """bench_serving appends to its output file: a level whose client fails this time must not
    read the line an earlier run into the same folder left under its tag."""
    from contextlib import contextmanager

    @contextmanager
    def up(*args, **kwargs):
        yield None

    monkeypatch.setattr(sb, "launched", up)
    monkeypatch.setattr(sb, "_get", lambda url, timeout=5.0: "")
    monkeypatch.setattr(sb.subprocess, "call", lambda *a, **kw: 1)
    raw = tmp_path / "raw" / "dual.jsonl"
    raw.parent.mkdir()
    raw.write_text(json.dumps({"tag": "dual-c1", "output_throughput": 999.0}) + "\n")
    [point] = sb.run_engine("dual", _cfg(tmp_path, concurrency=(1,)), "T", "D")
    assert point.metrics == {} and point.error.startswith("client exited with 1")


def test_a_levels_error_shows_in_its_row_even_with_metrics(tmp_path):
    m = {k: 1.0 for k in sb.FIELDS} | {"output_throughput": 100.0}
    text = sb.report(_cfg(tmp_path, concurrency=(4,)),
                     [sb.ServePoint("dual", 4, m, error="client exited with 1: Killed")])
    assert "| dual (client exited with 1: Killed) | 4 | 1.00 |" in text


def test_results_are_written_through_write_json(tmp_path, monkeypatch):
    # write_json writes a temporary file and renames it: --resume never reads half a file.
    from dual_graph_worker.core.jsonio import write_json

    written = []
    monkeypatch.setattr(sb, "write_json",
                        lambda data, path: (written.append(path), write_json(data, path)))
    sb.write_results(_cfg(tmp_path, concurrency=(1,)), [], {})
    assert written == [tmp_path / "serve-bench.json"]


@pytest.mark.parametrize("accept", ["0", "-1", "4.5"])
def test_an_accept_length_sglang_would_not_force_is_one_line(accept, capsys):
    with pytest.raises(SystemExit) as exc:
        sb.parse_args(["--accept", accept])
    assert exc.value.code == 2 and "must be in 1..4" in capsys.readouterr().err
