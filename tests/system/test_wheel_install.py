"""The built wheel, installed with its dependencies resolved by pip into a fresh virtualenv that
already holds other compatible versions of numpy and pydantic than constraints.txt pins (issue 46
item 1, docs/install.md): pyproject.toml's ranges accept them, so pip keeps them; ``import
diloco_async``, the command line and a short ``diloco_async.train(...)`` work from a folder outside
the checkout; a bad config raises the CLI's one-line error; and nothing named ``flows`` or
``storage`` is installed at the top of site-packages.

Unlike tests/system/test_install.py (offline, ``--no-deps``), this install asks pip's configured
index for the dependencies the virtualenv lacks, as a user's ``pip install`` does (the pip cache and
a local mirror make a rerun fast). torch is installed first at the exact build the test environment
holds (``2.13.0+cpu`` here, from a file on disk), and the wheel is installed under a constraints
file holding only that torch, so pip never reaches for another torch build.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from test_install import _SKIP, ROOT, _clean_env  # noqa: F401, F811 (shared with test_install.py)

pytestmark = pytest.mark.timeout(1800)  # pip resolves and installs the dependency tree: minutes

#: the versions the virtualenv holds before the wheel comes: other than the pins, inside the ranges
FOREIGN = {"numpy": "2.3.5", "pydantic": "2.13.5"}
#: the wheel's only top-level import packages (configs/ ships as diloco_recipes)
TOP_LEVEL = {"diloco_async", "diloco_recipes"}


def _pip(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args], cwd=cwd,
                          env=_clean_env(), capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, f"pip {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, sep, pinned = line.split("#", 1)[0].strip().partition("==")
        if sep:
            pins[name.lower()] = pinned
    return pins


def test_the_foreign_versions_differ_from_the_pins_and_fit_the_ranges():
    """The premise of the install below, read from the files: a change of a range or a pin that
    makes it vacuous (a foreign version equal to the pin) or impossible (outside the range) fails here."""
    requires = {Requirement(r).name: Requirement(r) for r in
                tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    pins = _pins()
    for name, foreign in FOREIGN.items():
        assert foreign != pins[name], f"{name} {foreign} is the pin: the test would prove nothing"
        assert requires[name].specifier.contains(foreign), f"{name} {foreign} outside {requires[name]}"
        assert requires[name].specifier.contains(pins[name]), f"{name}: the pin {pins[name]} outside the range"
    assert all("==" not in str(r.specifier) for r in requires.values()), "pyproject.toml takes ranges, not pins"


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> tuple[Path, Path]:
    """(the virtualenv's bin/, the wheel): the wheel built from a clean copy of the checkout; torch at
    the test environment's build, then the foreign numpy and pydantic, then the wheel with pip
    resolving the rest."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, venv = tmp / "src", tmp / "dist", tmp / "venv"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    _pip(Path(sys.executable), "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src), cwd=tmp)
    (wheel,) = dist.glob("diloco_async-*.whl")
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    torch = f"torch=={version('torch')}"  # the exact build (2.13.0+cpu): never a CUDA torch from an index
    (tmp / "torch.txt").write_text(torch + "\n")
    # --no-compile: no .pyc of every file up front (torch alone has thousands); imports compile what they use
    _pip(python, "install", "-q", "--no-compile", "--only-binary", ":all:", torch, cwd=tmp)
    _pip(python, "install", "-q", "--no-compile", *(f"{n}=={v}" for n, v in FOREIGN.items()), cwd=tmp)
    _pip(python, "install", "-q", "--no-compile", "-c", str(tmp / "torch.txt"), str(wheel), cwd=tmp)
    return venv / "bin", wheel


@pytest.fixture()
def elsewhere(tmp_path) -> Path:
    """A folder outside the checkout; data/ points at the corpus already downloaded."""
    (tmp_path / "data").symlink_to((ROOT / "data").resolve())
    return tmp_path


def _run(argv: list[str], cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    env = {**_clean_env(), "PREFECT_HOME": str(cwd / ".local" / "prefect")}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)


