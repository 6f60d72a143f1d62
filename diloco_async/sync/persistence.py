"""The synchronizer's durable state (DESIGN §5): the initial publish, checkpoint payloads, and
resume (open a checkpoint URL, restore the actor's components from it). The functions take the
components they read or set (:mod:`~diloco_async.sync.fragment_book`, the round table, the learner
registry, the reporter, the checkpoint book), never the actor.

The functions here are blocking (store calls) except :func:`checkpoint_payload`; the actor runs
the blocking ones before serving.
"""

from __future__ import annotations

import json
import logging
import time
from functools import partial

import torch

from diloco_async.codec import wire
from diloco_async.config.guard import weight_ramp_as_stored
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config, config_differences, config_hash
from diloco_async.policy.rounds import budget_spent_at_checkpoint
from diloco_async.policy.shards import assignment
from diloco_async.policy.slices import header_slices
from diloco_async.protocol.versions import VersionHistory, read_version
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import (
    Checkpoint,
    latest_checkpoint,
    list_checkpoint_seqs,
    load_checkpoint,
    tensor_key,
)
from diloco_async.storage.run_checkpoints import open_run_checkpoint
from diloco_async.storage.store import IntegrityError, ObjectRef, ObjectStore, object_digest
from diloco_async.sync.context import ActorContext
from diloco_async.sync.fragment_book import FragmentBook
from diloco_async.sync.learners import LearnerRegistry
from diloco_async.sync.reporting import Reporter
from diloco_async.sync.rounds import RoundTable
from diloco_async.sync.slices import SliceDesk
from diloco_async.sync.state import CheckpointBook, FragmentState
from diloco_async.sync.work import put_version

__all__ = ["publish_initial", "stored_config", "open_checkpoint", "no_such_run", "restore", "checkpoint_payload"]

log = logging.getLogger("diloco.synchronizer")


def publish_initial(ctx: ActorContext, book: FragmentBook) -> None:
    """Write plan.json, config.json and version 0 of every fragment of ``book`` (blocking; call once).

    With ``synchronizer.shards > 1`` the first shard to start writes plan.json and config.json
    and the others find them equal to their own (:func:`check_assignment` first).

    Raises:
        ValueError: another shard wrote a different plan, config or assignment.
    """
    check_assignment(ctx, book)
    _put_or_same(ctx, keys.plan_key(ctx.run_id), {
        "run_id": ctx.run_id, "plan": book.plan.to_json(), "schema_hash": book.plan.schema_hash,
        "config_hash": config_hash(ctx.cfg),
    })
    _put_or_same(ctx, keys.config_key(ctx.run_id), ctx.cfg.public_dict())
    for f in book:
        f.refs[0] = put_version(ctx.store, ctx.run_id, f.p, 0, f.current, lease_epoch=ctx.lease_epoch)
    log.info("synchronizer run=%s: %d fragments, schema %s…", ctx.run_id, book.plan.num_fragments,
             book.plan.schema_hash[:12])


def _put_or_same(ctx: ActorContext, key: str, doc: dict) -> None:
    """Create ``key``; with shards, one that another shard created must hold ``doc`` too."""
    try:
        ctx.store.put_json(key, doc)
    except FileExistsError:
        if ctx.sc.shards == 1:
            raise
        if ctx.store.get_json(key) != json.loads(json.dumps(doc)):
            raise ValueError(f"{ctx.store.url}/{key} was written by another shard with other contents than "
                             f"shard {ctx.shard}'s") from None


def check_assignment(ctx: ActorContext, book: FragmentBook) -> None:
    """With ``synchronizer.shards > 1``: create the run's shard assignment ``{run_id}/shards.json``
    (``{"shards", "fragments": {shard: [fragment, ...]}, "schema_hash"}``; exclusive create: the
    first shard to start writes it), or read the one there and refuse to serve under another
    (blocking). With one shard nothing is read or written.

    Raises:
        ValueError: the stored assignment differs from this synchronizer's (the message names both).
    """
    sc = ctx.sc
    if sc.shards == 1:
        return
    mine = {"shards": sc.shards, "schema_hash": book.plan.schema_hash,
            "fragments": {str(i): f for i, f in assignment(sc.shards, book.plan.num_fragments).items()}}
    key = keys.shards_manifest_key(ctx.run_id)
    try:
        ctx.store.put_json(key, mine)
        log.info("run %s: shard assignment written (%d shards)", ctx.run_id, sc.shards)
        return
    except FileExistsError:
        stored = ctx.store.get_json(key)
    for field in ("shards", "fragments", "schema_hash"):
        if stored.get(field) != mine[field]:
            raise ValueError(f"{ctx.store.url}/{key} assigns {field}={stored.get(field)!r}, but shard {ctx.shard} "
                             f"has {field}={mine[field]!r}: a run keeps the shard assignment it started with")


