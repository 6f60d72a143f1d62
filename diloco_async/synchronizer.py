"""The synchronizer actor: one asyncio task owns all global state (DESIGN §2-§4).

HTTP handlers (``diloco_async.server``) only validate and enqueue typed messages; the actor
handles each message without awaiting, so every state change is atomic. Blocking work
(fetching, decoding and verifying contributions; merging and publishing; checkpoints) runs in
``asyncio.to_thread`` and posts its result back to the queue. A fragment has at most one round
in flight, so the worker thread of that round is the only user of the fragment's optimizer
until it reports back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from diloco_async import codec as wire
from diloco_async.config import Config, config_differences, config_hash
from diloco_async.fragments import FragmentPlan, fragment_offset, plan_fragments, specs_of
from diloco_async.goodput import LearnerLedger, totals, uptime
from diloco_async.merge import OuterOptimizer, merge_outer_gradients, token_weight
from diloco_async.messages import (
    Announcement,
    AnnouncementAck,
    Heartbeat,
    HeartbeatResponse,
    JoinRequest,
    JoinResponse,
    RoundOpen,
    VersionInfo,
)
from diloco_async.model import ByteGPT, embedding_names
from diloco_async.policy import Ema, GraceDecision, RoundStage, RoundState, global_step, grace_window, round_due_step
from storage import keys
from storage.checkpoint import Checkpoint, list_checkpoint_seqs, tensor_key, write_checkpoint
from storage.gc import collect_garbage
from storage.store import IntegrityError, ObjectRef, ObjectStore

__all__ = ["Synchronizer", "Broadcaster", "initial_parameters", "new_run_id"]

log = logging.getLogger("diloco.synchronizer")


def initial_parameters(cfg: Config) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Θ^0 (fp32 parameters of a freshly seeded model) and the embedding tensor names."""
    torch.manual_seed(cfg.run.seed)
    model = ByteGPT(cfg.model)
    params = {n: p.detach().clone().float() for n, p in model.named_parameters()}
    return params, embedding_names(model)


class Broadcaster:
    """Push channel to learners (the WebSocket route subscribes one queue per connection).

    Events are small JSON dicts: ``round_open``, ``version`` and ``stop``. Heartbeat responses
    carry the same information, so a lost push only costs one heartbeat period.
    """

    def __init__(self, max_queue: int = 256) -> None:
        self.max_queue = max_queue
        self.queues: dict[int, asyncio.Queue] = {}

    def subscribe(self) -> tuple[int, asyncio.Queue]:
        q: asyncio.Queue = asyncio.Queue(self.max_queue)
        self.queues[id(q)] = q
        return id(q), q

    def unsubscribe(self, handle: int) -> None:
        self.queues.pop(handle, None)

    def publish(self, event: dict) -> None:
        for q in self.queues.values():
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:  # a stuck connection drops pushes; heartbeats cover them
                pass


@dataclass
class _FragmentState:
    p: int
    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    share: float
    version: int
    current: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    optimizer: OuterOptimizer
    history: dict[int, dict[str, torch.Tensor]]
    refs: dict[int, ObjectRef]
    sync_ema: Ema
    next_round: int = 1
    busy: bool = False
    outer_steps: int = 0


@dataclass
class _LearnerInfo:
    learner_id: str
    incarnation: int
    started_s: float
    last_seen_s: float
    live: bool = True
    step: int = 0
    step_time_s: Optional[float] = None
    tokens_seen: int = 0  # tokens_total reported by the current incarnation
    bytes_down_seen: int = 0
    stop_sent: bool = False


@dataclass
class _Contribution:
    ann: Announcement
    delta: Optional[dict[str, torch.Tensor]] = None


@dataclass
class _Round:
    state: RoundState
    contributions: dict[str, _Contribution] = field(default_factory=dict)
    last_wait_log_s: float = 0.0


# Internal messages. Each carries the future the HTTP handler waits on, where there is one.
@dataclass
class _Req:
    kind: str
    body: Any
    reply: "asyncio.Future[Any]"


@dataclass
class _Verified:
    fragment: int
    round_n: int
    learner: str
    delta: Optional[dict[str, torch.Tensor]]
    reason: str
    nbytes: int


@dataclass
class _Merged:
    fragment: int
    round_n: int
    ok: bool
    reason: str
    new: Optional[dict[str, torch.Tensor]] = None
    momentum: Optional[dict[str, torch.Tensor]] = None
    ref: Optional[ObjectRef] = None
    merged: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    quorum_wait_s: float = 0.0
    outer_steps: int = 0


@dataclass
class _CheckpointDone:
    seq: int
    ok: bool
    reason: str


