"""The learner's training thread: inner steps that never wait for the network (DESIGN §3).

At each step boundary the loop adopts the downloaded versions (:func:`~diloco_async.learner.rules.adopt`),
reads its contributions' outcomes and answers open rounds with an outer gradient for the comms thread to
upload; then one inner step. ``learners.barrier``: it waits like synchronous DiLoCo; a replay asks for each
boundary's rounds and versions (:mod:`~diloco_async.learner.replay`)."""

from __future__ import annotations

import logging
import os
import queue
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
import torch

from diloco_async.config.schema import Config
from diloco_async.inner.base_file import overwrite_param
from diloco_async.inner.state import state_meta
from diloco_async.inner.workload import Workload
from diloco_async.learner.device_copies import to_host_async
from diloco_async.learner.fsdp_outer import ContributionOrder, ShardedUpload
from diloco_async.learner.group import Decision, LearnerGroup
from diloco_async.learner.replay import ReplayBoundaries
from diloco_async.learner.rules import Progress, adopt, encoded_outer_gradient, outer_gradient, progress_after_adopt
from diloco_async.learner.spool import StateSpooler, new_spool_folder, remove_dead_spool_folders
from diloco_async.learner.state import Shared, UploadJob
from diloco_async.metrics.timeline import Recorder
from diloco_async.policy.fragments import FragmentPlan, fragment_offset
from diloco_async.protocol.messages import VersionInfo
from diloco_async.runtime.heap import ReleaseWhenItPays, release_free_memory

__all__ = ["InnerLoop", "StartPoint"]

log = logging.getLogger("diloco.learner")

#: a release of the C heap's free pages (:class:`~diloco_async.runtime.heap.ReleaseWhenItPays`) pays when
#: the next step faults back at most the model's fp32 size, or when it kept this share of the
#: model's fp32 size (at least :data:`HEAP_RELEASE_MIN_GAIN_BYTES`) and half what it faulted back
HEAP_RELEASE_GAIN_OF_MODEL = 0.125
HEAP_RELEASE_MIN_GAIN_BYTES = 16 << 20


@dataclass
class StartPoint:
    """Where a learner's training loop starts.

    Args:
        base_tensors: Θ^base of every fragment (by fragment, then tensor name), each a local
            :class:`~diloco_async.inner.base_file.BaseFile` (read a tensor at a time, not held in
            RAM), or a :class:`~diloco_async.inner.base_file.HeldBase` in RAM when the parameters
            are on an accelerator; adopted versions replace them.
        counters: progress restored with the inner state, by fragment (steps, tokens, compute s).
        step: the local step to continue from.
        restored: the inner state was restored (its progress is contributed before a newer version is adopted).
    """

    base_tensors: dict[int, dict[str, torch.Tensor]]
    counters: dict[int, tuple[int, int, float]] = field(default_factory=dict)
    step: int = 0
    restored: bool = False


@dataclass
class _InFlight:
    """A contribution in flight: its round, the parameters at the snapshot and the progress it covers."""

    round_n: int
    params: dict[str, torch.Tensor]
    progress: Progress