def test_the_wheel_holds_no_top_level_flows_or_storage(wheel_venv):
    _, wheel = wheel_venv
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert tops == TOP_LEVEL, tops
    assert "diloco_async/flows/cli.py" in zipfile.ZipFile(wheel).namelist()
    assert "diloco_async/storage/keys.py" in zipfile.ZipFile(wheel).namelist()


def test_pip_kept_the_foreign_versions_and_installed_nothing_named_flows_or_storage(wheel_venv, elsewhere):
    bin_dir, _ = wheel_venv
    probe = ("import importlib.metadata as m, importlib.util as u, json, sys, sysconfig; "
             "site = sysconfig.get_paths()['purelib']; import os; "
             "print(json.dumps({'versions': {n: m.version(n) for n in ('numpy', 'pydantic', 'torch', 'diloco-async')}, "
             "'specs': {n: u.find_spec(n) is not None for n in ('flows', 'storage')}, "
             "'site': sorted(os.listdir(site)), 'file': __import__('diloco_async').__file__}))")
    done = _run([str(bin_dir / "python"), "-c", probe], elsewhere)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert {n: got["versions"][n] for n in FOREIGN} == FOREIGN  # the ranges admitted them: pip kept them
    assert got["versions"]["torch"] == version("torch") and got["versions"]["diloco-async"] == "0.1.0"
    assert got["specs"] == {"flows": False, "storage": False}
    assert not {top + ext for top in ("flows", "storage") for ext in ("", ".py")} & set(got["site"]), got["site"]
    assert got["file"].startswith(str(bin_dir.parent)) and str(ROOT) not in got["file"]
    assert _run([str(bin_dir / "python"), "-m", "pip", "check"], elsewhere).returncode == 0


def test_the_cli_and_a_short_train_run_from_the_installed_wheel(wheel_venv, elsewhere):
    bin_dir, _ = wheel_venv
    helped = _run([str(bin_dir / "diloco-async"), "--help"], elsewhere)
    assert helped.returncode == 0 and "train" in helped.stdout and "resume" in helped.stdout, helped.stderr
    listed = _run([str(bin_dir / "diloco-async"), "recipes"], elsewhere)
    assert listed.returncode == 0 and re.search(r"^\s*default\b", listed.stdout, re.M), listed.stdout
    script = f"""
import json, diloco_async
tiny = ["run.store=file://{elsewhere}/store", "run.workdir={elsewhere}/runs", "model.n_layer=1", "model.d_model=32",
        "model.n_head=2", "model.context=32", "learners.count=2", "learners.batch_size=8",
        "synchronizer.num_fragments=3", "synchronizer.sync_every=12", "budget.tokens=20000", "budget.wall_s=120",
        "data.eval_batches=4"]
summary = diloco_async.train("default", tiny, poll_s=0.5)
from diloco_async.storage import ObjectStore, keys  # the installed store names the published versions
summary["stored_versions"] = len(ObjectStore("file://{elsewhere}/store").list(keys.versions_prefix(summary["run_id"])))
print("RESULT " + json.dumps(summary))
"""
    done = _run([str(bin_dir / "python"), "-c", script], elsewhere, timeout_s=900)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert summary["stop_reason"].startswith("token budget") and summary["merges"] > 0
    assert summary["eval_loss_final"] < summary["eval_loss_initial"]
    assert summary["stored_versions"] > 0 and (elsewhere / "store" / summary["run_id"]).is_dir()


def test_a_bad_config_raises_the_clis_error_in_the_installed_package(wheel_venv, elsewhere):
    bin_dir, _ = wheel_venv
    script = ("import diloco_async\n"
              "try:\n    diloco_async.train('default', ['learners.count=0'])\n"
              "except ValueError as err:\n    print(err)\nelse:\n    print('no error')\n")
    api = _run([str(bin_dir / "python"), "-c", script], elsewhere)
    cli = _run([str(bin_dir / "diloco-async"), "train", "--set", "learners.count=0"], elsewhere)
    assert api.returncode == 0, api.stderr[-3000:]
    # the recipe and the override, then a line per invalid field that names it and its value
    assert "learners.count: Input should be greater than or equal to 1 (got 0)" in api.stdout.splitlines()[-1]
    assert cli.returncode == 2 and cli.stderr == "error: " + api.stdout, (cli.stderr, api.stdout)
