"""Real processes on loopback: a learner killed mid-run and started again as its next incarnation
(with no inner state to restore) steps at the run's point on the inner learning-rate schedule, not
at its start (issue 44 item 5): the run's tokens come from the synchronizer's answers."""

from __future__ import annotations

import os
import signal

import pytest
from resolved_config import resolved_args
from tiny_recipe import tiny_recipe_text

from diloco_async.config.schema import load_config
from diloco_async.learner.main import TIMELINE_DIR_ENV
from diloco_async.metrics.timeline import read_records
from diloco_async.policy.schedules import InnerSchedule
from diloco_async.protocol.auth import learner_token
from diloco_async.protocol.client import LEARNER_TOKEN_ENV, TOKEN_ENV, fetch_status
from diloco_async.runtime.procs import LocalProcessLauncher, wait_for_ready_file

from polling import wait_until

TOKEN = "schedule-run-secret-0123456789abcdef"
BUDGET = 1_000_000


def test_a_restarted_learner_resumes_at_the_runs_point_on_the_schedule(tmp_path):
    text = tiny_recipe_text(2, run=f'store = "file://{tmp_path}/store"', budget=f"tokens = {BUDGET}")
    text = text.replace("batch_size = 8", 'batch_size = 8\nlr_schedule = "cosine"\ncheckpoint_every_s = 0.0')
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(text)
    schedule = InnerSchedule.from_config(load_config(recipe))
    launcher = LocalProcessLauncher(tmp_path / "logs")
    sync = launcher.start("synchronizer", ["-m", "diloco_async.server", *resolved_args(recipe, [], tmp_path),
                                           "--run-id", "sched", "--ready-file", str(tmp_path / "ready.json")],
                          {TOKEN_ENV: TOKEN})
    procs = []
    timelines = tmp_path / "timelines"

    def learner(i: int, incarnation: int):
        procs.append(launcher.start(f"learner-{i}.{incarnation}", [
            "-m", "diloco_async.learner", "--learner-id", f"learner-{i}", "--index", str(i), "--sync-url", url,
            "--store", f"file://{tmp_path}/store", "--incarnation", str(incarnation)],
            {LEARNER_TOKEN_ENV: learner_token(TOKEN, "sched", f"learner-{i}"), TIMELINE_DIR_ENV: str(timelines)}))
        return procs[-1]

    def steps(incarnation: int) -> list[dict]:
        return [r for r in read_records(timelines / "learner-1.jsonl") if r["kind"] == "step"
                and r["inc"] == incarnation]

    try:
        url = wait_for_ready_file(tmp_path / "ready.json", sync, timeout_s=60)["url"]
        learner(0, 0)
        first = learner(1, 0)
        wait_until(lambda: fetch_status(url)["tokens_processed"] >= 0.3 * BUDGET, 240, "30% of the budget")
        first.kill()
        at_kill = fetch_status(url)["tokens_processed"]
        learner(1, 1)
        wait_until(lambda: len(steps(1)) >= 3, 120, "steps of learner-1's next incarnation")
        os.kill(sync.pid, signal.SIGTERM)
        assert sync.proc.wait(timeout=90) == 0
    finally:
        for p in procs + [sync]:
            p.terminate(grace_s=5)
    before, after = steps(0), steps(1)
    assert before[0]["run_tokens"] < 0.3 * BUDGET <= at_kill
    # the new incarnation's first step is at the run's point: where it was killed or later (told in steps of
    # 0.1% of the budget)
    assert after[0]["run_tokens"] >= at_kill - BUDGET // 1000
    for r in after:
        assert r["lr"] == pytest.approx(schedule.lr(r["step"] - 1, r["run_tokens"]), rel=1e-12)
    # past 30% of a cosine schedule (to 10%): at most 0.1 + 0.9 * (1 + cos(0.3 pi)) / 2 = 0.81 of lr, where a
    # learner on its own count would start again at the top (or in its warm-up)
    assert after[0]["lr"] <= 0.82 * schedule.base_lr
    assert after[0]["step"] > schedule.warmup_steps  # it continued at the global step: no second warm-up
