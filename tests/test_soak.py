"""The soak's workload, its client against a stand-in HTTP server, and its token comparison."""

import asyncio

import pytest

from bench.sglang import serve_bench as sb
from bench.sglang import soak

aiohttp_web = pytest.importorskip("aiohttp.web")

VOCAB = 1000


def _cfg(**kw):
    base = dict(requests=300, concurrency=16, idle_every=100, idle_s=0.01, abort_within_s=0.05,
                output_len=(1, 8), long_input=(40, 60), check_output_len=4)
    return soak.SoakConfig(**(base | kw))


def test_workload_mixes_lengths_prefixes_aborts_and_checks():
    cfg = soak.SoakConfig(requests=2000)
    reqs = soak.make_requests(cfg, VOCAB)
    assert reqs == soak.make_requests(cfg, VOCAB) and len(reqs) == 2000
    checks = [r for r in reqs if r.check is not None]
    assert [r.index for r in checks] == list(range(0, 2000, 100))
    assert all(r.abort_after_s is None and r.max_new_tokens == cfg.check_output_len
               for r in checks)
    assert [list(r.input_ids) for r in checks] == soak.check_prompts(cfg, VOCAB)
    rest = [r for r in reqs if r.check is None]
    aborted = sum(r.abort_after_s is not None for r in rest) / len(rest)
    long = sum(len(r.input_ids) >= cfg.long_input[0] for r in rest) / len(rest)
    assert 0.1 < aborted < 0.2 and 0.05 < long < 0.15
    heads = {r.input_ids[:cfg.prefix_len] for r in rest if len(r.input_ids) > cfg.prefix_len}
    assert len(heads) < len(rest) * 0.9     # shared prefixes repeat
    assert all(cfg.output_len[0] <= r.max_new_tokens <= cfg.output_len[1] for r in rest)


def test_agreement_names_the_first_mismatch():
    ref = [[1, 2], [3, 4], [5, 6]]
    assert soak.agreement(ref, {0: [1, 2], 2: [5, 6]}) == soak.Agreement(2, 2)
    got = soak.agreement(ref, {0: [1, 2], 1: [3, 9], 2: [5, 0]})
    assert (got.equal, got.compared, got.first_mismatch) == (1, 3, 1)
    assert "first mismatch at check 1" in got.line("quiet")


class StandIn:
    """An HTTP server answering /generate like SGLang: output ids from the prompt, one token per
    millisecond, an abort finish once /abort_request names a prefix of the rid (SGLang's rule);
    `wrong` corrupts answers,
    `fail_with` answers every generate with that HTTP status."""

    def __init__(self, wrong: bool = False, fail_with: int = 0):
        from http_stand_in import serve_in_thread

        self.wrong, self.fail_with, self.aborted = wrong, fail_with, set()
        self.port = serve_in_thread([aiohttp_web.post("/generate", self.generate),
                                     aiohttp_web.post("/abort_request", self.abort)])

    def answer(self, ids, n):
        out = [(sum(ids) + k) % VOCAB for k in range(n)]
        return [x + 1 for x in out] if self.wrong else out

    async def generate(self, request):
        if self.fail_with:
            return aiohttp_web.Response(status=self.fail_with, text="internal error")
        body = await request.json()
        n = body["sampling_params"]["max_new_tokens"]
        if body["input_ids"] and isinstance(body["input_ids"][0], list):
            return aiohttp_web.json_response(
                [{"output_ids": self.answer(ids, n)} for ids in body["input_ids"]])
        rid = body.get("rid")
        for _ in range(n):
            await asyncio.sleep(0.001)
            if rid and any(rid.startswith(a) for a in self.aborted):
                return aiohttp_web.json_response(
                    {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}})
        return aiohttp_web.json_response({"output_ids": self.answer(body["input_ids"], n),
                                          "meta_info": {"finish_reason": {"type": "length"}}})

    async def abort(self, request):
        self.aborted.add((await request.json())["rid"])
        return aiohttp_web.Response()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"


def test_no_soak_rid_is_a_prefix_of_another():
    rids = sorted(r.rid for r in soak.make_requests(soak.SoakConfig(requests=2000), VOCAB))
    assert not any(b.startswith(a) for a, b in zip(rids, rids[1:]))


def test_soak_counts_every_request_and_records_the_check_answers():
    cfg = _cfg()
    server = StandIn()
    reqs = soak.make_requests(cfg, VOCAB)
    res = soak.run_soak(server.url, cfg, reqs, alive=lambda: True)
    assert res.sent == 300 and res.errors == 0, res.first_error
    assert res.completed + res.aborted == 300 and res.aborted > 0
    assert res.idle_pauses == 3
    ref = [server.answer(p, cfg.check_output_len) for p in soak.check_prompts(cfg, VOCAB)]
    assert soak.agreement(ref, res.loaded_check_outputs) == soak.Agreement(3, 3)
    quiet = soak.generate_batch(server.url, soak.check_prompts(cfg, VOCAB), cfg.check_output_len)
    assert quiet == ref


