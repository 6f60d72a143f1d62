"""Error feedback in a real run (issue 44 item 3): a synchronizer and one learner process on
loopback over a file:// store, int2 uploads with ``learners.error_feedback = true`` and inner-state
checkpoints every half second.

The learner's saved inner state carries its residuals (non-zero: int2 drops most of each outer
gradient), one per tensor of every fragment it uploaded; after a SIGKILL its next incarnation
restores them (its log says so) and goes on contributing, and the synchronizer ends cleanly.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from resolved_config import resolved_args
from test_integration import TOKEN, learner_env, tiny_recipe

from diloco_async.protocol.client import TOKEN_ENV, fetch_status
from diloco_async.runtime.procs import LocalProcessLauncher, wait_for_ready_file
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_state
from diloco_async.storage.store import ObjectStore

from polling import wait_until


def _learner(launcher: LocalProcessLauncher, tmp_path: Path, url: str, incarnation: int):
    return launcher.start(f"learner-0-i{incarnation}", [
        "-m", "diloco_async.learner", "--learner-id", "learner-0", "--index", "0", "--sync-url", url,
        "--store", f"file://{tmp_path}/store", "--incarnation", str(incarnation)], learner_env("eftest", "learner-0"))


def _merged(url: str) -> int:
    return fetch_status(url)["learners"].get("learner-0", {}).get("contributions", {}).get("merged", 0)


def _residuals(store: ObjectStore) -> dict:
    saved = latest_state(store, keys.learner_prefix("eftest", "learner-0"))
    return {} if saved is None else {k: t for k, t in saved.tensors.items() if k.startswith("residual/")}


def test_the_residuals_are_spooled_and_restored_by_the_next_incarnation(tmp_path):
    recipe = tiny_recipe(tmp_path, learners=1, wall_s=300)
    recipe.write_text(recipe.read_text().replace(
        "batch_size = 8", 'batch_size = 8\ncodec = "int2"\nerror_feedback = true\ncheckpoint_every_s = 0.5'))
    launcher = LocalProcessLauncher(tmp_path / "logs")
    sync = launcher.start("synchronizer", ["-m", "diloco_async.server", *resolved_args(recipe, [], tmp_path),
                                           "--run-id", "eftest", "--ready-file", str(tmp_path / "ready.json")],
                          {TOKEN_ENV: TOKEN})
    store = ObjectStore(f"file://{tmp_path}/store")
    procs = []
    try:
        url = wait_for_ready_file(tmp_path / "ready.json", sync, timeout_s=60)["url"]
        procs.append(_learner(launcher, tmp_path, url, 0))
        wait_until(lambda: _merged(url) >= 4, 120, "four merged contributions")
        wait_until(lambda: {k.split("/")[1] for k in _residuals(store)} == {"0", "1", "2"}, 120,
                   "an inner state holding the residuals of all three fragments")
        saved = _residuals(store)
        assert all(t.dtype.is_floating_point for t in saved.values())
        assert sum(int(t.count_nonzero()) for t in saved.values()) > 0  # int2 dropped something, and it was kept
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].proc.wait(timeout=30)
        before = _merged(url)
        procs.append(_learner(launcher, tmp_path, url, 1))
        wait_until(lambda: _merged(url) >= before + 3, 120, "contributions of the next incarnation merged")
        log = (tmp_path / "logs" / "learner-0-i1.log").read_text()
        assert "learner-0 restored its error-feedback residuals of 3 fragment(s) from checkpoint" in log
        assert "no error-feedback residual to restore" not in log
        os.kill(sync.pid, signal.SIGTERM)
        assert sync.proc.wait(timeout=90) == 0
        assert procs[1].proc.wait(timeout=30) == 0
    finally:
        for p in procs + [sync]:
            p.terminate(grace_s=5)
