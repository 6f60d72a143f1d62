"""What an operator sees when a command is given something wrong (issue 15's new-user check): a
resume of a run the store does not hold, the process commands' help, a weak run secret."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from resolved_config import resolved_args

from diloco_async.storage import keys
from diloco_async.storage.options import STORAGE_OPTIONS_ENV
from diloco_async.storage.store import ObjectStore

from storage_servers import make_bucket


@pytest.fixture(params=["file", "s3"])
def store_with_runs(request, tmp_path):
    """(root URL, storage options) of a store holding runs run-a and run-b, and a folder that is
    not a run (MLflow's artifacts, as the default store has)."""
    if request.param == "file":
        url, options = f"file://{tmp_path}/store", {}
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        url, options = f"s3://{make_bucket('s3', endpoint.storage_options)}/runs", endpoint.storage_options
    store = ObjectStore(url, options)
    for run_id in ("run-b", "run-a"):
        store.put_json(keys.config_key(run_id), {"run": {"name": run_id}})
    store.put("mlartifacts/1/meta.yaml", b"artifact")
    return url, options


def _cli(tmp_path, options: dict, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, STORAGE_OPTIONS_ENV: json.dumps(options), "PREFECT_HOME": str(tmp_path / "prefect")}
    return subprocess.run([sys.executable, "-m", "diloco_async.flows.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("config", [None, "default"])
def test_resume_of_an_unknown_run_names_the_store_and_the_runs_it_holds(tmp_path, store_with_runs, config):
    url, options = store_with_runs
    for target in (f"{url}/run-x", keys.checkpoint_url(url, "run-x", 3)):
        proc = _cli(tmp_path, options, "resume", target, *(["--config", config] if config else []))
        assert proc.returncode == 2, proc.stdout + proc.stderr
        err = proc.stderr
        assert "Errno" not in err and "Traceback" not in err, err
        assert f"no run 'run-x' in store {ObjectStore(url, options).url}" in err, err
        assert "runs in that store: run-a, run-b" in err and "mlartifacts" not in err, err


def test_resume_in_a_store_that_holds_no_run_says_so(tmp_path):
    proc = _cli(tmp_path, {}, "resume", f"file://{tmp_path}/empty/run-x")
    assert proc.returncode == 2 and "Errno" not in proc.stderr, proc.stderr
    assert f"no run 'run-x' in store file://{tmp_path}/empty" in proc.stderr
    assert "that store holds no run" in proc.stderr


# -- the process commands' help ---------------------------------------------------------------


@pytest.mark.parametrize("module", ["diloco_async.server", "diloco_async.learner"])
def test_every_option_of_the_process_commands_has_a_help_text_with_units(module):
    from diloco_async.learner.main import build_parser as learner_parser
    from diloco_async.sync.process import build_parser as server_parser

    parser = {"diloco_async.server": server_parser, "diloco_async.learner": learner_parser}[module]()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert options
    for action in options:
        assert action.help and len(action.help) > 15, f"{action.option_strings[0]} has no help text"
        if action.dest.endswith("_s"):
            assert "seconds" in action.help, f"{action.option_strings[0]}: no unit in {action.help!r}"
    shown = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "environment:" in shown.stdout and "exit codes:" in shown.stdout
    for action in options:  # what a user reads: each option followed by its text
        assert action.option_strings[0] in shown.stdout
    assert " ".join(shown.stdout.split()).count(" (default: ") >= (2 if module.endswith("learner") else 0)


# -- a weak run secret ------------------------------------------------------------------------

WEAK = ["short-secret", "a" * 64, "ab" * 40]


@pytest.mark.parametrize("secret", WEAK)
def test_a_weak_run_secret_is_refused_naming_the_variable_and_never_the_secret(secret):
    from diloco_async.protocol.auth import check_run_secret

    with pytest.raises(ValueError, match="DILOCO_RUN_TOKEN is too weak") as err:
        check_run_secret(secret)
    assert secret not in str(err.value) and "token_hex(32)" in str(err.value)


def test_random_secrets_of_the_documented_kinds_are_accepted():
    import secrets

    from diloco_async.protocol.auth import MIN_SECRET_CHARS, check_run_secret

    for secret in (secrets.token_hex(16), secrets.token_hex(32), secrets.token_urlsafe(32)):
        assert check_run_secret(secret) == secret
    assert len(secrets.token_hex(16)) == MIN_SECRET_CHARS


def test_every_entry_point_refuses_a_weak_run_secret(tmp_path, monkeypatch, capsys):
    from diloco_async.config.schema import load_config
    from diloco_async.flows.cli import main
    from diloco_async.flows.deployments import _require_token
    from diloco_async.protocol.client import TOKEN_ENV
    from diloco_async.run import RunProcesses

    secret = "operator-pet-name"
    store = f"file://{tmp_path}/store"
    server = subprocess.run([sys.executable, "-m", "diloco_async.server", "--run-id", "weak",
                             *resolved_args(None, [f"run.store={store}"], tmp_path)],
                            env={**os.environ, TOKEN_ENV: secret},
                            capture_output=True, text=True, timeout=120)
    assert server.returncode == 2 and f"{TOKEN_ENV} is too weak" in server.stderr, server.stderr
    assert secret not in server.stdout + server.stderr
    assert not (tmp_path / "store").exists()  # refused before the lease or anything else was written
    monkeypatch.setenv(TOKEN_ENV, secret)
    cfg = load_config(None, [f"run.store={store}", f"run.workdir={tmp_path}/runs"])
    with pytest.raises(ValueError, match=f"{TOKEN_ENV} is too weak"):
        RunProcesses(cfg, run_id="weak")
    with pytest.raises(ValueError, match=f"{TOKEN_ENV} is too weak"):
        _require_token()
    for argv in (["token", "--run-id", "weak", "--learner-id", "learner-0"],
                 ["train", "--set", f"run.store={store}"], ["resume", f"{store}/weak"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"{TOKEN_ENV} is too weak" in err and secret not in err, (argv, err)


@pytest.mark.parametrize("pattern", ["missing/*.txt", "empty.txt"])
def test_train_on_corpus_urls_that_match_nothing_is_refused_before_the_flow(tmp_path, pattern):
    (tmp_path / "empty.txt").write_bytes(b"")
    url = f"file://{tmp_path}/{pattern}"
    proc = _cli(tmp_path, {}, "train", "--set", 'data.source="urls"', "--set", f'data.urls=["{url}"]',
                "--set", f"run.store=file://{tmp_path}/store")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and f"data.urls: {url!r}" in proc.stderr, proc.stderr
    assert not (tmp_path / "prefect").exists() and not (tmp_path / "store").exists()  # nothing started


@pytest.mark.parametrize("args, why", [
    (["chaos", "--scenario", "configs/chaos/straggler-ci.toml", "--out", "{tmp}"], "is a folder"),
    (["wan", "--scenario", "configs/wan/wan-ci.toml", "--out", "{tmp}/file.txt/r.json"], "is a file, not a folder"),
    (["ablate", "--suite", "configs/ablations/merge.toml", "--out", "{tmp}/file.txt"], "is a file; give a folder"),
])
def test_an_out_path_that_cannot_be_written_is_refused_before_any_run(tmp_path, args, why):
    """The comparisons run for minutes to hours; an --out they cannot write failed only at the end."""
    (tmp_path / "file.txt").write_text("x")
    proc = _cli(tmp_path, {}, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert why in proc.stderr and "--out" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "prefect").exists()
