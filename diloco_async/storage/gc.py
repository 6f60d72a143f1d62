"""Garbage collection of a run behind its newest verified checkpoint (DESIGN §5).

What a resume needs is the newest checkpoint that verifies (the one :func:`latest_checkpoint`
picks) and what its manifest names. Behind it:

* global versions ``globals/p{p}/v{v}`` older than both the manifest's current version of ``p``
  and every version its ``version_refs`` still name are deleted;
* contributions ``contrib/p{p}/r{n}/...`` of rounds before ``next_round[p] - 1`` are deleted
  (the round just before the next one is kept, to be conservative);
* checkpoints older than it, beyond the ``keep_checkpoints - 1`` newest complete ones, are
  deleted manifest first (so a half-deleted checkpoint never counts).

Independently of checkpoints, leftovers of writers that died mid-upload (local temporary files,
incomplete S3 multipart uploads: :mod:`diloco_async.storage.orphans`) under the run's prefix are removed once
older than ``orphan_age_s`` (default 24 h); younger ones may be live uploads and are left alone.

With synchronizer shards (DESIGN §2.2) a shard collects behind the checkpoint of its own that the
run's newest run checkpoint names (:class:`ShardScope`; diloco_async/storage/run_checkpoints.py), since that is
what a resume of the whole run restores: its checkpoints under its own root, and under the run's
root the versions and contributions of its own fragments, the only ones its manifest mentions.

Never deleted: the newest verified checkpoint (a shard's: the one named), any checkpoint newer than
it (it may be in progress), ``plan.json``/``config.json``, learners' own state, keys this module cannot parse,
anything of a fragment the manifest does not mention, and the versions (and their compact forms)
named in ``keep_versions``: those live learners were told to read and may not have finished
reading (the synchronizer's read leases, :class:`diloco_async.policy.catchup.ReadLeases`). A
listing that lags behind only makes collection delete less.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from diloco_async.storage import keys
from diloco_async.storage.checkpoint import Checkpoint, latest_checkpoint, verify_checkpoint
from diloco_async.storage.orphans import drop_orphan, find_orphans
from diloco_async.storage.store import IntegrityError, ObjectStore

__all__ = ["GcReport", "ShardScope", "collect_garbage", "DEFAULT_ORPHAN_AGE_S"]

log = logging.getLogger("diloco.storage.gc")

#: leftover uploads idle (local) or started (S3) longer ago than this are collected, seconds
DEFAULT_ORPHAN_AGE_S = 24 * 3600.0


@dataclass(frozen=True)
class ShardScope:
    """What a synchronizer shard's collection covers: the run whose versions and contributions it
    collects (``run_id``; the shard's checkpoints lie under ``{run_id}/shards/{I:03d}``), and its
    checkpoint to collect behind (``behind``, the one the run's newest run checkpoint names; it
    must verify, else nothing is deleted; checkpoints newer than it are kept)."""

    run_id: str
    behind: int


@dataclass
class GcReport:
    """What one collection did (or would do, with ``dry_run``).

    Attributes:
        checkpoint: the newest verified checkpoint (protected), or None (nothing deleted).
        reason: why collection stopped where it did, in words.
        deleted: objects deleted by kind (``contrib``, ``globals``, ``checkpoints``, and the
            leftovers ``temp_file`` and ``multipart_upload``).
        deleted_nbytes: bytes deleted by kind.
        deleted_checkpoints: sequence numbers of the checkpoints removed.
        kept_checkpoints: sequence numbers of the checkpoints left.
        kept_for_reads: objects (versions and compact forms) behind the floor left for the
            learners' reads (``keep_versions``).
    """

    run_id: str
    checkpoint: int | None
    reason: str
    dry_run: bool = False
    deleted: dict[str, int] = field(default_factory=lambda: collections.Counter())
    deleted_nbytes: dict[str, int] = field(default_factory=lambda: collections.Counter())
    deleted_checkpoints: list[int] = field(default_factory=list)
    kept_checkpoints: list[int] = field(default_factory=list)
    kept_for_reads: int = 0

    @property
    def objects(self) -> int:
        return sum(self.deleted.values())

    @property
    def nbytes(self) -> int:
        return sum(self.deleted_nbytes.values())


def collect_garbage(store: ObjectStore, run_id: str, *, keep_checkpoints: int = 2, dry_run: bool = False,
                    orphan_age_s: float | None = DEFAULT_ORPHAN_AGE_S,
                    clock: Callable[[], float] = time.time,
                    keep_versions: Mapping[int, Collection[int]] | None = None,
                    shard: ShardScope | None = None) -> GcReport:
    """Delete what no resume from the newest verified checkpoint can need, and leftover uploads.

    Args:
        store: the store holding the run.
        run_id: the run under ``{store}/{run_id}/``.
        keep_checkpoints: complete checkpoints to keep, counting the newest verified one (>= 1).
        dry_run: report without deleting.
        orphan_age_s: leftover uploads older than this many seconds are removed (None: none).
        clock: wall-clock seconds since the epoch, for the leftovers' ages.
        keep_versions: fragment -> versions never deleted (with their compact forms), whatever the floor.
        shard: ``run_id`` is a synchronizer shard's root: collect behind the checkpoint the scope
            names and in the versions and contributions of the run it names.

    Raises:
        ValueError: ``keep_checkpoints`` < 1, or a negative ``orphan_age_s``.
    """
    if keep_checkpoints < 1:
        raise ValueError(f"keep_checkpoints must be >= 1, got {keep_checkpoints}")
    if orphan_age_s is not None and orphan_age_s < 0:
        raise ValueError(f"orphan_age_s must be >= 0 seconds, got {orphan_age_s}")
    newest = latest_checkpoint(store, run_id, load=False) if shard is None else _verified(store, run_id, shard.behind)
    if newest is None:
        report = GcReport(run_id, None, "no verified checkpoint: nothing deleted but leftover uploads", dry_run)
        _collect_orphans(store, run_id, orphan_age_s, clock, report)
        return report
    report = GcReport(run_id, newest.seq, f"behind verified checkpoint {newest.seq}", dry_run)
    _collect_orphans(store, run_id, orphan_age_s, clock, report)
    doomed = _old_checkpoints(store, run_id, newest.seq, keep_checkpoints, report)  # (kind, key, nbytes), in order
    doomed += _behind_floors(store, run_id if shard is None else shard.run_id, newest.manifest,
                             {str(p): set(vs) for p, vs in (keep_versions or {}).items()}, report)

    for kind, key, nbytes in doomed:
        if not dry_run:
            store.delete(key)
        report.deleted[kind] += 1
        report.deleted_nbytes[kind] += nbytes
    log.info("gc %s: %s; %s %d objects, %d bytes (%s); checkpoints kept %s; %d objects kept for learners' reads",
             run_id, report.reason, "would delete" if dry_run else "deleted", report.objects, report.nbytes,
             dict(report.deleted), report.kept_checkpoints, report.kept_for_reads)
    return report


def _behind_floors(store: ObjectStore, data: str, manifest: dict, kept: Mapping[str, set[int]],
                   report: GcReport) -> list[tuple[str, str, int]]:
    """The versions, compact versions and contributions of run ``data`` behind what ``manifest``
    still needs, of the fragments it mentions, but not the versions ``kept`` (counted in ``report``)."""
    version_floor = _version_floors(manifest)
    round_floor = {p: int(n) - 1 for p, n in manifest.get("next_round", {}).items()}
    doomed = []
    for kind, prefix, parse, floors in (
            ("globals", keys.versions_prefix(data), keys.parse_version_key, version_floor),
            ("compact", keys.compact_prefix(data), keys.parse_compact_key, version_floor),
            ("contrib", keys.contributions_prefix(data), keys.parse_contribution_key, round_floor)):
        for key, nbytes in sorted(store.sizes(prefix).items()):
            parsed = parse(data, key)
            if parsed is None:
                continue
            p, n = str(parsed[0]), parsed[1]
            if p in floors and n < floors[p]:
                if kind != "contrib" and n in kept.get(p, ()):
                    report.kept_for_reads += 1  # a live learner may still be reading it
                    continue
                doomed.append((kind, key, nbytes))
    return doomed


def _verified(store: ObjectStore, run_id: str, seq: int) -> Checkpoint | None:
    """Checkpoint ``seq`` of ``run_id`` verified (state streamed, not kept), or None (logged)."""
    try:
        return verify_checkpoint(store, run_id, seq)
    except (FileNotFoundError, IntegrityError, ValueError) as err:
        log.warning("gc %s: checkpoint %d to collect behind does not verify (%s): nothing deleted", run_id, seq, err)
        return None


def _collect_orphans(store: ObjectStore, run_id: str, older_than_s: float | None, clock: Callable[[], float],
                     report: GcReport) -> None:
    """Remove (or count, on a dry run) the run's leftover uploads older than ``older_than_s``."""
    if older_than_s is None:
        return
    for orphan in find_orphans(store, run_id, older_than_s, clock):
        if not report.dry_run:
            drop_orphan(store, orphan)
        log.info("gc %s: %s %s %s (%.0f s old)", run_id, "would remove" if report.dry_run else "removed",
                 orphan.kind, orphan.path, orphan.age_s)
        report.deleted[orphan.kind] += 1
        report.deleted_nbytes[orphan.kind] += orphan.nbytes


def _version_floors(manifest: dict) -> dict[str, int]:
    """Per fragment, the oldest version the checkpoint may still need."""
    floors = {}
    refs = manifest.get("version_refs", {})
    for p, v in manifest.get("versions", {}).items():
        named = [int(x) for x in refs.get(p, {})]
        floors[str(int(p))] = min([int(v), *named])
    return floors


def _old_checkpoints(store: ObjectStore, run_id: str, protected: int, keep: int,
                     report: GcReport) -> list[tuple[str, str, int]]:
    prefix = keys.checkpoint_prefix(run_id)
    files: dict[int, dict[str, int]] = collections.defaultdict(dict)
    for key, nbytes in store.sizes(prefix).items():
        seq = keys.state_seq_of(prefix, key)
        if seq is not None:
            files[seq][key] = nbytes
    older_complete = [s for s in sorted(files, reverse=True)
                      if s < protected and keys.checkpoint_manifest_key(run_id, s) in files[s]]
    keep_seqs = {s for s in files if s >= protected} | set(older_complete[: keep - 1])
    report.kept_checkpoints = sorted(keep_seqs)
    doomed = []
    for seq in sorted(set(files) - keep_seqs):
        report.deleted_checkpoints.append(seq)
        # the manifest goes first: from then on the checkpoint no longer counts
        manifest = keys.checkpoint_manifest_key(run_id, seq)
        for key in sorted(files[seq], key=lambda k: (k != manifest, k)):
            doomed.append(("checkpoints", key, files[seq][key]))
    return doomed
