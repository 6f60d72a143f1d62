"""Real processes on loopback: a synchronizer and three learners over a file:// store.

One learner is killed with SIGKILL mid-run: the synchronizer keeps merging with the other two,
the run finishes, and the missing learner shows in the metrics.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from resolved_config import resolved_args
from tiny_recipe import tiny_recipe_text

from diloco_async.protocol.auth import learner_token
from diloco_async.protocol.client import LEARNER_TOKEN_ENV, TOKEN_ENV, call_blocking, fetch_status
from diloco_async.runtime.procs import LocalProcessLauncher, wait_for_ready_file
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_checkpoint
from diloco_async.storage.store import ObjectStore

from polling import wait_until

TOKEN = "integration-run-secret-0123456789abcdef"


def learner_env(run_id: str, learner_id: str) -> dict[str, str]:
    """A learner started by hand gets only its own token, never the run secret."""
    return {LEARNER_TOKEN_ENV: learner_token(TOKEN, run_id, learner_id)}


def tiny_recipe(tmp_path: Path, learners: int, wall_s: float) -> Path:
    text = tiny_recipe_text(learners, run=f'store = "file://{tmp_path}/store"', budget=f"wall_s = {wall_s}")
    path = tmp_path / "tiny.toml"
    path.write_text(text)
    return path


def test_sigkill_one_of_three_learners(tmp_path):
    recipe = tiny_recipe(tmp_path, learners=3, wall_s=300)
    launcher = LocalProcessLauncher(tmp_path / "logs")
    env = {TOKEN_ENV: TOKEN}
    sync = launcher.start("synchronizer", ["-m", "diloco_async.server", *resolved_args(recipe, [], tmp_path),
                                           "--run-id", "itest", "--ready-file", str(tmp_path / "ready.json")], env)
    procs = {}
    try:
        url = wait_for_ready_file(tmp_path / "ready.json", sync, timeout_s=60)["url"]
        for i in range(3):
            procs[i] = launcher.start(f"learner-{i}", ["-m", "diloco_async.learner", "--learner-id", f"learner-{i}",
                                                       "--index", str(i), "--sync-url", url,
                                                       "--store", f"file://{tmp_path}/store"],
                                       learner_env("itest", f"learner-{i}"))

        def six_merges_all_three_live() -> bool:  # learner-2 may join after the others have merged six times
            st = fetch_status(url)
            lives = [st["learners"].get(f"learner-{i}", {}).get("live") for i in range(3)]
            return st["merges"] >= 6 and all(lives)
        wait_until(six_merges_all_three_live, 90, "six merges with three learners live")
        killed_ms = int(time.time() * 1000)  # metric timestamps are unix ms of the same machine
        procs[2].kill()
        killed_at = fetch_status(url)
        versions_at_kill = min(killed_at["versions"].values())
        # the synchronizer notices the silence and keeps merging with the two others
        wait_until(lambda: not fetch_status(url)["learners"]["learner-2"]["live"], 60, "learner-2 marked lost")
        wait_until(lambda: min(fetch_status(url)["versions"].values()) >= versions_at_kill + 3, 120,
                   "versions to keep rising after the kill")
        metrics = call_blocking(url, TOKEN, "metrics", 0)["metrics"]
        os.kill(sync.pid, signal.SIGTERM)  # a clean stop: final checkpoint, learners told to stop
        assert sync.proc.wait(timeout=90) == 0
        for i in (0, 1):
            assert procs[i].proc.wait(timeout=30) == 0
    finally:
        for p in list(procs.values()) + [sync]:
            p.terminate(grace_s=5)
    alive = [m["value"] for m in metrics if m["key"] == "learner/learner-2/alive"]
    assert alive[-1] == 0.0
    assert any(m["key"] == "sync/live_learners" and m["value"] == 2.0 for m in metrics)
    store = ObjectStore(f"file://{tmp_path}/store")
    epoch = json.loads((tmp_path / "ready.json").read_text())["epoch"]
    summary = store.get_json(keys.summary_key("itest", epoch))
    assert summary["learners"]["learner-2"]["live"] is False
    assert summary["learners"]["learner-0"]["live"] is True
    merged_after = [m for m in metrics if m["key"] == "sync/quorum_size" and m["timestamp_ms"] > killed_ms]
    assert len(merged_after) >= 3, f"{len(merged_after)} merges recorded after the kill"
    assert summary["stop_reason"] == "signal SIGTERM"
    assert 0 < summary["compute_goodput"] <= 1 and 0 < summary["token_goodput"] <= 1
    ckpt = latest_checkpoint(store, "itest")
    assert ckpt is not None and summary["last_checkpoint_seq"] == ckpt.seq  # the final checkpoint
    assert min(int(v) for v in ckpt.manifest["versions"].values()) >= versions_at_kill + 3
    # contributions, versions and checkpoints are objects in the store
    assert store.list(keys.contributions_prefix("itest")) and store.list(keys.versions_prefix("itest"))
    assert store.list(keys.checkpoint_prefix("itest"))


def test_restarted_learner_restores_its_inner_state(tmp_path):
    recipe = tiny_recipe(tmp_path, learners=2, wall_s=300)
    recipe.write_text(recipe.read_text().replace("batch_size = 8", "batch_size = 8\ncheckpoint_every_s = 1.0"))
    launcher = LocalProcessLauncher(tmp_path / "logs")
    env = {TOKEN_ENV: TOKEN}
    sync = launcher.start("synchronizer", ["-m", "diloco_async.server", *resolved_args(recipe, [], tmp_path),
                                           "--run-id", "rtest", "--ready-file", str(tmp_path / "ready.json")], env)
    procs = []

    def learner(i: int, incarnation: int):
        proc = launcher.start(f"learner-{i}.{incarnation}", [
            "-m", "diloco_async.learner", "--learner-id", f"learner-{i}", "--index", str(i), "--sync-url", url,
            "--store", f"file://{tmp_path}/store", "--incarnation", str(incarnation)],
            learner_env("rtest", f"learner-{i}"))
        procs.append(proc)
        return proc

    try:
        url = wait_for_ready_file(tmp_path / "ready.json", sync, timeout_s=60)["url"]
        learner(0, 0)
        first = learner(1, 0)
        log1 = tmp_path / "logs" / "learner-1.0.log"
        wait_until(lambda: "saved its inner state" in log1.read_text(), 60, "a learner checkpoint")
        first.kill()
        merged_before = fetch_status(url)["learners"]["learner-1"]["contributions"].get("merged", 0)
        learner(1, 1)
        log2 = tmp_path / "logs" / "learner-1.1.log"
        wait_until(lambda: "restored its inner state" in log2.read_text(), 60, "the restore")
        wait_until(lambda: fetch_status(url)["learners"]["learner-1"]["contributions"].get("merged", 0)
                   > merged_before + 2, 60, "merged contributions after the restart")
        # live: a state read when it holds (a loaded learner may be seen lost for a moment)
        wait_until(lambda: fetch_status(url)["learners"]["learner-1"]["live"], 60, "learner-1 live")
        assert fetch_status(url)["learners"]["learner-1"]["incarnation"] == 1
        os.kill(sync.pid, signal.SIGTERM)
        assert sync.proc.wait(timeout=90) == 0
    finally:
        for p in procs + [sync]:
            p.terminate(grace_s=5)
    assert "CPU subnormals flushed" in log2.read_text()  # learners.flush_denormal, true by default
    restored = log2.read_text().split("restored its inner state from checkpoint ")[1]
    restored_step = int(restored.split("(step ")[1].split(",")[0])
    assert restored_step > 0


def test_signals_that_land_as_the_synchronizer_ends_leave_it_a_clean_exit(tmp_path):
    """SIGINT every 20 ms for the whole life of a synchronizer: the first stops it cleanly (final
    checkpoint, summary), and those that land while it tears down after its summary must not turn
    the finished run into a process killed by SIGINT (a Ctrl-C that lands as a run ends on its own
    then failed the flow run and fired the failure alert)."""
    from diloco_async.config.schema import load_config
    from diloco_async.run import RunProcesses

    recipe = str(tiny_recipe(tmp_path, learners=1, wall_s=60))
    overrides = [f"run.workdir={tmp_path}/runs"]
    rp = RunProcesses(load_config(recipe, overrides))
    rp.start_synchronizer()
    sent = 0
    try:
        deadline = time.monotonic() + 60
        while rp.sync.poll() is None and time.monotonic() < deadline:
            rp.sync.signal_group(signal.SIGINT)
            sent += 1
            time.sleep(0.02)
        code = rp.sync.wait(timeout=30)
    finally:
        rp.finished_cleanly = True
        rp.stop_all()
    log = rp.sync.log_path.read_text()
    assert code == 0, (sent, log[-3000:])
    assert "finished: signal SIGINT" in log and "Traceback" not in log, log[-3000:]
    summary = rp.store.get_json(keys.summary_key(rp.run_id, str(rp.epoch)))
    assert summary["stop_reason"] == "signal SIGINT"


def test_the_processes_run_with_exactly_the_resolved_config_they_are_given(tmp_path):
    """The recipe and its overrides are parsed once, by whoever starts the run; the synchronizer
    reads that value (``resolved-config.json``) and publishes it as the run's ``config.json``, and a
    learner joining takes the same value from it: no process parses the recipe again (issue 42)."""
    from diloco_async.config.schema import load_config
    from diloco_async.run import RunProcesses

    recipe = tiny_recipe(tmp_path, learners=1, wall_s=60)
    cfg = load_config(recipe, [f"run.workdir={tmp_path}/runs", "synchronizer.outer_lr=0.375",
                               "synchronizer.num_fragments=2", "learners.lr=0.00125"])
    recipe.write_text("this is no longer a recipe [")  # a process that parsed it again would fail
    rp = RunProcesses(cfg)
    try:
        url = rp.start_synchronizer()
        joined = call_blocking(url, learner_token(rp.token, rp.run_id, "learner-0"), "join",
                               {"learner_id": "learner-0", "incarnation": 0})
    finally:
        rp.stop_all()
    assert rp.store.get_json(keys.config_key(rp.run_id)) == cfg.public_dict()
    assert joined["config"]["synchronizer"]["outer_lr"] == 0.375 and joined["config"]["learners"]["lr"] == 0.00125
