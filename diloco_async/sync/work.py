"""The synchronizer's blocking work, run in worker threads (``asyncio.to_thread``).

* :func:`fetch_and_verify`: fetch a contribution, check its size and sha256, decode it, check
  shapes and finiteness (DESIGN §3.6, §10).
* :func:`merge_and_publish`: anchor, weight and merge the round's outer gradients, take the outer
  step and publish the new version (DESIGN §3.6-§3.7, §4). In place: anchoring is done on the
  fly by chunks (``merge.AnchoredDelta``), the outer step writes new tensors that become the
  fragment's value without a copy, and the version is serialized from them.

A fragment has at most one round in flight, so the thread merging a round is the only user of
that fragment's optimizer until it reports back.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from diloco_async.codec import versions as version_codec
from diloco_async.codec import wire
from diloco_async.codec.held import EncodedTensors, load_encoded
from diloco_async.merge.core import (
    AnchoredDelta,
    AnchoredNotFinite,
    MergeWorkspace,
    OuterOptimizer,
    check_anchored,
    merge_and_step,
    token_weight,
)
from diloco_async.policy.guard import (
    NO_DIRECTION_CHECK,
    DirectionCheck,
    direction_factor,
    leave_one_out_cosines,
    non_finite_tensors,
    sustained_anti_alignment,
    tensor_norms,
)
from diloco_async.policy.slices import slice_header
from diloco_async.protocol.messages import Announcement, CompactInfo
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import safetensors_nbytes, write_safetensors
from diloco_async.storage.store import IntegrityError, ObjectRef, ObjectStore
from diloco_async.sync.shard_objects import fetch_shards
from diloco_async.sync.state import Contribution, FragmentState, Merged

__all__ = ["put_version", "publish_next_version", "publish_compact", "fetch_and_verify", "fetch_contribution",
           "checked_norms", "rejection_reason",
           "merge_and_publish", "merge_workspace", "VERSION_SKIPS", "PublishSettings"]

log = logging.getLogger("diloco.synchronizer")


#: version numbers tried past one already taken (by a fenced-out synchronizer) before a merge fails
VERSION_SKIPS = 4


def put_version(store: ObjectStore, run_id: str, p: int, v: int, tensors: dict[str, torch.Tensor], *,
                lease_epoch: int = 0, round_n: int = 0, slices: str = "") -> ObjectRef:
    """Publish version ``v`` of fragment ``p`` (fp32 safetensors, immutable key). The header
    names the fragment, the version, the round it merged and the lease epoch of its publisher
    (a resume uses them to rebuild the published history, docs/resume-and-fencing.md) and, with
    leases, the slices it trained (``slices``: :func:`~diloco_async.policy.slices.slice_header`; DESIGN §5.2).

    Raises:
        FileExistsError: that version was already published.
    """
    meta = {"fragment": str(p), "version": str(v), "lease_epoch": str(lease_epoch), "round": str(round_n)}
    if slices:
        meta["slices"] = slices
    key = keys.version_key(run_id, p, v)
    if not _streamable(tensors):
        return store.put(key, wire.encode_to_bytes(tensors, "fp32", meta))
    with store.open_writer(key, safetensors_nbytes(tensors)) as w:
        _write_fp32(tensors, meta, w.write)
    assert w.ref is not None
    return w.ref


def _streamable(tensors: Mapping[str, torch.Tensor]) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and "::" not in n
               for n, t in tensors.items())


def _write_fp32(tensors: Mapping[str, torch.Tensor], meta: dict[str, str], write) -> int:
    """Stream what ``wire.encode_to_bytes(tensors, "fp32", meta)`` writes (safetensors' layout:
    the metadata, then the tensors by name; the same header entries and data bytes) to ``write``,
    straight from the live tensors: no serialized copy of the fragment (the store's writer holds
    at most a few parts). Returns the bytes written."""
    header = dict(meta, codec="fp32", block_size=str(wire.DEFAULT_BLOCK_SIZE))
    return write_safetensors({n: tensors[n].detach() for n in sorted(tensors)}, write, metadata=header)


def _fp32_bytes(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    """The bytes :func:`put_version` publishes for ``tensors``, as one object (tests, benchmarks)."""
    if not _streamable(tensors):
        return wire.encode_to_bytes(tensors, "fp32", meta)
    out = bytearray()
    _write_fp32(tensors, meta, out.extend)
    return bytes(out)


def publish_compact(store: ObjectStore, run_id: str, f: FragmentState, v: int, encoded: dict[str, torch.Tensor],
                    published: dict[str, torch.Tensor], download: tuple[str, str, int]) -> CompactInfo:
    """Publish the compact form of version ``v`` of ``f`` (after ``f.version``), whose published
    value is ``published`` (:mod:`diloco_async.codec.versions`).

    Raises:
        FileExistsError: that payload was already published.
    """
    codec, mode, block_size = download
    digest = version_codec.published_digest(published)
    base = f.version if mode == "delta" else None
    data = version_codec.compact_bytes(encoded, codec, mode, block_size, fragment=f.p, version=v, base_version=base,
                                       digest=digest)
    ref = store.put(keys.compact_key(run_id, f.p, v, codec, mode), data)
    return CompactInfo(key=ref.key, nbytes=ref.nbytes, sha256=ref.sha256, codec=codec, mode=mode,
                       block_size=block_size, base_version=base, published_sha256=digest)


def publish_next_version(store: ObjectStore, run_id: str, f: FragmentState, tensors: dict[str, torch.Tensor], *,
                         lease_epoch: int, round_n: int, slices: str = "") -> tuple[int, ObjectRef]:
    """Publish ``tensors`` as the next version of fragment ``f``: ``f.version + 1``, or the next
    free number when a synchronizer fenced out since wrote that one (logged; at most
    :data:`VERSION_SKIPS` numbers skipped). Returns (version, ref).

    Raises:
        FileExistsError: every number tried was taken.
    """
    v = f.version + 1
    for skip in range(VERSION_SKIPS + 1):
        try:
            return v + skip, put_version(store, run_id, f.p, v + skip, tensors, lease_epoch=lease_epoch,
                                         round_n=round_n, slices=slices)
        except FileExistsError:
            if skip == VERSION_SKIPS:
                raise
            log.error("fragment %d: version %d exists but was not published by this synchronizer (lease epoch "
                      "%d); taking the next number", f.p, v + skip, lease_epoch)
    raise AssertionError("unreachable")


def fetch_and_verify(store: ObjectStore, ref: ObjectRef, codec: str, shapes: dict[str, tuple[int, ...]],
                     block_size: int = wire.DEFAULT_BLOCK_SIZE,
                     ) -> tuple[dict[str, torch.Tensor] | EncodedTensors, dict[str, float], dict[str, torch.Tensor]]:
    """The outer gradient at ``ref``, checked, the L2 norm of each tensor (for the update guard,
    :mod:`diloco_async.policy.guard`) and the same norms as float32 0-dim tensors, as the merge's RDA
    computes them (``torch.linalg.vector_norm`` of the float32 tensor, bit for bit; only where
    finite), so that the merge need not read Δ once more for them (``AnchoredDelta(norms=...)``).
    The guard's value is that float32 norm, or the float64 one where float32 overflows. It is
    decoded once here for the checks and the norms; what is kept
    for the merge is the payload as encoded (:class:`~diloco_async.codec.held.EncodedTensors`, decoded
    again by the merge), or with ``codec`` fp32 the decoded tensors (name -> fp32 tensor of the
    fragment's shapes), so that a contribution waiting for its merge holds the codec's bytes,
    not fp32's.

    The header is checked against the announced codec, the configured ``block_size`` and the
    expected tensors before anything is decoded (:func:`~diloco_async.codec.wire.check_header`).

    Raises:
        IntegrityError: size or sha256 differ from the announcement.
        FileNotFoundError: no object at the key.
        PayloadError: ``codec_header``, ``schema``, ``dtype``, ``shape`` or ``non_finite``.
        ValueError: otherwise undecodable.
    """
    data = store.get(ref)
    wire.check_header(data, codec, shapes, block_size)
    held, _meta = load_encoded(data, codec, shapes)
    del data
    tensors, norms, norms32 = checked_norms(held.iter_decoded(), keep=codec == "fp32")
    return (tensors if codec == "fp32" else held), norms, norms32


def checked_norms(decoded: Iterable[tuple[str, torch.Tensor]], keep: bool
                  ) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, torch.Tensor]]:
    """Check each decoded tensor of a contribution for NaN/Inf and take its norms (see
    :func:`fetch_and_verify`); returns (the tensors when ``keep``, else empty; norms; float32 norms).

    Raises:
        PayloadError: ``non_finite``, naming every tensor with NaN/Inf elements.
    """
    tensors, bad, norms, norms32 = {}, {}, {}, {}
    for name, t in decoded:  # one tensor decoded at a time
        bad.update(non_finite_tensors({name: t}))
        n32 = torch.linalg.vector_norm(t) if t.dtype == torch.float32 else None
        if n32 is not None and math.isfinite(n32.item()):
            norms32[name] = n32
            norms[name] = n32.item()
        else:
            norms.update(tensor_norms({name: t}))
        if keep:
            tensors[name] = t
    if bad:
        raise wire.PayloadError("non_finite", f"{sum(bad.values())} NaN/Inf elements in {sorted(bad)}")
    return tensors, norms, norms32


def fetch_contribution(store: ObjectStore, ann: Announcement, shapes: dict[str, tuple[int, ...]],
                       block_size: int = wire.DEFAULT_BLOCK_SIZE,
                       ) -> tuple[dict[str, torch.Tensor] | EncodedTensors, dict[str, float], dict[str, torch.Tensor]]:
    """:func:`fetch_and_verify` of an announced contribution; a sharded group's (``ann.shards``)
    is reassembled from its shard objects first (:func:`~diloco_async.sync.shard_objects.fetch_shards`)
    and held decoded (fp32), its norms those of the whole tensors.

    Raises:
        as :func:`fetch_and_verify`, and :class:`~diloco_async.sync.shard_objects.ShardError`.
    """
    if ann.shards is None:
        return fetch_and_verify(store, ObjectRef(ann.key, ann.nbytes, ann.sha256), ann.codec, shapes, block_size)
    whole = fetch_shards(store, ann.shards, ann.sha256, ann.codec, shapes, block_size)
    return checked_norms(((n, whole[n]) for n in shapes), keep=True)


def rejection_reason(err: BaseException, key: str, timeout_s: float) -> str:
    """``"<code>: <detail>"`` for an error of :func:`fetch_and_verify` (or its timeout)."""
    if isinstance(err, wire.PayloadError):
        return str(err)
    if isinstance(err, IntegrityError):
        return f"digest: {err}"
    if isinstance(err, FileNotFoundError):
        return f"missing_object: {key}"
    if isinstance(err, TimeoutError):
        return f"storage_timeout: fetch took over {timeout_s}s"
    if isinstance(err, ValueError):
        return f"bad_tensor: {err}"
    return f"storage_error: {type(err).__name__}: {err}"


@dataclass(frozen=True)
class PublishSettings:
    """How a merged value is published: under the lease epoch ``lease_epoch`` (fencing, 0: none)
    and, for compressed downloads, as ``download`` = (codec, mode, block size) (``synchronizer.download``);
    with ``lookahead`` < 1 (a drain's last round) after taking back ``1 - lookahead`` of the step's
    momentum look-ahead (``OuterOptimizer.take_back_lookahead``; docs/end-of-run.md)."""

    lease_epoch: int = 0
    download: tuple[str, str, int] = ("fp32", "delta", 64)
    lookahead: float = 1.0


def _screen(f: FragmentState, contribs: list[Contribution], directions: DirectionCheck = NO_DIRECTION_CHECK,
            workspace: MergeWorkspace | None = None, check: bool = True,
            ) -> tuple[list, list, list, list[tuple[str, str]], dict, dict]:
    """Weight and anchor each contribution on its own: (kept, weights, anchored, dropped as (learner,
    why), cosines, factors). A contribution whose weight or anchored outer gradient is not finite
    cannot take the round down; one that points away from the rest of its round is weighted down,
    and left out when its learner's recent cosines (``directions``) point away too (the
    direction guard, :mod:`diloco_async.policy.guard`). Without ``check``, the anchored values are
    taken as finite here (``merge_and_step`` checks them as it goes)."""
    kept, weights, anchored, raw, dropped = [], [], [], [], []
    candidates, failed = [], []  # (index, contribution, weight, anchored, delta); (index, (learner, why))
    for i, c in enumerate(contribs):
        try:
            w = token_weight(c.ann.c_tokens, c.ann.c_steps)
            held = c.delta.decode() if isinstance(c.delta, EncodedTensors) else c.delta  # fp32, this merge only
            delta = {n: t * c.scales[n] if n in c.scales else t for n, t in held.items()}
            known = {n: v for n, v in c.norms.items() if n not in c.scales}  # of Δ itself, from its verification
            lazy = AnchoredDelta(delta, f.published, f.history[c.ann.base_version], norms=known)
            candidates.append((i, c, w, lazy, delta))
        except Exception as err:  # noqa: BLE001 - whatever one contribution does, the others go on
            failed.append((i, (c.ann.learner_id, f"{type(err).__name__}: {err}")))
    try:  # the norms RDA needs and the finite check, one pass per tensor, Θcur − Θbase shared
        bads = (check_anchored([a for _, _, _, a, _ in candidates], workspace=workspace) if check
                else [{} for _ in candidates])
    except Exception:  # noqa: BLE001 - one contribution's failure must not take the others down
        bads = [_check_one(a) for _, _, _, a, _ in candidates]
    for (i, c, w, a, delta), bad in zip(candidates, bads, strict=True):
        if isinstance(bad, BaseException) or not math.isfinite(w) or bad:
            err = bad if isinstance(bad, BaseException) else ValueError(
                f"weight {w:.4g}, non-finite anchored tensors {sorted(bad)}")
            failed.append((i, (c.ann.learner_id, f"{type(err).__name__}: {err}")))
            continue
        kept.append(c)
        weights.append(w)
        anchored.append(a)
        raw.append(delta)
    dropped.extend(why for _, why in sorted(failed, key=lambda x: x[0]))
    cosines, factors = _judge_directions(kept, weights, anchored, raw, dropped, directions)
    weights = [w * factors[c.ann.learner_id] for c, w in zip(kept, weights, strict=True)]
    return kept, weights, anchored, dropped, cosines, factors


def _check_one(a: AnchoredDelta) -> dict[str, int] | BaseException:
    try:
        return a.check()
    except Exception as err:  # noqa: BLE001 - reported as that contribution's reason
        return err


def _judge_directions(kept: list, weights: list, anchored: list, raw: list, dropped: list,
                      directions: DirectionCheck) -> tuple[dict[str, float | None], dict[str, float]]:
    """The direction guard over one round (lists changed in place): while three or more are
    judged and one points away from the others (cosine ≤ 0, factor 0), the one pointing away most
    is taken out of the others' consensus and they are judged again without it. It is left out
    (``dropped``, direction_outlier) if it is anti-aligned and its learner keeps pointing away
    (:func:`~diloco_async.policy.guard.sustained_anti_alignment`; never while the guard warms up, with
    no ``reference``), else merged at zero weight. So the merged weights never all fall to zero,
    and the cosines that warm the guard up are judged against a consensus without them. Returns
    each learner's cosine (when last judged) and factor."""
    reference, fraction, memory = directions.reference, directions.fraction, directions.memory
    learner_cosines = directions.learner_cosines
    cosines: dict[str, float | None] = {}
    factors: dict[str, float] = {}
    bound = None if reference is None else -fraction * reference
    zeroed = []
    while True:
        ids = [c.ann.learner_id for c in kept]
        cos = leave_one_out_cosines(raw, weights) if fraction > 0 else [None] * len(kept)
        cosines.update(zip(ids, cos, strict=True))
        ratios = [directions.token_ratio(c.ann.c_tokens) for c in kept]
        factors.update((i, direction_factor(x, reference, directions.weight(r), r))
                       for i, x, r in zip(ids, cos, ratios, strict=True))
        away = [i for i, x in enumerate(cos) if x is not None and x <= 0]  # also while warming up
        if not away:  # (fewer than 3 have no cosines, so the loop ends with 2 at least)
            break
        worst = min(away, key=lambda i: cos[i])
        entry = tuple(seq.pop(worst) for seq in (kept, weights, anchored, raw))
        record = learner_cosines.get(ids[worst], ())
        if bound is not None and sustained_anti_alignment(record, cos[worst], bound, memory):
            recent = ", ".join(f"{x:.3f}" for x in list(record)[-(memory - 1):]) if memory > 1 else ""
            dropped.append((ids[worst], f"direction_outlier: cosine {cos[worst]:.3f} with the rest of its round "
                                        f"(usual {reference:.3f}; its learner's previous cosines: {recent or '-'})"))
        else:
            zeroed.append(entry)
            factors[ids[worst]] = 0.0
    for c, w, a, _raw in zeroed:
        kept.append(c)
        weights.append(w)
        anchored.append(a)
    return cosines, factors


def merge_workspace(optimizer: OuterOptimizer) -> MergeWorkspace:
    """The workspace of one merge of a fragment: buffers from its optimizer's pool, and the
    anchored outer gradients kept whole up to one fragment's size (read by the merge instead of
    anchored again; issue 17 item 1)."""
    p = optimizer.shared_state().params
    return MergeWorkspace(optimizer.pool, keep_bytes=sum(t.numel() * t.element_size() for t in p.values()))


def _merge_step(f: FragmentState, anchored: list, weights: list[float], merge_mode: str,
                workspace: MergeWorkspace | None = None) -> dict[str, torch.Tensor]:
    """Check, merge and take the outer step, tensor by tensor (``merge_and_step``): the new value,
    the optimizer's own tensors (raises on any error, e.g. a non-finite result or
    ``AnchoredNotFinite``, leaving the optimizer unchanged)."""
    return merge_and_step(f.optimizer, anchored, weights, merge_mode, f.embedding_names, workspace=workspace)


def _publish(store: ObjectStore, run_id: str, f: FragmentState, new: dict[str, torch.Tensor], round_n: int,
             settings: PublishSettings, slices: str = "") -> tuple[int, ObjectRef, dict[str, torch.Tensor],
                                                                   CompactInfo | None]:
    """Publish the master value ``new``: (version, ref, published value, compact form). With
    compressed downloads the published value is Θ^pub (:mod:`diloco_async.codec.versions`), put
    whole in fp32 and as its compact payload; else ``new`` itself, with no compact form."""
    lease_epoch, download = settings.lease_epoch, settings.download
    if download[0] == "fp32":
        version, ref = publish_next_version(store, run_id, f, new, lease_epoch=lease_epoch, round_n=round_n,
                                            slices=slices)
        return version, ref, new, None
    encoded, published = version_codec.compress_version(new, f.published, *download)
    version, ref = publish_next_version(store, run_id, f, published, lease_epoch=lease_epoch, round_n=round_n,
                                        slices=slices)
    return version, ref, published, publish_compact(store, run_id, f, version, encoded, published, download)


def _merge_leaving_one_out(f: FragmentState, kept: list, anchored: list, weights: list[float], merge_mode: str,
                           ws: MergeWorkspace, restore) -> tuple[dict[str, torch.Tensor] | None, list, str | None]:
    """After a failed merge: merge again leaving out one contribution at a time; the first that
    makes it succeed is left out. Returns (new value or None, kept, the learner left out or None)."""
    for i in range(len(kept) if len(kept) > 1 else 0):
        rest = [j for j in range(len(kept)) if j != i]
        try:
            new = _merge_step(f, [anchored[j] for j in rest], [weights[j] for j in rest], merge_mode, ws)
        except Exception:  # noqa: BLE001 - try the next one
            restore()
            continue
        return new, [kept[j] for j in rest], kept[i].ann.learner_id
    return None, kept, None


def merge_and_publish(store: ObjectStore, run_id: str, f: FragmentState, round_n: int,
                      contribs: list[Contribution], merge_mode: str, *,
                      directions: DirectionCheck = NO_DIRECTION_CHECK,
                      publish: PublishSettings = PublishSettings()) -> Merged:
    """Merge one round of fragment ``f`` and publish version ``f.version + 1`` (or the next free
    number, :func:`publish_next_version`).

    Each outer gradient is clipped where the guard said so, anchored on the current value
    (``merge.anchor``, DESIGN §4.1), weighted by c_tokens²/c_steps (§4.2) and merged with RDA or
    the mean (§4.4); the outer Nesterov step (§4.5) gives the new value. With a
    ``directions.reference`` (the median recent leave-one-out cosine), each weight is also
    multiplied by its direction factor; an anti-aligned contribution whose learner's recent
    cosines (``directions.learner_cosines``, the last ``directions.memory``) point away too is dropped
    (``direction_outlier``). A contribution whose
    weight or anchored value is not finite is dropped (``Merged.dropped``); if the merge or step
    still fails, the round is retried leaving out one contribution at a time, and the first that
    makes it succeed is dropped. If nothing works or the publish fails, the optimizer is restored
    and the result says why (``ok`` False); the fragment's value is never changed here.
    """
    t0 = time.perf_counter()
    p, n = f.p, round_n
    before = f.optimizer.shared_state()  # by reference: a step never writes the tensors it replaces

    def restore() -> None:
        f.optimizer.restore(before)

    new, err = None, None
    for check in (False, True):  # checked as merged; a non-finite Δ' is rare: screen again, checks first
        ws = merge_workspace(f.optimizer)  # scratch of this merge, shared by the norm pass and the merge
        kept, weights, anchored, dropped, cosines, factors = _screen(f, contribs, directions, ws, check=check)
        if not kept or sum(weights) <= 0:
            return Merged(p, n, False, "no contribution with a positive token weight", dropped=dropped,
                          cosines=cosines, factors=factors)
        try:
            new = _merge_step(f, anchored, weights, merge_mode, ws)
        except Exception as e:  # noqa: BLE001 - tried again, leaving out one at a time
            restore()
            err = e
            if isinstance(e, AnchoredNotFinite):
                continue
        break
    if new is None:
        first = f"{type(err).__name__}: {err}"
        new, kept, left_out = _merge_leaving_one_out(f, kept, anchored, weights, merge_mode, ws, restore)
        if new is None:
            return Merged(p, n, False, first, dropped=dropped)
        dropped.append((left_out, f"the round merges without it ({first})"))
    if publish.lookahead < 1.0:
        new = f.optimizer.take_back_lookahead(1.0 - publish.lookahead)
    try:
        trained = slice_header({c.ann.learner_id: c.ann.slices for c in kept if factors.get(c.ann.learner_id, 1.0) > 0})
        version, ref, published, compact = _publish(store, run_id, f, new, n, publish, trained)
    except Exception as err:
        restore()
        return Merged(p, n, False, f"{type(err).__name__}: {err}", dropped=dropped)
    return Merged(p, n, True, "published", new=new, published=published, compact=compact,
                  momentum=f.optimizer.shared_state().momentum, ref=ref, version=version,
                  outer_steps=f.optimizer.steps_taken, merged=[c.ann.learner_id for c in kept],
                  seconds=time.perf_counter() - t0, dropped=dropped,
                  cosines=cosines, factors=factors)
