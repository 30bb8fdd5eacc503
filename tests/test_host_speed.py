"""The host's speed over a matrix run (a side sampler) and a load that slows the host on purpose:
each cell and run carries the host's speed while it ran, and the report sets runs on a slow host
apart per engine."""

from __future__ import annotations

import json
import time

import pytest

from bench.sglang import engine_child, host_speed, placement
from bench.sglang import matrix_report
from bench.sglang import policy_matrix as pm


def test_during_reads_the_median_inside_a_span_else_a_near_sample():
    samples = [(10.0, 9.0), (10.25, 15.0), (10.5, 11.0), (12.0, 30.0)]
    assert host_speed.during(samples, 10.0, 10.5) == 11.0
    assert host_speed.during(samples, 11.0, 11.1) == 11.0      # between samples: the nearest
    assert host_speed.during(samples, 20.0, 21.0) is None      # the sampler had stopped
    assert host_speed.during([], 0.0, 1.0) is None


def test_the_sampler_writes_until_its_block_ends_and_a_torn_line_is_skipped(tmp_path):
    path = tmp_path / "speed.jsonl"
    with host_speed.Sampler(path, period_s=0.01) as sampler:
        deadline = time.monotonic() + 30
        while len(host_speed.read(path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        (proc,) = sampler._procs
    assert proc.poll() is not None                     # gone with the block
    got = host_speed.read(path)
    assert len(got) >= 2 and all(ms > 0 for _, ms in got)
    with open(path, "a") as fh:
        fh.write('{"t": 1.0, "m')
    assert host_speed.read(path) == got
    assert host_speed.read(tmp_path / "none.jsonl") == []


def test_the_side_processes_go_with_a_parent_that_dies(tmp_path):
    """A killed engine process (its deadline) leaves neither hogs nor a sampler running."""
    import subprocess
    import sys

    code = ("import os, sys\nfrom pathlib import Path\nfrom bench.sglang.host_speed import Hogs, "
            "Sampler\nh = Hogs(2).__enter__()\ns = Sampler(Path(sys.argv[1])).__enter__()\n"
            "print(*[p.pid for p in h._procs + s._procs], flush=True)\nos._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s.jsonl")],
                         cwd=host_speed.REPO_ROOT, capture_output=True, text=True, timeout=60)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 3, out.stderr
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.05)
    assert not any(_running(p) for p in pids)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for a reaper the test does not own)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_hogs_spin_only_inside_their_block():
    with host_speed.Hogs(2) as hogs:
        procs = list(hogs._procs)
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs)
    with host_speed.Hogs(0) as none:
        assert none._procs == []
    with pytest.raises(ValueError, match=">= 0"):
        host_speed.Hogs(-1)


def test_a_sweep_under_load_spins_hogs_around_each_cells_runs_and_records_each_run(monkeypatch):
    loads = []

    class FakeHogs:
        def __init__(self, count):
            loads.append(count)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            loads.append("off")

    class FakeEngine:
        def generate(self, input_ids, sampling_params):
            loads.append("run")
            return [{"output_ids": [0] * sampling_params["max_new_tokens"]} for _ in input_ids]

    monkeypatch.setattr(engine_child, "Hogs", FakeHogs)
    monkeypatch.setattr(engine_child, "probe_ms", lambda: 0.0)
    (task,) = [t for t in pm.tasks_for("dual", [2.0], [pm.Workload.parse("8x40@1")], 100,
                                       pm.Repeats(1e9, 3), host_load=5) if t["kind"] == "sweep"]
    task["warmup"] = task["warm_shapes"] = False
    (point,) = engine_child.run_sweep(FakeEngine(), task, emit=lambda r: None)["points"]
    assert loads == [5, "run", "run", "run", "off"]
    assert point["host_load"] == 5 and len(point["runs_t"]) == 3
    assert all(a <= b for a, b in point["runs_t"])
    (plain,) = [t for t in pm.tasks_for("plain", [2.0], [pm.Workload.parse("8x40@1")], 100)]
    assert plain["host_load"] == 0


def test_records_carry_the_hosts_speed_per_cell_and_per_run():
    samples = [(t / 4, 10.0 if t < 8 else 20.0) for t in range(16)]
    rec = {"engine": "dual", "t_start": 0.0, "t_end": 3.9, "machine": {"sm_mhz": 1980.0},
           "runs_t": [[0.0, 1.9], [2.0, 3.9]]}
    got = pm.with_host_speed(rec, samples)
    assert got["machine"] == {"sm_mhz": 1980.0, "host_ms": 15.0}
    assert got["runs_host_ms"] == [10.0, 20.0]
    assert pm.with_host_speed(rec, []) == rec
    assert pm.with_host_speed({"engine": "plain"}, samples) == {"engine": "plain"}


