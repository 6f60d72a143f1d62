"""The kill matrix (issue 14): SIGKILL real learners at random moments, some while their upload
is in flight, then SIGKILL the synchronizer at random moments and resume it from its newest
checkpoint, again and again; then check what the store holds.

A run of real processes (:class:`~diloco_async.run.RunProcesses` with the chaos harness's fork
server, a tiny model on the Shakespeare corpus, a ``file://`` store that is never collected).
The learners' store is slowed by the fault layer (``faults.storage_faults``: every ``put``
takes ``upload_hold_s`` longer), so each upload is in flight for a window that the learner's log
line ``uploading fragment p round n ... to KEY`` opens: a kill inside that window is a
mid-upload kill, confirmed when the key never appears in the store.

Checks (:meth:`KillMatrixResult.bars`): every resume finishes (the synchronizer listens again),
merges resume within ``merge_within_s`` of each restart, every merged contribution's object in
the store is complete (decodes to every tensor of its fragment, with the right shapes), and no
published version holds a non-finite value.
"""

from __future__ import annotations

import logging
import random
import re
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diloco_async.chaos.scripted import published_extremes
from diloco_async.chaos.targets import PRELOAD
from diloco_async.codec import wire
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.protocol.client import fetch_status
from diloco_async.run import RunProcesses
from diloco_async.runtime.procs import ForkServerLauncher
from diloco_async.storage import keys

__all__ = ["KillMatrix", "KillMatrixResult", "kill_config", "merged_contributions"]

log = logging.getLogger("diloco.chaos.kills")

_UPLOADING = re.compile(r"(learner-\d+) uploading fragment (\d+) round (\d+) \(base v\d+[^)]*\) to (\S+)")
_MERGED = re.compile(r"fragment (\d+) round (\d+) merged \d+ \(([^)]*)\) -> version (\d+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_config(workdir: Path, learners: int, upload_hold_s: float, port: int,
                checkpoint_every_s: float = 10.0) -> Config:
    """A tiny real run: ``learners`` learners, 3 fragments, H = 8, K = 1, a checkpoint every
    ``checkpoint_every_s`` (so a kill often comes after versions the checkpoint lacks), nothing
    collected, slow uploads, restarts without limit."""
    return with_fields(Config(), {
        "run.store": f"file://{workdir}/store", "run.workdir": f"{workdir}/runs",
        "data.cache_dir": str(Path("data").resolve()), "model.n_layer": 1, "model.d_model": 32, "model.n_head": 2,
        "model.context": 32, "learners.count": learners, "learners.batch_size": 8, "learners.checkpoint_every_s": 0.0,
        "learners.restart_delay_s": 0.5, "learners.max_restarts": 100000,
        "faults.storage_faults": {"p_slow": 1.0, "slow_s": upload_hold_s, "ops": ["put"]},
        "synchronizer.port": port, "synchronizer.num_fragments": 3, "synchronizer.sync_every": 8,
        "synchronizer.min_quorum": 1, "synchronizer.heartbeat_timeout_s": 3.0,
        "synchronizer.checkpoint_every_s": checkpoint_every_s,
        "synchronizer.keep_checkpoints": 0, "synchronizer.drain_s": 0.0,
        "budget.wall_s": 36000.0, "budget.tokens": None})


