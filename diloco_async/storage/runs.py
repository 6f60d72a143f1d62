"""What a store holds: its runs, and for each its checkpoints and their state, the newest version of
each fragment and whether it finished (``diloco-async runs ls``).

A run is a folder of the store root with a ``config.json`` (:func:`diloco_async.storage.keys.config_key`). Its
checkpoints are the state folders under :func:`diloco_async.storage.keys.checkpoint_prefix`; each is in one of
these states:

* ``partial``: objects but no manifest (a write that did not finish); it never counts.
* ``unverified``: a manifest; its state file was not read (``verify=False``, the default, reads
  only the checkpoint a resume would continue from).
* ``verified``: the state file has the size and sha256 its manifest names.
* ``corrupt``: the manifest is unreadable, or the state file is missing, short or has another digest.

The checkpoint a resume continues from is :func:`diloco_async.storage.checkpoint.latest_checkpoint`'s (so this
listing and ``resume`` never disagree). A run is ``finished`` when the summary of its newest
synchronizer process (the one with the highest ``last_checkpoint_seq``) covers its newest
checkpoint and says no signal stopped it; ``stopped`` when a signal did (Ctrl-C, a cancellation:
resumable); ``unfinished`` otherwise (running, or ended without a summary).

A run whose synchronizer is S > 1 shards (``synchronizer.shards`` in its ``config.json``) lists its
*run checkpoints* (:mod:`diloco_async.storage.run_checkpoints`: one manifest naming a checkpoint per shard),
in the same states, the one a resume continues from being
:func:`~diloco_async.storage.run_checkpoints.latest_run_checkpoint`'s; it is ``finished`` when every shard's
newest summary covers that shard's newest checkpoint and no signal stopped any, ``stopped`` when a
signal stopped one, ``unfinished`` otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_checkpoint, list_checkpoint_seqs, verify_checkpoint
from diloco_async.storage.run_checkpoints import latest_run_checkpoint, list_run_manifest_seqs, open_run_checkpoint
from diloco_async.storage.store import IntegrityError, ObjectStore

__all__ = ["CheckpointInfo", "RunInfo", "run_ids", "describe_run", "describe_store"]

log = logging.getLogger("diloco.runs")


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint of a run: its sequence number, state (see the module docstring), and from its
    manifest the lease epoch, the global step and each fragment's version (fragment -> version)."""

    seq: int
    state: str
    lease_epoch: int | None = None
    global_step: int | None = None
    versions: dict[int, int] = field(default_factory=dict)
    resume: bool = False  # the one ``diloco-async resume {store}/{run_id}`` continues from
    detail: str = ""  # why it is corrupt
    shard_seqs: dict[int, int] = field(default_factory=dict)  # a run checkpoint: shard -> its checkpoint


@dataclass(frozen=True)
class RunInfo:
    """One run of a store.

    Attributes:
        run_id: the run's folder.
        url: ``{store}/{run_id}``, what ``diloco-async resume`` takes.
        status: ``finished``, ``stopped`` or ``unfinished`` (see the module docstring).
        stop_reason: the newest summary's ``stop_reason`` (None when ``unfinished``).
        newest_versions: fragment -> the newest version published in the store (the fragment count
            is its length).
        checkpoints: every checkpoint (with S > 1 shards: every run checkpoint), newest sequence first.
        shards: the run's synchronizer shards (``synchronizer.shards``).
    """

    run_id: str
    url: str
    status: str
    stop_reason: str | None
    newest_versions: dict[int, int]
    checkpoints: list[CheckpointInfo]
    shards: int = 1

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    @property
    def resume_seq(self) -> int | None:
        return next((c.seq for c in self.checkpoints if c.resume), None)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (fragment numbers as strings, as in the manifests)."""
        doc = asdict(self)
        doc["newest_versions"] = {str(p): v for p, v in self.newest_versions.items()}
        for c in doc["checkpoints"]:
            c["versions"] = {str(p): v for p, v in c["versions"].items()}
            c["shard_seqs"] = {str(i): q for i, q in c["shard_seqs"].items()}
        return {**doc, "finished": self.finished, "resume_seq": self.resume_seq}


def run_ids(store: ObjectStore) -> list[str]:
    """The runs of the store: root folders holding a ``config.json``, sorted (ids start with their date)."""
    return sorted(f for f in store.folders() if store.exists(keys.config_key(f)))


def _checkpoint(store: ObjectStore, run_id: str, seq: int, resume_seq: int | None, verify: bool) -> CheckpointInfo:
    try:
        manifest = store.get_json(keys.checkpoint_manifest_key(run_id, seq))
        versions = {int(p): int(v) for p, v in (manifest.get("versions") or {}).items()}
        lease, step = int(manifest.get("lease_epoch") or 0), manifest.get("global_step")
    except FileNotFoundError:
        return CheckpointInfo(seq, "partial")
    except (ValueError, TypeError, AttributeError) as err:
        return CheckpointInfo(seq, "corrupt", detail=f"unreadable manifest ({err})")
    state, detail = "verified" if seq == resume_seq else "unverified", ""
    if verify and seq != resume_seq:
        try:
            verify_checkpoint(store, run_id, seq)
            state = "verified"
        except (FileNotFoundError, IntegrityError, ValueError, KeyError) as err:
            state, detail = "corrupt", f"{type(err).__name__}: {err}"
    return CheckpointInfo(seq, state, lease, step, versions, seq == resume_seq, detail)


def _covered(summary: dict) -> int:
    """The last checkpoint a summary's synchronizer process wrote (-1: none)."""
    seq = summary.get("last_checkpoint_seq")
    return -1 if seq is None else int(seq)