def test_the_report_sets_each_engines_runs_on_a_slow_host_apart():
    def cell(engine, speeds, host):
        return {"engine": engine, "runs_tok_s": speeds, "runs_host_ms": host}
    recs = [cell("eagle3", [100.0, 99.0, 100.0], [10.0, 20.0, 10.0]),
            cell("dual", [100.0, 70.0, 99.0], [10.0, 20.0, 10.0]),
            cell("dual", [50.0, 50.0, 40.0], [10.0, 10.0, None]),
            cell("plain", [10.0], [30.0]) | {"from": "run7"}]
    md = matrix_report.slow_host_report(recs)
    assert "Host probe median 10.0 ms" in md
    assert "| dual | 1 | 0.700, 0.700 | 4 | 1.000, 0.990 | 1 of 5 |" in md
    assert "| eagle3 | 1 | 0.990, 0.990 | 2 | 1.000, 1.000 | 0 of 3 |" in md
    assert "plain" not in md
    assert matrix_report.slow_host_report([cell("dual", [1.0], [10.0])]) == ""


def test_a_loaded_matrix_says_so_and_never_shares_a_folder_with_an_unloaded_one(tmp_path,
                                                                                monkeypatch,
                                                                                capsys):
    specs = []

    def fake_engine(name, spec, out, deadline):
        specs.append(spec)
        until = time.monotonic() + 30                   # the side sampler's first line
        while not host_speed.read(out / pm.HOST_SPEED_FILE) and time.monotonic() < until:
            time.sleep(0.05)
        task = "256x256" if name == "plain" else "a3.0-256x256"
        return {"returncode": 0, "startup_s": 1.0, "tasks": {task: {"points": [
            {"concurrency": 1, "tok_s": 100.0, "seconds": 1.0, "t_start": time.time() - 1,
             "t_end": time.time(), "runs_t": [[time.time() - 1, time.time()]]}]}}}

    monkeypatch.setattr(pm, "run_engine", fake_engine)
    out = tmp_path / "o"
    args = ["--out", str(out), "--accept", "3", "--workload", "256x256@1"]
    assert pm.main(args + ["--host-load", "3"]) == 0
    assert {t["host_load"] for s in specs for t in s["tasks"] if t["kind"] == "sweep"} == {3}
    matrix = json.loads((out / "policy-matrix.json").read_text())
    assert "HOST LOADED ON PURPOSE: 3 processes" in matrix["note"]
    assert matrix["settings"]["host_load"] == 3
    assert all("host_ms" in r["machine"] for r in matrix["records"])
    assert all(len(r["runs_host_ms"]) == 1 for r in matrix["records"])
    capsys.readouterr()
    assert pm.main(args) == 2
    assert "--host-load 3" in capsys.readouterr().err
    assert pm.main(args + ["--host-load", "-1"]) == 2
    assert "--host-load must be >= 0" in capsys.readouterr().err


def test_a_matrix_from_before_the_load_setting_merges_as_unloaded():
    from bench.sglang.merge_matrix import _servers

    assert _servers({"settings": {"attention_backend": "default"}}) == \
        _servers({"settings": {"attention_backend": "default", "host_load": 0}})
    assert _servers({"settings": {"host_load": 16}}) != _servers({})


def _cost(t, mode, bs, seconds, **kw):
    return {"event": "cost", "kind": "StepTime", "t": t, "mode": mode, "padded_bs": bs,
            "seconds": seconds, "catch_up_tokens": 0, "carries_next": False} | kw


def test_a_switchs_settling_is_read_within_each_run_against_its_own_steady_steps():
    from bench.sglang import step_costs

    def run(mode, early, late, n=16, bs=4):
        return [_cost(0.0, mode, bs, early if 2 <= p <= 8 else late) for p in range(1, n + 1)]
    held = run("spec", 0.010, 0.010)
    held[2] = _cost(0.0, "spec", 4, 0.5, catch_up_tokens=64)      # place 3: a catch-up's
    held[4] = _cost(0.0, "spec", 4, 0.5, carries_next=True)       # place 5: holds a launch
    log = (run("decode", 0.009, 0.005)                   # the process's first run: no switch's
           + run("spec", 0.011, 0.010) + run("decode", 0.005, 0.005)
           + run("spec", 0.020, 0.020)                   # a slower spell, settled alike
           + run("decode", 0.005, 0.005, n=6)             # too short to read
           + held)
    ratios = step_costs.settling_ratios(log)
    assert [round(r, 3) for r in ratios["spec"]] == [1.1, 1.0, 1.0]
    assert ratios["decode"] == [1.0]
    md = step_costs.settling_report(log)
    assert "| spec | 3 | 1.000 |" in md and step_costs.settling_report([]) == ""