def test_soak_reports_wrong_answers_and_a_dead_server():
    cfg = _cfg(requests=200)
    wrong = StandIn(wrong=True)
    reqs = soak.make_requests(cfg, VOCAB)
    res = soak.run_soak(wrong.url, cfg, reqs, alive=lambda: False)
    assert res.idle_pauses == 1 and res.sent == 100     # stops after the first wave
    assert res.first_error == "server process exited during the soak"
    wrong.wrong = False
    ref = [wrong.answer(p, cfg.check_output_len) for p in soak.check_prompts(cfg, VOCAB)]
    assert soak.agreement(ref, res.loaded_check_outputs).equal == 0


def test_soak_section_of_the_report(tmp_path):
    cfg = _cfg()
    res = soak.SoakResult(sent=300, completed=250, aborted=50, output_tokens=900, seconds=12.0,
                          idle_pauses=3)
    soaked = {"server_env": sb.SOAK_ENV, "server_args": list(sb.SOAK_ARGS), "dgw": {
        "dgw_switches_total{tp_rank=0}": 41.0}, "alive_at_end": True, "leak_reports": 0,
        "retracted_requests": 7.0} | soak.summary(cfg, res, {"quiet vs plain": soak.Agreement(3, 3)})
    text = sb.soak_report(soaked, dummy=True)
    assert "| 300 / 250 / 50 / 0 / 0 |" in text and "| T=0 checks, quiet vs plain | 3 / 3 |" in text
    assert "| switches (dgw_switches_total) | 41 |" in text and "NOT forced" in text
    assert "| retracted requests (sglang:num_retracted_requests_total) | 7 |" in text
    assert "(DUMMY weights)" in text
    # With --model the soak serves the real checkpoint: its report says so.
    assert "(real weights)" in sb.soak_report(soaked, dummy=False)
    assert sb.soak_report({"error": "server exited with 1"}, dummy=True).strip().endswith(
        "exited with 1")


def test_a_counter_family_is_summed_over_its_label_sets():
    page = ("# TYPE sglang:num_retracted_requests counter\n"
            'sglang:num_retracted_requests_total{tp_rank="0"} 3.0\n'
            'sglang:num_retracted_requests_total{tp_rank="1"} 4.0\n'
            "# TYPE other counter\nother_total 9.0\n")
    assert sb.metric_total(page, "sglang:num_retracted_requests") == 7.0
    assert sb.metric_total("", "sglang:num_retracted_requests") == 0


def test_a_server_error_on_a_request_scheduled_for_abort_is_an_error_not_an_abort():
    cfg = _cfg(requests=100, abort_share=1.0, check_every=1000)
    server = StandIn(fail_with=500)
    res = soak.run_soak(server.url, cfg, soak.make_requests(cfg, VOCAB), alive=lambda: True)
    assert res.aborted == 0 and res.errors >= 99 and "HTTP 500" in res.first_error


def test_the_soak_passes_only_alive_leak_free_error_free_and_equal():
    ok = {"alive_at_end": True, "leak_reports": 0, "result": {"errors": 0},
          "checks": {"quiet vs plain": {"equal": 3, "compared": 3},
                     "under load vs plain": {"equal": 2, "compared": 3}}}
    assert sb.soak_passed(ok)
    assert not sb.soak_passed(ok | {"alive_at_end": False})
    assert not sb.soak_passed(ok | {"leak_reports": 1})
    assert not sb.soak_passed(ok | {"result": {"errors": 1}})
    assert not sb.soak_passed(ok | {"checks": {"quiet vs plain": {"equal": 2, "compared": 3}}})
    assert not sb.soak_passed(ok | {"checks": {"quiet vs plain": {"equal": 0, "compared": 0}}})
    assert not sb.soak_passed({"error": "server exited with 1"})


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow in a container)."""
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_stopping_a_server_stops_its_children_when_the_leader_already_exited(tmp_path):
    import subprocess
    import time

    marker = tmp_path / "child.pid"
    proc = subprocess.Popen(["bash", "-c", f"sleep 300 & echo $! > {marker}; exit 1"],
                            start_new_session=True)
    proc.wait(timeout=10)
    child = int(marker.read_text())
    assert _running(child)
    sb._stop(proc)
    deadline = time.time() + 10
    while _running(child) and time.time() < deadline:
        time.sleep(0.05)
    assert not _running(child)