def stored_config(url: str, storage_options: dict) -> dict:
    """The run's own ``config.json`` (public fields, plain data) from the store of a checkpoint URL,
    for a resume without a recipe: the entry point applies the user's overrides to it once
    (``load_config(None, overrides, base=...)``).

    Raises:
        ValueError: the URL is malformed, or the store holds no such run (the message lists the runs it holds).
    """
    root, run_id, _ = keys.split_checkpoint_url(url)
    try:
        return ObjectStore(root, storage_options).get_json(keys.config_key(run_id))
    except FileNotFoundError:
        raise ValueError(no_such_run(ObjectStore(root, storage_options), run_id)) from None


def open_checkpoint(url: str, cfg: Config | None, storage_options: dict,
                    shard: int = 0) -> tuple[Config, ObjectStore, str, Checkpoint]:
    """Resolve a checkpoint URL into (config, store, run id, verified checkpoint).

    With ``synchronizer.shards > 1`` the checkpoint is shard ``shard``'s (under
    :func:`diloco_async.storage.keys.synchronizer_root`): without a sequence number its newest that verifies (a
    shard restarted alone); with one, the checkpoint of that shard that run checkpoint ``seq``
    names (``run-{seq}.json``, verified whole: diloco_async/storage/run_checkpoints.py), so every shard of one
    resume restores the same run checkpoint.

    ``cfg`` is the resolved config of the resume (a recipe or the run's stored config, with the
    user's overrides applied once by the entry point), or None for the run's own ``config.json``
    as it is; either way ``run.store`` becomes the URL's store. Training fields must match the
    checkpoint's (a budget may be extended).

    Raises:
        ValueError: ``shard`` is outside ``[0, shards)``, nothing verifies at that URL, the URL is
            malformed, the config differs from the
            checkpoint's, or the checkpoint already spent the budget (the message names the override
            that extends it).
    """
    root, run_id, seq = keys.split_checkpoint_url(url)
    if cfg is None:
        raw = stored_config(url, storage_options)
        raw["run"]["store"] = root
        cfg = Config.model_validate(weight_ramp_as_stored(raw))  # a run stored before the field resumes as trained
    elif cfg.run.store != root:
        cfg = with_fields(cfg, {"run.store": root})
    store = ObjectStore(root, {**cfg.run.storage_options, **storage_options})
    owner = keys.synchronizer_root(run_id, shard, cfg.synchronizer.shards)
    if seq is None:
        ckpt = latest_checkpoint(store, owner)
        if ckpt is None:
            if not store.exists(keys.config_key(run_id)):
                raise ValueError(no_such_run(store, run_id))
            raise ValueError(f"no verified checkpoint under {root}/{owner}")
    elif cfg.synchronizer.shards > 1:
        if not store.exists(keys.config_key(run_id)):
            raise ValueError(no_such_run(store, run_id))
        ckpt = open_run_checkpoint(store, run_id, cfg.synchronizer.shards, seq, load=True, only=shard).shards[shard]
    else:
        try:
            ckpt = load_checkpoint(store, owner, seq)
        except FileNotFoundError:
            if not store.exists(keys.config_key(run_id)):
                raise ValueError(no_such_run(store, run_id)) from None
            raise ValueError(f"checkpoint {seq} of {owner} is incomplete or missing (no manifest)") from None
        except IntegrityError as err:
            raise ValueError(f"checkpoint {seq} of {owner} does not verify: {err}") from None
    if ckpt.manifest.get("config_hash") != config_hash(cfg):
        diffs = config_differences(ckpt.manifest.get("config", {}), cfg.public_dict())
        raise ValueError(f"config differs from checkpoint {ckpt.seq}'s: " + ("; ".join(diffs) or "hash only"))
    spent = budget_spent_at_checkpoint(cfg.budget, ckpt.manifest)
    if spent is not None:
        raise ValueError(f"run {run_id} has nothing left to train at checkpoint {ckpt.seq}: {spent}")
    return cfg, store, run_id, ckpt


