"""`diloco-async validate` as a process on the default recipe: it starts nothing and prints the plan
(issue 15, items 3 and 4; recipe checks without a process are tests/unit/test_validate.py's)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
from test_validate import ROOT  # noqa: F401, F811 (shared with unit/test_validate.py; fixtures among them)


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_validate_default_starts_nothing_and_prints_the_plan(tmp_path):
    store = tmp_path / "store"
    (store / "earlier-run").mkdir(parents=True)
    (store / "earlier-run" / "manifest.json").write_text("{}")
    before = _files(store)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = psutil.Popen([sys.executable, "-m", "diloco_async.flows.cli", "validate", "configs/default.toml",
                         "--set", f"run.store=file://{store}"], cwd=ROOT, env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: set[int] = set()
    deadline = time.monotonic() + 300  # the failure mode of a validate that never ends (its speed is no test's)
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                children |= {c.pid for c in proc.children(recursive=True)}
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)  # a sample of its children, not a wait for an effect
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err
    assert not children, f"validate started processes {children}"
    assert _files(store) == before  # the probe object is gone, nothing else written
    assert "4 fragments" in out and "fragment 3:" in out and "bytes" in out
    for step in ("config", "store", "data", "tokenizer", "model", "fragments"):
        assert f"ok   {step}" in out


def _validate_in(cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "diloco_async.flows.cli", "validate", "default",
                           "--set", f'data.cache_dir="{ROOT / "data"}"', *extra],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_validate_writes_nothing_to_the_current_folder_unless_asked(tmp_path):
    """Run from an empty folder, the default recipe (store file://.local/store, token cache
    .local/tokens, both relative) leaves that folder empty (issue 46: it created ./.local);
    ``--write-resolved DIR`` writes DIR/resolved-config.json and nothing else."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = _validate_in(cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _files(cwd) == []
    assert "ok   store      file://" in proc.stdout and "does not exist yet" in proc.stdout
    assert "ok   tokenizer" in proc.stdout
    proc = _validate_in(cwd, "--write-resolved", "out")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _files(cwd) == ["out", "out/resolved-config.json"]
