"""Real processes on loopback: learners with ``learners.optimizer = "muon"`` (issue 44 item 4) train,
save inner states that carry Muon's momentum beside AdamW's moments, and a learner killed mid-run
restores them as its next incarnation and keeps contributing."""

from __future__ import annotations

import os
import signal

from resolved_config import resolved_args
from tiny_recipe import tiny_recipe_text

from diloco_async.config.schema import load_config
from diloco_async.inner.optimizers import muon_parameter_names
from diloco_async.models import build_run_model
from diloco_async.protocol.auth import learner_token
from diloco_async.protocol.client import LEARNER_TOKEN_ENV, TOKEN_ENV, fetch_status
from diloco_async.runtime.procs import LocalProcessLauncher, wait_for_ready_file
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_state
from diloco_async.storage.store import ObjectStore

from polling import wait_until

TOKEN = "muon-run-secret-0123456789abcdef0123"


def test_muon_learners_save_restore_and_keep_contributing(tmp_path):
    text = tiny_recipe_text(2, run=f'store = "file://{tmp_path}/store"', budget="wall_s = 300")
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(text.replace("batch_size = 8", 'batch_size = 8\ncheckpoint_every_s = 1.0\noptimizer = "muon"'))
    launcher = LocalProcessLauncher(tmp_path / "logs")
    sync = launcher.start("synchronizer", ["-m", "diloco_async.server", *resolved_args(recipe, [], tmp_path),
                                           "--run-id", "mtest", "--ready-file", str(tmp_path / "ready.json")],
                          {TOKEN_ENV: TOKEN})
    procs = []

    def learner(i: int, incarnation: int):
        procs.append(launcher.start(f"learner-{i}.{incarnation}", [
            "-m", "diloco_async.learner", "--learner-id", f"learner-{i}", "--index", str(i), "--sync-url", url,
            "--store", f"file://{tmp_path}/store", "--incarnation", str(incarnation)],
            {LEARNER_TOKEN_ENV: learner_token(TOKEN, "mtest", f"learner-{i}")}))
        return procs[-1]

    def merged() -> int:
        return fetch_status(url)["learners"]["learner-1"]["contributions"].get("merged", 0)

    try:
        url = wait_for_ready_file(tmp_path / "ready.json", sync, timeout_s=60)["url"]
        learner(0, 0)
        first = learner(1, 0)
        log1 = tmp_path / "logs" / "learner-1.0.log"
        wait_until(lambda: "saved its inner state" in log1.read_text(), 90, "a learner checkpoint")
        first.kill()
        before = merged()
        learner(1, 1)
        log2 = tmp_path / "logs" / "learner-1.1.log"
        wait_until(lambda: "restored its inner state" in log2.read_text(), 90, "the restore")
        wait_until(lambda: merged() > before + 2, 90, "merged contributions after the restart")
        os.kill(sync.pid, signal.SIGTERM)
        assert sync.proc.wait(timeout=90) == 0
    finally:
        for p in procs + [sync]:
            p.terminate(grace_s=5)
    saved = latest_state(ObjectStore(f"file://{tmp_path}/store"), keys.learner_prefix("mtest", "learner-1"))
    assert saved is not None
    hidden = muon_parameter_names(build_run_model(load_config(recipe)))
    assert {f"muon_momentum/{n}" for n in hidden} <= set(saved.tensors)  # Muon's state, every hidden matrix
    assert not any(f"exp_avg/{n}" in saved.tensors for n in hidden)
    assert "exp_avg/tok_emb.weight" in saved.tensors  # AdamW's for the embedding
