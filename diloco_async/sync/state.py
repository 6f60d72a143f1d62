"""State types of the synchronizer actor (DESIGN §2): fragments, rounds, contributions, and the
internal messages that worker tasks post back to the actor's inbox.

Everything here is owned by the actor task; worker threads get the fragment of the one round
they work on (a fragment has at most one round in flight) and report back through a message.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco_async.codec.held import EncodedTensors
from diloco_async.config.schema import Config, SynchronizerConfig
from diloco_async.merge.buffer_pool import SMALL_SPARE_BYTES, BufferPool
from diloco_async.merge.core import OuterOptimizer, make_outer_optimizer, token_weight
from diloco_async.models import build_run_model, plan_of, trainable_parameters
from diloco_async.policy.admission import FragmentFacts
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.policy.rounds import Ema, RoundState
from diloco_async.protocol.messages import Announcement, CompactInfo
from diloco_async.protocol.versions import VersionHistory
from diloco_async.storage.store import ObjectRef, ObjectStore

__all__ = [
    "initial_parameters",
    "initial_state",
    "new_run_id",
    "Broadcaster",
    "FragmentState",
    "new_fragments",
    "Contribution",
    "Round",
    "Request",
    "Verified",
    "Merged",
    "CheckpointDone",
    "CheckpointBook",
    "FinalWritten",
]


def initial_state(cfg: Config) -> tuple[dict[str, torch.Tensor], FragmentPlan]:
    """Θ^0 (fp32 copies of the trainable parameters of the freshly seeded model: with LoRA, the
    adapter only) and the fragment plan of that model (its identity in the schema hash).

    Raises:
        ValueError, TypeError: the model config does not build (see ``diloco_async.models.build_model``).
    """
    torch.manual_seed(cfg.run.seed)
    model = build_run_model(cfg)
    # the model's own tensors (a float32 parameter is not copied): the model is dropped on return
    params = {n: p.detach().float() for n, p in trainable_parameters(model).items()}
    return params, plan_of(model, cfg.synchronizer.num_fragments, cfg.synchronizer.fragmentation)


def initial_parameters(cfg: Config) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Θ^0 (see :func:`initial_state`) and the embedding tensor names."""
    params, plan = initial_state(cfg)
    return params, sorted(plan.embedding_names)