class Synchronizer:
    """The synchronizer of one run.

    Args:
        cfg: the validated config.
        store: the object store; the run lives under ``{store}/{run_id}/``.
        run_id: this run's id.
        clock: monotonic clock in seconds (injectable for tests).
    """

    def __init__(self, cfg: Config, store: ObjectStore, run_id: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.sc = cfg.synchronizer
        self.store = store
        self.run_id = run_id
        self.clock = clock
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.push = Broadcaster()
        self.learners: dict[str, _LearnerInfo] = {}
        self.ledgers: dict[str, LearnerLedger] = {}
        self.rounds: dict[tuple[int, int], _Round] = {}
        self.due: list[tuple[int, int]] = []  # (fragment, round) waiting for a free slot
        self.counters: Counter[str] = Counter()
        self.rejected_by_reason: Counter[str] = Counter()
        self.metrics: list[dict] = []
        self.settled: dict[tuple[str, int, int], str] = {}  # (learner, fragment, round) -> key
        self.merge_times_s: list[float] = []
        # one record per merge (unix time, fragment, round, version, merged update ids): the
        # chaos harness joins it with learner timelines to find which steps were merged
        self.merge_log: list[dict] = []
        self.started_s = clock()
        self.stopping: Optional[str] = None
        self.draining: Optional[str] = None  # stop reason while the last rounds run
        self._drain_until_s = 0.0
        self.finished = asyncio.Event()
        self.final_summary: Optional[dict] = None
        self._tasks: set[asyncio.Task] = set()
        self.epoch = uuid.uuid4().hex[:12]  # changes at every (re)start: learners reset round state
        self.resumed_from: Optional[int] = None
        self._checkpoint_waiters: list[asyncio.Future] = []
        self._checkpoint_seq = 0
        self.last_checkpoint_seq: Optional[int] = None  # newest checkpoint this process wrote
        self._checkpoint_in_flight = False
        self._gc_in_flight = False
        self._merges_at_checkpoint = -1
        self._last_checkpoint_s = self.started_s
        self._stop_since_s: Optional[float] = None
        self._g: Optional[int] = None
        params, emb = initial_parameters(cfg)
        self.plan: FragmentPlan = plan_fragments(specs_of(params), self.sc.num_fragments, emb)
        self.fragments: list[_FragmentState] = []
        for p in range(self.plan.num_fragments):
            cur = self.plan.fragment_of(params, p)
            self.fragments.append(_FragmentState(
                p=p, names=self.plan.names(p), shapes={s.name: s.shape for s in self.plan.fragments[p]},
                share=self.plan.numel_fraction(p), version=0, current=cur,
                momentum={n: torch.zeros_like(t) for n, t in cur.items()},
                optimizer=OuterOptimizer(cur, lr=self.sc.outer_lr, momentum=self.sc.outer_momentum),
                history={0: cur}, refs={}, sync_ema=Ema(self.sc.ema_alpha),
            ))

    # -- start-up -----------------------------------------------------------------------------

    def publish_initial(self) -> None:
        """Write plan.json, config.json and version 0 of every fragment (blocking; call once)."""
        self.store.put_json(keys.plan_key(self.run_id), {
            "run_id": self.run_id, "plan": self.plan.to_json(), "schema_hash": self.plan.schema_hash,
            "config_hash": config_hash(self.cfg),
        })
        self.store.put_json(keys.config_key(self.run_id), self.cfg.public_dict())
        for f in self.fragments:
            f.refs[0] = self._put_version(f.p, 0, f.current)
        log.info("synchronizer run=%s: %d fragments, schema %s…", self.run_id,
                 self.plan.num_fragments, self.plan.schema_hash[:12])

    def restore(self, ckpt: Checkpoint) -> None:
        """Continue from a verified checkpoint of this run (DESIGN §5), blocking (store reads).

        Restores every fragment's value, momentum and outer-step count, versions, round
        counters, the learner registry and the goodput ledgers, so the next outer step equals
        the one an uninterrupted run would take. Versions published after the checkpoint (by a
        synchronizer that died before checkpointing again) are superseded: the checkpoint's
        value is re-published under the next free version number, so learners adopt it.

        Raises:
            ValueError: the checkpoint belongs to another run, or its config or fragment plan
                differs from this one (the message names the differing fields).
        """
        m = ckpt.manifest
        if m.get("run_id") != self.run_id:
            raise ValueError(f"checkpoint {ckpt.seq} belongs to run {m.get('run_id')!r}, not {self.run_id!r}")
        if m["config_hash"] != config_hash(self.cfg):
            diffs = config_differences(m.get("config", {}), self.cfg.public_dict())
            raise ValueError(f"config differs from checkpoint {ckpt.seq}'s: " + ("; ".join(diffs) or "hash only"))
        if m["schema_hash"] != self.plan.schema_hash:
            raise ValueError(f"fragment plan differs from checkpoint {ckpt.seq}'s "
                             f"(schema {m['schema_hash'][:12]} vs {self.plan.schema_hash[:12]})")
        for f in self.fragments:
            key = str(f.p)
            params = {n: ckpt.tensors[tensor_key(f.p, "param", n)].clone() for n in f.names}
            mom = {n: ckpt.tensors[tensor_key(f.p, "momentum", n)].clone() for n in f.names}
            steps = int(m["outer_steps"][key])
            f.optimizer.load_state(params, mom if steps > 0 else None, steps_taken=steps)
            f.current, f.momentum, f.outer_steps = params, mom, steps
            f.version, f.next_round = int(m["versions"][key]), int(m["next_round"][key])
            f.refs = {int(v): ObjectRef.from_json(r) for v, r in m["version_refs"][key].items()}
            f.history = {f.version: params}
            for v, ref in sorted(f.refs.items()):
                if v != f.version:
                    try:
                        f.history[v], _ = wire.decode_from_bytes(self.store.get(ref), "fp32", f.shapes)
                    except (FileNotFoundError, IntegrityError, ValueError) as err:
                        log.warning("fragment %d: version %d unavailable after resume (%s)", f.p, v, err)
            f.refs = {v: r for v, r in f.refs.items() if v in f.history}
            self._supersede_orphans(f)
        now = self.clock()
        self.ledgers = {lid: LearnerLedger.from_json(d) for lid, d in m["ledgers"].items()}
        for lid, d in m["learners"].items():
            info = _LearnerInfo(lid, int(d["incarnation"]), now - self.ledgers[lid].provisioned_s, now, live=False,
                                step=int(d["step"]), tokens_seen=int(d.get("tokens_seen", 0)),
                                bytes_down_seen=int(d.get("bytes_down_seen", 0)))
            self.learners[lid] = info
        self.counters = Counter(m["counters"])
        self._checkpoint_seq = max([ckpt.seq, *list_checkpoint_seqs(self.store, self.run_id)])
        self._merges_at_checkpoint = self.counters["merges"]
        self.resumed_from = ckpt.seq
        log.info("resumed run %s from checkpoint %d: versions %s, next rounds %s", self.run_id, ckpt.seq,
                 {f.p: f.version for f in self.fragments}, {f.p: f.next_round for f in self.fragments})

    def _supersede_orphans(self, f: _FragmentState) -> None:
        prefix = f"{self.run_id}/globals/p{f.p:03d}/"
        published = [int(k.rsplit("/v", 1)[1].split(".")[0]) for k in self.store.list(prefix) if "/v" in k]
        newest = max(published, default=f.version)
        if newest <= f.version:
            return
        v = newest + 1
        while True:
            try:
                ref = self._put_version(f.p, v, f.current)
                break
            except FileExistsError:  # a listing can be stale: take the next number
                v += 1
        log.warning("fragment %d: versions %d..%d were published after the checkpoint and are superseded; "
                    "the checkpoint's value is version %d", f.p, f.version + 1, newest, v)
        f.history[v] = f.current
        f.refs[v] = ref
        f.version = v

    def _put_version(self, p: int, v: int, tensors: dict[str, torch.Tensor]) -> ObjectRef:
        data = wire.encode_to_bytes(tensors, "fp32", {"fragment": str(p), "version": str(v)})
        return self.store.put(keys.version_key(self.run_id, p, v), data)

    # -- the actor loop -----------------------------------------------------------------------

    async def run(self) -> dict:
        """Run until the budget is spent and the final checkpoint is written; returns the summary."""
        try:
            while not self.finished.is_set():
                try:
                    msg = await asyncio.wait_for(self.inbox.get(), timeout=0.05)
                except asyncio.TimeoutError:
                    msg = None
                if msg is not None:
                    self._dispatch(msg)
                self._advance()
        finally:
            for t in list(self._tasks):
                t.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
        assert self.final_summary is not None
        return self.final_summary

    async def request(self, kind: str, body: Any) -> Any:
        """Enqueue a request for the actor and wait for its reply (used by the HTTP handlers)."""
        fut = asyncio.get_running_loop().create_future()
        await self.inbox.put(_Req(kind, body, fut))
        return await fut

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, _Req):
            if msg.reply.cancelled():
                return
            if msg.kind == "checkpoint":  # answered when the checkpoint is written
                self._checkpoint_waiters.append(msg.reply)
                if not self._checkpoint_in_flight:
                    self._start_checkpoint()
                return
            handler = {"join": self._on_join, "heartbeat": self._on_heartbeat,
                       "announce": self._on_announce, "status": self._on_status,
                       "metrics": self._on_metrics, "stop": self._on_stop}[msg.kind]
            try:
                msg.reply.set_result(handler(msg.body))
            except Exception as err:  # a handler bug must not kill the actor
                log.exception("handler %s failed", msg.kind)
                msg.reply.set_exception(err)
        elif isinstance(msg, _Verified):
            self._on_verified(msg)
        elif isinstance(msg, _Merged):
            self._on_merged(msg)
        elif isinstance(msg, _CheckpointDone):
            self._on_checkpoint_done(msg)

    # -- metrics ------------------------------------------------------------------------------

    def _metric(self, key: str, value: float, step: Optional[int] = None) -> None:
        self.metrics.append({"key": key, "value": float(value),
                             "step": int(self.counters["merges"] if step is None else step),
                             "timestamp_ms": int(time.time() * 1000)})

    def _reject(self, learner: str, reason: str, detail: str, p: int = -1, n: int = -1) -> AnnouncementAck:
        self.counters["contributions_rejected"] += 1
        self.rejected_by_reason[reason] += 1
        if learner in self.ledgers:
            self.ledgers[learner].count("rejected")
        log.warning("rejected contribution learner=%s fragment=%d round=%d: %s (%s)", learner, p, n, reason, detail)
        self._metric("sync/contributions_rejected", self.counters["contributions_rejected"])
        self._metric(f"sync/rejected/{reason}", self.rejected_by_reason[reason])
        return AnnouncementAck(status="rejected", reason=f"{reason}: {detail}")

    def _duplicate(self, learner: str, p: int, n: int) -> AnnouncementAck:
        self.counters["duplicates"] += 1
        log.info("duplicate announcement learner=%s fragment=%d round=%d: acknowledged, not merged again", learner, p, n)
        self._metric("sync/duplicates", self.counters["duplicates"])
        return AnnouncementAck(status="duplicate", reason="already announced; acknowledged once, merged at most once")

    def count_unauthenticated(self, remote: str) -> None:
        """Called by the HTTP layer for a request without the run's token (counted, logged)."""
        self.rejected_by_reason["unauthenticated"] += 1
        self.counters["requests_rejected"] += 1
        log.warning("rejected request from %s: unauthenticated", remote)
        self._metric("sync/rejected/unauthenticated", self.rejected_by_reason["unauthenticated"])

    # -- learner messages ---------------------------------------------------------------------

    def _version_infos(self) -> list[VersionInfo]:
        out = []
        for f in self.fragments:
            ref = f.refs[f.version]
            out.append(VersionInfo(fragment=f.p, version=f.version, key=ref.key, nbytes=ref.nbytes, sha256=ref.sha256))
        return out

    def _on_join(self, req: JoinRequest) -> JoinResponse:
        now = self.clock()
        info = self.learners.get(req.learner_id)
        start_step = info.step if info is not None else 0
        if info is None or req.incarnation != info.incarnation:
            # A (re)starting learner takes the newest versions, so it continues at the global step
            # at least: behind it, it would hold the schedule back once the learners ahead are gone.
            start_step = max(start_step, self._g or 0)
            started = now - req.uptime_s
            if info is not None:
                started = info.started_s  # the slot was provisioned since its first start
                log.info("learner %s rejoined (incarnation %d -> %d) at step %d", req.learner_id, info.incarnation,
                         req.incarnation, start_step)
            self.learners[req.learner_id] = _LearnerInfo(req.learner_id, req.incarnation, started, now, step=start_step)
            self.ledgers.setdefault(req.learner_id, LearnerLedger())
        else:
            info.last_seen_s = now
            info.live = True
        log.info("learner %s joined (incarnation %d)", req.learner_id, req.incarnation)
        self._metric(f"learner/{req.learner_id}/alive", 1.0)
        return JoinResponse(run_id=self.run_id, config=self.cfg.public_dict(), config_hash=config_hash(self.cfg),
                            plan=self.plan.to_json(), schema_hash=self.plan.schema_hash,
                            versions=self._version_infos(), epoch=self.epoch, start_step=start_step)

    def _on_heartbeat(self, hb: Heartbeat) -> HeartbeatResponse:
        now = self.clock()
        info = self.learners.get(hb.learner_id)
        if info is None or info.incarnation != hb.incarnation:
            return HeartbeatResponse(open_rounds=[], versions=[], stop=self.stopping is not None, known=False,
                                     epoch=self.epoch)
        if not info.live:
            log.info("learner %s is back", hb.learner_id)
            self._metric(f"learner/{hb.learner_id}/alive", 1.0)
        info.live, info.last_seen_s, info.step = True, now, hb.step
        info.step_time_s = hb.step_time_s
        ledger = self.ledgers[hb.learner_id]
        if hb.tokens_total >= info.tokens_seen:
            ledger.tokens_processed += hb.tokens_total - info.tokens_seen
            info.tokens_seen = hb.tokens_total
        if hb.bytes_down >= info.bytes_down_seen:
            self.counters["bytes_out"] += hb.bytes_down - info.bytes_down_seen
            info.bytes_down_seen = hb.bytes_down
        lid = hb.learner_id
        if hb.train_loss is not None:
            self._metric(f"learner/{lid}/train_loss", hb.train_loss, hb.step)
        if hb.tokens_per_s is not None:
            self._metric(f"learner/{lid}/tokens_per_s", hb.tokens_per_s, hb.step)
        if hb.step_time_s is not None:
            self._metric(f"learner/{lid}/step_time_s", hb.step_time_s, hb.step)
        opens = []
        if self.stopping is None:
            for (p, n), rnd in sorted(self.rounds.items()):
                if rnd.state.stage is RoundStage.OPEN or rnd.state.stage is RoundStage.GRACE:
                    if lid not in rnd.state.entries:
                        opens.append(RoundOpen(fragment=p, round_n=n, version=self.fragments[p].version))
        stop = self.stopping is not None
        if stop:
            info.stop_sent = True
        return HeartbeatResponse(open_rounds=opens, versions=self._version_infos(), stop=stop, epoch=self.epoch)

    def _on_announce(self, ann: Announcement) -> AnnouncementAck:
        now = self.clock()
        lid, p, n = ann.learner_id, ann.fragment, ann.round_n
        if lid not in self.learners:
            return self._reject(lid, "unknown_learner", "join first", p, n)
        if not 0 <= p < len(self.fragments):
            return self._reject(lid, "bad_fragment", f"fragment {p} does not exist", p, n)
        f = self.fragments[p]
        rnd = self.rounds.get((p, n))
        if rnd is None:
            if self.settled.get((lid, p, n)) == ann.key:
                return self._duplicate(lid, p, n)
            if n < f.next_round:
                # The round is over: a replay of an old message, or one that arrived too late.
                self.counters["contributions_late"] += 1
                self.ledgers[lid].count("late")
                self._metric("sync/contributions_late", self.counters["contributions_late"])
                return AnnouncementAck(status="late", reason=f"round p{p} r{n} is closed")
            return self._reject(lid, "unknown_round", f"round p{p} r{n} is not open", p, n)
        prior = rnd.state.entries.get(lid)
        if prior is not None and prior.key == ann.key:
            return self._duplicate(lid, p, n)
        if ann.c_steps < 1:
            return self._reject(lid, "no_progress", "c_steps = 0 carries no weight", p, n)
        if ann.base_version not in f.history:
            return self._reject(lid, "too_stale", f"base version {ann.base_version}, current {f.version}, "
                                f"keeping {self.sc.max_staleness}", p, n)
        if not ann.key.startswith(f"{self.run_id}/contrib/p{p:03d}/r{n:08d}/"):
            return self._reject(lid, "bad_key", f"key {ann.key!r} is outside this round's prefix", p, n)
        if ann.codec not in wire.CODECS:
            return self._reject(lid, "bad_codec", ann.codec, p, n)
        adm = rnd.state.announce(lid, ann.key, now)
        if adm.status == "late":
            self.counters["contributions_late"] += 1
            self.ledgers[lid].count("late")
            self._metric("sync/contributions_late", self.counters["contributions_late"])
            return AnnouncementAck(status="late", reason=adm.reason)
        if adm.status == "rejected":
            return self._reject(lid, "duplicate_learner", adm.reason, p, n)
        if adm.status == "duplicate":
            return self._duplicate(lid, p, n)
        rnd.contributions[lid] = _Contribution(ann)
        self._spawn(self._verify(f, ann))
        return AnnouncementAck(status="accepted", reason=adm.reason)

    def _on_stop(self, reason: str) -> bool:
        if self.stopping is None:  # a second stop while draining stops at once
            self._begin_stop(str(reason))
        return True

    def _on_status(self, _body: Any) -> dict:
        return self.status()

    def _on_metrics(self, since: int) -> dict:
        since = max(0, int(since))
        batch = self.metrics[since:since + 5000]
        return {"next": since + len(batch), "total": len(self.metrics), "metrics": batch}

    # -- verification and merge (worker threads) ----------------------------------------------

    async def _verify(self, f: _FragmentState, ann: Announcement) -> None:
        ref = ObjectRef(ann.key, ann.nbytes, ann.sha256)
        delta, reason = None, "ok"
        try:
            delta = await asyncio.wait_for(asyncio.to_thread(self._fetch_decode, ref, ann.codec, f.shapes),
                                           timeout=self.sc.storage_timeout_s)
        except IntegrityError as err:
            reason = f"digest_mismatch: {err}"
        except FileNotFoundError:
            reason = f"missing_object: {ann.key}"
        except asyncio.TimeoutError:
            reason = f"storage_timeout: fetch took over {self.sc.storage_timeout_s}s"
        except ValueError as err:
            reason = f"{'non_finite' if 'non-finite' in str(err) else 'bad_tensor'}: {err}"
        except Exception as err:  # storage errors: counted, never fatal
            reason = f"storage_error: {type(err).__name__}: {err}"
        await self.inbox.put(_Verified(f.p, ann.round_n, ann.learner_id, delta, reason, ann.nbytes))

    def _fetch_decode(self, ref: ObjectRef, codec: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        data = self.store.get(ref)
        tensors, _meta = wire.decode_from_bytes(data, codec, shapes)
        bad = {n: int((~torch.isfinite(t)).sum()) for n, t in tensors.items() if not bool(torch.isfinite(t).all())}
        if bad:
            raise ValueError(f"non-finite values in {sum(bad.values())} elements of {sorted(bad)}")
        return tensors

    def _on_verified(self, msg: _Verified) -> None:
        rnd = self.rounds.get((msg.fragment, msg.round_n))
        if rnd is None:
            return
        contrib = rnd.contributions.get(msg.learner)
        if msg.delta is None:
            reason, _, detail = msg.reason.partition(": ")
            self._reject(msg.learner, reason, detail, msg.fragment, msg.round_n)
            rnd.state.settle(msg.learner, False)
            rnd.contributions.pop(msg.learner, None)
            return
        self.counters["bytes_in"] += msg.nbytes  # logged with each merge
        if contrib is not None:
            contrib.delta = msg.delta
        rnd.state.settle(msg.learner, True)

    def _merge_and_publish(self, f: _FragmentState, round_n: int, contribs: list[_Contribution],
                           quorum_wait_s: float) -> _Merged:
        t0 = time.perf_counter()
        p, n = f.p, round_n
        weights = [token_weight(c.ann.c_tokens, c.ann.c_steps) for c in contribs]
        anchored = []
        for c in contribs:
            base = f.history[c.ann.base_version]
            anchored.append({k: (f.current[k] - base[k]) + c.delta[k] for k in f.names})
        emb = [n_ for n_ in f.names if n_ in self.plan.embedding_names]
        if sum(weights) <= 0:
            return _Merged(p, n, False, "zero total token weight")
        g = merge_outer_gradients(anchored, weights, mode=self.sc.merge, embedding_names=emb)
        before_params, before_mom, steps = f.optimizer.params(), f.optimizer.momentum(), f.optimizer.steps_taken
        try:
            new = f.optimizer.step(g)
            bad = [k for k, t in new.items() if not bool(torch.isfinite(t).all())]
            if bad:
                raise ValueError(f"non-finite values after the outer step in {bad}")
            ref = self._put_version(p, f.version + 1, new)
        except Exception as err:
            f.optimizer.load_state(before_params, before_mom if steps else None, steps_taken=steps)
            return _Merged(p, n, False, f"{type(err).__name__}: {err}")
        return _Merged(p, n, True, "published", new=new, momentum=f.optimizer.momentum(), ref=ref,
                       outer_steps=f.optimizer.steps_taken,
                       merged=[c.ann.learner_id for c in contribs], seconds=time.perf_counter() - t0,
                       quorum_wait_s=quorum_wait_s)

    async def _merge_task(self, f: _FragmentState, rnd: _Round, quorum_wait_s: float) -> None:
        # Announcements admitted before the merge started are awaited (bounded by the fetch timeout).
        deadline = self.clock() + self.sc.storage_timeout_s + 1.0
        while rnd.state.pending and self.clock() < deadline:
            await asyncio.sleep(0.01)
        try:
            # the contributions are fixed here, on the actor's loop: the worker thread gets its own list
            contribs = [c for c in rnd.contributions.values() if c.delta is not None]
            result = await asyncio.to_thread(self._merge_and_publish, f, rnd.state.round_n, contribs, quorum_wait_s)
        except Exception as err:
            log.exception("merge of fragment %d round %d failed", f.p, rnd.state.round_n)
            result = _Merged(f.p, rnd.state.round_n, False, f"{type(err).__name__}: {err}")
        await self.inbox.put(result)

    def _on_merged(self, res: _Merged) -> None:
        f = self.fragments[res.fragment]
        rnd = self.rounds.pop((res.fragment, res.round_n))
        f.busy = False
        for lid, entry in rnd.state.entries.items():
            self.settled[(lid, res.fragment, res.round_n)] = entry.key
        if not res.ok:
            rnd.state.abandon()
            self.counters["rounds_abandoned"] += 1
            log.error("fragment %d round %d abandoned: %s (version stays %d)", f.p, res.round_n, res.reason, f.version)
            self._metric("sync/rounds_abandoned", self.counters["rounds_abandoned"])
            return
        rnd.state.finish()
        now = self.clock()
        f.version += 1
        f.current, f.momentum, f.outer_steps = res.new, res.momentum, res.outer_steps
        f.history[f.version] = res.new
        f.refs[f.version] = res.ref
        for old in [v for v in f.history if v < f.version - self.sc.max_staleness]:
            del f.history[old]
        f.sync_ema.update(res.seconds)
        self.push.publish({"type": "version", **VersionInfo(
            fragment=f.p, version=f.version, key=res.ref.key, nbytes=res.ref.nbytes, sha256=res.ref.sha256
        ).model_dump()})
        self.counters["merges"] += 1
        self.counters["contributions_merged"] += len(res.merged)
        self.merge_times_s.append(now)
        self.merge_log.append({"t": time.time(), "fragment": f.p, "round": res.round_n, "version": f.version,
                               "update_ids": [rnd.contributions[lid].ann.update_id for lid in res.merged]})
        staleness = []
        for lid in res.merged:
            c = rnd.contributions[lid]
            led = self.ledgers[lid]
            led.count("merged")
            led.useful_s += c.ann.compute_s * f.share
            led.tokens_merged += c.ann.c_tokens * f.share
            staleness.append(f.version - 1 - c.ann.base_version)
        self._metric("sync/merges", self.counters["merges"])
        self._metric("sync/quorum_size", len(res.merged))
        self._metric("sync/grace_s", rnd.state.grace.grace_s if rnd.state.grace else 0.0)
        self._metric("sync/quorum_wait_s", res.quorum_wait_s)
        self._metric("sync/merge_s", res.seconds)
        self._metric("sync/contributions_merged", self.counters["contributions_merged"])
        self._metric("sync/contributions_late", self.counters["contributions_late"])
        self._metric("sync/contributions_rejected", self.counters["contributions_rejected"])
        self._metric("sync/live_learners", len(self._live()))
        self._metric("net/bytes_out", self.counters["bytes_out"])
        self._metric("net/bytes_in", self.counters["bytes_in"])
        self._metric("sync/staleness_versions", sum(staleness) / len(staleness))
        self._metric(f"sync/fragment/{f.p}/version", f.version)
        late = len(rnd.state.late)
        log.info("fragment %d round %d merged %d (%s) -> version %d; grace %.3fs; %d late",
                 f.p, res.round_n, len(res.merged), ",".join(res.merged), f.version,
                 rnd.state.grace.grace_s if rnd.state.grace else 0.0, late)

    # -- checkpoints --------------------------------------------------------------------------

    def _checkpoint_payload(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors: dict[str, torch.Tensor] = {}
        for f in self.fragments:
            for name in f.names:
                tensors[tensor_key(f.p, "param", name)] = f.current[name]
                tensors[tensor_key(f.p, "momentum", name)] = f.momentum[name]
        open_round = {p: n for (p, n) in self.rounds}
        manifest = {
            "config_hash": config_hash(self.cfg),
            "config": self.cfg.public_dict(),
            "schema_hash": self.plan.schema_hash,
            "versions": {str(f.p): f.version for f in self.fragments},
            "outer_steps": {str(f.p): f.outer_steps for f in self.fragments},
            # a round in flight is not in this checkpoint: a resumed run opens it again
            "next_round": {str(f.p): open_round.get(f.p, f.next_round) for f in self.fragments},
            "version_refs": {str(f.p): {str(v): f.refs[v].to_json() for v in f.history} for f in self.fragments},
            "global_step": self._g,
            "ledgers": {lid: l.to_json() for lid, l in self.ledgers.items()},
            "learners": {lid: {"incarnation": i.incarnation, "step": i.step, "tokens_seen": i.tokens_seen,
                               "bytes_down_seen": i.bytes_down_seen} for lid, i in self.learners.items()},
            "counters": dict(self.counters, checkpoints=self.counters["checkpoints"] + 1),  # this one included
            "wall_s": self.clock() - self.started_s,
            "epoch": self.epoch,
        }
        return tensors, manifest

    def _start_checkpoint(self) -> None:
        self._checkpoint_seq += 1
        self._merges_at_checkpoint = self.counters["merges"]
        self._checkpoint_in_flight = True
        self._last_checkpoint_s = self.clock()
        seq = self._checkpoint_seq
        tensors, manifest = self._checkpoint_payload()

        async def write() -> None:
            try:
                await asyncio.to_thread(write_checkpoint, self.store, self.run_id, seq, tensors, manifest)
                await self.inbox.put(_CheckpointDone(seq, True, "written"))
            except Exception as err:
                await self.inbox.put(_CheckpointDone(seq, False, f"{type(err).__name__}: {err}"))

        self._spawn(write())

    def _on_checkpoint_done(self, msg: _CheckpointDone) -> None:
        self._checkpoint_in_flight = False
        waiters, self._checkpoint_waiters = self._checkpoint_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result({"seq": msg.seq, "ok": msg.ok, "reason": msg.reason})
        if not msg.ok:
            self._merges_at_checkpoint = -1  # try again at the next period
        if msg.ok:
            self.counters["checkpoints"] += 1
            self.last_checkpoint_seq = msg.seq
            log.info("checkpoint %d written", msg.seq)
            self._metric("sync/checkpoints", self.counters["checkpoints"])
            if self.sc.keep_checkpoints and not self._gc_in_flight:
                self._gc_in_flight = True
                self._spawn(self._collect_garbage())
        else:
            self.counters["checkpoints_failed"] += 1
            log.error("checkpoint %d failed: %s", msg.seq, msg.reason)

    async def _collect_garbage(self) -> None:
        """Delete contributions, versions and checkpoints that no resume can need (storage/gc.py)."""
        try:
            report = await asyncio.to_thread(collect_garbage, self.store, self.run_id,
                                             keep_checkpoints=self.sc.keep_checkpoints)
            self.counters["gc_deleted_objects"] += report.objects
            self.counters["gc_deleted_bytes"] += report.nbytes
            self._metric("storage/gc_deleted_bytes", self.counters["gc_deleted_bytes"])
        except Exception as err:  # collection is an optimisation: count, log, go on
            self.counters["gc_failures"] += 1
            log.warning("garbage collection failed: %s: %s", type(err).__name__, err)
        finally:
            self._gc_in_flight = False

    # -- the clock-driven part ----------------------------------------------------------------

    def _live(self) -> list[_LearnerInfo]:
        return [i for i in self.learners.values() if i.live]

    def _advance(self) -> None:
        now = self.clock()
        self._update_liveness(now)
        self._update_ledgers(now)
        if self.stopping is None and self.draining is None:
            self._check_budget(now)
        if self.stopping is None and self.draining is None:
            self._schedule(now)
        self._progress_rounds(now)
        if self.draining is not None and self.stopping is None and (not self.rounds or now >= self._drain_until_s):
            log.info("drain finished (%s)", "every last round closed" if not self.rounds else "timeout")
            self._begin_stop(self.draining)
        if (self.stopping is None and self.draining is None and not self._checkpoint_in_flight
                and self.counters["merges"] > self._merges_at_checkpoint
                and now - self._last_checkpoint_s >= self.sc.checkpoint_every_s):
            self._start_checkpoint()
        if self.stopping is not None:
            self._progress_stop(now)

    def _update_liveness(self, now: float) -> None:
        for info in self.learners.values():
            if info.live and now - info.last_seen_s > self.sc.heartbeat_timeout_s:
                info.live = False
                log.warning("learner %s lost (silent for %.1fs)", info.learner_id, now - info.last_seen_s)
                self._metric(f"learner/{info.learner_id}/alive", 0.0)
                self._metric("sync/live_learners", len(self._live()))

    def _update_ledgers(self, now: float) -> None:
        for lid, info in self.learners.items():
            self.ledgers[lid].provisioned_s = now - info.started_s

    def _check_budget(self, now: float) -> None:
        b = self.cfg.budget
        tokens = sum(l.tokens_processed for l in self.ledgers.values())
        if b.tokens is not None and tokens >= b.tokens:
            self._begin_stop(f"token budget reached ({tokens} >= {b.tokens})")
        elif b.max_steps is not None and self._g is not None and self._g >= b.max_steps:
            self._begin_stop(f"step budget reached (g = {self._g})")
        elif b.wall_s is not None and now - self.started_s >= b.wall_s:
            self._begin_stop(f"wall-time budget reached ({now - self.started_s:.0f}s)")

    def _begin_stop(self, reason: str) -> None:
        """Stop: first drain (a last round of every fragment, at most ``drain_s``), then tell the
        learners to stop, close the open rounds, write the final checkpoint and the summary."""
        if self.draining is None and self.sc.drain_s > 0 and self._live():
            self.draining = reason
            now = self.clock()
            self._drain_until_s = now + self.sc.drain_s
            self.due.clear()
            opened = []
            for f in self.fragments:
                if not f.busy:
                    n = f.next_round
                    f.busy, f.next_round = True, n + 1
                    self.rounds[(f.p, n)] = _Round(RoundState(f.p, n, now, self.sc.min_quorum))
                    self.counters["rounds_opened"] += 1
                    self.push.publish({"type": "round_open", **RoundOpen(fragment=f.p, round_n=n,
                                                                        version=f.version).model_dump()})
                    opened.append(f"p{f.p} r{n}")
            log.info("stopping (%s): draining, last rounds %s, at most %.0fs", reason, ", ".join(opened) or "-",
                     self.sc.drain_s)
            return
        self.stopping = reason
        self._stop_since_s = self.clock()
        log.info("stopping: %s", reason)
        self.push.publish({"type": "stop", "reason": reason})
        self.due.clear()

    def _schedule(self, now: float) -> None:
        g = global_step([i.step for i in self._live()], self.sc.min_quorum)
        if g is None:
            return
        if g != self._g:
            self._g = g
            self._metric("sync/global_step", g, g)
        for f in self.fragments:
            off = fragment_offset(f.p, len(self.fragments), self.sc.sync_every)
            queued = any(q == f.p for q, _ in self.due)
            if not f.busy and not queued and g >= round_due_step(off, f.next_round, self.sc.sync_every):
                # If the learners ran ahead (slow merges, a resume), open the newest due round
                # instead of replaying every missed one H steps apart in quick succession.
                newest_due = max(f.next_round, (g - off) // self.sc.sync_every)
                self.due.append((f.p, newest_due))
        self.due.sort(key=lambda pn: (round_due_step(fragment_offset(pn[0], len(self.fragments), self.sc.sync_every),
                                                      pn[1], self.sc.sync_every), pn[0]))
        while self.due and len(self.rounds) < self.sc.max_open_rounds:
            p, n = self.due.pop(0)
            f = self.fragments[p]
            f.busy = True
            f.next_round = n + 1
            self.rounds[(p, n)] = _Round(RoundState(p, n, now, self.sc.min_quorum))
            self.counters["rounds_opened"] += 1
            self.push.publish({"type": "round_open", "fragment": p, "round_n": n, "version": f.version})
            log.info("round open: fragment %d round %d (g=%d, live=%d)", p, n, g, len(self._live()))

    def _slowest_step_s(self) -> Optional[float]:
        times = [i.step_time_s for i in self._live() if i.step_time_s]
        return max(times) if times else None

    def _progress_rounds(self, now: float) -> None:
        live_ids = [i.learner_id for i in self._live()]
        for (p, n), rnd in list(self.rounds.items()):
            st = rnd.state
            if st.stage is RoundStage.OPEN:
                if st.quorum_met():
                    quorum_wait = now - st.opened_s
                    if self.sc.grace_enabled:
                        decision = grace_window(
                            step_time_s=self._slowest_step_s(), quorum_wait_s=quorum_wait,
                            sync_time_s=self.fragments[p].sync_ema.value, tau=self.sc.max_open_rounds,
                            gamma=self.sc.grace_gamma, cap_s=self.sc.grace_cap_s, initial_s=self.sc.grace_initial_s)
                    else:
                        decision = GraceDecision(0.0, "grace window disabled")
                    st.start_grace(now, decision)
                    log.debug("fragment %d round %d quorum %d/%d after %.3fs; grace %.3fs (%s)", p, n,
                              len(st.verified), st.min_quorum, quorum_wait, decision.grace_s, decision.reason)
                elif self.stopping is not None:
                    st.abandon()
                    self.rounds.pop((p, n))
                    self.fragments[p].busy = False
                    log.info("fragment %d round %d abandoned at stop: quorum %d/%d", p, n, len(st.verified), st.min_quorum)
                    continue
                elif now - rnd.last_wait_log_s >= 10.0 and now - st.opened_s >= 10.0:
                    rnd.last_wait_log_s = now
                    log.info("fragment %d round %d waiting for quorum (%d/%d)", p, n, len(st.verified), st.min_quorum)
            if st.stage is RoundStage.GRACE:
                why = st.should_merge(now, live_ids)
                if why is not None:
                    st.start_merge()
                    quorum_wait = (st.quorum_s or now) - st.opened_s
                    if len(st.verified) == 1 and len(live_ids) > 1:
                        log.info("fragment %d round %d: quorum of one (%s)", p, n, why)
                    self._spawn(self._merge_task(self.fragments[p], rnd, quorum_wait))

    def _progress_stop(self, now: float) -> None:
        if self.rounds or self._checkpoint_in_flight or self._gc_in_flight:
            return
        if self.final_summary is None and not getattr(self, "_final_checkpoint_started", False):
            self._final_checkpoint_started = True
            self._start_checkpoint()
            return
        if self.final_summary is None:
            self.final_summary = self.summary()
            self._record_goodput()
            self._spawn(self._write_final())
            return
        everyone_told = all(i.stop_sent or not i.live for i in self.learners.values())
        if getattr(self, "_final_written", False) and (everyone_told or now - (self._stop_since_s or now) > 15.0):
            self.finished.set()

    async def _write_final(self) -> None:
        body = "\n".join(json.dumps(m) for m in self.metrics).encode()
        try:
            await asyncio.to_thread(self.store.put, keys.metrics_log_key(self.run_id, self.epoch), body)
            await asyncio.to_thread(self.store.put_json, keys.summary_key(self.run_id, self.epoch), self.final_summary)
            merges = "\n".join(json.dumps(m) for m in self.merge_log).encode()
            await asyncio.to_thread(self.store.put, keys.merge_log_key(self.run_id, self.epoch), merges)
        except Exception as err:
            log.error("could not write the final summary: %s", err)
        self._final_written = True

    def _record_goodput(self) -> None:
        tot = totals(self.ledgers)
        self._metric("goodput/compute", tot["compute_goodput"])
        self._metric("goodput/token", tot["token_goodput"])
        for lid, led in self.ledgers.items():
            self._metric(f"learner/{lid}/compute_goodput", led.compute_goodput)
            self._metric(f"learner/{lid}/token_goodput", led.token_goodput)

    # -- reports ------------------------------------------------------------------------------

    def summary(self) -> dict:
        """Run figures: goodput (DESIGN §7), merges, rejections by reason, versions, bytes."""
        now = self.clock()
        tot = totals(self.ledgers)
        max_gap = max(4 * (self._slowest_step_s() or 1.0) * self.sc.sync_every / max(1, len(self.fragments)), 5.0)
        return {
            "run_id": self.run_id,
            "epoch": self.epoch,
            "resumed_from": self.resumed_from,
            "stop_reason": self.stopping,
            "wall_s": now - self.started_s,
            **tot,
            "uptime": uptime(self.merge_times_s, self.started_s, now, max_gap),
            "uptime_max_gap_s": max_gap,
            "merges": self.counters["merges"],
            "contributions_merged": self.counters["contributions_merged"],
            "contributions_late": self.counters["contributions_late"],
            "contributions_rejected": self.counters["contributions_rejected"],
            "rejected_by_reason": dict(self.rejected_by_reason),
            "rounds_abandoned": self.counters["rounds_abandoned"],
            "duplicates": self.counters["duplicates"],
            "versions": {f.p: f.version for f in self.fragments},
            "bytes_in": self.counters["bytes_in"],
            "bytes_out": self.counters["bytes_out"],
            "checkpoints": self.counters["checkpoints"],
            "last_checkpoint_seq": self.last_checkpoint_seq,
            "global_step": self._g,
            "learners": {lid: {"live": i.live, "step": i.step, "incarnation": i.incarnation,
                               **self.ledgers[lid].to_json(),
                               "compute_goodput": self.ledgers[lid].compute_goodput,
                               "token_goodput": self.ledgers[lid].token_goodput}
                         for lid, i in self.learners.items()},
        }

    def status(self) -> dict:
        s = self.summary()
        s["rounds"] = [{"fragment": p, "round": n, "stage": r.state.stage.value,
                        "announced": sorted(r.state.entries), "verified": r.state.verified}
                       for (p, n), r in sorted(self.rounds.items())]
        s["stopping"] = self.stopping
        s["finished"] = self.final_summary is not None
        return s


def new_run_id() -> str:
    """A sortable, unique run id: UTC time plus a random suffix."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