@dataclass
class KillMatrixResult:
    """Counts and times measured by one :meth:`KillMatrix.run`."""

    learner_kills: int = 0
    mid_upload_kills: int = 0
    mid_upload_confirmed: int = 0  # the key never appeared in the store
    learner_restarts: int = 0
    sync_kills: int = 0
    resumes_finished: int = 0
    resume_ready_s: list[float] = field(default_factory=list)
    resume_retries: int = 0  # starts of a resumed synchronizer that failed and were tried again
    restart_to_merge_s: list[float | None] = field(default_factory=list)
    merges: int = 0
    merged_checked: int = 0
    merged_incomplete: list[str] = field(default_factory=list)
    published_read: int = 0
    published_non_finite: int = 0
    elapsed_s: float = 0.0
    log_dir: str = ""

    def bars(self, learner_kills: int, sync_kills: int,
             merge_within_s: float = 30.0) -> list[tuple[str, float, str, bool]]:
        """``(figure, value, goal, ok)`` rows."""
        times = [t for t in self.restart_to_merge_s if t is not None]
        late = len(self.restart_to_merge_s) - sum(t <= merge_within_s for t in times)
        return [
            ("learner SIGKILLs", self.learner_kills, f">= {learner_kills}", self.learner_kills >= learner_kills),
            ("  of them mid-upload (key never published)", self.mid_upload_confirmed, ">= 1",
             self.mid_upload_confirmed >= 1 or learner_kills == 0),
            ("synchronizer SIGKILL + resume cycles", self.sync_kills, f">= {sync_kills}",
             self.sync_kills >= sync_kills),
            ("resumes that finished (listening again)", self.resumes_finished, f"== {self.sync_kills}",
             self.resumes_finished == self.sync_kills),
            (f"restarts without a merge within {merge_within_s:g} s", late, "== 0", late == 0),
            ("slowest restart -> first merge (s)", max(times, default=-1.0), f"<= {merge_within_s:g}",
             bool(times) and max(times) <= merge_within_s or sync_kills == 0),
            ("merged contributions whose object is incomplete", len(self.merged_incomplete), "== 0",
             not self.merged_incomplete and self.merged_checked > 0),
            ("published versions with a non-finite value", self.published_non_finite, "== 0",
             self.published_non_finite == 0 and self.published_read > 0),
        ]


def merged_contributions(log_text: str) -> set[tuple[int, int, str]]:
    """``(fragment, round, learner)`` of every merged contribution named in a synchronizer log."""
    out = set()
    for m in _MERGED.finditer(log_text):
        for lid in filter(None, m.group(3).split(",")):
            out.add((int(m.group(1)), int(m.group(2)), lid))
    return out


def _complete(data: bytes, codec: str, shapes: dict[str, tuple[int, ...]], key: str) -> bool:
    """Does ``data`` decode to every tensor of ``shapes``, each of its shape and finite?"""
    try:
        tensors, _ = wire.decode_from_bytes(data, codec, shapes)
    except Exception as err:  # any failure to decode is an incomplete object
        log.warning("merged object %s does not decode: %s", key, err)
        return False
    return set(tensors) == set(shapes) and all(
        tuple(t.shape) == shapes[name] and bool(torch.isfinite(t).all()) for name, t in tensors.items())