def _run_checkpoint(store: ObjectStore, run_id: str, shards: int, seq: int, resume_seq: int | None,
                    verify: bool) -> CheckpointInfo:
    """Run checkpoint ``seq`` of a run of ``shards`` shards, as :func:`_checkpoint` gives one checkpoint."""
    try:
        doc = store.get_json(keys.run_manifest_key(run_id, seq))
        named = {int(i): e for i, e in (doc.get("checkpoints") or {}).items()}
        versions = {int(p): int(v) for e in named.values() for p, v in (e.get("versions") or {}).items()}
        lease = max((int(e.get("lease_epoch") or 0) for e in named.values()), default=0)
        shard_seqs = {i: int(e["seq"]) for i, e in sorted(named.items())}
    except FileNotFoundError:
        return CheckpointInfo(seq, "partial")
    except (ValueError, TypeError, AttributeError, KeyError) as err:
        return CheckpointInfo(seq, "corrupt", detail=f"unreadable run manifest ({err})")
    state, detail = "verified" if seq == resume_seq else "unverified", ""
    if verify and seq != resume_seq:
        try:
            open_run_checkpoint(store, run_id, shards, seq)
            state = "verified"
        except ValueError as err:
            state, detail = "corrupt", str(err)
    return CheckpointInfo(seq, state, lease, None, dict(sorted(versions.items())), seq == resume_seq, detail,
                          shard_seqs)


def _shards_status(store: ObjectStore, run_id: str, shards: int) -> tuple[str, str | None]:
    """(status, stop reason) of a run of ``shards`` shards from each shard's newest summary."""
    reasons = []
    for i in range(shards):
        root = keys.synchronizer_root(run_id, i, shards)
        summary = _newest_summary(store, root)
        newest = max(list_checkpoint_seqs(store, root), default=-1)
        if summary is None or _covered(summary) < newest:
            return "unfinished", None
        reasons.append(str(summary.get("stop_reason") or ""))
    stopped = next((r for r in reasons if r.startswith("signal")), None)
    return ("stopped", stopped) if stopped else ("finished", reasons[0] or None)


def _newest_summary(store: ObjectStore, run_id: str) -> dict | None:
    """The summary of the newest synchronizer process under root ``run_id`` (a run's, or a shard's:
    :func:`diloco_async.storage.keys.synchronizer_root`; highest ``last_checkpoint_seq``), or None."""
    found = []
    for key in store.list(f"{run_id}/epochs/"):
        if key.endswith("/summary.json"):
            try:
                found.append(store.get_json(key))
            except (FileNotFoundError, ValueError) as err:
                log.warning("run %s: unreadable summary %s (%s)", run_id, key, err)
    return max(found, key=_covered, default=None)


def describe_run(store: ObjectStore, run_id: str, verify: bool = False) -> RunInfo:
    """What the store holds of ``run_id`` (see the module docstring). ``verify``: read every
    checkpoint's state file (its size and sha256), not only the one a resume continues from.

    Raises:
        OSError (or a backend error): the store could not be listed or read.
    """
    shards = _shards_of(store, run_id)
    if shards > 1:
        target = latest_run_checkpoint(store, run_id, shards)
        resume_seq = None if target is None else target.seq
        checkpoints = [_run_checkpoint(store, run_id, shards, seq, resume_seq, verify)
                       for seq in reversed(list_run_manifest_seqs(store, run_id))]
    else:
        target = latest_checkpoint(store, run_id, load=False)
        resume_seq = None if target is None else target.seq
        checkpoints = [_checkpoint(store, run_id, seq, resume_seq, verify)
                       for seq in reversed(list_checkpoint_seqs(store, run_id))]
    newest: dict[int, int] = {}
    for key in store.list(keys.versions_prefix(run_id)):
        if (pv := keys.parse_version_key(run_id, key)) is not None:
            newest[pv[0]] = max(newest.get(pv[0], -1), pv[1])
    if shards > 1:
        status, reason = _shards_status(store, run_id, shards)
    else:
        summary = _newest_summary(store, run_id)
        newest_seq = max((c.seq for c in checkpoints if c.state != "partial"), default=-1)
        if summary is None or _covered(summary) < newest_seq:
            status, reason = "unfinished", None  # a summary older than the newest checkpoint: a resume went on
        else:
            reason = summary.get("stop_reason")
            status = "stopped" if str(reason or "").startswith("signal") else "finished"
    return RunInfo(run_id, f"{store.url}/{run_id}", status, reason, dict(sorted(newest.items())), checkpoints,
                   shards)


def _shards_of(store: ObjectStore, run_id: str) -> int:
    """``synchronizer.shards`` of the run's ``config.json`` (1 when absent or unreadable)."""
    try:
        return int(((store.get_json(keys.config_key(run_id)) or {}).get("synchronizer") or {}).get("shards") or 1)
    except (FileNotFoundError, ValueError, TypeError, AttributeError):
        return 1


def describe_store(store: ObjectStore, verify: bool = False) -> list[RunInfo]:
    """:func:`describe_run` of every run of the store, by run id."""
    return [describe_run(store, run_id, verify) for run_id in run_ids(store)]