_RUNS_SHOWN = 20


def no_such_run(store: ObjectStore, run_id: str) -> str:
    """The message for a run id that the store does not hold: where it looked, and the run ids it
    does hold (folders with a ``config.json``; one listing plus at most 20 existence checks)."""
    # the URL before a space, not before punctuation: a terminal links a URL up to the next space
    where = f"no run {run_id!r} in store {store.url} (no {keys.config_key(run_id)} there)"
    try:
        folders = store.folders()
        runs = [f for f in folders[:_RUNS_SHOWN * 2] if store.exists(keys.config_key(f))][:_RUNS_SHOWN]
    except (OSError, TimeoutError) as err:  # e.g. a credential that may read keys but not list
        return f"{where}; listing the store's runs failed too ({type(err).__name__})"
    if not runs:
        return f"{where}; that store holds no run" + ("" if folders else " (its root is empty or absent)")
    shown = ", ".join(runs) + (f" (the first {_RUNS_SHOWN})" if len(runs) == _RUNS_SHOWN else "")
    return f"{where}; runs in that store: {shown}"


def _check_compatible(ctx: ActorContext, book: FragmentBook, ckpt: Checkpoint) -> None:
    m = ckpt.manifest
    if m.get("run_id") != ctx.owner_id:  # with shards: {run_id}/shards/{shard:03d}, so one shard's is no other's
        raise ValueError(f"checkpoint {ckpt.seq} belongs to run {m.get('run_id')!r}, not {ctx.owner_id!r}")
    if m["config_hash"] != config_hash(ctx.cfg):
        diffs = config_differences(m.get("config", {}), ctx.cfg.public_dict())
        raise ValueError(f"config differs from checkpoint {ckpt.seq}'s: " + ("; ".join(diffs) or "hash only"))
    if m["schema_hash"] != book.plan.schema_hash:
        raise ValueError(f"fragment plan differs from checkpoint {ckpt.seq}'s "
                         f"(schema {m['schema_hash'][:12]} vs {book.plan.schema_hash[:12]})")


#: the counters by reason a checkpoint keeps (manifest ``by_reason``) -> their Reporter attribute,
#: so that every figure of a summary continues across a resume
BY_REASON = {"rejected": "rejected_by_reason", "bad_requests": "bad_requests", "clamped": "clamped_by_reason",
             "abandoned": "abandoned_by_reason", "edge": "edge_rejections"}


