"""`pip install .` into a fresh virtualenv, then the installed tool used from outside the checkout
(issue 15, item 4): the recipes ship with the package.

The install is real (pip builds the wheel from a clean copy of the source tree and installs it
into the new environment's site-packages, entry point included) but offline: ``--no-deps
--no-index --no-build-isolation``, with the dependencies (torch, prefect, ...) taken from the
test's own environment through a ``.pth`` line (``--system-site-packages`` would point at the
base interpreter, not at this virtualenv). Nothing of the checkout is on the path: the test checks
that the tool imports the installed copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_SKIP_ANYWHERE = shutil.ignore_patterns("*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis")
_SKIP_AT_ROOT = {".git", ".local", ".venv", "data", "build", "dist"}  # diloco_async/data/ is a package


def _SKIP(directory: str, names: list[str]) -> set[str]:
    at_root = {n for n in names if n in _SKIP_AT_ROOT} if Path(directory) == ROOT else set()
    return set(_SKIP_ANYWHERE(directory, names)) | at_root


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PREFECT_HOME", "VIRTUAL_ENV")}
    return {**env, "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtualenv with `pip install .` done; returns its bin/ folder."""
    tmp = tmp_path_factory.mktemp("install")
    src, venv = tmp / "src", tmp / "venv"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", "--no-build-isolation", str(src)], check=True, env=_clean_env(),
                   cwd=tmp)
    return venv / "bin"


@pytest.fixture()
def elsewhere(tmp_path) -> Path:
    """A working folder outside the checkout; data/ points at the corpus already downloaded (the
    default recipe's ``data.cache_dir``), so the test does not download it again."""
    (tmp_path / "data").symlink_to((ROOT / "data").resolve())
    return tmp_path


def test_installed_tool_finds_the_recipes_outside_the_checkout(installed, elsewhere):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(installed / "diloco-async"), *args], cwd=elsewhere, env=_clean_env(),
                              capture_output=True, text=True, timeout=300)

    where = subprocess.run([str(installed / "python"), "-c", "import diloco_async, diloco_recipes;"
                            "print(diloco_async.__file__); print(list(diloco_recipes.__path__)[0])"],
                           cwd=elsewhere, env=_clean_env(), capture_output=True, text=True, check=True).stdout
    assert str(ROOT) not in where and str(installed.parent) in where, where
    listed = run("recipes")
    assert listed.returncode == 0 and "default" in listed.stdout, listed.stdout + listed.stderr
    checked = run("validate", "default", "--set", "budget.tokens=200000")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "diloco_recipes/default.toml" in checked.stdout and "fragment 0:" in checked.stdout
    assert run("--version").stdout.startswith("diloco-async 0.1.0")


def test_installed_tool_trains_the_default_recipe_outside_the_checkout(installed, elsewhere, prefect_server):
    """A short `train --recipe default` (2 learners, 40k tokens: about 20 inner steps each, a few
    merges; 4 held-out batches): the claim is that it runs, merges and checkpoints from outside the
    checkout, not how far it trains. It reports to the session's Prefect server: a temporary one
    per command (10 s of start-up) is the newcomer path of test_stop and test_parent_death."""
    from prefect.settings import PREFECT_API_URL

    done = subprocess.run([str(installed / "diloco-async"), "train", "--recipe", "default",
                           "--set", "budget.tokens=40000", "--set", "learners.count=2",
                           "--set", "data.eval_batches=4"],
                          cwd=elsewhere, env={**_clean_env(), "PREFECT_API_URL": PREFECT_API_URL.value()},
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["merges"] > 0 and summary["eval_loss_final"] < summary["eval_loss_initial"]
    assert list((elsewhere / ".local" / "store").glob(f"{summary['run_id']}/checkpoints/*"))
