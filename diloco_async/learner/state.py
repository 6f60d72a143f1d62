"""What the learner's two threads share: events, queues, open rounds, bases and counters."""

from __future__ import annotations

import collections
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from diloco_async.inner.state import InnerState
from diloco_async.learner.feedback import ErrorFeedback
from diloco_async.learner.link import LinkMeter
from diloco_async.learner.slices import SliceFeed
from diloco_async.protocol.messages import JoinResponse, VersionInfo
from diloco_async.storage.store import ObjectRef

__all__ = ["LearnerSlot", "SyncEndpoint", "UploadJob", "SpooledState", "Stats", "Shared"]


@dataclass(frozen=True)
class LearnerSlot:
    """Who a learner process is: its slot id (``[A-Za-z0-9_.-]``, at most 64 characters), its data
    shard ``index`` in ``[0, learners.count)`` and its ``incarnation`` (restart count: 0 the first start)."""

    learner_id: str
    index: int
    incarnation: int = 0


@dataclass(frozen=True)
class SyncEndpoint:
    """How a learner reaches its synchronizer: base ``url`` (e.g. ``http://127.0.0.1:8765``, no
    trailing slash needed), this learner's own ``token``
    (:func:`diloco_async.protocol.auth.learner_token`), ``give_up_after_s`` (seconds without any
    answer before the comms fail), ``link_delay_s`` (one-way latency added to each exchange, the
    WAN harness's regions, :class:`~diloco_async.protocol.client.SyncClient`)."""

    url: str
    token: str
    give_up_after_s: float = 120.0
    link_delay_s: float = 0.0


@dataclass
class UploadJob:
    """One contribution for the comms thread: the outer gradient ``delta`` of ``fragment`` for
    round ``round_n``, taken against ``base_version``, with the counters it covers; or, when
    ``encoded`` is set, that outer gradient already encoded in ``codec`` (``delta`` empty). ``delta`` of a
    learner on a GPU may still be being copied to the host: read it after ``delta_ready``
    (:func:`~diloco_async.learner.device_copies.to_host_async`)."""

    fragment: int
    round_n: int
    base_version: int
    c_steps: int
    c_tokens: int
    compute_s: float
    delta: dict[str, torch.Tensor]
    update_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    encoded: dict[str, torch.Tensor] | None = None
    delta_ready: torch.cuda.Event | None = None  # ``delta`` is read after this event (a copy from a GPU)
    codec: str | None = None  # its wire codec (a link-bound step-down); None: the uploads' (learners.codec)
    shards: list[ObjectRef] | None = None  # a sharded group's shard objects, by rank, already put (DESIGN §3.1)
    slices: list[int] = field(default_factory=list)  # leased slices its c_tokens came from (DESIGN §5.2)


@dataclass
class SpooledState:
    """An inner state the training thread spooled to a local safetensors file
    (:func:`diloco_async.storage.checkpoint.spool_state`) for the comms thread to upload, then delete."""

    path: str
    nbytes: int
    meta: dict


@dataclass
class Stats:
    """Counters for the heartbeat (guarded by :attr:`Shared.lock`); the loss and the token
    window restart at every heartbeat."""

    step: int = 0
    tokens_total: int = 0
    step_time_s: float | None = None
    loss_sum: float = 0.0
    loss_count: int = 0
    window_tokens: int = 0
    window_start_s: float = field(default_factory=time.monotonic)
    bytes_down: int = 0
    bytes_up: int = 0
    blocked_s: float = 0.0  # seconds the training thread waited in ``_block`` since the process started
    blocked_since_s: float | None = None  # time.time() at which the block in progress began, if any

    def blocked_now_s(self, now_s: float) -> float:
        """``blocked_s`` including the block in progress up to ``now_s`` (``time.time()``), so that a
        heartbeat sent during a long wait reports it as it accrues, not only once it ends."""
        since = self.blocked_since_s
        return self.blocked_s + (max(0.0, now_s - since) if since is not None else 0.0)


class Shared:
    """State of one learner shared by the training thread and the comms thread.

    Under ``lock``: ``stats``, ``open_rounds``, ``base`` and ``newest_versions``. The queues and events
    are thread-safe; ``join_response``, ``newest_versions`` and ``fatal`` are written by the comms thread only.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats = Stats()
        self.link = LinkMeter("learner")  # seconds and bytes of transfers (the comms thread names it)
        # the codec of the next contributions: learners.codec, or a step-down of a link-bound learner
        # (UploadCodecs, written by the comms thread; read whole); None: learners.codec
        self.upload_codec: str | None = None
        # the error-feedback residuals (learners.error_feedback; set with the run's config), else None
        self.feedback: ErrorFeedback | None = None
        self.stop_event = threading.Event()
        self.joined = threading.Event()
        self.ready = threading.Event()  # plan known: versions can be decoded
        self.epoch_changed = threading.Event()  # the synchronizer restarted
        self.join_response: JoinResponse | None = None
        # tokens processed by the run as the synchronizer last told (join and heartbeat answers): the
        # inner lr schedule's progress (policy/schedules.py); written by the comms thread, read whole
        self.run_tokens = 0.0
        self.fatal: str | None = None
        self.fatal_code = 3  # the exit code of a fatal comms error (2: the shard URLs disagree with the run)
        # (fragment, round) -> (version the round builds on, when heard of)
        self.open_rounds: dict[tuple[int, int], tuple[int, float]] = {}
        self.base: dict[int, int] = {}  # fragment -> version adopted
        self.newest_versions: dict[int, VersionInfo] = {}  # the newest told of each fragment (join, heartbeat, push)
        # fragment (as a JSON key) -> contributions whose announcement was given up
        # (learners.announce_timeout_s), since the process started; reported in heartbeats (comms loop only)
        self.undeliverable: collections.Counter[str] = collections.Counter()
        # outcomes of our contributions, for the training thread: (fragment, round, status)
        self.outcomes: queue.Queue[tuple[int, int, str]] = queue.Queue()
        self.adopt_queue: queue.Queue[tuple[VersionInfo, dict[str, torch.Tensor]]] = queue.Queue()
        self.upload_queue: queue.Queue[UploadJob | InnerState | SpooledState] = queue.Queue()
        self.state_spooled = threading.Event()  # a spooled inner state waits for its upload
        self.slices: SliceFeed | None = None  # the leased slices (data.slices; set before ``ready``)
        # fragment-sized buffers were freed on another thread (a download, an upload, a spool): a
        # chance for the training thread to hand the heap's free pages back (InnerLoop.heap_release)
        self.large_frees = threading.Event()
