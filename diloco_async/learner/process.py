"""One learner: the comms thread, set-up from the synchronizer's answer, then the training loop (DESIGN §3).

Two threads:

* the **training thread** (the caller of :meth:`Learner.run`) builds the workload, loads its
  starting point (its own saved inner state, else the versions named at join) and runs the
  :class:`~diloco_async.learner.training.InnerLoop`;
* the **comms thread** (:class:`~diloco_async.learner.comms.Comms`) talks to the synchronizer
  and the store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from diloco_async.config.schema import Config, config_hash
from diloco_async.inner.base_file import BaseFile, HeldBase, keep_base
from diloco_async.inner.state import InnerState, parse_meta
from diloco_async.inner.workload import Workload
from diloco_async.learner.comms import Comms
from diloco_async.learner.faults import LearnerFaults
from diloco_async.learner.feedback import ErrorFeedback
from diloco_async.learner.fsdp_state import latest_sharded_state
from diloco_async.learner.group import LearnerGroup, place_workload
from diloco_async.learner.replay import ReplayBoundaries
from diloco_async.learner.rules import adopt
from diloco_async.learner.slices import SliceFeed
from diloco_async.learner.state import LearnerSlot, Shared, SyncEndpoint
from diloco_async.learner.training import InnerLoop, StartPoint
from diloco_async.metrics.timeline import Recorder
from diloco_async.models import plan_of
from diloco_async.policy.fragments import FragmentPlan, plan_differences
from diloco_async.protocol.client import ProtocolError
from diloco_async.protocol.messages import JoinResponse, VersionInfo
from diloco_async.runtime.devices import set_cpu_math
from diloco_async.runtime.process_clock import process_uptime_s
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_state, list_state_seqs
from diloco_async.storage.store import ObjectStore

__all__ = ["Learner"]

log = logging.getLogger("diloco.learner")


class Learner:
    """One learner.

    Args:
        slot: the learner slot's id (``[A-Za-z0-9_.-]``), data shard index in ``[0, learners.count)``
            and incarnation (restart count, 0 for the first start).
        endpoint: the synchronizer's base URL, this learner's own token, how long to wait for an
            answer before exiting, and the one-way latency added to each exchange with it
            (:class:`~diloco_async.protocol.client.SyncClient`; the store's is the caller's, e.g. a
            :class:`~diloco_async.storage.latency.LatencyStore`).
        store: the run's object store (same root as the synchronizer's).
        recorder: where timeline records go (none written by default).
        make_workload: builds what this learner trains from (run config, index, incarnation);
            the place where another model plugs in. It is then put on its device and precision.
        group: rank 0's side of the learner's torchrun group (None: a one-process learner); the
            config, the starting point and every step boundary go to the other ranks.

    The run's ``[faults]`` (chaos and guard tests) are applied here, once the config is known, by
    wrapping the store, the client transport and the workload (:class:`~diloco_async.learner.faults.LearnerFaults`).
    """

    def __init__(self, slot: LearnerSlot, endpoint: SyncEndpoint, store: ObjectStore,
                 recorder: Recorder | None = None,
                 make_workload: Callable[[Config, int, int], Workload] = Workload.from_config,
                 group: LearnerGroup | None = None) -> None:
        self.slot = slot
        self.learner_id = slot.learner_id
        self.group = group
        self.make_workload = make_workload
        self.index = slot.index
        self.incarnation = slot.incarnation
        self.faults: LearnerFaults | None = None  # known with the run's config
        self.store = store
        self.recorder = recorder or Recorder(None)
        self.shared = Shared()
        self._restored_step = 0  # steps up to here are in the restored inner state (timeline attribution)
        self.stop_event = self.shared.stop_event
        self.comms = Comms(slot, endpoint, store, self.shared, started_s=time.monotonic() - process_uptime_s())

    def run(self, max_wait_join_s: float = 120.0) -> int:
        """Join, load the newest versions, train until told to stop. Returns the exit code
        (0, or 3 when the synchronizer could not be joined or the comms failed; 2 when the shard URLs
        disagree with the shards' join answers).

        Raises:
            ProtocolError: the synchronizer's config or fragment plan does not match this learner's.
        """
        sh = self.shared
        self.comms.start()
        deadline = time.monotonic() + max_wait_join_s
        while not sh.joined.wait(0.1):
            if sh.stop_event.is_set() or time.monotonic() >= deadline:  # the comms gave up, or too long
                log.error("%s could not join (%s)", self.learner_id, sh.fatal or f"no answer in {max_wait_join_s:.0f}s")
                sh.stop_event.set()
                if self.group is not None:
                    self.group.share_config(None)
                return sh.fatal_code if sh.fatal else 3
        jr = sh.join_response
        assert jr is not None
        cfg = self._configure(jr)
        if self.group is not None:
            self.group.share_config(jr.config)
        subnormals_flushed = set_cpu_math(cfg.learners.threads, cfg.learners.flush_denormal)
        assert self.faults is not None
        workload = self.make_workload(cfg, self.index, self.incarnation)
        if cfg.run.schedule != "replay":  # a replay draws its speeds on the virtual clock: no real slowdown
            workload = self.faults.wrap_workload(workload)
        device = place_workload(workload, cfg, self.index, self.group.local_rank if self.group else 0)
        self.comms.base_in_ram = device.type != "cpu"  # host RAM holds no other copy of the model then
        self.comms.pin_device = device if device.type == "cuda" else None  # asynchronous copies to the GPU
        plan = self._check_plan(cfg, jr, workload)
        sh.slices = SliceFeed(plan.num_fragments) if cfg.data.slices else None  # leased slices (DESIGN §5.2)
        if self.group is not None and cfg.learners.parallelism == "fsdp":
            loop = self._start_sharded(cfg, jr, workload, plan)
        else:
            loop = self._start_point(cfg, jr, workload, plan)
            if self.group is not None:
                self.group.share_start(workload, loop.step)
                self.group.wrap(workload)
        sh.ready.set()
        shard_tokens = workload.load_data(cfg, self.index)
        log.info("%s ready: %s of %d tokens, %d parameters on %s (%s, %d rank(s)), CPU subnormals %s, "
                 "base copies %s, versions %s", self.learner_id, "leased slices" if cfg.data.slices else
                 f"shard {self.index}/{cfg.learners.count}", shard_tokens,
                 sum(p.numel() for p in workload.params.values()), device, cfg.learners.precision, workload.world,
                 "flushed" if subnormals_flushed else "kept", "in RAM" if self.comms.base_in_ram else "in local files",
                 sh.base)
        self.recorder.record("ready", step=loop.step, restored=self._restored_step)
        loop.run()
        sh.stop_event.set()
        self.comms.join(10)
        if sh.fatal:
            log.error("%s stopped: %s", self.learner_id, sh.fatal)
            return 3
        log.info("%s finished after %d steps, %d tokens", self.learner_id, sh.stats.step, sh.stats.tokens_total)
        return 0

    def _configure(self, jr: JoinResponse) -> Config:
        """The run's config from the join answer; the comms configured, the run's faults wrapped
        around the store and the client transport.

        Raises:
            ProtocolError: the config does not hash to the synchronizer's hash.
        """
        cfg = Config.model_validate(jr.config)
        if config_hash(cfg) != jr.config_hash:
            raise ProtocolError("config hash from the synchronizer does not match its config")
        self.faults = LearnerFaults(cfg.faults, cfg.run.seed, self.slot)
        self.store = self.faults.wrap_store(self.store)
        self.comms.configure(cfg, self.store)
        self.faults.wrap_transport(self.comms)
        return cfg

    def _check_plan(self, cfg: Config, jr: JoinResponse, workload: Workload) -> FragmentPlan:
        """This learner's fragment plan of the workload's parameters.

        Raises:
            ProtocolError: it differs from the synchronizer's (another model, base or fragment
                count); the message names the first differing tensors and model fields.
        """
        plan = plan_of(workload.model, cfg.synchronizer.num_fragments, cfg.synchronizer.fragmentation)
        if plan.schema_hash != jr.schema_hash:
            why = "; ".join(plan_differences(plan, FragmentPlan.from_json(jr.plan))) or "schema hashes differ"
            raise ProtocolError(f"{self.learner_id} refused at join: its model does not match the run's fragment "
                                f"plan (mine {plan.schema_hash[:12]}, synchronizer's {jr.schema_hash[:12]}): {why}")
        self.comms.shapes = {p: {s.name: s.shape for s in plan.fragments[p]} for p in range(plan.num_fragments)}
        return plan

    def _start_point(self, cfg: Config, jr: JoinResponse, workload: Workload, plan: FragmentPlan) -> InnerLoop:
        """The training loop, started from this slot's newest saved inner state, else from the
        versions named at join."""
        lc = cfg.learners
        uploads = self.comms.uploads
        uploads.state_prefix = keys.learner_prefix(jr.run_id, self.learner_id)
        saved = latest_state(self.store, uploads.state_prefix) if lc.checkpoint_every_s > 0 else None
        if lc.error_feedback:
            self._restore_residuals(saved.tensors if saved is not None else None,
                                    saved.seq if saved is not None else None)
        uploads.state_seq = max(list_state_seqs(self.store, uploads.state_prefix), default=0)
        counters: dict[int, tuple[int, int, float]] = {}
        start_step = jr.start_step
        if saved is not None:
            # The base copies come from the saved state, never from the weights present now (C03).
            local_step, base_tensors, versions, counters = workload.restore(
                InnerState(saved.tensors, saved.manifest["inner"]))
            saved.tensors.clear()  # the restored base copies go to local files, out of RAM (on CPU)
            base_tensors = {p: keep_base(t, self.learner_id, in_ram=self.comms.base_in_ram,
                                         pin_device=self.comms.pin_device) for p, t in base_tensors.items()}
            self.shared.base.update(versions)
            start_step = max(start_step, local_step)
            self._restored_step = local_step
            log.info("%s restored its inner state from checkpoint %d (step %d, bases %s)", self.learner_id,
                     saved.seq, local_step, versions)
            self._rebase_to_join(jr.versions, workload, base_tensors, counters)
        else:
            base_tensors = self._load_versions(jr.versions, workload)
        start = StartPoint(base_tensors, counters, start_step, restored=saved is not None)
        loop = InnerLoop(cfg, self.shared, workload, plan, self.recorder, learner_id=self.learner_id, start=start,
                         group=self.group)
        if cfg.run.schedule == "replay":  # step boundaries in virtual-time order (DESIGN §3.2)
            loop.replay = ReplayBoundaries(self.comms, cfg.replay.stall_timeout_s + self.comms.give_up_after_s)
        return loop

    def _restore_residuals(self, saved: dict[str, torch.Tensor] | None, seq: int | None) -> None:
        """The error-feedback residuals (``learners.error_feedback``) from the saved inner state's
        tensors (taken out of them); a restart (or resume) that has none starts from zero, logged."""
        self.shared.feedback = feedback = ErrorFeedback(self.learner_id)
        n = feedback.restore(saved) if saved is not None else 0
        if n:
            log.info("%s restored its error-feedback residuals of %d fragment(s) from checkpoint %d", self.learner_id,
                     n, seq)
        elif saved is not None or self.incarnation > 0:
            log.warning("%s (incarnation %d) has no error-feedback residual to restore (%s): the residuals start "
                        "at zero, what earlier uploads' codec dropped is lost", self.learner_id, self.incarnation,
                        f"checkpoint {seq} holds none" if saved is not None else "no saved inner state")

    def _start_sharded(self, cfg: Config, jr: JoinResponse, workload: Workload, plan: FragmentPlan) -> InnerLoop:
        """A sharded group's start (``parallelism = "fsdp"``, DESIGN §3.1): rank 0's step on every
        rank, the model sharded, the group's newest saved inner state restored (DCP,
        :mod:`~diloco_async.learner.fsdp_state`) when inner states are saved, and every rank's rows
        of the versions named at join (or newer ones told since) read and adopted (rebased onto
        them where the saved state's base is older). The comms thread then only tells of new
        versions: the ranks read their rows at the step boundary where rank 0 adopts them.

        Raises:
            ValueError: the saved state was written by a group of another size.
        """
        group = self.group
        assert group is not None
        group.share_start(workload, jr.start_step)
        group.shard(workload, cfg, self.store, self.learner_id, plan)
        self.comms.defer_reads = True
        self.comms.base_in_ram = True  # each rank's rows of Θ^base (ShardedOuter.base)
        versions = []
        for v in jr.versions:
            newer = self.shared.newest_versions.get(v.fragment)
            versions.append(newer if newer is not None and newer.version > v.version else v)
        prefix = keys.learner_prefix(jr.run_id, self.learner_id)
        saved = latest_sharded_state(self.store, prefix) if cfg.learners.checkpoint_every_s > 0 else None
        group.state_seq = max(list_state_seqs(self.store, prefix), default=0)
        saved = group.start_sharded(jr.run_id, versions, saved, workload)
        assert group.outer is not None
        self.shared.base.update({v.fragment: v.version for v in versions})
        step, counters = jr.start_step, {}
        if saved is not None:
            local_step, saved_versions, counters = parse_meta(saved["inner"])
            step = max(step, local_step)
            self._restored_step = local_step
            log.info("%s restored its sharded inner state from checkpoint %d (step %d, bases %s)", self.learner_id,
                     saved["seq"], local_step, saved_versions)
        start = StartPoint(group.outer.base, counters, step, restored=saved is not None)
        return InnerLoop(cfg, self.shared, workload, plan, self.recorder, learner_id=self.learner_id, start=start,
                         group=group)

    def _rebase_to_join(self, versions: list[VersionInfo], workload: Workload,
                        base_tensors: dict[int, BaseFile | HeldBase],
                        counters: dict[int, tuple[int, int, float]]) -> None:
        """Move restored progress onto the versions named at join (issue 14 item 7), in place.

        A fragment whose saved base differs from the version named at join is *rebased*: θ ←
        θ + (Θ^join − Θ^saved base) (:func:`~diloco_async.learner.rules.adopt` ``rebase``), so
        the outer gradient later sent is the same progress, measured from Θ^join, and its
        counters are kept. Without the saved base's tensors the progress is *discarded*: θ ←
        Θ^join and the counters restart. Either way the learner never reports or trains on a base
        older than the one named at join; each case is logged.
        """
        params = workload.params
        for v in versions:
            p, saved = v.fragment, self.shared.base.get(v.fragment)
            if saved == v.version:
                continue
            new, v = self._fetch_initial(v)
            old = base_tensors.get(p)
            keep = old is not None and all(n in old and old.shape_of(n) == new.shape_of(n) for n in new)
            moved = adopt("rebase" if keep else "overwrite", params, new, base=old)  # on θ's device
            with torch.no_grad():
                for n, val in moved.items():
                    params[n].copy_(val)
            if not keep:
                counters[p] = (0, 0, 0.0)
            base_tensors[p] = new
            self.shared.base[p] = v.version
            log.warning("%s: fragment %d saved on base v%s, join names v%d: %s", self.learner_id, p, saved,
                        v.version, f"rebased its {counters.get(p, (0,))[0]} saved steps onto v{v.version}" if keep
                        else "saved progress discarded (no saved base to rebase from)")

    def _load_versions(self, versions: list[VersionInfo], workload: Workload) -> dict[int, BaseFile | HeldBase]:
        """Copy the versions named at join into the model; returns them as the base tensors."""
        base_tensors = {}
        with torch.no_grad():
            for v in versions:
                t, v = self._fetch_initial(v)
                for n, val in t.items():
                    workload.params[n].copy_(val)
                base_tensors[v.fragment] = t
                self.shared.base[v.fragment] = v.version
        return base_tensors

    def _fetch_initial(self, v: VersionInfo, attempts: int = 20) -> tuple[BaseFile | HeldBase, VersionInfo]:
        """Download the version named at join, or a newer one told since (its read named in the
        heartbeats: the read lease of policy/catchup.py); if garbage collection removed it meanwhile
        (the run moved on while this process was starting), take the newest one a heartbeat names.

        Raises:
            FileNotFoundError: no listed version of the fragment could be read after ``attempts``.
        """
        heartbeat_s = self.comms.heartbeat_s
        for _ in range(attempts):
            newer = self.shared.newest_versions.get(v.fragment)
            if newer is not None and newer.version > v.version:
                v = newer
            try:
                with self.comms.reading(v):
                    return self.comms.fetch_version(v), v
            except FileNotFoundError:
                log.warning("%s: fragment %d version %d is gone (collected); taking a newer one",
                            self.learner_id, v.fragment, v.version)
                deadline = time.monotonic() + 10 * heartbeat_s + 5
                while time.monotonic() < deadline:
                    newer = self.shared.newest_versions.get(v.fragment)
                    if newer is not None and newer.version > v.version:
                        v = newer
                        break
                    time.sleep(heartbeat_s)
        raise FileNotFoundError(f"no readable version of fragment {v.fragment} (last tried {v.version})")