def restore(ckpt: Checkpoint, ctx: ActorContext, *, book: FragmentBook, table: RoundTable,
            registry: LearnerRegistry, report: Reporter, checkpoints: CheckpointBook,
            slices: SliceDesk | None = None) -> None:
    """Continue from a verified checkpoint of this run (DESIGN §5), blocking (store reads).

    Restores every fragment of ``book`` (the checkpoint may hold more): its value, momentum,
    outer-step count, versions and round counter; the global step of ``table``, the learners and
    goodput ledgers of ``registry``, every counter of ``report`` and the sequence numbers of
    ``checkpoints``, so the next outer step equals the one an uninterrupted run would take.
    Versions published after the checkpoint (by a synchronizer that died before checkpointing
    again) are kept: each one that
    verifies joins the history and the newest becomes the fragment's value, with the checkpoint's
    momentum (:func:`_adopt_published`; docs/resume-and-fencing.md), so learners that adopted them
    are not stranded. The slice ledger (``slices``, with ``data.slices``) comes back with the slices
    those later versions' headers name as trained, so none is leased and trained again.

    Raises:
        ValueError: the checkpoint belongs to another run, or its config or fragment plan
            differs from this one (the message names the differing fields).
    """
    _check_compatible(ctx, book, ckpt)
    check_assignment(ctx, book)
    m = ckpt.manifest
    trained_since: list[int] = []
    for f in book:
        _restore_fragment(ctx.store, f, ckpt)
        trained_since += _adopt_published(ctx, f, int(m.get("lease_epoch", 0)))
    if slices is not None:
        slices.restore(m.get("slices"), trained_since)
    written_unix_s = float(m.get("written_unix_s", time.time()))  # (absent from older checkpoints)
    registry.restore(m["ledgers"], m["learners"], ctx.clock(), checkpoint_age_s=time.time() - written_unix_s)
    registry.wire.restore(m.get("wire_bytes", {}))
    registry.undeliverable.restore(m.get("undeliverable", {}))  # (absent from checkpoints before shards)
    table.g = m.get("global_step")  # until the learners report again (a learner joining starts no lower)
    report.counters.clear()
    report.counters.update(m["counters"])
    for name, attr in BY_REASON.items():  # (absent from checkpoints written before they were kept)
        counts = getattr(report, attr)
        counts.clear()
        counts.update(m.get("by_reason", {}).get(name, {}))
    checkpoints.resumed(ckpt.seq, list_checkpoint_seqs(ctx.store, ctx.owner_id), report.counters["merges"])
    log.info("resumed run %s from checkpoint %d: versions %s, next rounds %s", ctx.run_id, ckpt.seq,
             {f.p: f.version for f in book}, {f.p: f.next_round for f in book})
    c = report.counters
    log.info("resumed counts: merges %d, contributions merged/late/rejected %d/%d/%d, tokens processed %d, "
             "bytes in/out %d/%d", c["merges"], c["contributions_merged"], c["contributions_late"],
             c["contributions_rejected"], registry.tokens_processed(), c["bytes_in"], c["bytes_out"])


def _restore_fragment(store: ObjectStore, f: FragmentState, ckpt: Checkpoint) -> None:
    m, key = ckpt.manifest, str(f.p)
    params = {n: ckpt.tensors[tensor_key(f.p, "param", n)].clone() for n in f.names}
    mom = {n: ckpt.tensors[tensor_key(f.p, "momentum", n)].clone() for n in f.names}
    steps = int(m["outer_steps"][key])
    f.optimizer.load_state(params, mom if steps > 0 else None, steps_taken=steps)
    f.current, f.momentum, f.outer_steps = params, mom, steps
    # compressed downloads: the published value learners adopted (the master value less its residual)
    pub_keys = {n: tensor_key(f.p, "published", n) for n in f.names}
    f.published = ({n: ckpt.tensors[k].clone() for n, k in pub_keys.items()}
                   if all(k in ckpt.tensors for k in pub_keys.values()) else params)
    f.compact = None  # a learner missing the current version downloads it whole
    f.version, f.next_round = int(m["versions"][key]), int(m["next_round"][key])
    f.refs = {int(v): ObjectRef.from_json(r) for v, r in m["version_refs"][key].items()}
    f.history = VersionHistory(store, f.shapes, f.refs)
    f.history[f.version] = f.published
    for v, ref in sorted(f.refs.items()):
        if v != f.version:
            try:  # read through and checked, then kept in the store only (read back when a merge needs it)
                read_version(store, ref, f.shapes)
                f.history[v] = {}
            except (FileNotFoundError, IntegrityError, ValueError) as err:
                log.warning("fragment %d: version %d unavailable after resume (%s)", f.p, v, err)
    for v in [v for v in f.refs if v not in f.history]:
        del f.refs[v]


