"""Checkpoints of the synchronizer's outer state (DESIGN §5).

A checkpoint is a state folder ``checkpoints/{seq:08d}/`` (:mod:`diloco_async.storage.keys`):
``state.safetensors`` (every fragment's parameters and momentum buffers, fp32) plus
``manifest.json``, written LAST and naming the state file's size and sha256. A checkpoint
without a manifest, or whose state does not verify, does not count: :func:`latest_checkpoint`
skips it and logs why.

State files are written as a stream (:func:`write_safetensors`: the safetensors header, then
every tensor's bytes read from the tensor itself in bounded chunks), never as one serialized
copy of the whole state in memory (issue 17 item 3). A learner spools its inner state to a local
file on a thread of its own while training goes on (:func:`spool_state`, a consistent snapshot
without a copy in RAM: training waits before it mutates a tensor not written yet) and uploads that
file from its comms thread (:func:`write_state_file`).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from diloco_async.storage import keys
from diloco_async.storage.store import IntegrityError, ObjectRef, ObjectStore

__all__ = ["Checkpoint", "write_checkpoint", "latest_checkpoint", "load_checkpoint", "list_checkpoint_seqs",
           "verify_checkpoint",
           "write_state", "load_state", "latest_state", "list_state_seqs", "tensor_key", "write_safetensors",
           "safetensors_nbytes", "spool_state", "write_state_file", "read_safetensors"]

#: safetensors' dtype names
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
_CHUNK_NBYTES = 16 << 20

log = logging.getLogger("diloco.checkpoint")


@dataclass
class Checkpoint:
    """A verified checkpoint: ``tensors`` maps ``p{p:03d}/param/{name}`` and
    ``p{p:03d}/momentum/{name}`` to fp32 tensors; ``manifest`` holds the rest of the state."""

    seq: int
    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def tensor_key(fragment: int, kind: str, name: str) -> str:
    return f"p{fragment:03d}/{kind}/{name}"


def _loaded(t: Any) -> torch.Tensor:
    """``t`` itself, or for a lazy tensor (not a ``torch.Tensor``: an object with ``shape``,
    ``dtype``, ``numel()``, ``element_size()`` and ``load()``, such as
    ``diloco_async.inner.base_file.LazyTensor``) the tensor it loads."""
    return t if isinstance(t, torch.Tensor) else t.load()


def _header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The safetensors header (8-byte little-endian length, then JSON padded with spaces to a
    multiple of 8) of ``tensors`` laid out in the mapping's order, with ``metadata`` (string
    values) first as ``__metadata__``, as the safetensors library writes it.

    Raises:
        ValueError: a dtype safetensors cannot hold.
    """
    entries: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(metadata)}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} cannot be written to safetensors")
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(entries, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


def safetensors_nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Size in bytes of the safetensors file :func:`write_safetensors` writes for ``tensors``."""
    return len(_header(tensors)) + sum(t.numel() * t.element_size() for t in tensors.values())


def _check_finite(tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise ValueError naming the floating tensors that hold NaN or Inf. One pass per tensor,
    no tensor-sized temporary: a NaN or Inf makes the tensor's sum non-finite (so does a sum past
    the dtype's range, ~3e38 in fp32, which no trained tensor reaches: refused too)."""
    bad = [k for k, t in tensors.items() if t.is_floating_point() and t.numel()
           and not bool(torch.isfinite(t.detach().sum()))]
    if bad:
        raise ValueError(f"refusing to checkpoint non-finite tensors: {bad[:5]}")


def write_safetensors(tensors: Mapping[str, torch.Tensor], write: Callable[[memoryview], Any],
                      chunk_nbytes: int = _CHUNK_NBYTES, header: bool = True,
                      metadata: Mapping[str, str] | None = None) -> int:
    """Stream ``tensors`` in the safetensors format to ``write`` (called with the header, then
    with views of each tensor's bytes of at most ``chunk_nbytes``; CPU tensors are read in place,
    a tensor on another device is copied to CPU one at a time). ``safetensors.torch.load`` reads
    the result back bit for bit. Returns the bytes written. ``header=False``: only the tensors'
    bytes (the caller wrote the header of a larger mapping, :func:`spool_state`). ``metadata``:
    the header's ``__metadata__`` (string values).

    The views are read-only, so a writer may keep them rather than copy them (an
    :class:`~diloco_async.storage.writer.ObjectWriter` keeps them until it sends them, at the latest on
    ``close``): the caller keeps the tensors unchanged until ``write`` is done with them (for a
    writer, until it is closed).

    Raises:
        ValueError: a dtype safetensors cannot hold.
    """
    total = 0
    if header:
        head = _header(tensors, metadata)
        write(memoryview(head))
        total = len(head)
    for t in tensors.values():
        flat = _loaded(t).detach().to("cpu").contiguous().reshape(-1)
        if flat.numel() == 0:
            continue
        raw = memoryview(flat.view(torch.uint8).numpy()).toreadonly()
        for start in range(0, len(raw), chunk_nbytes):
            write(raw[start:start + chunk_nbytes])
        total += len(raw)
    return total


_BY_ST_DTYPE = {v: k for k, v in _ST_DTYPES.items()}


class _SafetensorsSink:
    """Builds the tensors of a safetensors stream chunk by chunk: each tensor is allocated once
    and filled in place (no copy of the whole file in memory)."""

    def __init__(self) -> None:
        self.head = bytearray()
        self.entries: list[tuple[str, torch.Tensor, memoryview]] | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.pos = 0  # within the current entry
        self.meta: dict[str, str] = {}

    def _start(self, header: dict[str, Any]) -> None:
        self.meta = header.pop("__metadata__", None) or {}
        entries = []
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            t = torch.empty(e["shape"], dtype=_BY_ST_DTYPE[e["dtype"]])
            if t.numel() * t.element_size() != e["data_offsets"][1] - e["data_offsets"][0]:
                raise ValueError(f"tensor {name}: its data offsets do not match its shape")
            self.tensors[name] = t
            if t.numel():
                entries.append((name, t, memoryview(t.reshape(-1).view(torch.uint8).numpy())))
        self.entries = entries[::-1]  # popped from the end

    def __call__(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        if self.entries is None:
            self.head += view
            if len(self.head) < 8 or len(self.head) < 8 + (n := struct.unpack("<Q", self.head[:8])[0]):
                return
            self._start(json.loads(bytes(self.head[8:8 + n])))
            view = memoryview(bytes(self.head[8 + n:]))
        while len(view):
            if not self.entries:
                raise ValueError("bytes past the last tensor")
            _, _, dst = self.entries[-1]
            take = min(len(view), len(dst) - self.pos)
            dst[self.pos:self.pos + take] = view[:take]
            self.pos += take
            view = view[take:]
            if self.pos == len(dst):
                self.entries.pop()
                self.pos = 0

    def result(self) -> dict[str, torch.Tensor]:
        if self.entries is None or self.entries:
            raise ValueError("the stream ended inside the safetensors data")
        return self.tensors


def read_safetensors(store: ObjectStore, ref: ObjectRef, with_metadata: bool = False) -> Any:
    """The tensors of the safetensors object at ``ref``, verified (size and sha256) and decoded
    while streaming: each tensor is allocated once and filled from the stream (writable, on
    CPU), so memory stays at the tensors plus a chunk. With ``with_metadata``: (tensors, the
    header's ``__metadata__``).

    Raises:
        FileNotFoundError: no object. IntegrityError: size or digest differ, or unparsable.
    """
    sink = _SafetensorsSink()
    try:
        store.stream(ref, sink)
        return (sink.result(), sink.meta) if with_metadata else sink.result()
    except IntegrityError:
        raise
    except (ValueError, KeyError, TypeError, struct.error) as err:  # a corrupt header or layout
        raise IntegrityError(f"{ref.key}: unreadable ({err})") from None


def write_state(store: ObjectStore, prefix: str, seq: int, tensors: Mapping[str, torch.Tensor],
                manifest: dict[str, Any], max_concurrency: int | None = None, consume: bool = False) -> ObjectRef:
    """Write ``{prefix}/{seq:08d}/state.safetensors``, then ``manifest.json`` naming its size and
    sha256 (publish, then mark). Returns the manifest's ref. The state streams from the tensors
    (:func:`write_safetensors`): no serialized copy of the whole state is made; the caller keeps
    the tensors unchanged until this returns. ``max_concurrency``: upload parts in flight (the
    store's by default); the writer holds that many parts plus one in memory. ``consume``:
    ``tensors`` is a dict whose entries are removed once written, so that a tensor only the
    checkpoint keeps alive (a value a merge replaced meanwhile) is freed as the write goes on.

    Raises:
        ValueError: a tensor holds NaN or Inf (nothing is written).
        FileExistsError: ``seq`` already exists under ``prefix``.
    """
    _check_finite(tensors)
    with store.open_writer(keys.state_file_key(prefix, seq), max_concurrency=max_concurrency) as w:
        if not consume:
            write_safetensors(tensors, w.write)
        else:
            w.write(memoryview(_header(tensors)))
            for name in list(tensors):
                write_safetensors({name: tensors[name]}, w.write, header=False)
                del tensors[name]  # type: ignore[attr-defined]
    assert w.ref is not None
    body = dict(manifest, seq=seq, state=w.ref.to_json())
    return store.put_json(keys.state_manifest_key(prefix, seq), body)


def spool_state(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                written: Callable[[str], None] | None = None, consume: bool = False,
                starting: Callable[[str], None] | None = None) -> int:
    """Write ``tensors`` as a safetensors file at ``path`` (a local spool, replaced atomically:
    written to ``{path}.tmp`` first), in the mapping's order; returns its size in bytes. A
    consistent snapshot of live tensors at local-disk speed, without a copy in RAM, uploaded later
    by :func:`write_state_file`. Each tensor is checked for NaN/Inf just before its bytes are
    written, so the file is one pass over memory plus the write.

    Args:
        written: called with each tensor's name once its bytes are written (a learner's spool
            thread lets training mutate a tensor only after that).
        consume: ``tensors`` is a dict whose entries are removed once written, so that what only
            the spool keeps alive (a replaced base copy) is freed as the spool goes on.
        starting: called with each tensor's name just before ``tensors[name]`` is read; until
            then another thread may replace that entry (with a copy of the same values).

    Raises:
        ValueError: a tensor holds NaN or Inf, or a dtype safetensors cannot hold (nothing is
            left at ``path``).
        OSError: the local write failed (nothing is left at ``path``).
    """
    tmp = f"{os.fspath(path)}.tmp"
    try:
        with open(tmp, "wb") as fh:
            header = _header(tensors)
            fh.write(header)
            nbytes = len(header)
            for name in list(tensors):
                if starting is not None:
                    starting(name)
                t = _loaded(tensors[name])
                _check_finite({name: t})
                nbytes += write_safetensors({name: t}, fh.write, header=False)
                if consume:
                    del tensors[name]  # type: ignore[attr-defined]
                del t
                if written is not None:
                    written(name)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return nbytes


def write_state_file(store: ObjectStore, prefix: str, seq: int, local_path: str | os.PathLike,
                     manifest: dict[str, Any]) -> ObjectRef:
    """As :func:`write_state`, from a state file spooled by :func:`spool_state` (streamed to the
    store in parts, hashed on the way). Returns the manifest's ref. One part is in flight at a
    time: a learner saves its state in the background, and the store's parallel parts held
    ``max_concurrency + 1`` parts (80 MiB by default, 0.8x a 25M-parameter model) on top of training.

    Raises:
        FileExistsError: ``seq`` already exists under ``prefix``. FileNotFoundError: no spool file.
    """
    state_ref = store.put_from_file(keys.state_file_key(prefix, seq), local_path, max_concurrency=1)
    body = dict(manifest, seq=seq, state=state_ref.to_json())
    return store.put_json(keys.state_manifest_key(prefix, seq), body)


def list_state_seqs(store: ObjectStore, prefix: str) -> list[int]:
    """Sequence numbers under ``prefix`` that have any object, ascending (complete or not)."""
    seqs = {keys.state_seq_of(prefix, key) for key in store.list(prefix)}
    return sorted(seq for seq in seqs if seq is not None)


def load_state(store: ObjectStore, prefix: str, seq: int) -> Checkpoint:
    """Load and verify ``{prefix}/{seq:08d}``.

    Raises:
        FileNotFoundError: no manifest (incomplete).
        IntegrityError: the state file is short, has the wrong digest, or holds non-finite values.
    """
    manifest = store.get_json(keys.state_manifest_key(prefix, seq))
    ref = ObjectRef.from_json(manifest["state"])
    tensors = read_safetensors(store, ref)
    if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors.values()):
        raise IntegrityError(f"{keys.state_folder(prefix, seq)} holds non-finite values")
    return Checkpoint(seq=seq, manifest=manifest, tensors=tensors)


def latest_state(store: ObjectStore, prefix: str) -> Checkpoint | None:
    """The newest state under ``prefix`` whose manifest exists and whose data verifies, or None."""
    for seq in reversed(list_state_seqs(store, prefix)):
        try:
            return load_state(store, prefix, seq)
        except FileNotFoundError:
            log.warning("skipping incomplete checkpoint %d (no manifest)", seq)
        except (IntegrityError, ValueError, KeyError) as err:
            log.warning("skipping checkpoint %d: %s", seq, err)
    return None


def write_checkpoint(
    store: ObjectStore, run_id: str, seq: int, tensors: Mapping[str, torch.Tensor], manifest: dict[str, Any],
    max_concurrency: int | None = None, consume: bool = False,
) -> ObjectRef:
    """Write synchronizer checkpoint ``seq`` of a run (see :func:`write_state`)."""
    return write_state(store, keys.checkpoint_prefix(run_id), seq, tensors, dict(manifest, run_id=run_id),
                       max_concurrency, consume)


def list_checkpoint_seqs(store: ObjectStore, run_id: str) -> list[int]:
    """Checkpoint sequence numbers of a run that have any object, ascending."""
    return list_state_seqs(store, keys.checkpoint_prefix(run_id))


def load_checkpoint(store: ObjectStore, run_id: str, seq: int) -> Checkpoint:
    """Load and verify synchronizer checkpoint ``seq`` (see :func:`load_state`)."""
    return load_state(store, keys.checkpoint_prefix(run_id), seq)


def _verify_state(store: ObjectStore, prefix: str, seq: int) -> Checkpoint:
    """As :func:`load_state` without building the tensors: the state file's size and sha256 are
    checked as it streams through (memory: one read chunk); ``tensors`` is empty. A state that
    verifies holds what :func:`write_state` wrote, which refuses NaN and Inf.

    Raises:
        FileNotFoundError: no manifest or no state file. IntegrityError: short or wrong digest.
    """
    manifest = store.get_json(keys.state_manifest_key(prefix, seq))
    store.verify(ObjectRef.from_json(manifest["state"]))
    return Checkpoint(seq=seq, manifest=manifest, tensors={})


def verify_checkpoint(store: ObjectStore, run_id: str, seq: int) -> Checkpoint:
    """Verify synchronizer checkpoint ``seq`` as it streams by, without keeping its tensors (see
    :func:`_verify_state`; ``tensors`` is empty).

    Raises:
        FileNotFoundError: no manifest or no state file. IntegrityError: short or wrong digest.
    """
    return _verify_state(store, keys.checkpoint_prefix(run_id), seq)


def latest_checkpoint(store: ObjectStore, run_id: str, load: bool = True) -> Checkpoint | None:
    """The synchronizer checkpoint of a run that a resume continues from, or None: of those that
    verify, the newest by (``lease_epoch`` of its manifest, ``seq``). A synchronizer fenced out by
    a successor (a higher lease epoch) can only write checkpoints of its lower epoch, so a late
    checkpoint of it never becomes the newest (docs/resume-and-fencing.md). Checkpoints without
    ``lease_epoch`` count as epoch 0. ``load=False``: the state is verified as it streams by and
    not kept (``tensors`` empty), for callers that need only which checkpoint and its manifest
    (garbage collection: loading it cost a running synchronizer twice the model in RAM).
    """
    prefix = keys.checkpoint_prefix(run_id)
    ranked = []
    for seq in list_state_seqs(store, prefix):
        try:
            epoch = int(store.get_json(keys.state_manifest_key(prefix, seq)).get("lease_epoch") or 0)
        except FileNotFoundError:
            log.warning("skipping incomplete checkpoint %d (no manifest)", seq)
            continue
        except (ValueError, TypeError, AttributeError) as err:
            log.warning("skipping checkpoint %d: unreadable manifest (%s)", seq, err)
            continue
        ranked.append((epoch, seq))
    for epoch, seq in sorted(ranked, reverse=True):
        try:
            return (load_state if load else _verify_state)(store, prefix, seq)
        except FileNotFoundError:
            log.warning("skipping checkpoint %d (lease epoch %d): deleted meanwhile", seq, epoch)
        except (IntegrityError, ValueError, KeyError) as err:
            log.warning("skipping checkpoint %d (lease epoch %d): %s", seq, epoch, err)
    return None
