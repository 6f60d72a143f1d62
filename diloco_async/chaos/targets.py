"""The methods of a chaos scenario as fault targets (:class:`~diloco_async.chaos.driver.FaultTarget`).

* :class:`DilocoTarget` (``sync-diloco``, ``decoupled``): a synchronizer and one learner
  process per slot. A failure SIGKILLs the slot's learner; after the drawn recovery delay its
  next incarnation starts and rejoins from the store (the synchronizer never waits for it). A
  learner that dies on its own is restarted at once.
* :class:`DdpTarget` (``ddp``): one rank per slot (:class:`~diloco_async.baselines.ddp_group.DdpGroup`).
  Any failure tears the whole group down; once every slot is back the group restarts from its
  last checkpoint (``torchrun`` semantics, DESIGN §8). The other slots are ``blocked`` meanwhile.

Stalls are SIGSTOP/SIGCONT of the slot's process group. Every process is forked from one fork
server (:data:`PRELOAD` imported once), so a restart costs a fork, not seconds of imports.
:meth:`ChaosTarget.run` drives a schedule and returns the timeline of every slot and the
snapshots of the global model.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from diloco_async.chaos.driver import SlotBook, drive, restarting_intervals
from diloco_async.chaos.measure import Snapshot
from diloco_async.chaos.scenario import FaultEvent, Scenario
from diloco_async.config.schema import Config
from diloco_async.metrics.evaluation import model_from_checkpoint
from diloco_async.metrics.run_timeline import fragment_shares, read_merges
from diloco_async.metrics.timeline import Interval, Step, Timeline, diloco_timeline_steps, read_records
from diloco_async.run import RunProcesses
from diloco_async.runtime.procs import ForkServerLauncher
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import list_checkpoint_seqs, load_checkpoint
from diloco_async.storage.store import ObjectStore

if TYPE_CHECKING:
    from diloco_async.baselines.ddp_group import RankPlacement

__all__ = ["PRELOAD", "TargetRun", "ChaosTarget", "DilocoTarget", "DdpTarget", "ddp_timeline_steps",
           "read_summary_ledgers"]

log = logging.getLogger("diloco.chaos")

#: What the fork server imports once, so that (re)starting a learner or a DDP rank costs a fork,
#: not seconds of imports on a shared CPU (every method gets the same launcher).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "diloco_async.learner", "diloco_async.server",
           "diloco_async.baselines.ddp"]


@dataclass
class TargetRun:
    """What one method's run under the schedule gave.

    Attributes:
        ledgers: learner id (``learner-i``) -> the synchronizer's ledger of it in its run summary
            (``tokens_merged``, ``tokens_processed``, ``contributions`` by outcome, ...); empty for
            DDP or when the synchronizer wrote no summary.
        skipped: slot -> why its learner never ran (e.g. its shaped link needs root); such a
            slot is not in the timeline.
    """

    timeline: Timeline
    snapshots: list[Snapshot]
    cfg: Config
    slots: SlotBook
    ledgers: dict[str, dict] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)


class ChaosTarget:
    """The common part of both targets: the config of the method under the scenario, the slot
    bookkeeping, and :meth:`run`. Subclasses implement the :class:`FaultTarget` hooks and
    ``_start``, ``_stop``, ``_close``, ``_collect``. ``cfg``: the method's resolved config
    (:func:`~diloco_async.chaos.scenario.method_config` of the scenario's recipe; WAN runs add their
    fields), which every process of the run reads."""

    def __init__(self, sc: Scenario, cfg: Config) -> None:
        self.sc = sc
        self.cfg = cfg
        self.slots = SlotBook(sc.scenario.slots)
        self.skipped: dict[int, str] = {}
        self.ledgers: dict[str, dict] = {}

    def run(self, events: Sequence[FaultEvent]) -> TargetRun:
        """Start the method, apply ``events`` for the scenario's wall time, stop it, and read
        back its timeline and snapshots. The processes are stopped whatever happens."""
        try:
            t_start = self._start()
            drive(events, t_start, self.sc.scenario.wall_s, self)
            t_end = time.time()
            for slot in list(self.slots.stalled_since):
                self.on_cont(slot)
            self.slots.close_all(t_end)
            self._stop(t_end)
        finally:
            self._close()
        tl, snaps = self._collect(t_start, t_end)
        return TargetRun(tl, snaps, self.cfg, self.slots, dict(self.ledgers), dict(self.skipped))

    def active_slots(self) -> list[int]:
        """The slots whose processes run (every slot but the :attr:`skipped` ones)."""
        return [i for i in range(self.slots.n) if i not in self.skipped]

    def on_cont(self, slot: int) -> None:
        raise NotImplementedError

    def _start(self) -> float:
        """Start the processes; returns the start time of the schedule (unix s)."""
        raise NotImplementedError

    def _stop(self, t_end: float) -> None:
        """Stop cleanly at the end of the wall time (final checkpoints)."""

    def _close(self) -> None:
        """Stop whatever still runs."""

    def _collect(self, t_start: float, t_end: float) -> tuple[Timeline, list[Snapshot]]:
        raise NotImplementedError


class DilocoTarget(ChaosTarget):
    """``sync-diloco`` or ``decoupled`` (module docstring).

    Args:
        on_metrics: receives the synchronizer's new metric points every 2 s and at the end.
        skip: slot -> why its learner does not run (never started, never restarted, left out of
            the timeline; a fault event of it is ignored). Only with K = 1: a synchronous round
            would wait for it forever.

    Raises:
        ValueError: a skipped slot with ``synchronizer.min_quorum`` above the slots that run.
    """

    def __init__(self, sc: Scenario, cfg: Config,
                 on_metrics: Callable[[list[dict]], None] = lambda points: None,
                 skip: dict[int, str] | None = None) -> None:
        super().__init__(sc, cfg)
        self.skipped = dict(skip or {})
        if self.skipped and cfg.synchronizer.min_quorum > sc.scenario.slots - len(self.skipped):
            raise ValueError(f"slots {sorted(self.skipped)} are skipped ({'; '.join(self.skipped.values())}) but "
                             f"synchronizer.min_quorum = {cfg.synchronizer.min_quorum} needs that many learners")
        self.procs = RunProcesses(self.cfg)
        self.procs.launcher = ForkServerLauncher(self.procs.workdir / "logs", PRELOAD)
        self.timeline_dir = self.procs.workdir / "timeline"
        self.on_metrics = on_metrics
        self.incarnation = {i: 0 for i in range(sc.scenario.slots)}
        self.killed: set[int] = set()
        self.last_pull = 0.0

    def _learner(self, slot: int):
        return self.procs.learners[f"learner-{slot}"]

    def _start(self) -> float:
        self.procs.start_synchronizer()
        t_start = time.time()
        for i in self.active_slots():
            self.slots.launched[i].append(time.time())
            self.procs.start_learner(i, 0)
        for i, why in self.skipped.items():
            log.warning("learner-%d skipped: %s", i, why)
        return t_start

    def on_fail(self, slot: int, duration_s: float) -> None:
        if slot in self.skipped:
            return
        self.slots.failures += 1
        now = time.time()
        if slot in self.slots.stalled_since:
            self._learner(slot).signal_group(signal.SIGCONT)
            self.slots.close("stalled", slot, now)
        self._learner(slot).kill()
        self.slots.ended[slot].append(now)
        self.killed.add(slot)
        self.slots.open_down(slot, now)

    def on_recover(self, slot: int) -> None:
        if slot in self.skipped:
            return
        self.slots.close("down", slot, time.time())
        self.incarnation[slot] += 1
        self.slots.restarts += 1
        self.slots.launched[slot].append(time.time())
        self.procs.start_learner(slot, self.incarnation[slot])
        self.killed.discard(slot)

    def on_stall(self, slot: int) -> None:
        if slot in self.killed or slot in self.skipped:
            return
        self._learner(slot).signal_group(signal.SIGSTOP)
        self.slots.stalled_since[slot] = time.time()

    def on_cont(self, slot: int) -> None:
        if slot in self.slots.stalled_since:
            self._learner(slot).signal_group(signal.SIGCONT)
            self.slots.close("stalled", slot, time.time())

    def tick(self, now: float) -> None:
        sync = self.procs.sync
        if sync is not None and sync.poll() is not None:
            raise RuntimeError(f"synchronizer exited early (code {sync.poll()}); log {sync.log_path}")
        for i in self.active_slots():
            h = self.procs.learners.get(f"learner-{i}")
            if i not in self.killed and h is not None and h.poll() is not None:
                log.warning("learner-%d exited with %s; restarting", i, h.poll())  # supervision: at once
                self.on_recover(i)
        if now - self.last_pull > 2.0:
            self.last_pull = now
            self.on_metrics(self.procs.pull_metrics())

    def _stop(self, t_end: float) -> None:
        self.procs.sync.signal_group(signal.SIGTERM)  # clean stop: open rounds, final checkpoint, summary
        self.procs.sync.wait(timeout=180)
        self.on_metrics(self.procs.pull_metrics())

    def _close(self) -> None:
        self.procs.stop_all()

    def _collect(self, t_start: float, t_end: float) -> tuple[Timeline, list[Snapshot]]:
        """Each running slot's steps (merged share from the merge log), restarts and blocked time;
        the synchronizer's checkpoints (tokens merged so far) as snapshots; its per-learner ledgers
        from the run summary (:attr:`ledgers`)."""
        procs, active = self.procs, self.active_slots()
        merges = read_merges(procs.store, procs.run_id, str(procs.epoch))
        merged_ids = {u for m in merges for u in m["update_ids"]}
        shares = fragment_shares(self.cfg)
        self.ledgers = read_summary_ledgers(procs.store, procs.run_id, str(procs.epoch))
        tl = Timeline(learners=[f"slot-{i}" for i in active], start_s=t_start, end_s=t_end,
                      intervals=list(self.slots.intervals), merges_s=[m["t"] for m in merges])
        for i in active:
            recs = read_records(self.timeline_dir / f"learner-{i}.jsonl")
            tl.steps += diloco_timeline_steps(f"slot-{i}", recs, merged_ids, shares)
            tl.intervals += restarting_intervals(f"slot-{i}", self.slots.launched[i], recs, self.slots.ended[i], t_end)
            tl.intervals += [Interval(f"slot-{i}", "blocked", r["t0"], r["t1"]) for r in recs if r["kind"] == "blocked"]
        snaps = []
        for seq in list_checkpoint_seqs(procs.store, procs.run_id):
            ck = load_checkpoint(procs.store, procs.run_id, seq)
            tokens = sum(float(led["tokens_merged"]) for led in ck.manifest["ledgers"].values())
            snaps.append(Snapshot(t_start + float(ck.manifest["wall_s"]), tokens,
                                  lambda ck=ck: model_from_checkpoint(self.cfg, ck)))
        return tl, snaps


def read_summary_ledgers(store: ObjectStore, run_id: str, epoch: str) -> dict[str, dict]:
    """Learner id -> its entry of the synchronizer's run summary (``summary.json`` of the epoch:
    the ledger's ``tokens_merged``, ``tokens_processed``, ``contributions`` by outcome, ...); {}
    when the synchronizer wrote no summary (it was killed) or the summary is unreadable (logged)."""
    try:
        doc = store.get_json(keys.summary_key(run_id, epoch))
    except FileNotFoundError:
        log.warning("run %s epoch %s: no summary.json; no per-learner ledgers", run_id, epoch)
        return {}
    except ValueError as err:
        log.warning("run %s epoch %s: summary.json unreadable (%s); no per-learner ledgers", run_id, epoch, err)
        return {}
    learners = doc.get("learners") if isinstance(doc, dict) else None
    return {str(k): dict(v) for k, v in learners.items()} if isinstance(learners, dict) else {}


def ddp_timeline_steps(learner: str, records: Sequence[dict], final_step: int) -> list[Step]:
    """Steps of one DDP rank over its incarnations (``incarnation`` field carried forward).

    A step of incarnation k survives (``useful`` 1) when it is at or before the step the next
    incarnation resumed from (its ``ready`` record's ``step``), or, for the last incarnation, at
    or before ``final_step`` (the newest checkpoint); otherwise it is thrown away (0). A step's
    ``wait_s`` (all-reduce waiting for peers) is kept.
    """
    by_inc: dict[int, list[dict]] = {}
    readies: dict[int, int] = {}
    inc = -1
    for r in records:
        inc = int(r.get("incarnation", inc))
        if r["kind"] == "ready":
            readies[inc] = int(r["step"])
        elif r["kind"] == "step":
            by_inc.setdefault(inc, []).append(r)
    steps = []
    for k in sorted(by_inc):
        later = [readies[x] for x in sorted(readies) if x > k]
        survived_to = later[0] if later else final_step
        steps += [Step(learner, float(r["t0"]), float(r["t1"]), int(r["tokens"]),
                       1.0 if int(r["step"]) <= survived_to else 0.0, float(r.get("wait_s", 0.0)))
                  for r in by_inc[k]]
    return steps


class DdpTarget(ChaosTarget):
    """``ddp`` (module docstring). ``max_steps`` and ``placement`` go to the
    :class:`~diloco_async.baselines.ddp_group.DdpGroup` (WAN runs: ``master_addr``, ``env``; the
    store options are the recipe's)."""

    def __init__(self, sc: Scenario, cfg: Config, *, max_steps: int | None = None,
                 placement: RankPlacement | None = None) -> None:
        from diloco_async.baselines.ddp_group import DdpGroup, RankPlacement, RankSchedule
        from diloco_async.storage.store import ObjectStore
        from diloco_async.sync import new_run_id

        super().__init__(sc, cfg)
        self.run_id = new_run_id()
        self.workdir = Path(self.cfg.run.workdir).resolve() / self.run_id
        self.store = ObjectStore(self.cfg.run.store, self.cfg.run.storage_options)
        self.group = DdpGroup(cfg=self.cfg, world_size=sc.scenario.slots,
                              run_id=self.run_id, store=self.store.url, workdir=self.workdir,
                              schedule=RankSchedule(speeds=sc.speed_factors(), jitter=sc.stragglers.jitter,
                                                    checkpoint_every_steps=sc.ddp.checkpoint_every_steps,
                                                    max_steps=max_steps),
                              placement=replace(placement or RankPlacement(),
                                                storage_options=self.cfg.run.storage_options))
        self.group.launcher = ForkServerLauncher(self.workdir / "logs", PRELOAD)
        self.running = False
        self.incarnation = 0
        self.blocked_since: dict[int, float] = {}  # slot -> waiting for the group to come back

    def _launch(self, now: float) -> None:
        for i in range(self.slots.n):
            if i in self.blocked_since:
                t0 = self.blocked_since.pop(i)
                if now > t0:
                    self.slots.intervals.append(Interval(f"slot-{i}", "blocked", t0, now))
            self.slots.launched[i].append(now)
        self.group.start(self.incarnation)
        self.running = True

    def _tear_down(self, now: float, except_slot: int | None) -> None:
        self.group.kill_all()
        self.running = False
        self.incarnation += 1
        for i in range(self.slots.n):
            self.slots.ended[i].append(now)
            if i in self.slots.stalled_since:
                self.slots.close("stalled", i, now)
            if i != except_slot and i not in self.slots.down_since:
                self.blocked_since.setdefault(i, now)

    def _start(self) -> float:
        t_start = time.time()
        self._launch(t_start)
        return t_start

    def on_fail(self, slot: int, duration_s: float) -> None:
        now = time.time()
        self.slots.failures += 1
        self.blocked_since.pop(slot, None)
        if slot in self.slots.stalled_since:
            self.group.cont_rank(slot)
        self.slots.open_down(slot, now)
        if self.running:
            self._tear_down(now, slot)

    def on_recover(self, slot: int) -> None:
        now = time.time()
        self.slots.close("down", slot, now)
        if self.slots.down_since:
            self.blocked_since.setdefault(slot, now)  # up again, waiting for the slots still down
        elif not self.running:
            self.slots.restarts += 1
            self._launch(now)  # every slot is back: the whole group restarts from its checkpoint

    def on_stall(self, slot: int) -> None:
        if self.running and slot not in self.slots.down_since:
            self.group.stop_rank(slot)
            self.slots.stalled_since[slot] = time.time()

    def on_cont(self, slot: int) -> None:
        if slot in self.slots.stalled_since:
            self.group.cont_rank(slot)
            self.slots.close("stalled", slot, time.time())

    def tick(self, now: float) -> None:
        if self.running:
            codes = self.group.poll()
            if any(c is not None for c in codes.values()):
                # a rank died on its own (e.g. a gloo timeout): torchrun restarts the group
                log.warning("DDP rank exited %s; restarting the group", codes)
                for slot in list(self.slots.stalled_since):
                    self.group.cont_rank(slot)
                self._tear_down(now, None)
        if not self.running and not self.slots.down_since:
            self.slots.restarts += 1
            self._launch(now)

    def _stop(self, t_end: float) -> None:
        for i, t0 in list(self.blocked_since.items()):
            if t_end > t0:
                self.slots.intervals.append(Interval(f"slot-{i}", "blocked", t0, t_end))
        if self.running:
            self.group.terminate_all(grace_s=120.0)  # ranks agree on a last step and checkpoint it

    def _close(self) -> None:
        self.group.kill_all()

    def _collect(self, t_start: float, t_end: float) -> tuple[Timeline, list[Snapshot]]:
        """A step survives if the next incarnation resumed from a checkpoint at or after it; the
        global model "advances" when a step survives (merges: the surviving steps of rank 0);
        the rank-0 checkpoints are the snapshots."""
        from diloco_async.baselines.ddp_checkpoints import ddp_checkpoints, load_ddp_model

        ckpts = ddp_checkpoints(self.store, self.run_id)
        final_step = max((c.step for c in ckpts), default=0)
        steps: list[Step] = []
        for i in range(self.slots.n):
            recs = read_records(self.workdir / "timeline" / f"ddp-rank-{i}.jsonl")
            steps += ddp_timeline_steps(f"slot-{i}", recs, final_step)
            self.slots.intervals += restarting_intervals(f"slot-{i}", self.slots.launched[i], recs,
                                                         self.slots.ended[i], t_end)
        merges = sorted(st.t1 for st in steps if st.learner == "slot-0" and st.useful > 0)
        tl = Timeline(learners=[f"slot-{i}" for i in range(self.slots.n)], start_s=t_start, end_s=t_end,
                      intervals=list(self.slots.intervals), steps=steps, merges_s=merges)
        snaps = [Snapshot(c.wall_unix, float(c.tokens_committed), lambda c=c: load_ddp_model(self.cfg, self.store, c))
                 for c in ckpts]
        return tl, snaps
