"""The one registry of DGW_* settings: types, bounds, precedence, unknown names, and the docs
table generated from it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dual_graph_worker.cli import main as dgw_main
from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.core.settings import (BY_ENV, BY_KEY, REGISTRY, PolicyKind, Settings,
                                             assignments, docs_table, explicit_keys,
                                             settings_env)

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_precedence_and_explicit_keys(tmp_path):
    assert Settings.from_env({}) == Settings()
    f = tmp_path / "dgw.json"
    f.write_text(json.dumps({"policy": "threshold", "threshold": 7, "spec_max_bs": 16}))
    env = {"DGW_CONFIG": str(f), "DGW_THRESHOLD": "5", "DGW_STEP_LOG": "/tmp/x.jsonl",
           "DGW_DECODE_MAX_BS": ""}
    cfg = Settings.from_env(env)
    assert cfg.policy is PolicyKind.THRESHOLD        # from the file
    assert cfg.threshold == 5                        # the variable beats the file
    assert cfg.spec_max_bs == 16 and cfg.step_log == "/tmp/x.jsonl" and cfg.decode_max_bs is None
    assert explicit_keys(env) == {"policy", "threshold", "spec_max_bs", "step_log"}
    assert Settings().continuity is Continuity.LAZY_CATCH_UP


def test_one_setting_read_before_the_rest_resolves_as_the_whole_settings_do(tmp_path):
    """The plugin reads capture_probe and NVTX reads nvtx before any Settings exists: the
    DGW_CONFIG file counts there too, under the variable."""
    f = tmp_path / "dgw.json"
    f.write_text(json.dumps({"nvtx": False, "capture_probe": "/tmp/probe.json",
                             "threshold": 7}))
    for env in ({"DGW_CONFIG": str(f)}, {"DGW_CONFIG": str(f), "DGW_NVTX": "1"},
                {"DGW_CONFIG": str(f), "DGW_CAPTURE_PROBE": "none"}, {}):
        whole = Settings.from_env(env)
        for key in ("nvtx", "capture_probe", "threshold", "margin"):
            assert BY_KEY[key].read(env) == getattr(whole, key), (env, key)
    assert BY_KEY["nvtx"].read({"DGW_CONFIG": str(f)}) is False
    with pytest.raises(ConfigError, match="DGW_CONFIG"):
        BY_KEY["nvtx"].read({"DGW_CONFIG": str(tmp_path / "missing.json")})


@pytest.mark.parametrize("env,match", [
    ({"DGW_TRESHOLD": "8"}, "did you mean DGW_THRESHOLD"),       # misspelt: never ignored
    ({"DGW_THRESHOLD": "16.7"}, "DGW_THRESHOLD"),
    ({"DGW_THRESHOLD": "true"}, "DGW_THRESHOLD"),
    ({"DGW_THRESHOLD": "-1"}, "minimum"),
    ({"DGW_MARGIN": "nan"}, "DGW_MARGIN"),
    ({"DGW_STALL_TRACE_S": "inf"}, "DGW_STALL_TRACE_S"),
    ({"DGW_STALL_TRACE_S": "0"}, "minimum"),
    ({"DGW_EXPLORE_BUDGET": "0.9"}, "maximum"),
    ({"DGW_POLICY": "sometimes"}, "one of goodput"),
    ({"DGW_CONTINUITY": "none"}, "keep-current"),
    ({"DGW_DEFER_DRAFT_PREFILL": "maybe"}, "1/0 or true/false"),
    ({"DGW_POLICY": "cycle", "DGW_MIN_DWELL": "0"}, "DGW_MIN_DWELL"),
])
def test_bad_values_are_refused_with_the_variable_and_what_it_accepts(env, match):
    with pytest.raises(ConfigError, match=match):
        Settings.from_env(env)


@pytest.mark.parametrize("content,match", [
    ({"threshold": 16.7}, "whole number"),
    ({"threshold": True}, "boolean"),
    ({"treshold": 3}, "did you mean threshold"),
    ([1, 2], "JSON object"),
])
def test_bad_config_files_are_refused(tmp_path, content, match):
    f = tmp_path / "dgw.json"
    f.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=match):
        Settings.from_env({"DGW_CONFIG": str(f)})


def test_a_missing_or_broken_config_file_names_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        Settings.from_env({"DGW_CONFIG": str(tmp_path / "missing.json")})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Settings.from_env({"DGW_CONFIG": str(bad)})


def test_settings_built_in_code_obey_the_same_rules():
    with pytest.raises(ConfigError, match="DGW_SPEC_MAX_BS"):
        Settings(spec_max_bs=0)
    with pytest.raises(ConfigError, match="DGW_THRESHOLD"):
        Settings(threshold=True)


def test_every_field_is_registered_once_with_help():
    assert len(REGISTRY) == len({s.env for s in REGISTRY}) == len(Settings.__dataclass_fields__)
    assert all(s.env.startswith("DGW_") and s.help for s in REGISTRY)
    assert set(BY_ENV) == {s.env for s in REGISTRY}


def test_the_docs_table_is_generated_from_the_registry():
    doc = (ROOT / "docs" / "settings.md").read_text()
    assert doc.endswith(docs_table()), "replace the table in docs/settings.md with what `dgw settings` prints"
    assert all(f"`{s.env}`" in doc for s in REGISTRY)


def test_settings_check_validates_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("DGW_THRESHOLD", "12")
    assert dgw_main(["settings", "--check"]) == 0
    assert json.loads(capsys.readouterr().out)["threshold"] == 12
    monkeypatch.setenv("DGW_TRESHOLD", "8")
    assert dgw_main(["settings", "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DGW_THRESHOLD" in err and "Traceback" not in err


def test_settings_check_reports_a_profile_window_with_no_start_in_one_line(monkeypatch,
                                                                           capsys):
    """DGW_PROFILE_STEPS alone is refused by the settings themselves, so the launch check and
    `dgw settings --check` name it before any server starts."""
    monkeypatch.setenv("DGW_PROFILE_STEPS", "10")
    assert dgw_main(["settings", "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "DGW_PROFILE_STEPS=10 needs DGW_PROFILE_STEADY_AFTER_STEPS" in err
    monkeypatch.setenv("DGW_PROFILE_STEADY_AFTER_STEPS", "4")
    assert dgw_main(["settings", "--check"]) == 0


def test_assignments_are_checked_as_the_worker_checks_its_environment():
    assert assignments(["DGW_SPEC_MAX_BS=256", "DGW_POLICY=threshold"]) == {
        "DGW_SPEC_MAX_BS": "256", "DGW_POLICY": "threshold"}
    with pytest.raises(ConfigError, match="DGW_NAME=VALUE"):
        assignments(["SPEC_MAX_BS=256"])
    with pytest.raises(ConfigError, match="DGW_NAME=VALUE"):
        assignments(["DGW_SPEC_MAX_BS"])
    with pytest.raises(ConfigError, match="DGW_NAME=VALUE"):
        assignments(["DGW_SPEC_MAX_B="])                # empty: the worker would skip it
    with pytest.raises(ConfigError, match="DGW_SPEC_MAX_BS"):
        assignments(["DGW_SPEC_MAX_B=256"])             # the closest name is offered
    with pytest.raises(ConfigError, match="DGW_SPEC_MAX_BS"):
        assignments(["DGW_SPEC_MAX_BS=0"])


def test_settings_env_names_each_key_by_its_variable(tmp_path):
    """A benchmark passes registry keys; the worker reads back what it was given."""
    env = settings_env(min_dwell_steps=4, policy=PolicyKind.CYCLE, step_log=tmp_path / "s",
                       draft_extend_graphs=0, continuity="keep-current")
    assert env == {"DGW_MIN_DWELL": "4", "DGW_POLICY": "cycle", "DGW_DRAFT_EXTEND_GRAPHS": "0",
                   "DGW_STEP_LOG": str(tmp_path / "s"), "DGW_CONTINUITY": "keep-current"}
    got = Settings.from_env(env)
    assert (got.min_dwell_steps, got.policy, got.draft_extend_graphs) == (4, PolicyKind.CYCLE,
                                                                          False)
    with pytest.raises(ConfigError, match="'min_dwell'.*did you mean min_dwell_steps"):
        settings_env(min_dwell=4)


def test_a_variable_may_fix_what_the_settings_file_alone_gets_wrong(tmp_path):
    """The file and the variables are checked together: a cycle policy with no dwell in the
    file is valid once DGW_MIN_DWELL sets one."""
    path = tmp_path / "dgw.json"
    path.write_text(json.dumps({"policy": "cycle", "min_dwell_steps": 0}))
    with pytest.raises(ConfigError, match="DGW_MIN_DWELL"):
        Settings.from_env({"DGW_CONFIG": str(path)})
    got = Settings.from_env({"DGW_CONFIG": str(path), "DGW_MIN_DWELL": "3"})
    assert (got.policy, got.min_dwell_steps) == (PolicyKind.CYCLE, 3)


@pytest.mark.parametrize("env, want", [
    ("DGW_CAPTURE_CONFIG", "DGW_CAPTURE_CONFIG={missing}: cannot read capture config"),
    ("DGW_CALIBRATION", "DGW_CALIBRATION={missing}: cannot read calibration table"),
    ("DGW_STEP_LOG", "DGW_STEP_LOG={missing}/x.jsonl: {missing} is not writable"),
    ("DGW_STALL_TRACE", "DGW_STALL_TRACE={missing}/x.jsonl: {missing} is not writable"),
])
def test_settings_check_reads_the_files_the_settings_name(env, want, tmp_path, monkeypatch,
                                                         capsys):
    """What the server's launch check refuses, `dgw settings --check` refuses too."""
    missing = tmp_path / "missing.json"
    if env in ("DGW_STEP_LOG", "DGW_STALL_TRACE"):   # an output under a file: unwritable
        missing.write_text("")
        monkeypatch.setenv(env, f"{missing}/x.jsonl")
    else:
        monkeypatch.setenv(env, str(missing))
    assert dgw_main(["settings", "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and want.format(missing=missing) in err


def test_an_output_file_the_server_cannot_write_is_one_line_naming_its_variable(tmp_path):
    """DGW_STEP_LOG / DGW_STALL_TRACE: refused at launch (check_output creates nothing) and
    at open, with the variable and the fix, never an OSError's traceback."""
    from dual_graph_worker.core.settings import check_output, open_output

    (tmp_path / "file").write_text("")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    for key, env in (("step_log", "DGW_STEP_LOG"), ("stall_trace", "DGW_STALL_TRACE")):
        with pytest.raises(ConfigError, match=f"{env}=.* is a folder.*unset {env}"):
            check_output(key, str(tmp_path))
        with pytest.raises(ConfigError, match=f"cannot open {env} file .*unset {env}"):
            open_output(key, str(tmp_path / "file" / "x.jsonl"))
        with pytest.raises(ConfigError, match=f"{env}=.*file.* is not writable"):
            check_output(key, str(tmp_path / "file" / "x.jsonl"))
        with pytest.MonkeyPatch.context() as mp:   # root writes anywhere: deny by hand
            mp.setattr(os, "access", lambda p, mode: Path(p) != ro)
            with pytest.raises(ConfigError, match="is not writable"):
                check_output(key, str(ro / "x.jsonl"))
    check_output("step_log", str(tmp_path / "new" / "deeper" / "steps.jsonl"))
    assert not (tmp_path / "new").exists()         # a check creates nothing
    with open_output("step_log", str(tmp_path / "new" / "steps.jsonl")) as fh:
        fh.write("x")
    assert (tmp_path / "new" / "steps.jsonl").read_text() == "x"


def test_settings_built_in_code_hold_the_parsed_types_and_obey_the_same_rules():
    """A Settings built in code re-parses its values: "cycle" is PolicyKind.CYCLE (so the
    cycle's dwell rule applies to it too), and the pools' caps are checked together."""
    assert Settings(policy="cycle", min_dwell_steps=2).policy is PolicyKind.CYCLE
    with pytest.raises(ConfigError, match="DGW_MIN_DWELL"):
        Settings(policy="cycle", min_dwell_steps=0)
    with pytest.raises(ConfigError, match="DGW_DECODE_MAX_BS=8 is below DGW_SPEC_MAX_BS=64"):
        Settings.from_env({"DGW_DECODE_MAX_BS": "8", "DGW_SPEC_MAX_BS": "64"})
    assert Settings.from_env({"DGW_DECODE_MAX_BS": "64", "DGW_SPEC_MAX_BS": "64"})
