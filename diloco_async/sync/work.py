"""The synchronizer's blocking work, run in worker threads (``asyncio.to_thread``).

* :func:`fetch_and_verify`: fetch a contribution, check its size and sha256, decode it, check
  shapes and finiteness (DESIGN §3.6, §10).
* :func:`merge_and_publish`: anchor, weight and merge the round's outer gradients, take the outer
  step and publish the new version (DESIGN §3.6-§3.7, §4).

A fragment has at most one round in flight, so the thread merging a round is the only user of
that fragment's optimizer until it reports back.
"""

from __future__ import annotations

import logging
import time

import torch

from diloco_async import codec as wire
from diloco_async.merge import anchor, merge_outer_gradients, token_weight
from diloco_async.sync.state import Contribution, FragmentState, Merged
from storage import keys
from storage.store import IntegrityError, ObjectRef, ObjectStore

__all__ = ["put_version", "publish_next_version", "fetch_and_verify", "rejection_reason", "merge_and_publish",
           "VERSION_SKIPS"]

log = logging.getLogger("diloco.synchronizer")


#: version numbers tried past one already taken (by a fenced-out synchronizer) before a merge fails
VERSION_SKIPS = 4


def put_version(store: ObjectStore, run_id: str, p: int, v: int, tensors: dict[str, torch.Tensor], *,
                lease_epoch: int = 0, round_n: int = 0) -> ObjectRef:
    """Publish version ``v`` of fragment ``p`` (fp32 safetensors, immutable key). The header
    names the fragment, the version, the round it merged and the lease epoch of its publisher
    (a resume uses them to rebuild the published history, docs/resume-and-fencing.md).

    Raises:
        FileExistsError: that version was already published.
    """
    meta = {"fragment": str(p), "version": str(v), "lease_epoch": str(lease_epoch), "round": str(round_n)}
    return store.put(keys.version_key(run_id, p, v), wire.encode_to_bytes(tensors, "fp32", meta))


def publish_next_version(store: ObjectStore, run_id: str, f: FragmentState, tensors: dict[str, torch.Tensor], *,
                         lease_epoch: int, round_n: int) -> tuple[int, ObjectRef]:
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
                                         round_n=round_n)
        except FileExistsError:
            if skip == VERSION_SKIPS:
                raise
            log.error("fragment %d: version %d exists but was not published by this synchronizer (lease epoch "
                      "%d); taking the next number", f.p, v + skip, lease_epoch)
    raise AssertionError("unreachable")


def fetch_and_verify(store: ObjectStore, ref: ObjectRef, codec: str,
                     shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The decoded fp32 outer gradient at ``ref``, name -> tensor of the fragment's shapes.

    Raises:
        IntegrityError: size or sha256 differ from the announcement.
        FileNotFoundError: no object at the key.
        ValueError: undecodable, wrong names or shapes, or non-finite values.
    """
    data = store.get(ref)
    tensors, _meta = wire.decode_from_bytes(data, codec, shapes)
    bad = {n: int((~torch.isfinite(t)).sum()) for n, t in tensors.items() if not bool(torch.isfinite(t).all())}
    if bad:
        raise ValueError(f"non-finite values in {sum(bad.values())} elements of {sorted(bad)}")
    return tensors


def rejection_reason(err: BaseException, key: str, timeout_s: float) -> str:
    """``"<code>: <detail>"`` for an error of :func:`fetch_and_verify` (or its timeout)."""
    if isinstance(err, IntegrityError):
        return f"digest_mismatch: {err}"
    if isinstance(err, FileNotFoundError):
        return f"missing_object: {key}"
    if isinstance(err, TimeoutError):
        return f"storage_timeout: fetch took over {timeout_s}s"
    if isinstance(err, ValueError):
        return f"{'non_finite' if 'non-finite' in str(err) else 'bad_tensor'}: {err}"
    return f"storage_error: {type(err).__name__}: {err}"


def merge_and_publish(store: ObjectStore, run_id: str, f: FragmentState, round_n: int,
                      contribs: list[Contribution], merge_mode: str, quorum_wait_s: float,
                      lease_epoch: int = 0) -> Merged:
    """Merge one round of fragment ``f`` and publish version ``f.version + 1`` (or the next free
    number, :func:`publish_next_version`).

    Each outer gradient is anchored on the current value (``merge.anchor``, DESIGN §4.1), weighted
    by c_tokens²/c_steps (§4.2) and merged with RDA or the mean (§4.4); the outer Nesterov step
    (§4.5) gives the new value. If the step is non-finite or the publish fails, the optimizer is
    restored and the result says why (``ok`` False); the fragment's value is never changed here.
    """
    t0 = time.perf_counter()
    p, n = f.p, round_n
    weights = [token_weight(c.ann.c_tokens, c.ann.c_steps) for c in contribs]
    anchored = [anchor(c.delta, f.current, f.history[c.ann.base_version]) for c in contribs]
    if sum(weights) <= 0:
        return Merged(p, n, False, "zero total token weight")
    g = merge_outer_gradients(anchored, weights, mode=merge_mode, embedding_names=f.embedding_names)
    before_params, before_mom, steps = f.optimizer.params(), f.optimizer.momentum(), f.optimizer.steps_taken
    try:
        new = f.optimizer.step(g)
        bad = [k for k, t in new.items() if not bool(torch.isfinite(t).all())]
        if bad:
            raise ValueError(f"non-finite values after the outer step in {bad}")
        version, ref = publish_next_version(store, run_id, f, new, lease_epoch=lease_epoch, round_n=n)
    except Exception as err:
        f.optimizer.load_state(before_params, before_mom if steps else None, steps_taken=steps)
        return Merged(p, n, False, f"{type(err).__name__}: {err}")
    return Merged(p, n, True, "published", new=new, momentum=f.optimizer.momentum(), ref=ref, version=version,
                  outer_steps=f.optimizer.steps_taken, merged=[c.ann.learner_id for c in contribs],
                  seconds=time.perf_counter() - t0, quorum_wait_s=quorum_wait_s)
