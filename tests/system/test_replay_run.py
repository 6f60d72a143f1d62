"""Replayable asynchrony in real runs (issue 44 item 2; DESIGN §3.2): a synchronizer and two real
learner processes on loopback over a file:// store, ``run.schedule = "replay"``, learners of different
seeded virtual speeds with per-step jitter, one fragment's rounds closing on a quorum of one with the
grace window. Two replayed runs of one seed and recipe publish the same versions: the sha256 of every
version in the merge log (fragment, version, digest, the learners merged), and of every version object
left in the store, are equal; the second run has a CPU hog process beside it, which changes every
wall-clock duration. A free run of the same recipe is run for contrast and asserted to have
published versions, not to differ (it may or may not).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from test_shards import wait_clean_exit
from tiny_recipe import ROOT

from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config
from diloco_async.run import RunProcesses
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore

LEARNERS = 2
TOKENS_PER_STEP = 2 * 16  # batch_size x context
BUDGET_TOKENS = TOKENS_PER_STEP * LEARNERS * 48  # about 48 steps a learner: a dozen rounds per fragment


def recipe(tmp_path: Path, name: str, schedule: str) -> Config:
    """A tiny model, 2 learners (virtual speeds exp(N(0, 0.5)), 20% step jitter), 2 fragments, K = 1."""
    return with_fields(Config(), {
        "run.store": f"file://{tmp_path}/{name}/store", "run.workdir": f"{tmp_path}/{name}/runs", "run.seed": 5,
        "run.schedule": schedule, "data.cache_dir": str((ROOT / "data").resolve()),
        "model.n_layer": 1, "model.d_model": 16, "model.n_head": 2, "model.context": 16,
        "learners.count": LEARNERS, "learners.batch_size": 2, "learners.heartbeat_s": 0.25,
        "learners.checkpoint_every_s": 0.0, "synchronizer.num_fragments": 2, "synchronizer.sync_every": 4,
        "synchronizer.min_quorum": 1, "synchronizer.heartbeat_timeout_s": 10.0,
        "synchronizer.checkpoint_every_s": 100000.0, "replay.step_s": 1.0, "replay.speed_spread": 0.5,
        "faults.step_jitter": 0.2, "budget.tokens": BUDGET_TOKENS})


def published(tmp_path: Path, name: str, schedule: str) -> tuple[list[tuple], dict[str, str]]:
    """Run the recipe to its end; returns the merge log's (fragment, version, sha256, learners merged)
    in order, and the sha256 of the bytes of every version object left in the store, by key."""
    cfg = recipe(tmp_path, name, schedule)
    run = RunProcesses(cfg, run_id="replayed")
    try:
        run.start_synchronizer()
        for i in range(LEARNERS):
            run.start_learner(i)
        wait_clean_exit(run)
    finally:
        run.stop_all()
    store = ObjectStore(cfg.run.store)
    logs = [k for k in store.list("replayed/epochs") if k.endswith("/merges.jsonl")]
    assert len(logs) == 1, logs
    records = [json.loads(line) for line in store.get_unverified(logs[0]).decode().splitlines() if line.strip()]
    merges = [(r["fragment"], r["version"], r["sha256"], [c["learner"] for c in r["contributions"]])
              for r in records]
    objects = {k: hashlib.sha256(store.get_unverified(k)).hexdigest()
               for k in store.list(keys.versions_prefix("replayed")) if k.endswith(".safetensors")}
    return merges, objects


def test_two_replays_of_one_seed_publish_the_same_versions_even_beside_a_cpu_hog(tmp_path):
    first_merges, first_objects = published(tmp_path, "first", "replay")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        second_merges, second_objects = published(tmp_path, "second", "replay")
    finally:
        hog.kill()
        hog.wait(timeout=30)
    assert len(first_merges) >= 6, first_merges  # rounds of both fragments merged, more than once each
    assert {p for p, *_ in first_merges} == {0, 1}
    assert {lid for *_, merged in first_merges for lid in merged} == {"learner-0", "learner-1"}
    assert any(len(merged) == 1 for *_, merged in first_merges)  # rounds closed on a quorum of one
    assert any(len(merged) == 1 for *_, merged in first_merges)  # quorum of one: asynchrony, not lockstep
    assert second_merges == first_merges
    assert first_objects and second_objects == first_objects

    free_merges, free_objects = published(tmp_path, "free", "free")
    assert free_merges and free_objects  # the free run's versions follow the wall clock: not asserted equal
    print(f"free run: {len(free_merges)} merges, same digests as the replay: {free_merges == first_merges}")
