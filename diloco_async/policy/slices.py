"""The slice ledger: which part of the training tokens each learner may train, and what became of it
(issue 45 item 2; DESIGN §5.2).

The training tokens (``train.bin``, fixed-width records) are cut into ``n_slices`` slices of
``slice_tokens`` tokens each: slice ``s`` is tokens ``[s * slice_tokens, (s + 1) * slice_tokens)``
(the tail shorter than one slice belongs to none). Each slice of the current epoch is in one state:

- ``never reached``: not leased yet in this epoch (the pool's fresh part);
- ``leased``: held by one learner since a time of the injected clock;
- ``trained``: a merged contribution named it (its holder's training reached the global model);
- ``returned``: its lease ended without a merge (the holder's heartbeat lapsed, it restarted, or it
  released a slice no merged contribution named): back in the pool, leased again before fresh ones.

A lease stays *held* after its slice was trained, so the holder's later contributions of other
fragments may still name it, until the holder releases it or is lost. A lease that ends while a
contribution naming it is still in a round (not merged, not thrown away yet) is *releasing*: it
returns only once :meth:`SliceLedger.sweep` is told that no contribution in flight names it, so a
slice is never leased again while a merge could still make it trained. When a lease is asked for and
the pool is empty (nothing fresh, nothing returned), the epoch counter moves on and every slice is
available again, except those still held: each joins the new pool when its lease ends. A slice
still held from an earlier epoch is that epoch's: trained there if a merge names it; if its lease
ends untrained (thrown away) the earlier epoch *owes* it, and it is leased again under that epoch,
before anything else, until a merge trains it there (an epoch that ends while a slice is held under
an older one owes it too). So every epoch trains each of its slices
exactly once, the last few perhaps after the counter moved on (learners never wait for them: a
learner with nothing to train contributes nothing, and rounds that wait for its steps would wait
for ever).

Pure: no I/O; times come from the caller's clock. :meth:`SliceLedger.to_json` and
:meth:`SliceLedger.from_json` carry it through the synchronizer's checkpoints.
"""

from __future__ import annotations

import base64
import zlib
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from diloco_async.config.slices import step_tokens

__all__ = ["SliceLedger", "SliceLease", "NEVER_REACHED", "LEASED", "TRAINED", "RETURNED", "slice_count",
           "slice_header", "header_slices", "slices_needed", "check_corpus_slices"]

NEVER_REACHED, LEASED, TRAINED, RETURNED = 0, 1, 2, 3
_STATE_NAMES = {NEVER_REACHED: "never_reached", LEASED: "leased", TRAINED: "trained", RETURNED: "returned"}


def slice_count(train_tokens: int, slice_tokens: int) -> int:
    """Whole slices of ``slice_tokens`` tokens in ``train_tokens - 1`` tokens (the last token is only
    ever a target), at least 1.

    Raises:
        ValueError: ``slice_tokens`` < 1, or fewer tokens than one slice (naming both).
    """
    if slice_tokens < 1:
        raise ValueError(f"data.slice_tokens={slice_tokens} must be at least 1")
    n = (train_tokens - 1) // slice_tokens
    if n < 1:
        raise ValueError(f"data.slice_tokens={slice_tokens} is larger than the {train_tokens} training tokens: "
                         "not one slice")
    return n


#: slices a learner holds besides those it finished: the one in hand and the next
#: (:data:`diloco_async.learner.slices.PREFETCH_SLICES` + 1)
SLICES_BESIDE_FINISHED = 2