def test_the_spells_table_sets_the_workers_spec_steps_beside_the_hosts_speed(tmp_path, capsys):
    from bench.sglang import step_costs

    log = [_cost(t * 0.125, "spec", 4, 0.010 if t < 40 else 0.013) for t in range(80)]
    log += [{"step": t, "mode": "spec", "t": t * 0.125, "plan_us": 100.0 + 50 * (t >= 40),
             "launch_us": 2000.0} for t in range(80)]
    log.append(_cost(1.0, "spec", 32, 0.1))               # a size above 16: not in the table
    host = [(t * 0.25, 17.0) for t in range(40)]
    md = step_costs.spells_report(log, host)
    assert "| 0 | 0.870 | 100 | 2000 | 17.0 |" in md and "| 5 | 1.130 | 150 | 2000 | 17.0 |" in md
    assert "Correlation" not in md                       # two bins are too few to correlate
    assert step_costs.spells_report(log, []) == ""
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in log) + "\n")
    with pytest.raises(SystemExit):
        step_costs.main([str(path), "--host-speed", str(tmp_path / "none.jsonl")])
    assert f"--host-speed {tmp_path / 'none.jsonl'}: no such file" in capsys.readouterr().err


def test_placement_finds_a_scheduler_process_its_parent_and_its_cpu(tmp_path):
    """Each sample names every SGLang scheduler process (by the name SGLang gives it), the
    engine process above it, the CPU it last ran on and the CPU ticks it used since."""
    import os
    import subprocess
    import sys

    code = ("from pathlib import Path\nPath('/proc/self/comm').write_text('sglang::scheduler')\n"
            "print('r', flush=True)\nwhile True:\n    pass\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "r"
        sampler = placement.Placement()
        first = sampler.sample()
        deadline = time.monotonic() + 30               # only so a starved host cannot hang it
        ticks = 0
        while not ticks and time.monotonic() < deadline:
            time.sleep(0.1)
            second = sampler.sample()
            ours = [s for s in second["sched"] if s[0] == proc.pid]
            assert len(ours) == 1
            pid, parent, cpu, ticks = ours[0]
    finally:
        proc.kill()
        proc.wait()
    assert parent == os.getpid() and 0 <= cpu < os.cpu_count()
    assert ticks > 0                                   # it spun between the samples
    assert [s for s in first["sched"] if s[0] == proc.pid][0][3] == 0
    json.dumps(second)                                 # a sampler line as it is written


def test_placement_reports_each_cpus_steal_ticks_since_the_last_sample(monkeypatch):
    reads = iter([{0: 10, 1: 5}, {0: 13, 1: 5}, {0: 13, 1: 9, 2: 4}])
    monkeypatch.setattr(placement, "cpu_steal", lambda: next(reads))
    monkeypatch.setattr(placement, "scheduler_pids", lambda: [])
    sampler = placement.Placement()
    # Only CPUs that lost ticks, and only against a reading of their own (CPU 2 is new).
    assert [sampler.sample()["steal"], sampler.sample()["steal"]] == [{0: 3}, {1: 4}]


def test_each_run_records_where_its_engines_scheduler_ran_and_the_report_sets_slow_runs_apart():
    """The sampler's placement samples, read per run for one engine's scheduler (its parent is
    the engine process): the CPUs it was seen on and those CPUs' steal; the report counts per
    engine the runs seen on two CPUs and the steal of its slow runs against the others'."""
    placed = [{"t": 0.0, "sched": [[11, 100, 3, 20], [12, 200, 5, 20]], "steal": {"3": 2}},
              {"t": 0.5, "sched": [[11, 100, 3, 20]], "steal": {"5": 9}},
              {"t": 1.5, "sched": [[11, 100, 4, 20]], "steal": {"4": 1, "3": 7}},
              {"t": 9.0, "sched": [], "steal": {}}]
    assert placement.placement_during(placed, 100, 0.0, 1.0) == {"cpus": [3], "steal": 2}
    assert placement.placement_during(placed, 100, 0.0, 2.0) == {"cpus": [3, 4], "steal": 10}
    assert placement.placement_during(placed, 200, 0.0, 1.0) == {"cpus": [5], "steal": 9}
    assert placement.placement_during(placed, 100, 8.0, 9.5) is None
    rec = {"engine": "dual", "t_start": 0.0, "t_end": 2.0, "runs_tok_s": [100.0, 90.0],
           "runs_t": [[0.0, 1.0], [1.2, 2.0]]}
    got = pm.with_host_speed(rec, [(0.0, 10.0), (1.5, 10.0)], placed, 100)
    assert got["runs_placement"] == [{"cpus": [3], "steal": 2}, {"cpus": [4], "steal": 1}]
    assert "runs_placement" not in pm.with_host_speed(rec, [(0.0, 10.0)], placed, None)
    md = matrix_report.placement_report([got, {**got, "from": "run7"}])
    assert "| dual | 2 | 3, 4 | 0 | 1 | 1, 1 | 2, 2 |" in md
    assert matrix_report.placement_report([rec]) == ""