def _adopt_published(ctx: ActorContext, f: FragmentState, lease_epoch: int) -> list[int]:
    """Keep the versions of ``f`` published after the checkpoint (blocking; store reads).

    Each listed version above the checkpoint's is read, decoded and checked (shapes, finite
    values, its header's fragment and version); one published by a lower lease epoch than a
    version or checkpoint before it was written by a synchronizer already fenced out and is
    skipped. The kept ones join the history, the newest becomes ``f.current`` and the optimizer's
    parameters; the momentum and outer-step count stay the checkpoint's; the next round follows
    the newest round a kept version merged. Unreadable versions are skipped (logged). Returns the
    slices the kept versions' headers name as trained (DESIGN §5.2).
    """
    prefix = keys.fragment_versions_prefix(ctx.run_id, f.p)
    listed = sorted({pv[1] for pv in map(partial(keys.parse_version_key, ctx.run_id), ctx.store.list(prefix))
                     if pv is not None and pv[0] == f.p and pv[1] > f.version})
    floor, kept, trained = lease_epoch, [], []
    for v in listed:
        key = keys.version_key(ctx.run_id, f.p, v)
        try:
            data = ctx.store.get_unverified(key)
            tensors, meta = wire.decode_from_bytes(data, "fp32", f.shapes)
            if meta.get("fragment") != str(f.p) or meta.get("version") != str(v):
                raise ValueError(f"its header names fragment {meta.get('fragment')} version {meta.get('version')}")
            if not all(bool(torch.isfinite(t).all()) for t in tensors.values()):
                raise ValueError("non-finite values")
        except (FileNotFoundError, ValueError) as err:
            log.warning("fragment %d: published version %d unusable after resume (%s)", f.p, v, err)
            continue
        epoch = int(meta.get("lease_epoch") or 0)
        if epoch < floor:
            log.warning("fragment %d: version %d was published by lease epoch %d after epoch %d had taken over; "
                        "skipped", f.p, v, epoch, floor)
            continue
        floor = epoch
        f.history[v], f.refs[v] = tensors, ObjectRef(key, len(data), object_digest(data))
        f.version, f.current, f.published, f.compact = v, tensors, tensors, None  # (a residual is dropped)
        f.next_round = max(f.next_round, int(meta.get("round") or 0) + 1)
        kept.append(v)
        trained += [s for named in header_slices(meta.get("slices")).values() for s in named]
    if not kept:
        return trained
    f.optimizer.load_state(f.current, f.momentum if f.outer_steps > 0 else None, steps_taken=f.outer_steps)
    for old in [v for v in f.history if v < f.version - ctx.sc.max_staleness]:
        del f.history[old]
        f.refs.pop(old, None)
    log.warning("fragment %d: versions %s were published after the checkpoint and are kept; version %d is the "
                "current value (momentum from the checkpoint); next round %d", f.p, kept, f.version, f.next_round)
    return trained


def checkpoint_payload(ctx: ActorContext, *, book: FragmentBook, table: RoundTable, registry: LearnerRegistry,
                       report: Reporter, slices: SliceDesk | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, manifest) of a checkpoint of the outer state now: every Θ_p and momentum buffer,
    versions, round counters, version refs, ledgers, learners, counters and the slice ledger."""
    tensors: dict[str, torch.Tensor] = {}
    for f in book:
        for name in f.names:
            tensors[tensor_key(f.p, "param", name)] = f.current[name]
            tensors[tensor_key(f.p, "momentum", name)] = f.momentum[name]
            if f.published is not f.current:  # compressed downloads (diloco_async/codec/versions.py)
                tensors[tensor_key(f.p, "published", name)] = f.published[name]
    open_round = {p: n for (p, n) in table.rounds}
    ledgers, learners = registry.to_manifest(ctx.clock())
    counters = report.counters
    manifest = {
        "config_hash": config_hash(ctx.cfg),
        "config": ctx.cfg.public_dict(),
        "schema_hash": book.plan.schema_hash,
        "versions": {str(f.p): f.version for f in book},
        "outer_steps": {str(f.p): f.outer_steps for f in book},
        # a round in flight is not in this checkpoint: a resumed run opens it again
        "next_round": {str(f.p): open_round.get(f.p, f.next_round) for f in book},
        "version_refs": {str(f.p): {str(v): f.refs[v].to_json() for v in f.history} for f in book},
        "global_step": table.g,
        "wire_bytes": registry.wire.to_json(),
        "undeliverable": registry.undeliverable.to_json(),
        "ledgers": ledgers,
        "learners": learners,
        "counters": dict(counters, checkpoints=counters["checkpoints"] + 1),  # this one included
        "by_reason": {name: dict(getattr(report, attr)) for name, attr in BY_REASON.items()},
        "wall_s": ctx.clock() - ctx.started_s,
        "written_unix_s": time.time(),  # a resume counts the learners' pace allowance across the gap
        "epoch": ctx.epoch,
        "lease_epoch": ctx.lease_epoch,  # a resume prefers the checkpoints of the newest lease epoch
    }
    if slices is not None and slices.enabled:  # (left out without leases: the manifest stays as before)
        manifest["slices"] = slices.to_json()
    return tensors, manifest
