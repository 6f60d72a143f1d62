"""The fused merge kernels' build in real compiler processes (diloco_async/kernels/merge_kernels.c, DESIGN §4.5c):
the fallback to the torch code, with its logged reason, when the compiler is broken or the cache
unwritable, and concurrent builds into one cache directory from several processes. The kernels'
bits against the torch code are tests/unit/test_merge_native.py's."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_merge_native import _bits, _same, native  # noqa: F401, F811 (shared with unit/test_merge_native.py; fixtures among them)

import diloco_async.merge.core as merge
from diloco_async.kernels import build as native_build
from diloco_async.merge import native as merge_native
from tests import merge_reference as ref

ROOT = Path(__file__).resolve().parents[2]


def _fresh_kernels(monkeypatch, tmp_path, **env):
    monkeypatch.setenv("DILOCO_NATIVE_CACHE", str(tmp_path / "cache"))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    merge_native.reset()
    return merge_native.usable(), native_build.unavailable_reason()


@pytest.mark.parametrize("how", ["missing", "broken", "disabled", "unwritable"])
def test_fallback_with_a_logged_reason(how, monkeypatch, tmp_path, caplog):
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: internal error: out of luck' >&2\nexit 4\n")
    broken.chmod(0o755)
    env = {"missing": {"CC": "no-such-compiler-here"}, "broken": {"CC": str(broken)},
           "disabled": {"DILOCO_NATIVE": "0"}, "unwritable": {}}[how]
    try:
        with caplog.at_level(logging.WARNING, logger="diloco.native"):
            ok, reason = _fresh_kernels(monkeypatch, tmp_path, **env)
            if how == "unwritable":  # the cache directory would be under a plain file
                monkeypatch.setenv("DILOCO_NATIVE_CACHE", str(broken / "cache"))
                merge_native.reset()
                ok, reason = merge_native.usable(), native_build.unavailable_reason()
        assert not ok
        want = {"missing": "no C compiler", "broken": "exited with 4: cc: internal error: out of luck",
                "disabled": "DILOCO_NATIVE=0", "unwritable": "cannot build into the cache directory"}[how]
        assert want in reason
        assert [r.getMessage() for r in caplog.records if r.name == "diloco.native"] == [
            f"fused kernels of merge_kernels.c unavailable, using the torch code: {reason}"]
        merge_native.usable()  # asked again: no second build, no second warning
        assert len([r for r in caplog.records if r.name == "diloco.native"]) == 1
        assert not list((tmp_path / "cache").glob("*.tmp"))
        gen = torch.Generator().manual_seed(3)
        xs = [torch.randn(1001, generator=gen) for _ in range(3)]
        _same(merge.rda(xs, [1.0, 2.0, 0.5]), ref.rda(xs, [1.0, 2.0, 0.5]))  # the torch code, same bits
    finally:
        monkeypatch.undo()
        merge_native.reset()


_BUILDER = """
import torch
from diloco_async.merge import native as merge_native
from diloco_async.kernels import build as native_build
ok = merge_native.usable()
ones = torch.ones(5)
out = merge_native.anchor_into(torch.empty(5), 3 * ones, ones, ones / 2) if ok else None
print("RESULT", ok, native_build.unavailable_reason(), None if out is None else out.tolist())
"""


def test_concurrent_builds_into_one_cache(tmp_path):
    """Six processes build the kernels into one empty cache directory at once: each loads a
    complete library, one file is left, no temporary file."""
    cache = tmp_path / "cache"
    env = dict(os.environ, DILOCO_NATIVE_CACHE=str(cache), PYTHONPATH=str(ROOT))
    env.pop("DILOCO_NATIVE", None)
    procs = [subprocess.Popen([sys.executable, "-c", _BUILDER], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(6)]
    outs = [p.communicate(timeout=240) for p in procs]
    for (out, err), p in zip(outs, procs, strict=True):
        assert p.returncode == 0, err[-2000:]
        assert "RESULT True None [2.5, 2.5, 2.5, 2.5, 2.5]" in out, (out, err[-2000:])
    assert [f.suffix for f in cache.iterdir()] == [".so"]