def new_run_id() -> str:
    """A sortable, unique run id: UTC time plus a random suffix."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


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
class FragmentState:
    """One fragment p: its current value Θ_p (fp32), outer-optimizer state, kept versions and
    their store refs, and its round counter. ``busy`` while one of its rounds is open or merging.

    ``current``, ``momentum`` and the ``history`` values are read-only: after a merge they are the
    outer optimizer's own tensors (``OuterOptimizer.step_shared``), which a step never writes
    again, so they are shared without copies with the optimizer, the history and checkpoints."""

    p: int
    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    share: float  # numel share of the whole model, in (0, 1]
    version: int
    current: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    optimizer: OuterOptimizer
    history: VersionHistory  # version -> value, the last S + 1 versions (older ones read from the store)
    refs: dict[int, ObjectRef]
    sync_ema: Ema  # seconds of fetch + merge + publish
    embedding_names: list[str] = field(default_factory=list)  # of this fragment, merged with the mean
    # Θ^pub of ``version``: what learners adopt and merges anchor on; ``current`` itself unless
    # downloads are compressed (diloco_async/codec/versions.py), then the master value minus its residual
    published: dict[str, torch.Tensor] = field(default_factory=dict)
    compact: CompactInfo | None = None  # the compact form of ``version`` (None: download it whole, fp32)
    next_round: int = 1
    busy: bool = False
    outer_steps: int = 0

    def __post_init__(self) -> None:
        if not self.published:  # downloads not compressed: the published value is the value itself
            self.published = self.current

    def facts(self) -> FragmentFacts:
        """What :func:`diloco_async.policy.admission.admit_announcement` needs of this fragment."""
        return FragmentFacts(self.version, self.next_round, frozenset(self.history))


#: the buffers the merges of all fragments keep free for the next merge, in largest fragments
#: (fp32): the replaced value and momentum of the last merge and the anchored outer gradients it
#: kept (``merge_workspace``, up to one fragment), which the next one of an equal-sized fragment
#: writes without fresh pages (diloco_async/merge/buffer_pool.py; with 2, a 256 MiB merge faulted in
#: ~225 MiB of fresh pages each time, ~90 ms); more would be resting memory
MERGE_POOL_FRAGMENTS = 3


def merge_pool(largest_fragment_bytes: int) -> BufferPool:
    """The buffer pool every fragment's outer optimizer shares: free buffers of at most
    :data:`MERGE_POOL_FRAGMENTS` largest fragments (bytes of their state), plus small chunks."""
    return BufferPool(max_free_bytes=MERGE_POOL_FRAGMENTS * largest_fragment_bytes + SMALL_SPARE_BYTES)


def new_fragments(plan: FragmentPlan, params: dict[str, torch.Tensor], sc: SynchronizerConfig,
                  store: ObjectStore | None = None, indices: Sequence[int] | None = None) -> list[FragmentState]:
    """Version 0 of the fragments ``indices`` of ``plan`` (None: every fragment), in that order, cut
    from the model's ``params``. Kept versions older than the newest are read back from ``store``
    (None: they stay in RAM). Their optimizers share one merge pool sized by the largest of them.

    Raises:
        ValueError: an index outside the plan.
    """
    indices = range(plan.num_fragments) if indices is None else list(indices)
    if not indices or any(not 0 <= p < plan.num_fragments for p in indices):
        raise ValueError(f"fragment indices {list(indices)} are not a non-empty subset of the plan's "
                         f"{plan.num_fragments} fragments")
    out = []
    optimizers = [make_outer_optimizer(sc.outer_optimizer, plan.fragment_of(params, p), sc.outer_lr,
                                       sc.outer_momentum, period=sc.outer_momentum_every)
                  for p in indices]
    pool = merge_pool(max(sum(t.numel() * t.element_size() for t in o.shared_state().params.values())
                          for o in optimizers))
    for p, optimizer in zip(indices, optimizers, strict=True):
        names = plan.names(p)
        optimizer.pool = pool  # one pool for every fragment: its free buffers are a fixed budget
        cur = optimizer.shared_state().params  # the optimizer's own copy: one fp32 copy, never written
        shapes = {s.name: s.shape for s in plan.fragments[p]}
        refs: dict[int, ObjectRef] = {}
        history = VersionHistory(store, shapes, refs)
        history[0] = cur
        out.append(FragmentState(
            p=p, names=names, shapes=shapes,
            share=plan.numel_fraction(p), version=0, current=cur,
            momentum={n: torch.zeros_like(t) for n, t in cur.items()},
            optimizer=optimizer,
            history=history, refs=refs, sync_ema=Ema(sc.ema_alpha),
            embedding_names=[n for n in names if n in plan.embedding_names], published=cur,
        ))
    return out


@dataclass
class Contribution:
    """An admitted announcement and, once fetched and verified, its outer gradient: decoded (fp32
    payloads) or as encoded, decoded by its merge (:func:`~diloco_async.sync.work.fetch_and_verify`)."""

    ann: Announcement
    delta: dict[str, torch.Tensor] | EncodedTensors | None = None
    scales: dict[str, float] = field(default_factory=dict)  # tensors the guard clipped, name -> factor
    norms: dict[str, torch.Tensor] = field(default_factory=dict)  # Δ's float32 norms from its verification
    lr_warmup: bool = False  # its inner steps began inside the learner's learning-rate warm-up

    def merge_record(self, direction_factor: float = 1.0, direction_cosine: float | None = None,
                     slice_epochs: list[int] | None = None) -> dict:
        """This contribution in the merge log: who, its counters, its direction factor (DESIGN §10), its
        token weight c_tokens²/c_steps (DESIGN §4.2, so learners of different batch sizes show their
        weights), its leave-one-out cosine to the rest of its round (when judged) and the leased
        slices it trained (DESIGN §5.2): ``slices`` when its factor is above 0,
        ``slices_untrained`` when it merged with no weight (its slices stay untrained, another learner
        may train them), and ``slice_epochs``, the ledger epoch each was leased in (given by the
        caller)."""
        a = self.ann
        rec = {"learner": a.learner_id, "c_tokens": a.c_tokens, "c_steps": a.c_steps, "base_version": a.base_version,
               "token_weight": token_weight(a.c_tokens, a.c_steps), "direction_factor": round(direction_factor, 6),
               "direction_cosine": None if direction_cosine is None else round(direction_cosine, 6)}
        if a.slices:
            rec["slices" if direction_factor > 0 else "slices_untrained"] = a.slices
            if slice_epochs is not None:
                rec["slice_epochs"] = slice_epochs
        return rec


@dataclass
class Round:
    """An open round: its policy state and the contributions admitted so far (by learner).
    ``none_pending`` is set while no admitted contribution is still being fetched and checked."""

    state: RoundState
    contributions: dict[str, Contribution] = field(default_factory=dict)
    last_wait_log_s: float = 0.0
    none_pending: asyncio.Event = field(default_factory=asyncio.Event)
    drain_until_s: float | None = None  # a drain's last round: waits for every live learner until then


# Internal messages. A request carries the future the HTTP handler waits on.
@dataclass
class Request:
    kind: str
    body: Any
    reply: asyncio.Future[Any]


@dataclass
class Verified:
    """A contribution fetched and checked: ``delta`` is None when it failed (``reason`` says why)."""

    fragment: int
    round_n: int
    learner: str
    delta: dict[str, torch.Tensor] | EncodedTensors | None
    reason: str
    nbytes: int
    norms: dict[str, float] = field(default_factory=dict)  # L2 norm per tensor of the delta
    norms32: dict[str, torch.Tensor] = field(default_factory=dict)  # the same, float32, as the merge's


@dataclass
class Merged:
    """Outcome of merge + outer step + publish of one round; ``ok`` False abandons the round."""

    fragment: int
    round_n: int
    ok: bool
    reason: str
    new: dict[str, torch.Tensor] | None = None
    published: dict[str, torch.Tensor] | None = None  # Θ^pub of the new version (``new`` when not compressed)
    compact: CompactInfo | None = None
    momentum: dict[str, torch.Tensor] | None = None
    ref: ObjectRef | None = None
    version: int = 0  # the version published (the fragment's next, unless a number was taken)
    merged: list[str] = field(default_factory=list)
    seconds: float = 0.0
    quorum_wait_s: float = 0.0
    outer_steps: int = 0
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (learner, why) left out of the merge
    cosines: dict[str, float | None] = field(default_factory=dict)  # learner -> leave-one-out cosine to its round
    factors: dict[str, float] = field(default_factory=dict)  # learner -> direction factor of its weight


@dataclass
class CheckpointDone:
    seq: int
    ok: bool
    reason: str


@dataclass
class FinalWritten:
    """The final metrics, summary and merge log are in the store (or failed to get there)."""

    ok: bool


class CheckpointBook:
    """Which checkpoint is next, whether one (or a garbage collection) is in flight, who waits for
    it, and when the periodic one is due. Times are seconds on the actor's clock."""

    def __init__(self, started_s: float) -> None:
        self.seq = 0  # the newest sequence number taken
        self.last_seq: int | None = None  # newest checkpoint this process wrote
        self.in_flight = False
        self.gc_in_flight = False
        self.waiters: list = []  # futures of POST /checkpoint requests
        self.resumed_from: int | None = None  # the checkpoint this process resumed from
        self._merges_at_checkpoint = -1
        self._last_s = started_s

    def due(self, now_s: float, merges: int, every_s: float) -> bool:
        """A periodic checkpoint is due: none in flight, a merge since the last, ``every_s`` passed."""
        return not self.in_flight and merges > self._merges_at_checkpoint and now_s - self._last_s >= every_s

    def begin(self, now_s: float, merges: int) -> int:
        """Take the next sequence number for a checkpoint starting now."""
        self.seq += 1
        self._merges_at_checkpoint = merges
        self.in_flight = True
        self._last_s = now_s
        return self.seq

    def done(self, msg: CheckpointDone) -> list:
        """Record the outcome; returns the waiters to answer. A failure retries at the next period."""
        self.in_flight = False
        waiters, self.waiters = self.waiters, []
        if msg.ok:
            self.last_seq = msg.seq
        else:
            self._merges_at_checkpoint = -1
        return waiters

    def resumed(self, seq: int, listed: list[int], merges: int) -> None:
        """After a resume from ``seq``: never reuse a listed (even torn) sequence number."""
        self.resumed_from = seq
        self.seq = max([seq, *listed])
        self._merges_at_checkpoint = merges