class KillMatrix:
    """One run of real processes and the kills applied to it (module docstring).

    Args:
        workdir: store and logs. seed: seeds the moments and the victims.
        learners: learner processes. upload_hold_s: how long every upload is held in flight.
        checkpoint_every_s: the synchronizer's checkpoint period; each synchronizer kill comes
            0.5 s to 1.2 periods after the previous restart.
        fields: config fields set over :func:`kill_config`'s (``with_fields`` typed values), e.g. a
            token budget and leased slices for :meth:`run_to_budget`.
        fork_server: start the processes as forks of a server that imported their modules once
            (a restart costs a fork; the server lives as long as this process), else as subprocesses.
    """

    def __init__(self, workdir: str | Path, seed: int = 14, learners: int = 3, upload_hold_s: float = 1.5,
                 checkpoint_every_s: float = 10.0, fields: dict | None = None, fork_server: bool = True) -> None:
        self.workdir = Path(workdir).resolve()
        self.rng = random.Random(seed)
        self.upload_hold_s = upload_hold_s
        self.checkpoint_every_s = checkpoint_every_s
        self.resume_limit_s = 120.0  # a resume that does not listen within this is a failed resume
        cfg = kill_config(self.workdir, learners, upload_hold_s, _free_port(), checkpoint_every_s)
        self.run_procs = RunProcesses(with_fields(cfg, fields) if fields else cfg)
        if fork_server:  # else subprocesses (RunProcesses' default): nothing outlives the run in this process
            self.run_procs.launcher = ForkServerLauncher(self.run_procs.workdir / "logs", PRELOAD)
        self.run_procs.env["PYTHONUNBUFFERED"] = "1"  # each upload's log line is read as it is written
        self.learners = learners
        self.result = KillMatrixResult(log_dir=str(self.run_procs.workdir / "logs"))
        self._offsets: dict[str, int] = {}

    # -- observing -----------------------------------------------------------------------------

    def _versions(self) -> int | None:
        """Sum of the fragments' versions, or None when the synchronizer does not answer."""
        try:
            return sum(int(v) for v in fetch_status(str(self.run_procs.sync_url), timeout_s=3.0)["versions"].values())
        except (OSError, ValueError, KeyError):
            return None

    def _new_uploads(self) -> list[tuple[str, str]]:
        """(learner id, key) of uploads logged since the last call."""
        found = []
        for lid, handle in self.run_procs.learners.items():
            path = Path(handle.log_path)
            if not path.exists():
                continue
            with open(path, "rb") as fh:
                fh.seek(self._offsets.get(lid, 0))
                text = fh.read().decode(errors="replace")
                self._offsets[lid] = fh.tell()
            found += [(m.group(1), m.group(4)) for m in _UPLOADING.finditer(text)]
        return found

    def _tick(self, seconds: float) -> None:
        """Supervise the learners (restart the dead ones) for ``seconds``."""
        end = time.monotonic() + seconds
        while True:
            self.result.learner_restarts += len(self.run_procs.supervise())
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.05, left))

    def _wait_merge(self, since: int, timeout_s: float) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            v = self._versions()
            if v is not None and v > since:
                return time.monotonic() - t0
            self._tick(0.2)
        return None

    # -- killing -------------------------------------------------------------------------------

    def _kill_learner(self, lid: str) -> bool:
        handle = self.run_procs.learners.get(lid)
        if handle is None or handle.poll() is not None:
            return False
        handle.kill()
        self.result.learner_kills += 1
        return True

    def _kill_learners(self, kills: int, mid_upload_share: float = 0.4) -> None:
        """``kills`` SIGKILLs: a share of them inside an upload window, the rest at random moments."""
        mid_target = round(kills * mid_upload_share)
        next_random = time.monotonic() + self.rng.uniform(0.5, 4.0)
        pending: list[tuple[str, str]] = []
        while self.result.learner_kills < kills and self.run_procs.sync.poll() is None:  # (a budget may end it)
            self._tick(0.05)
            uploads = self._new_uploads()
            if self.result.mid_upload_kills < mid_target and uploads:
                lid, key = uploads[-1]
                time.sleep(self.rng.uniform(0.0, 0.6 * self.upload_hold_s))
                if self._kill_learner(lid):
                    self.result.mid_upload_kills += 1
                    pending.append((lid, key))
                    log.info("killed %s mid-upload of %s", lid, key)
            elif time.monotonic() >= next_random and self.result.learner_kills - self.result.mid_upload_kills < \
                    kills - mid_target:
                self._kill_learner(f"learner-{self.rng.randrange(self.learners)}")
                next_random = time.monotonic() + self.rng.uniform(0.5, 4.0)
        self._tick(2 * self.upload_hold_s)
        store = self.run_procs.store
        self.result.mid_upload_confirmed = sum(not store.exists(key) for _, key in pending)

    def _kill_and_resume_sync(self) -> None:
        """One cycle: SIGKILL the synchronizer at a random moment, resume it from its newest checkpoint,
        time until it listens and until the next merge."""
        self._tick(self.rng.uniform(0.5, 1.2 * self.checkpoint_every_s))
        before = self._versions()
        self.run_procs.sync.kill()
        self.run_procs.sync.wait(timeout=30)
        self.result.sync_kills += 1
        self.run_procs.resume_url = f"{self.run_procs.store.url}/{self.run_procs.run_id}"
        t0 = time.monotonic()
        if not self._resume(t0 + self.resume_limit_s):
            self.result.restart_to_merge_s.append(None)
            return
        self.result.resumes_finished += 1
        self.result.resume_ready_s.append(time.monotonic() - t0)
        since = self._versions() if before is None else max(before, self._versions() or 0)
        waited = self._wait_merge(since or 0, 30.0)
        self.result.restart_to_merge_s.append(None if waited is None else time.monotonic() - t0)
        log.info("resume %d: ready after %.1f s, merge %s", self.result.sync_kills, self.result.resume_ready_s[-1],
                 "none within 30 s" if waited is None else f"{time.monotonic() - t0:.1f} s after the restart")

    def _resume(self, deadline: float) -> bool:
        """Start the resumed synchronizer, again after a failed start (e.g. the dead one's lease
        not yet expired) until ``deadline``, as a supervising flow would; True once it listens."""
        while True:
            try:
                self.run_procs.start_synchronizer()
                return True
            except (RuntimeError, TimeoutError) as err:
                self.result.resume_retries += 1
                log.warning("resume %d: start failed (%s)", self.result.sync_kills, err)
                if time.monotonic() >= deadline:
                    log.error("resume %d failed for good", self.result.sync_kills)
                    return False
                self._tick(1.0)

    # -- the run -------------------------------------------------------------------------------

    def _start(self) -> None:
        """Start the synchronizer and every learner; wait for the first merge (RuntimeError after 180 s)."""
        self.run_procs.start_synchronizer()
        for i in range(self.learners):
            self.run_procs.start_learner(i)
        if self._wait_merge(0, 180.0) is None:
            raise RuntimeError(f"no merge within 180 s of the start; logs in {self.result.log_dir}")

    def run(self, learner_kills: int, sync_kills: int) -> KillMatrixResult:
        """Start the run, apply the kills, stop it and check the store.

        Raises:
            RuntimeError: the first merge did not come within 180 s.
        """
        t0 = time.monotonic()
        procs = self.run_procs
        try:
            self._start()
            self._kill_learners(learner_kills)
            for _ in range(sync_kills):
                self._kill_and_resume_sync()
            self.result.merges = self._versions() or 0
            if procs.sync.poll() is None:
                procs.sync.signal_group(signal.SIGTERM)
                procs.sync.wait(timeout=60)
        finally:
            procs.stop_all()
        self._check_store()
        self.result.elapsed_s = time.monotonic() - t0
        return self.result

    def run_to_budget(self, learner_kills: int, timeout_s: float = 900.0,
                      mid_upload_share: float = 0.4) -> KillMatrixResult:
        """Start the run, apply ``learner_kills`` learner SIGKILLs (a ``mid_upload_share`` of them in
        an upload window), then restart the dead learners until the run stops on its own (its
        budget, set through ``fields``); no synchronizer kill, nothing checked in the store.

        Raises:
            RuntimeError: no merge within 180 s of the start. TimeoutError: the run still going
            after ``timeout_s``.
        """
        t0 = time.monotonic()
        procs = self.run_procs
        try:
            self._start()
            self._kill_learners(learner_kills, mid_upload_share)
            while procs.sync.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"the run did not stop within {timeout_s:g} s; logs in {self.result.log_dir}")
                self._tick(0.2)
            procs.finished_cleanly = procs.sync.poll() == 0
        finally:
            procs.stop_all()
        self.result.elapsed_s = time.monotonic() - t0
        return self.result

    def _check_store(self) -> None:
        """Every merged contribution's objects decode completely; every published version is finite."""
        store, run_id = self.run_procs.store, self.run_procs.run_id
        plan = FragmentPlan.from_json(store.get_json(keys.plan_key(run_id))["plan"])
        codec = self.run_procs.cfg.learners.codec
        text = (Path(self.result.log_dir) / "synchronizer.log").read_text(errors="replace")
        for p, n, lid in sorted(merged_contributions(text)):
            shapes = {s.name: s.shape for s in plan.fragments[p]}
            for r in (n - 1, n) if n > 1 else (n,):  # a late contribution joins the next round (DESIGN §3.5)
                folder = keys.contribution_round_prefix(run_id, p, r)
                for key in [k for k in store.list(folder) if k.startswith(f"{folder}/{lid}-")]:
                    self.result.merged_checked += 1
                    if not _complete(store.get_unverified(key), codec, shapes, key):
                        self.result.merged_incomplete.append(key)
        self.result.published_read, self.result.published_non_finite, _ = published_extremes(store, run_id, plan)
