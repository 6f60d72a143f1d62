"""What an operator sees when a command is given something wrong (issue 15's new-user check): a
resume of a run the store does not hold, the process commands' help, a weak run secret."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from storage import keys
from storage.options import STORAGE_OPTIONS_ENV
from storage.store import ObjectStore

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
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)


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
