"""Bad arguments to every `dgw` subcommand: one line naming the problem and the fix, a non-zero
exit status, never a traceback, and nothing silently accepted.

Table-driven and in-process: each row calls an entry point's `main(argv)` and reads what it
printed. An error is either argparse's (its usage, then exactly one `PROG: error: ...` line)
or the project's own (exactly one `error: ...` line). Every row stops before any real work.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import pytest
import torch

from dual_graph_worker import __version__
from dual_graph_worker.cli import COMMANDS
from dual_graph_worker.cli import main as dgw

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = str(ROOT / "tests" / "data" / "capture" / "synthetic_h200_llama8b_k3.json")
CUDA = torch.cuda.is_available()
NSYS = shutil.which("nsys") is not None
no_gpu = pytest.mark.skipif(CUDA, reason="the row checks the error on a machine without a GPU")
no_nsys = pytest.mark.skipif(NSYS, reason="the row checks the error when nsys is missing")

TUNE = ["capture-tune", "--measurements", MEASUREMENTS, "--memory-budget", "4GiB",
        "--time-budget", "30", "--accept-len", "3", "--out", "{out}/config.json"]
REPORT = ["capture-report", "--measurements", MEASUREMENTS, "--out-dir", "{out}/report"]


def _tune(**flags: str) -> list[str]:
    argv = list(TUNE)
    for flag, value in flags.items():
        argv[argv.index("--" + flag.replace("_", "-")) + 1] = value
    return argv


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """Bad files of every kind, written once: garbage, damaged SQLite, empty, folders."""
    root = tmp_path_factory.mktemp("bad-inputs")
    (root / "folder").mkdir()
    (root / "file.txt").write_text("a file where a folder is expected\n")
    (root / "garbage.sqlite").write_bytes(b"garbage\x00\x01\x02 not a database" * 8)
    (root / "damaged.sqlite").write_bytes(b"SQLite format 3\x00" + os.urandom(4096))
    (root / "empty.sqlite").write_bytes(b"")
    (root / "empty.json").write_text("")
    (root / "broken.json").write_text("{not json")
    (root / "list.json").write_text("[1, 2]")
    (root / "bad_ts.json").write_text('{"traceEvents": [{"ph": "X", "name": "a", "ts": "soon", '
                                      '"dur": 1}]}')
    (root / "junk.nsys-rep").write_bytes(b"\x00" * 16)
    for run, steps_is_folder in (("stall-folder", True), ("stall-empty", False)):
        (root / run).mkdir()
        (root / run / "stall-dual-bench.jsonl").write_text("")
        steps = root / run / "steps-dual-bench.jsonl"
        steps.mkdir() if steps_is_folder else steps.write_text("")
    return {"dir": str(root), "out": str(root / "out"), "missing": str(root / "missing.json"),
            "folder": str(root / "folder"), "file": str(root / "file.txt"),
            "stall_folder": str(root / "stall-folder"), "stall_empty": str(root / "stall-empty"),
            **{p.stem.replace("-", "_") + "_" + p.suffix.lstrip(".").replace("-", "_"): str(p)
               for p in root.iterdir() if p.is_file()}}


# (argv for `dgw`, text the error line must hold: the accepted range or the fix)
CASES: list = [
    # dgw itself
    (["nosuch"], "unknown command 'nosuch'; commands: demo"),
    (["--bogus"], "unknown option '--bogus'"),
    # dgw accept-shift
    (["accept-shift", "--phases", "easy,medium"], "expected comma-separated easy/hard"),
    (["accept-shift", "--concurrency", "0"], "expected an integer in [1, 256], got 0"),
    (["accept-shift", "--concurrency", "1000"], "expected an integer in [1, 256], got 1000"),
    (["accept-shift", "--device", "tpu"], "use cpu or cuda[:N]"),
    (["accept-shift", "--input-len", "100000"], "over the toy model's context of 2048"),
    (["accept-shift", "--hidden", "12"], "--hidden: toy hidden size"),
    # dgw demo
    (["demo", "--output-len", "1"], "expected an integer >= 2, got 1"),
    (["demo", "--output-len", "-5"], "expected an integer >= 2, got -5"),
    (["demo", "--output-len", "abc"], "expected an integer >= 2, got 'abc'"),
    (["demo", "--input-len", "0"], "--input-len: expected an integer >= 1"),
    (["demo", "--ramp", "abc"], "comma-separated integers >= 1"),
    (["demo", "--ramp", "1,-4"], "comma-separated integers >= 1"),
    (["demo", "--ramp", "1,0"], "comma-separated integers >= 1"),
    (["demo", "--ramp", "1,1000"], "comma-separated integers in [1, 256]"),
    (["demo", "--ramp", "1,,2"], "comma-separated integers >= 1"),
    (["demo", "--ramp", ""], "comma-separated integers >= 1"),
    (["demo", "--requests-per-phase", "-1"], "finite number > 0"),
    (["demo", "--requests-per-phase", "0"], "finite number > 0"),
    (["demo", "--requests-per-phase", "nan"], "finite number > 0, got 'nan'"),
    (["demo", "--requests-per-phase", "inf"], "finite number > 0, got 'inf'"),
    (["demo", "--hidden", "0"], "--hidden: expected an integer in [8, 4096]"),
    (["demo", "--hidden", "12"], "multiple of 8"),
    (["demo", "--num-draft-tokens", "0"], "--num-draft-tokens: expected an integer in [1, 8]"),
    (["demo", "--num-draft-tokens", "1000"], "--num-draft-tokens: expected an integer in [1, 8]"),
    (["demo", "--input-len", "3000"], "lower --input-len, --output-len or --output-spread"),
    (["demo", "--output-spread", "1"], "expected a number in [0, 1), got '1'"),
    (["demo", "--agreement", "f33"], "invalid choice: 'f33'"),
    pytest.param(["demo", "--device", "cuda"], "use --device cpu", marks=no_gpu),
    (["demo", "--device", "cuda:99"], "cuda:99"),
    (["demo", "--device", "tpu"], "use cpu or cuda[:N]"),
    (["demo", "--out", "{file}"], "is a file, not a folder"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    # dgw bench
    pytest.param(["bench"], "use --model tiny on CPU", marks=no_gpu),
    (["bench", "--model", "tiny", "--concurrency", "abc"], "comma-separated integers >= 1"),
    (["bench", "--model", "tiny", "--concurrency", "1,-2"], "comma-separated integers >= 1"),
    (["bench", "--model", "tiny", "--concurrency", "1,100000"], "integers in [1, 512]"),
    (["bench", "--model", "tiny", "--num-draft-tokens", "1000"], "an integer in [1, 8]"),
    (["bench", "--model", "tiny", "--concurrency", "0"], "comma-separated integers >= 1"),
    (["bench", "--model", "tiny", "--input-len", "0"], "expected an integer >= 1"),
    (["bench", "--model", "tiny", "--output-len", "1"], "expected an integer >= 2"),
    (["bench", "--model", "tiny", "--requests-per-level", "nan"], "finite number > 0"),
    (["bench", "--model", "tiny", "--accept-len", "0"], "--accept-len: expected an integer >= 1"),
    (["bench", "--model", "tiny", "--accept-len", "9"], "lower it or raise --num-draft-tokens"),
    (["bench", "--model", "tiny", "--spec-max-bs", "0"], "expected an integer >= 1"),
    (["bench", "--model", "tiny", "--variants", "nosuch"], "pass comma-separated names from plain"),
    (["bench", "--model", "tiny", "--variants", ""], "pass comma-separated names from plain"),
    (["bench", "--model", "tiny", "--repeats", "0"], "--repeats: expected an integer >= 1"),
    (["bench", "--model", "tiny", "--capture-config", "{missing}"], "does not exist"),
    (["bench", "--model", "tiny", "--capture-config", "{folder}"], "is not a file"),
    (["bench", "--model", "tiny", "--out", "{file}"], "is a file, not a folder"),
    # dgw make-toy-checkpoints
    (["make-toy-checkpoints"], "the following arguments are required: dir"),
    (["make-toy-checkpoints", "{out}/toy", "--hidden", "0"], "expected an integer in [8, 4096]"),
    (["make-toy-checkpoints", "{out}/toy", "--hidden", "-1"], "expected an integer in [8, 4096]"),
    (["make-toy-checkpoints", "{out}/toy", "--hidden", "100000"], "in [8, 4096], got 100000"),
    (["make-toy-checkpoints", "{out}/toy", "--hidden", "12"], "multiple of 8"),
    (["make-toy-checkpoints", "{out}/toy", "--layers", "0"], "expected an integer in [7, 64]"),
    (["make-toy-checkpoints", "{out}/toy", "--layers", "6"], "expected an integer in [7, 64]"),
    (["make-toy-checkpoints", "{out}/toy", "--seed", "1e99"], "expected an integer in [0, "),
    (["make-toy-checkpoints", "{file}"], "is a file, not a folder"),
    # dgw profile
    (["profile", "--bs", "0"], "--bs: expected an integer in [1, 512], got 0"),
    (["profile", "--bs", "-3"], "--bs: expected an integer in [1, 512], got -3"),
    (["profile", "--bs", "100000"], "--bs: expected an integer in [1, 512], got 100000"),
    (["profile", "--out", "{file}"], "is a file, not a folder"),
    (["profile", "--expect-sm", "XX"], "like SM90, 9.0 or 90"),
    pytest.param(["profile", "--backend", "nsys"], "use --backend torch", marks=no_nsys),
    pytest.param(["profile", "--model", "llama3-8b"], "use --model tiny on CPU", marks=no_gpu),
    # dgw check-profile
    (["check-profile", "{missing}", "--out", "{out}/p"], "does not exist; check the path"),
    (["check-profile", "{folder}", "--out", "{out}/p"], "is a folder; pass the report file"),
    (["check-profile", "{garbage_sqlite}", "--out", "{out}/p"], "name the format with --source"),
    (["check-profile", "{damaged_sqlite}", "--out", "{out}/p"], "damaged SQLite file"),
    (["check-profile", "{empty_sqlite}", "--out", "{out}/p"], "name the format with --source"),
    (["check-profile", "{empty_json}", "--out", "{out}/p"], "or name another format with --source"),
    (["check-profile", "{broken_json}", "--out", "{out}/p"], "not a readable Chrome trace JSON"),
    (["check-profile", "{bad_ts_json}", "--out", "{out}/p"], "malformed events"),
    pytest.param(["check-profile", "{junk_nsys_rep}", "--out", "{out}/p"], "nsys is not on PATH",
                 marks=no_nsys),
    (["check-profile", "{list_json}", "--out", "{out}/p", "--warmup-steps", "-1"],
     "--warmup-steps: expected an integer >= 0"),
    (["check-profile", "{list_json}", "--out", "{out}/p", "--max-eager-kernels", "x"],
     "--max-eager-kernels: expected an integer >= 0"),
    (["check-profile", "{list_json}", "--out", "{out}/p", "--num-draft-tokens", "0"],
     "--num-draft-tokens: expected an integer >= 1"),
    (["check-profile", "{list_json}", "--out", "{out}/p", "--expect-sm", "-5"],
     "like SM90, 9.0 or 90"),
    (["check-profile", "{list_json}", "--out", "{file}"], "is a file, not a folder"),
    (["check-profile", "{list_json}"], "the following arguments are required: --out"),
    # dgw capture-measure (its argument checks come before the GPU check)
    (["capture-measure", "--out", "{out}/m.json", "--max-bs", "0"], "expected an integer >= 1"),
    (["capture-measure", "--out", "{out}/m.json", "--context", "-1"], "expected an integer >= 1"),
    (["capture-measure", "--out", "{folder}"], "is a folder; pass a file path"),
    (["capture-measure"], "the following arguments are required: --out"),
    pytest.param(["capture-measure", "--out", "{out}/m.json"], "run it on a GPU machine",
                 marks=no_gpu),
    # dgw capture-tune / capture-report
    (_tune(measurements="{missing}"), "cannot read measurements file"),
    (_tune(measurements="{broken_json}"), "is not valid JSON"),
    (_tune(memory_budget="abc"), "e.g. 4GiB, 512MiB"),
    (_tune(time_budget="nan"), "e.g. 30, 30s, 500ms"),
    (_tune(accept_len="nan"), "a number in 1..K+1 such as 3.0, got 'nan'"),
    (_tune(accept_len="0"), "a number in 1..K+1 such as 3.0, got '0'"),
    (_tune(accept_len="9"), "accept length must be in 1..K+1 = 1..4"),
    (_tune(measurements="{folder}"), "it is a folder; pass the JSON that `dgw capture-measure`"),
    (TUNE + ["--distribution", "bogus"], "use uniform:LO-HI"),
    (_tune(out="{folder}"), "is a folder; pass a file path"),
    (["capture-tune"], "the following arguments are required: --measurements"),
    (REPORT, "report needs --accept-len"),
    (REPORT + ["--accept-len", "-1"], "a number in 1..K+1"),
    (REPORT + ["--config", "{broken_json}"], "re-run `make capture-tune`"),
    (["capture-report", "--measurements", MEASUREMENTS, "--out-dir", "{file}",
      "--accept-len", "3"], "is a file; pass a folder"),
    # dgw capture-flags / settings
    (["capture-flags"], "the following arguments are required: config"),
    (["capture-flags", "{missing}"], "re-run `make capture-tune`"),
    (["capture-flags", "{folder}"], "re-run `make capture-tune`"),
    (["capture-flags", "{empty_json}"], "re-run `make capture-tune`"),
    (["capture-flags", MEASUREMENTS], "expected 'dgw-capture-config/1'"),
    (["settings", "--bogus"], "unrecognized arguments: --bogus"),
]


def _call(entry: Callable[[list[str]], Optional[int]], argv: Sequence[str], capsys):
    try:
        rc = entry(list(argv))
    except SystemExit as exc:         # argparse's way out
        rc = exc.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _error_line(rc, out: str, err: str, prog: Optional[str]) -> str:
    """The one error line; fails unless the output is one of the two accepted shapes."""
    assert rc not in (0, None), f"exit status {rc!r}: the bad input was accepted\n{out}{err}"
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert lines, "nothing on stderr"
    # The parser's (`PROG: error: ... (see PROG --help)`, no usage block) or the command's own.
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") or (": error: " in lines[0] and (
        not prog or lines[0].startswith(f"{prog}: error: "))), err
    return lines[0]


@pytest.mark.parametrize("argv, want", CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_argument_gives_one_line_and_non_zero_exit(argv, want, paths, capsys):
    argv = [a.format(**paths) for a in argv]
    rc, out, err = _call(dgw, argv, capsys)
    prog = f"dgw {argv[0]}" if argv and argv[0] in COMMANDS else None
    line = _error_line(rc, out, err, prog)
    assert want.format(**paths) in line, line


@pytest.mark.parametrize("command", ["demo", "accept-shift"])
def test_the_demos_read_the_dgw_settings_as_a_server_does(command, monkeypatch, capsys,
                                                          tmp_path):
    # The dynamic worker's DGW_* settings (a pinned policy, say): a bad one fails first.
    monkeypatch.setenv("DGW_POLICY", "bogus")
    rc, out, err = _call(dgw, [command, "--out", str(tmp_path / "out")], capsys)
    assert "DGW_POLICY='bogus' is not valid" in _error_line(rc, out, err, f"dgw {command}")


def test_the_table_is_broad():
    assert len(CASES) >= 40
    assert {getattr(c, "values", c)[0][0] for c in CASES} >= set(COMMANDS)


# ---------------------------------------------------------------- the modules' own entry points


def _workload_main(argv):
    from profiling.workload import main
    return main(argv)


def _stall_main(argv):
    from profiling.stall_report import main
    return main(argv)


def _check_main(argv):
    from profiling.check import main
    return main(argv)


def _capture_main(argv):
    from capture.cli import main
    return main(argv)


@pytest.mark.parametrize("entry, argv, want", [
    (_workload_main, ["--bs", "0"], "--bs: expected an integer in [1, 512]"),
    (_workload_main, ["--hold", "-1"], "--hold: expected an integer >= 1"),
    (_workload_main, ["--warmup", "-1"], "--warmup: expected an integer >= 0"),
    (_workload_main, ["--torch-profile", "{folder}"], "is a folder; pass a file path"),
    (_stall_main, ["{missing}"], "does not exist; pass the suite's run folder"),
    (_stall_main, ["{folder}", "--top", "0"], "--top: expected an integer >= 1"),
    (_stall_main, ["{stall_folder}"], "(or not a file): run the suite with --stall-trace-s"),
    (_stall_main, ["{stall_empty}"], "holds no step after the worker was ready"),
    (_check_main, ["{damaged_sqlite}", "--out", "{out}/p2"], "damaged SQLite file"),
    (_capture_main, ["tune"], "the following arguments are required"),
], ids=["workload-bs", "workload-hold", "workload-warmup", "workload-trace-folder",
        "stall-missing", "stall-top", "stall-log-folder", "stall-empty", "check-damaged",
        "capture-cli-tune"])
def test_module_entry_points_reject_bad_arguments(entry, argv, want, paths, capsys):
    rc, out, err = _call(entry, [a.format(**paths) for a in argv], capsys)
    assert want in _error_line(rc, out, err, None)


# ---------------------------------------------------------------- version and help


def test_version(capsys):
    assert dgw(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dgw {__version__}"


def test_no_command_prints_the_list_and_fails(capsys):
    assert dgw([]) == 2
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS) and "--version" in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_help_names_itself_dgw_cmd(name, capsys):
    rc, out, err = _call(dgw, [name, "--help"], capsys)
    assert rc in (0, None) and not err
    assert out.startswith(f"usage: dgw {name} "), out.splitlines()[0]


def test_the_demo_names_the_phases_that_miss_its_target():
    from bench.reference.demo import _target_line

    assert _target_line([0.999, 0.945, 0.875], [1, 4, 1]) == (
        "within 10% of the best static worker in every phase: NOT met; below: phase 2 (c=1) 0.875")
    assert _target_line([0.999, 0.945, 0.975], [1, 4, 16]).endswith(
        "met (lowest: phase 1, c=4, 0.945)")


# ---------------------------------------------------------------- errors no flag check can see


def test_a_path_the_command_cannot_use_an_interrupt_and_a_bug_each_end_as_they_should(capsys):
    """A file the command cannot read or write is the user's to fix: one line, status 2. An
    interrupt: one line, status 130. An OSError naming no path is a bug: its traceback stays."""
    from dual_graph_worker.core.errors import report_user_errors

    def unwritable():
        raise FileNotFoundError(2, "No such file or directory", "/proc/x")

    def interrupted():
        raise KeyboardInterrupt

    def broken():
        raise OSError("a socket closed")

    assert report_user_errors(unwritable) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: cannot use /proc/x: No such file or directory; pass a path this user can read "
        "or write"]
    assert report_user_errors(interrupted) == 130
    assert capsys.readouterr().err == "interrupted\n"
    with pytest.raises(OSError, match="a socket closed"):
        report_user_errors(broken)

    def too_many_files():
        raise OSError(24, "Too many open files", "/etc/hosts")

    with pytest.raises(OSError, match="Too many open files"):
        report_user_errors(too_many_files)        # names a path, but no path is the fix


def test_a_broken_pipe_is_quiet_only_when_it_is_stdouts(capsys, monkeypatch):
    from dual_graph_worker.core.errors import report_user_errors

    def socket_gone():
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        report_user_errors(socket_gone)          # stdout still flushes: not the reader's going

    class Gone:
        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            raise ValueError("no descriptor")

    monkeypatch.setattr("sys.stdout", Gone())
    assert report_user_errors(socket_gone) == 141
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_reader_that_closed_stdout_first_is_a_quiet_141(unbuffered):
    """`dgw settings | true`: the reader is gone before the first write. Unbuffered, that
    write's error came with a flush that succeeds (a traceback); buffered, at exit (status 120)."""
    import subprocess

    env = dict(os.environ, PYTHONUNBUFFERED=unbuffered)
    proc = subprocess.Popen([sys.executable, "-m", "dual_graph_worker.cli", "settings"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == ""


def test_a_settings_file_that_is_not_text_is_one_line(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "dgw.json"
    bad.write_bytes(b"\xff\xfe\x00")
    monkeypatch.setenv("DGW_CONFIG", str(bad))
    rc, out, err = _call(dgw, ["settings", "--check"], capsys)
    assert "is not a UTF-8 text file" in _error_line(rc, out, err, "dgw settings")


@pytest.mark.parametrize("command", ["demo", "accept-shift"])
@pytest.mark.parametrize("env", ["DGW_CAPTURE_CONFIG", "DGW_CALIBRATION"])
def test_the_demos_refuse_files_tuned_for_a_servers_model(command, env, monkeypatch, capsys,
                                                          tmp_path):
    monkeypatch.setenv(env, str(tmp_path / "tuned.json"))
    rc, out, err = _call(dgw, [command, "--out", str(tmp_path / "out")], capsys)
    assert f"{env} names a file tuned for a server's model" in _error_line(rc, out, err, None)
    assert not out                           # refused before the run's header


def test_the_demos_dynamic_worker_takes_dgw_continuity(monkeypatch):
    from dual_graph_worker.core.continuity import Continuity
    from dual_graph_worker.core.settings import Settings
    from bench.reference import variants

    asked = {}
    monkeypatch.setattr(variants, "build_variant",
                        lambda name, *a, **kw: asked.setdefault(name, kw["dynamic_continuity"]))
    list(variants.build_trio(lambda: None, variants.PoolSizes.up_to(4, 4), cuda=False,
                             calib_context=8,
                             settings=Settings(continuity=Continuity.KEEP_CURRENT)))
    assert asked["dynamic"] is Continuity.KEEP_CURRENT


def test_an_interrupted_demo_keeps_the_phases_it_finished(tmp_path, monkeypatch, capsys):
    """The demo's JSON is rewritten after every phase: a Ctrl-C in phase 1 keeps phase 0."""
    import json

    from bench.reference import demo

    calls = []
    real = demo.run_side_by_side

    def interrupt_in_phase_1(runs):
        calls.append(1)
        if len(calls) == 3:                       # the warm-up, phase 0, then phase 1
            raise KeyboardInterrupt
        return real(runs)

    monkeypatch.setattr(demo, "run_side_by_side", interrupt_in_phase_1)
    out = tmp_path / "demo"
    rc = dgw(["demo", "--ramp", "1,2", "--output-len", "4", "--input-len", "4", "--hidden", "64",
              "--requests-per-phase", "1", "--out", str(out)])
    assert rc == 130 and capsys.readouterr().err.endswith("interrupted\n")
    written = json.loads((out / "demo.json").read_text())
    assert written["complete"] is False and [p["concurrency"] for p in written["phases"]] == [1]


def test_the_bench_measures_the_switch_within_a_small_spec_pool_and_saves_the_sweep_first(
        tmp_path, capsys):
    """With the spec pool below 16, the switch is measured at its top (at 16 a pinned spec step
    ran decode and the run died after its sweep, its JSON unwritten); the ratios are end to end
    and over decode steps, verify-off's labelled as the modelled upper bound it is."""
    import json

    from bench.reference.bench import switch_bs

    assert dgw(["bench", "--model", "tiny", "--concurrency", "8,16", "--spec-max-bs", "4",
                "--requests-per-level", "1", "--input-len", "8", "--output-len", "8",
                "--variants", "plain,static-spec,dynamic,verify-off", "--skip-memory",
                "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_tiny_acc3.json").read_text())
    assert set(result["switch"]) == {"lazy-catch-up", "keep-current"}
    assert set(result["ratios"]) == {
        "dynamic / max(plain, static-spec)", "dynamic / max(plain, static-spec), decode steps only",
        "verify-off (modelled upper bound) / plain",
        "verify-off (modelled upper bound) / plain, decode steps only"}
    assert switch_bs(SimpleNamespace(dispatch=SimpleNamespace(max_spec_bs=0))) == 0
    assert switch_bs(SimpleNamespace(dispatch=SimpleNamespace(max_spec_bs=48))) == 16
