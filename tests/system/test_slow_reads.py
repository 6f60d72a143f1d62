"""A learner whose store reads are slow, beside a fast one, real processes (issue 47, item 1).

Every read the slow learner starts waits 3 s (``faults.storage_faults`` on its ``open``s only,
``faults.storage_fault_learners = [1]``), longer than the versions take to move, while the
synchronizer checkpoints every second and collects garbage behind each checkpoint. Before the
catch-up (policy/catchup.py) it queued one read per version told, each of them collected before
its turn came (``No such file or directory``), and its contributions waited behind those reads
until their rounds had closed: none was merged.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from resolved_config import resolved_args
from tiny_recipe import tiny_recipe_text

from diloco_async.protocol.auth import learner_token
from diloco_async.protocol.client import LEARNER_TOKEN_ENV, TOKEN_ENV, fetch_status
from diloco_async.runtime.procs import LocalProcessLauncher, wait_for_ready_file
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore

from polling import wait_until

pytestmark = [pytest.mark.timeout(600)]

TOKEN = "slow-reads-run-secret-0123456789abcdef"
RUN = "slowreads"
FRAGMENTS = 3  # the tiny recipe's
SLOW, FAST = "learner-1", "learner-0"
#: the slow learner's reads: each waits this long before it starts (its version may be collected meanwhile)
READ_WAIT_S = 3.0


@dataclass
class Finished:
    """What a run left: the synchronizer's summary, its contribution records and the learners' logs."""

    summary: dict
    fates: list[dict]
    logs: dict[str, str]

    def merged_by_fragment(self, learner_id: str) -> Counter[int]:
        return Counter(r["fragment"] for r in self.fates if r["learner"] == learner_id and r["fate"] == "merged")


def recipe(tmp_path: Path, *, speed: float, synchronizer: str = "") -> Path:
    """The tiny recipe with two learners, checkpoints (and garbage collection) every second, a
    slow-reading learner-1 and both learners at ``speed`` (the versions' pace)."""
    text = tiny_recipe_text(2, run=f'store = "file://{tmp_path}/store"', budget="wall_s = 600",
                            synchronizer=synchronizer, checkpoint_every_s=1.0)
    text = text.replace("sync_every = 12", "sync_every = 24")
    text += (f'[faults]\nstorage_faults = {{p_slow = 1.0, slow_s = {READ_WAIT_S}, ops = ["open"]}}\n'
             f"storage_fault_learners = [1]\nspeed_factors = [{speed}, {speed}]\n")
    path = tmp_path / "slow-reads.toml"
    path.write_text(text)
    return path


@contextmanager
def two_learners(tmp_path: Path, recipe_path: Path) -> Iterator[tuple[str, Callable[[], Finished]]]:
    """A synchronizer and learners 0 and 1 of ``recipe_path``; yields (its URL, ``stop``): ``stop()``
    ends the run with SIGTERM and returns what it left. Every process is gone after the ``with``."""
    launcher = LocalProcessLauncher(tmp_path / "logs")
    sync = launcher.start("synchronizer", ["-m", "diloco_async.server", *resolved_args(recipe_path, [], tmp_path),
                                           "--run-id", RUN, "--ready-file", str(tmp_path / "ready.json")],
                          {TOKEN_ENV: TOKEN})
    procs = []

    def stop() -> Finished:
        os.kill(sync.pid, signal.SIGTERM)  # a clean stop: final checkpoint, learners told to stop
        assert sync.proc.wait(timeout=90) == 0
        for p in procs:
            assert p.proc.wait(timeout=60) == 0
        store = ObjectStore(f"file://{tmp_path}/store")
        epoch = json.loads((tmp_path / "ready.json").read_text())["epoch"]
        summary = store.get_json(keys.summary_key(RUN, epoch))
        fates = [json.loads(line) for line in
                 store.get_unverified(keys.contribution_log_key(RUN, epoch)).decode().splitlines()]
        logs = {lid: (tmp_path / "logs" / f"{lid}.log").read_text() for lid in (FAST, SLOW)}
        return Finished(summary, fates, logs)

    try:
        url = wait_for_ready_file(tmp_path / "ready.json", sync, timeout_s=60)["url"]
        for i in range(2):
            procs.append(launcher.start(f"learner-{i}", ["-m", "diloco_async.learner", "--learner-id", f"learner-{i}",
                                                         "--index", str(i), "--sync-url", url,
                                                         "--store", f"file://{tmp_path}/store"],
                                        {LEARNER_TOKEN_ENV: learner_token(TOKEN, RUN, f"learner-{i}")}))
        yield url, stop
    finally:
        for p in [*procs, sync]:
            p.terminate(grace_s=5)


def learner_status(url: str, learner_id: str) -> dict:
    return fetch_status(url)["learners"].get(learner_id, {})


def downloads_of(log: str) -> tuple[int, int, int]:
    """(versions downloaded, skipped, found collected), from the learner's last comms line."""
    m = re.findall(r"versions downloaded (\d+), skipped (\d+) \(a newer one was told first\), found collected (\d+)",
                   log)
    assert m, "the learner's comms did not log their downloads"
    return tuple(int(x) for x in m[-1])  # type: ignore[return-value]


def assert_no_read_failed(log: str) -> None:
    """No download failed, no version was found collected (after join or at it), nothing was missing."""
    assert "storage faults injected" in log  # the learner whose reads were slow
    for failure in ("collected before it was read", "is gone (collected)", "No such file or directory"):
        assert failure not in log, re.findall(rf".*{re.escape(failure)}.*", log)[:3]
    assert not re.findall(r".*download of fragment \d+ v\S+ failed.*", log)


def test_a_slow_reader_gets_contributions_merged_and_never_reads_a_collected_version(tmp_path):
    """Versions move every ~1-2 s and each read of the slow learner waits 3 s: it reads only the
    newest version of a fragment when its download lane frees up (skipping those in between), its
    contributions never wait behind those reads, and they are merged on every fragment."""
    with two_learners(tmp_path, recipe(tmp_path, speed=0.1)) as (url, stop):
        wait_until(lambda: learner_status(url, SLOW).get("contributions", {}).get("merged", 0) >= 2 * FRAGMENTS,
                   300, f"{2 * FRAGMENTS} contributions of the slow-reading learner merged")
        done = stop()
    merged = done.merged_by_fragment(SLOW)
    assert all(merged[p] >= 1 for p in range(FRAGMENTS)), (merged, Counter(
        (r["fragment"], r["fate"], (r["reason"] or "").split(" ")[0]) for r in done.fates if r["learner"] == SLOW))
    assert all(done.merged_by_fragment(FAST)[p] >= 1 for p in range(FRAGMENTS))
    assert_no_read_failed(done.logs[SLOW])
    downloaded, skipped, collected = downloads_of(done.logs[SLOW])
    assert downloaded >= FRAGMENTS and skipped >= 1 and collected == 0, (downloaded, skipped, collected)


def test_reads_longer_than_the_kept_history_finish_under_their_read_lease(tmp_path):
    """With one version kept behind the current one (max_staleness = 1), a 3 s read outlives the
    history garbage collection keeps: the versions the slow learner reads are kept for it (its
    read lease, from its heartbeats) until it has read them. Without the lease it cannot even load
    the versions named at its join, and never starts training."""
    with two_learners(tmp_path, recipe(tmp_path, speed=0.3, synchronizer="max_staleness = 1")) as (url, stop):
        # it joined, loaded every fragment and read at least as many newer versions since
        wait_until(lambda: learner_status(url, SLOW).get("step", 0) > 0
                   and learner_status(url, SLOW).get("bytes_down", 0) >= 2 * FRAGMENTS * version_nbytes(tmp_path),
                   300, "the slow-reading learner training on versions it read after its join")
        done = stop()
    assert_no_read_failed(done.logs[SLOW])
    downloaded, _skipped, collected = downloads_of(done.logs[SLOW])
    assert downloaded >= FRAGMENTS and collected == 0, (downloaded, collected)
    assert done.summary["gc_kept_for_reads"] >= 1, done.summary  # the lease kept what gc would have deleted
    assert done.summary["gc_deleted_objects"] >= 1  # and gc did run behind the checkpoints


def version_nbytes(tmp_path: Path) -> int:
    """The largest published version of the run (fp32 safetensors of one fragment), bytes."""
    sizes = ObjectStore(f"file://{tmp_path}/store").sizes(keys.versions_prefix(RUN))
    return max(sizes.values(), default=1 << 40)