class InnerLoop:
    """The training loop of one learner.

    Args:
        cfg: the run's config.
        shared: state shared with the comms thread.
        workload: model, optimizer and data.
        plan: the fragment plan.
        recorder: where timeline records go.
        learner_id: the learner's id (logs, spool folders).
        start: the base copies, restored counters and step it starts from (:class:`StartPoint`).
        group: rank 0's side of the learner's process group, or None for a one-process learner:
            each step boundary's decision and adopted fragments go to the other ranks.

    The parameters live on the workload's device; the base copies Θ^base are float32 in local files
    (pinned host memory for a GPU); the outer gradients are float32 on CPU (taken on the GPU and copied,
    :mod:`~diloco_async.learner.device_copies`); the snapshots of ``rebase`` on the parameters' device."""

    def __init__(self, cfg: Config, shared: Shared, workload: Workload, plan: FragmentPlan, recorder: Recorder, *,
                 learner_id: str, start: StartPoint, group: LearnerGroup | None = None) -> None:
        lc = cfg.learners
        self.group = group
        self.replay: ReplayBoundaries | None = None  #: set by the process for a replay (learner/replay.py)
        self.replay_rounds: dict[tuple[int, int], tuple[int, float]] = {}  # replay: rounds the last answer named
        self.replay_owed = 0  # replay: contributions queued at this boundary, announced with it
        self.lc, self.shared, self.workload, self.plan, self.recorder = lc, shared, workload, plan, recorder
        self.learner_id = learner_id
        self.base_tensors = start.base_tensors
        counters, restored = start.counters, start.restored
        P, H = plan.num_fragments, cfg.synchronizer.sync_every
        self.P, self.H = P, H
        self.progress = [Progress(*counters.get(p, (0, 0, 0.0))) for p in range(P)]
        self.in_flight: dict[int, _InFlight] = {}  # cleared on adoption, or when it will not be merged
        self.unheard: dict[int, int] = {}  # fragment -> round of its contribution whose answer is not heard yet
        self.feed = shared.slices  # data.slices: each step's tokens come from a leased slice (DESIGN §5.2)
        self.sharded = group is not None and group.outer is not None  # fsdp: the ranks adopt and contribute together
        self.versions: list[VersionInfo] = []  # sharded: versions every rank adopts at this boundary
        self.orders: list[ContributionOrder] = []  # sharded: contributions every rank puts its shard of
        self.answered: set[tuple[int, int]] = set()
        self.ema_alpha = cfg.synchronizer.ema_alpha
        self.step = start.step  # a restarted slot continues its step count
        self.offsets = [fragment_offset(p, P, H) for p in range(P)]
        self.next_n = [max(1, -(-(self.step - self.offsets[p]) // H)) for p in range(P)]  # next round each owes
        # After an inner-state restore, the restored progress on a fragment is contributed (on its old base, if kept)
        # before a newer version of it is adopted (an overwrite would lose it). Held for two rounds at most.
        self.hold = {p for p in range(P) if restored and self.progress[p].steps >= 1}
        self.hold_until_step = self.step + 2 * H
        self.last_state_s = time.monotonic()
        self.spool_dir: str | None = None  # local folder of spooled inner states (made on first use)
        # parameters and moments not yet spooled at the optimizer step are copied once they fit in half the params
        param_bytes = sum(t.numel() * t.element_size() for t in workload.params.values())
        self.spooler = StateSpooler(learner_id, shared, copy_budget_bytes=param_bytes // 2)
        # the optimizer's step mutates the parameters and moments in place: not while they are spooled
        self._spool_hook = workload.optimizer.register_step_pre_hook(self._before_optimizer_step)
        model_fp32_bytes = 4 * sum(t.numel() for t in workload.params.values())
        self.heap_release = ReleaseWhenItPays(
            model_fp32_bytes, max(HEAP_RELEASE_MIN_GAIN_BYTES, int(HEAP_RELEASE_GAIN_OF_MODEL * model_fp32_bytes)))
        self._process = psutil.Process()

    def run(self) -> None:
        """Train until the stop event is set."""
        with self.shared.lock:
            self.shared.stats.step = self.step
        while not self.shared.stop_event.is_set():
            if self.replay is not None:  # the rounds the last answer named, answered now, go with this boundary
                self._answer_rounds()
                rounds = self.replay.boundary(self.step, self.replay_owed)  # blocks; versions queued for adoption
                if rounds is None:
                    break
                self.replay_rounds, self.replay_owed = rounds, 0
            adopted = self._adopt_arrivals()
            if self.shared.epoch_changed.is_set():
                self.shared.epoch_changed.clear()
                self.answered.clear()  # round numbers may be reused by the restarted synchronizer
                self.in_flight.clear()  # contributions in flight will not be merged
                self.unheard.clear()
            if self.replay is None:
                self._answer_rounds()
            blocked = self.lc.barrier and self._barrier_blocked()
            run_tokens = self.shared.run_tokens  # the run's progress for the lr schedule, as last heard
            if self.group is not None:
                save = self._sharded_save_due() if self.sharded else None
                d = self.group.boundary(Decision(stop=False, step=not blocked, adopted=adopted, run_tokens=run_tokens,
                                                 versions=self.versions, orders=self.orders, save=save),
                                        self.workload, self.plan)
                self.versions, self.orders = [], []
                self._queue_sharded(d.uploads)
            if blocked:
                continue  # adopt or answer what arrived, at this step boundary
            if not self.sharded:
                self._maybe_save_inner_state()
            self._inner_step(run_tokens)
            self._maybe_release_heap(bool(adopted))
        if self.group is not None:
            self.group.boundary(Decision(stop=True, step=False), self.workload, self.plan)
        self.spooler.join()
        self._spool_hook.remove()
        if self.spool_dir is not None:  # empty once the comms thread uploaded (or dropped) the last spool
            try:
                os.rmdir(self.spool_dir)
            except OSError:
                pass

    def _adopt_arrivals(self) -> list[int]:
        """Read the outcomes heard (:meth:`_read_outcomes`), then adopt every downloaded version newer than
        the base (held ones go back to the queue); returns the fragments adopted."""
        self._read_outcomes()
        sh, deferred, adopted_now = self.shared, [], []
        if not sh.adopt_queue.empty():
            self.spooler.wait_mutable()  # an adoption writes θ in place
        while True:
            try:
                v, new = sh.adopt_queue.get_nowait()
            except queue.Empty:
                break
            p = v.fragment
            if v.version <= sh.base.get(p, -1):
                continue
            if p in self.hold and self.step < self.hold_until_step:
                deferred.append((v, new))
                continue
            snap = self.in_flight.pop(p, None)
            params = self.workload.params
            with torch.no_grad():
                if self.sharded:  # every rank reads its rows at this boundary (LearnerGroup.boundary)
                    self.versions.append(v)
                elif self.lc.adopt == "overwrite":  # θ ← Θ^new read from its file one tensor at a time
                    for n in new:
                        overwrite_param(params[n], new, n)
                else:  # mix and rebase on θ's device (the snapshot of rebase is there already)
                    adopted = adopt(self.lc.adopt, params, new, mix_alpha=self.lc.mix_alpha,
                                    base=self.base_tensors[p], snapshot=snap.params if snap and snap.params else None)
                    for n, val in adopted.items():
                        params[n].copy_(val)
                    del adopted
            self.progress[p] = progress_after_adopt(self.lc.adopt, self.progress[p], snap.progress if snap else None)
            if self.feed is not None:  # the next contribution of p names only the slices trained from now on
                self.feed.adopted(p, progress_kept=self.progress[p].steps > 0)
            if not self.sharded:  # sharded: the group's ShardedOuter.base, replaced at this boundary
                self.base_tensors[p] = new
            with sh.lock:
                sh.base[p] = v.version
            adopted_now.append(p)
            log.debug("%s adopted fragment %d v%d", self.learner_id, p, v.version)
        for item in deferred:
            sh.adopt_queue.put(item)
        return adopted_now

    def _maybe_release_heap(self, adopted: bool) -> None:
        """After a step: hand the C heap's free pages back when fragment-sized buffers were freed
        since the last step (an adoption here; a download, upload or spool elsewhere) and
        :attr:`heap_release` finds that releasing pays."""
        freed = adopted or self.shared.large_frees.is_set()
        self.shared.large_frees.clear()
        if self.heap_release.after_step(self._process.memory_info().rss, freed):
            release_free_memory()
            self.heap_release.released(self._process.memory_info().rss)

    def _read_outcomes(self) -> None:
        """Heard before adoptions (an adoption takes the contribution in flight as merged). ``folded``: the one
        in flight joined round n of p (DESIGN §3.5), which counts as answered."""
        while True:
            try:
                p, n, status = self.shared.outcomes.get_nowait()
            except queue.Empty:
                break
            if status == "folded":
                self.answered.add((p, n))
                self.next_n[p] = max(self.next_n[p], n + 1)
                if p in self.in_flight and self.in_flight[p].round_n < n:
                    self.in_flight[p].round_n = n
                continue
            if self.unheard.get(p) == n:
                del self.unheard[p]
            if self.feed is not None:  # its slices may be handed back once nothing else names them
                self.feed.settled(p, n)
            if status not in ("accepted", "duplicate") and p in self.in_flight and self.in_flight[p].round_n == n:
                del self.in_flight[p]  # nothing of it will be merged: the progress stays in θ for the next round
                self.hold.discard(p)

    def _answer_rounds(self) -> None:
        """Contribute to every open round not answered yet, one contribution in flight per fragment."""
        sh = self.shared
        with sh.lock:
            told = sh.open_rounds if self.replay is None else self.replay_rounds
            rounds = sorted((k, vt[0]) for k, vt in told.items() if k not in self.answered)
        for (p, n), round_version in rounds:
            if round_version < sh.base[p]:
                self.answered.add((p, n))  # that round already published a version we adopted
                self.next_n[p] = max(self.next_n[p], n + 1)
                continue
            if p in self.in_flight and self.in_flight[p].round_n < n and round_version == sh.base[p]:
                del self.in_flight[p]  # our round closed without a new version (abandoned)
            if self.progress[p].steps < 1 or p in self.in_flight or (p in self.unheard and self.replay is None):
                continue  # (a late one's answer may name this round as the one it joined)
            self.answered.add((p, n))
            self.next_n[p] = max(self.next_n[p], n + 1)
            self._contribute(p, n)

    def _contribute(self, p: int, n: int) -> None:
        """Snapshot the outer gradient of fragment ``p`` for round ``n`` and queue its upload. θ is read in
        place (Δ is the one new fragment-sized tensor); θ itself is kept only for ``rebase`` (on θ's device).
        On the CPU, when an upload is already waiting (a late learner answers several rounds at one step),
        Δ is encoded here one tensor at a time, so fp32 outer gradients do not pile up in the queue; on a GPU
        its copy to pinned host memory is queued (the upload thread waits for it). With error feedback, and
        in a replay, Δ is always queued in fp32 (the comms thread adds the residual before encoding)."""
        if self.sharded:
            self._order_sharded(p, n)
            return
        params = self.workload.params
        delta: dict[str, torch.Tensor] = {}
        encoded = None
        on_cpu = self.workload.device.type == "cpu"
        codec = self.shared.upload_codec or self.lc.codec  # a step-down while the link is bound
        base = self.base_tensors[p]
        with torch.no_grad():
            theta = {name: params[name].detach().to(torch.float32) for name in self.plan.names(p)}
            # on a GPU, Δ is taken there and copied to the host without a wait (device_copies)
            if self.shared.upload_queue.empty() or not on_cpu or self.shared.feedback is not None or self.replay:
                delta = outer_gradient(base, theta)
            else:
                encoded = encoded_outer_gradient(base, theta, codec)
            copy = to_host_async(delta)
            snap = {}
            if self.lc.adopt == "rebase":
                snap = {name: t.clone() if t.data_ptr() == params[name].data_ptr() else t for name, t in theta.items()}
        prog = self.progress[p]
        self._leaves(p, n, snap, prog)
        job = UploadJob(p, n, self.shared.base[p], prog.steps, prog.tokens, prog.compute_s, copy.tensors,
                        encoded=encoded, delta_ready=copy.event, codec=codec,
                        slices=self.feed.named(p, n) if self.feed is not None else [])
        self.recorder.record("contribution", fragment=p, round=n, last_step=self.step, c_steps=prog.steps,
                             update_id=job.update_id)
        self.replay_owed += 1
        self.shared.upload_queue.put(job)

    def _leaves(self, p: int, n: int, snap: dict[str, torch.Tensor], prog: Progress) -> None:
        """A contribution of p to round n leaves: in flight until adopted or refused, its answer awaited."""
        self.in_flight[p], self.unheard[p] = _InFlight(n, snap, prog), n
        self.hold.discard(p)

    def _order_sharded(self, p: int, n: int) -> None:
        """A sharded group's contribution to round ``n`` of ``p``: an order for every rank at this
        boundary (each takes Δ on its rows and puts its shard; :meth:`_queue_sharded` announces)."""
        prog = self.progress[p]
        codec = self.shared.upload_codec or self.lc.codec
        order = ContributionOrder(p, n, self.shared.base[p], codec, uuid.uuid4().hex[:16], prog.steps, prog.tokens,
                                  prog.compute_s)
        self._leaves(p, n, {}, prog)
        self.recorder.record("contribution", fragment=p, round=n, last_step=self.step, c_steps=prog.steps,
                             update_id=order.update_id)
        self.orders.append(order)

    def _queue_sharded(self, uploads: list[ShardedUpload]) -> None:
        """Hand each contribution whose shards every rank put to the comms thread, to announce; one
        with a shard missing is reported failed (nothing of it is announced)."""
        for up in uploads:
            o = up.order
            if up.shards is None:
                log.warning("%s fragment %d round %d: a rank could not put its shard; not announced", self.learner_id,
                            o.fragment, o.round_n)
                self.shared.outcomes.put((o.fragment, o.round_n, "failed"))
                continue
            self.shared.upload_queue.put(UploadJob(o.fragment, o.round_n, o.base_version, o.c_steps, o.c_tokens,
                                                   o.compute_s, {}, update_id=o.update_id, codec=o.codec,
                                                   shards=up.shards))

    def _barrier_blocked(self) -> bool:
        """Synchronous DiLoCo (``learners.barrier``): wait here when a contribution is in flight,
        or when the next step would pass the due step of a round not open yet. True: it waited."""
        sh, in_flight = self.shared, self.in_flight
        if in_flight:
            # the round we contributed to: a version to adopt, an outcome, or a newer round on the
            # version we hold (ours was abandoned)
            self._block("merge", lambda: not sh.adopt_queue.empty() or not sh.outcomes.empty() or any(
                n > in_flight[p].round_n and vt[0] == sh.base.get(p)
                for (p, n), vt in sh.open_rounds.items() if p in in_flight))
            return True

        # every learner does exactly H steps per round and waits for the slowest
        def is_open(p: int) -> bool:
            return any(q == p and n >= self.next_n[p] for (q, n) in sh.open_rounds)

        with sh.lock:
            waiting = [p for p in range(self.P) if self.step >= self.offsets[p] + self.next_n[p] * self.H
                       and not is_open(p)]
        if waiting:
            self._block("round", lambda: all(is_open(p) for p in waiting))
            return True
        return False

    def _block(self, why: str, ready: Callable[[], bool]) -> None:
        """Hold the training thread until ``ready()`` (called under the lock), a stop or a
        synchronizer restart; record the blocked time in the timeline."""
        sh = self.shared
        t0 = started_s = time.time()
        with sh.lock:
            sh.stats.blocked_since_s = started_s
        while not (sh.stop_event.is_set() or sh.epoch_changed.is_set()):
            with sh.lock:
                if ready():
                    break
            time.sleep(0.005)
            if time.time() - t0 >= 1.0:  # in pieces, so that a kill loses at most one second of it
                t1 = time.time()
                self.recorder.record("blocked", t0=t0, t1=t1, why=why)
                t0 = t1
        t1 = time.time()
        if t1 - t0 > 0.001:
            self.recorder.record("blocked", t0=t0, t1=t1, why=why)
        with sh.lock:
            sh.stats.blocked_s += t1 - started_s
            sh.stats.blocked_since_s = None

    def _maybe_save_inner_state(self) -> None:
        """Every ``checkpoint_every_s``: the inner state captured between two steps (no copy), written to a
        local file by the spool thread (:class:`~diloco_async.learner.spool.StateSpooler`) for the comms thread
        to upload and delete; skipped while the previous spool is written or waits for its upload."""
        every_s = self.lc.checkpoint_every_s
        sh = self.shared
        if (every_s <= 0 or time.monotonic() - self.last_state_s < every_s or sh.state_spooled.is_set()
                or self.spooler.writing()):
            return
        self.last_state_s = time.monotonic()
        counters = {p: tuple(self.progress[p]) for p in range(self.P)}
        state = self.workload.capture(step=self.step, base_tensors=self.base_tensors,
                                      base_versions=dict(sh.base), counters=counters)
        if sh.feedback is not None:  # the error-feedback residuals are inner state too (replaced whole, not copied)
            state.tensors.update(sh.feedback.tensors())
        if self.spool_dir is None:
            remove_dead_spool_folders(self.learner_id)
            self.spool_dir = new_spool_folder(self.learner_id)
        self.spooler.start(state, os.path.join(self.spool_dir, f"state-{self.step:010d}.safetensors"))

    def _sharded_save_due(self) -> dict | None:
        """Every ``checkpoint_every_s``, what rank 0 tells the ranks of a sharded group to save at this boundary
        (DCP, in :meth:`LearnerGroup.boundary`); else None."""
        every_s = self.lc.checkpoint_every_s
        if every_s <= 0 or time.monotonic() - self.last_state_s < every_s:
            return None
        self.last_state_s = time.monotonic()
        assert self.group is not None
        self.group.state_seq += 1
        counters = {p: tuple(self.progress[p]) for p in range(self.P)}
        return {"seq": self.group.state_seq, "inner": state_meta(self.step, dict(self.shared.base), counters)}

    def _before_optimizer_step(self, *_args) -> None:
        self.spooler.wait_mutable()  # the step mutates the parameters and moments in place

    def _inner_step(self, run_tokens: float) -> None:
        tokens = self.workload.tokens_per_step
        taken = self.feed.take(tokens) if self.feed is not None else None  # (slice, first token)
        if self.feed is not None and taken is None:  # no leased slice in hand: the comms thread is asking
            time.sleep(0.02)
            return
        t0 = time.perf_counter()
        t0_unix = time.time()
        loss = self.workload.step(self.step, run_tokens) if taken is None else self.workload.step(
            self.step, run_tokens, taken[1])
        if taken is not None and self.feed is not None:
            self.feed.trained(taken[0], tokens)
        dt = time.perf_counter() - t0
        self.step += 1
        self.recorder.record("step", t0=t0_unix, t1=time.time(), step=self.step, tokens=tokens,
                             lr=self.workload.last_lr, run_tokens=run_tokens)
        self.progress = [prog.plus(tokens, dt) for prog in self.progress]
        with self.shared.lock:
            s = self.shared.stats
            s.step = self.step
            s.tokens_total += tokens
            s.window_tokens += tokens
            s.step_time_s = dt if s.step_time_s is None else self.ema_alpha * dt + (1 - self.ema_alpha) * s.step_time_s
            s.loss_sum += loss
            s.loss_count += 1