def slices_needed(cfg: Any) -> int:
    """The fewest slices a corpus must hold for ``cfg``'s learners (a
    :class:`~diloco_async.config.schema.Config`): with fewer, they can hold every slice at once. A
    finished slice is handed back only once each fragment's next contribution named it, and the
    last fragment's first round opens after ``synchronizer.sync_every`` inner steps: so each learner
    holds the slices of that many steps (in whole slices), and :data:`SLICES_BESIDE_FINISHED` more.
    This is a floor, not a guarantee: with slow merges the learners can hold more (a finished
    slice waits for contributions in flight too)."""
    h_tokens = cfg.synchronizer.sync_every * step_tokens(cfg)
    finished = -(-h_tokens // cfg.data.slice_tokens)
    return cfg.learners.count * (finished + SLICES_BESIDE_FINISHED)


def check_corpus_slices(cfg: Any, train_tokens: int) -> int:
    """The slices of ``train_tokens`` training tokens under ``cfg`` (``data.slices`` on), checked
    before anything starts: with fewer than :func:`slices_needed` the learners could hold every
    slice, none would have one to step on, no round would open and nothing merged would let the next
    epoch start (the run would stall without a word).

    Raises:
        ValueError: not one slice, or fewer than :func:`slices_needed`, naming ``data.slice_tokens``,
            the corpus's tokens, the learners, the minimum and the largest slice that would do.
    """
    n = slice_count(train_tokens, cfg.data.slice_tokens)
    need = slices_needed(cfg)
    if n < need:
        raise ValueError(
            f"data.slice_tokens={cfg.data.slice_tokens}: the {train_tokens:,} training tokens make {n} slices, "
            f"fewer than the {need} that {cfg.learners.count} learners can hold at once (each holds the slices "
            f"of synchronizer.sync_every={cfg.synchronizer.sync_every} steps of {step_tokens(cfg)} tokens until "
            f"every fragment's contribution named them, and {SLICES_BESIDE_FINISHED} more): every slice could be "
            f"held with none left to train, and the run would stall. Use smaller slices, more data or fewer learners")
    return n


def slice_header(by_learner: dict[str, list[int]]) -> str:
    """The ``slices`` entry of a published version's header: the slices each merged learner's
    contribution named, ``learner:s,s,...`` joined by ``;`` (learners naming none left out); "" for none."""
    return ";".join(f"{lid}:{','.join(map(str, slices))}" for lid, slices in by_learner.items() if slices)


def header_slices(value: str | None) -> dict[str, list[int]]:
    """:func:`slice_header`'s string read back as learner -> slices (``{}`` for None or "").

    Raises:
        ValueError: a slice that is not an integer.
    """
    out: dict[str, list[int]] = {}
    for item in filter(None, (value or "").split(";")):
        learner, _, ids = item.partition(":")
        out[learner] = [int(s) for s in ids.split(",") if s]
    return out


@dataclass
class SliceLease:
    """One slice held by one learner.

    Attributes:
        learner: the holder's id; at_s: when it was leased (the ledger's clock, seconds);
        epoch: the ledger epoch it was leased in; named: a contribution named it;
        trained: a merged contribution named it; releasing: the lease ended, waiting for the
        contributions in flight that name it.
    """

    learner: str
    at_s: float
    epoch: int
    named: bool = False
    trained: bool = False
    releasing: bool = False


class SliceLedger:
    """The slices of one run's training tokens and their states (see the module docstring).

    Args:
        n_slices: slices in the stream (``slice_count``), at least 1.
        slice_tokens: tokens per slice, at least 1.

    Raises:
        ValueError: ``n_slices`` or ``slice_tokens`` below 1 (naming the value).
    """

    def __init__(self, n_slices: int, slice_tokens: int) -> None:
        if n_slices < 1:
            raise ValueError(f"a slice ledger needs at least one slice, got n_slices={n_slices}")
        if slice_tokens < 1:
            raise ValueError(f"data.slice_tokens={slice_tokens} must be at least 1")
        self.n_slices, self.slice_tokens = n_slices, slice_tokens
        self.epoch = 0
        self.state = bytearray(n_slices)  # one of NEVER_REACHED, LEASED, TRAINED, RETURNED, per slice
        self.cursor = 0  # fresh slices start here
        self.requeue: deque[int] = deque()  # returned slices, leased before fresh ones
        self.owed: list[tuple[int, int]] = []  # (slice, earlier epoch) thrown away there: leased first, under it
        self._owed_now: dict[int, int] = {}  # the one being leased (lease's scratch)
        self.leases: dict[int, SliceLease] = {}
        self.counts: Counter[str] = Counter()  # leased, trained, returned, thrown_away, trained_twice, ...

    # -- leasing ------------------------------------------------------------------------------

    def lease(self, learner: str, want: int, now_s: float) -> list[int]:
        """Up to ``want`` slices for ``learner``: those an earlier epoch owes first (leased under that
        epoch), then returned ones, then fresh ones in stream order; when the pool is empty, the next
        epoch starts (every slice not held available again). Fewer (possibly none) when every slice is
        leased.

        Raises:
            ValueError: ``want`` negative.
        """
        if want < 0:
            raise ValueError(f"a lease of {want} slices")
        out: list[int] = []
        while len(out) < want:
            s = self._next_available()
            if s is None and self._refill():
                s = self._next_available()
            if s is None:
                break
            epoch = self._owed_now.pop(s, self.epoch)
            if epoch == self.epoch:
                self.state[s] = LEASED
            self.leases[s] = SliceLease(learner, now_s, epoch)
            self.counts["leased"] += 1
            out.append(s)
        return out

    def _next_available(self) -> int | None:
        for i, (s, epoch) in enumerate(self.owed):  # an earlier epoch's first
            if s not in self.leases:
                del self.owed[i]
                self._owed_now[s] = epoch
                return s
        while self.requeue:
            s = self.requeue.popleft()
            if self.state[s] in (RETURNED, NEVER_REACHED) and s not in self.leases:
                return s
        while self.cursor < self.n_slices:
            s = self.cursor
            self.cursor += 1
            if self.state[s] == NEVER_REACHED and s not in self.leases:
                return s
        return None

    def _refill(self) -> bool:
        """The next epoch, when some slice was trained; False when there is nothing to refill with."""
        if TRAINED not in self.state:
            return False
        for s, lease in self.leases.items():  # held under an earlier epoch all this one: this one owes it too
            if lease.epoch < self.epoch:
                self.owed.append((s, self.epoch))
                self.counts["owed"] += 1
        self.epoch += 1
        self.counts["epochs_refilled"] += 1
        self.cursor = 0
        self.requeue.clear()
        for s in range(self.n_slices):  # held ones stay their epoch's until their lease ends (sweep)
            self.state[s] = LEASED if s in self.leases else NEVER_REACHED
        return True

    # -- contributions ------------------------------------------------------------------------

    def not_held(self, learner: str, slices: Iterable[int]) -> list[int]:
        """The slices of ``slices`` that ``learner`` does not hold now (a lease that ended, or never
        was), in the order given."""
        out = []
        for s in slices:
            lease = self.leases.get(s)
            if lease is None or lease.learner != learner or lease.releasing:
                out.append(s)
        return out

    def named(self, learner: str, slices: Iterable[int]) -> None:
        """An announcement of ``learner`` named ``slices`` (held ones are marked ``named``)."""
        for s in slices:
            lease = self.leases.get(s)
            if lease is not None and lease.learner == learner:
                lease.named = True

    def merged(self, learner: str, slices: Iterable[int]) -> list[int]:
        """A merged contribution of ``learner`` named ``slices``: those it holds become trained (a
        slice already trained under this lease stays so). Returns the slices newly trained. A named
        slice held by nobody or by another learner is counted (``merged_not_held``), never trained."""
        newly = []
        for s in slices:
            lease = self.leases.get(s)
            if lease is None or lease.learner != learner:
                self.counts["merged_not_held"] += 1
                continue
            lease.named = True
            if lease.trained:
                continue
            lease.trained = True
            if lease.epoch == self.epoch:
                if self.state[s] == TRAINED:
                    self.counts["trained_twice"] += 1  # never expected: counted so that a test can see it
                self.state[s] = TRAINED
            self.counts["trained"] += 1
            newly.append(s)
        return newly

    # -- ends of leases -----------------------------------------------------------------------

    def release(self, learner: str, slices: Iterable[int]) -> list[int]:
        """``learner`` is done with ``slices`` (no contribution of it will name them again): their
        leases end once no contribution in flight names them (:meth:`sweep`; the untrained ones then
        return to the pool). Slices it does not hold are ignored. Returns the slices whose lease is ending."""
        out = []
        for s in slices:
            lease = self.leases.get(s)
            if lease is not None and lease.learner == learner and not lease.releasing:
                self._end(s, lease)
                out.append(s)
        return out

    def learner_lost(self, learner: str) -> list[int]:
        """Every lease of ``learner`` ends (its heartbeat lapsed, it restarted, the run stopped):
        :meth:`release` of all it holds. Returns those slices."""
        return self.release(learner, [s for s, lease in self.leases.items() if lease.learner == learner])

    def held_by(self, learner: str) -> list[int]:
        """The slices ``learner`` holds now, in ascending order."""
        return sorted(s for s, lease in self.leases.items() if lease.learner == learner and not lease.releasing)

    def _end(self, s: int, lease: SliceLease) -> None:
        lease.releasing = True  # kept until no contribution in flight names it (sweep), trained or not

    def sweep(self, in_flight: Iterable[int]) -> list[int]:
        """End every releasing lease that no contribution in flight names (``in_flight``: the slices
        named by contributions accepted and not yet merged or thrown away); its slice returns to the
        pool unless it was trained, counted ``returned``, and ``thrown_away`` when a contribution had
        named it (training was done on it and discarded). Returns the slices whose lease ended."""
        busy = set(in_flight)
        done = [s for s, lease in self.leases.items() if lease.releasing and s not in busy]
        for s in done:
            lease = self.leases.pop(s)
            if lease.trained:  # a merge came while it was releasing
                if lease.epoch != self.epoch:
                    self._back_to_pool(s, counted=False)
                continue
            if lease.named:
                self.counts["thrown_away"] += 1
            if lease.epoch != self.epoch:  # its epoch still owes it (and this one has not trained it either)
                self.owed.append((s, lease.epoch))
                self.counts["owed"] += 1
            self._back_to_pool(s, counted=True)
        return done

    def releasing(self) -> bool:
        """Whether some lease waits in :meth:`sweep`."""
        return any(lease.releasing for lease in self.leases.values())

    def _back_to_pool(self, s: int, *, counted: bool) -> None:
        self.state[s] = RETURNED if counted else NEVER_REACHED
        self.requeue.append(s)
        if counted:
            self.counts["returned"] += 1

    def mark_trained(self, slices: Iterable[int]) -> list[int]:
        """Slices a merge made trained that the ledger did not record (a version published after the
        checkpoint this ledger was restored from): trained now, whatever their lease. Returns them."""
        out = []
        for s in slices:
            if not 0 <= s < self.n_slices or self.state[s] == TRAINED:
                continue
            lease = self.leases.get(s)
            if lease is not None:
                lease.trained, lease.named = True, True
            self.state[s] = TRAINED
            self.counts["trained"] += 1
            out.append(s)
        return out

    # -- figures and checkpoints --------------------------------------------------------------

    def tokens_of(self, s: int) -> tuple[int, int]:
        """Slice ``s`` as (first token, token count).

        Raises:
            ValueError: ``s`` outside ``[0, n_slices)``.
        """
        if not 0 <= s < self.n_slices:
            raise ValueError(f"slice {s} outside [0, {self.n_slices})")
        return s * self.slice_tokens, self.slice_tokens

    def states(self) -> dict[str, list[int]]:
        """Every slice of the current epoch by state name (for tests and tools)."""
        out: dict[str, list[int]] = {name: [] for name in _STATE_NAMES.values()}
        for s, code in enumerate(self.state):
            out[_STATE_NAMES[code]].append(s)
        return out

    def figures(self) -> dict:
        """The accounting of summary.json and ``/status``: slices and tokens trained (merged), thrown
        away (trained on, never merged, returned), re-queued (returned to the pool), the slices of
        this epoch never reached, leased now, the epoch, and the slices earlier epochs still owe."""
        n = self.slice_tokens
        c = self.counts
        return {"slice_tokens": n, "slices": self.n_slices, "slices_epoch": self.epoch,
                "slices_trained": c["trained"], "tokens_trained": c["trained"] * n,
                "slices_thrown_away": c["thrown_away"], "tokens_thrown_away": c["thrown_away"] * n,
                "slices_requeued": c["returned"], "tokens_requeued": c["returned"] * n,
                "slices_never_reached": self.state.count(NEVER_REACHED),
                "slices_leased_now": len(self.leases), "slices_leased_total": c["leased"],
                "slices_trained_twice": c["trained_twice"], "slices_merged_not_held": c["merged_not_held"],
                "slices_owed": len(self.owed)}

    def to_json(self) -> dict:
        """Plain data (JSON) that :meth:`from_json` reads back: states (zlib + base64), cursor,
        re-queue, the slices earlier epochs owe, leases, counts, epoch."""
        return {"n_slices": self.n_slices, "slice_tokens": self.slice_tokens, "epoch": self.epoch,
                "cursor": self.cursor, "state": base64.b64encode(zlib.compress(bytes(self.state))).decode(),
                "requeue": list(self.requeue), "owed": [list(debt) for debt in self.owed],
                "leases": {str(s): [ls.learner, ls.at_s, ls.epoch, ls.named, ls.trained, ls.releasing]
                           for s, ls in self.leases.items()},
                "counts": dict(self.counts)}

    @classmethod
    def from_json(cls, doc: dict) -> SliceLedger:
        """The ledger :meth:`to_json` wrote.

        Raises:
            ValueError: a document that is not one (wrong state length, a slice out of range).
        """
        ledger = cls(int(doc["n_slices"]), int(doc["slice_tokens"]))
        state = zlib.decompress(base64.b64decode(doc["state"]))
        if len(state) != ledger.n_slices or any(b > RETURNED for b in set(state)):
            raise ValueError(f"slice ledger: {len(state)} states for {ledger.n_slices} slices")
        ledger.state = bytearray(state)
        ledger.epoch, ledger.cursor = int(doc["epoch"]), int(doc["cursor"])
        ledger.requeue = deque(int(s) for s in doc["requeue"])
        ledger.owed = [(int(s), int(e)) for s, e in doc.get("owed", [])]  # (absent from older checkpoints)
        for key, (learner, at_s, epoch, named, trained, releasing) in doc["leases"].items():
            s = int(key)
            if not 0 <= s < ledger.n_slices:
                raise ValueError(f"slice ledger: lease of slice {s} outside [0, {ledger.n_slices})")
            ledger.leases[s] = SliceLease(str(learner), float(at_s), int(epoch), bool(named), bool(trained),
                                          bool(releasing))
        ledger.counts.update({str(k): int(v) for k, v in doc["counts"].items()})
        return ledger
