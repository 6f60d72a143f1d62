"""Published versions of a fragment, read without copies, and the synchronizer's kept versions
held in the store rather than in RAM (issue 17 item 3; DESIGN §4.1, anchoring on Θ^base).

Versions are published as fp32 safetensors (``sync/work.py``'s ``put_version``), so reading one
back gives exactly the tensors the learners adopted: a version kept in the store and decoded on
demand anchors exactly as one kept in RAM did.

* :func:`read_version` — one published version, streamed, verified (size and sha256) and
  checked against the fragment's tensors; each tensor allocated once.
* :class:`VersionHistory` — version → (name → fp32 tensor): the newest version in RAM (it is
  the fragment's current value), older published ones read from the store when asked for, with
  the last one read cached.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, MutableMapping

import torch

from diloco_async.storage.checkpoint import read_safetensors
from diloco_async.storage.store import ObjectRef, ObjectStore

__all__ = ["read_version", "VersionHistory"]


def read_version(store: ObjectStore, ref: ObjectRef, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The fp32 tensors of the published version at ``ref``, by name (the names and shapes of
    ``shapes``); streamed from the store into tensors allocated once.

    Raises:
        FileNotFoundError: collected. diloco_async.storage.store.IntegrityError: size, digest or layout.
        ValueError: not an fp32 version of these tensors.
    """
    tensors, meta = read_safetensors(store, ref, with_metadata=True)
    if meta.get("codec", "fp32") != "fp32":
        raise ValueError(f"{ref.key}: a version must be fp32, got codec {meta.get('codec')!r}")
    if set(tensors) != set(shapes):
        raise ValueError(f"{ref.key}: tensors {sorted(set(tensors) ^ set(shapes))[:5]} differ from the fragment's")
    for name, shape in shapes.items():
        t = tensors[name]
        if t.dtype != torch.float32 or tuple(t.shape) != tuple(shape):
            raise ValueError(f"{ref.key}: tensor {name} is {t.dtype} {list(t.shape)}, expected float32 {list(shape)}")
    return tensors


class VersionHistory(MutableMapping[int, dict[str, torch.Tensor]]):
    """The kept versions of one fragment: version → (name → fp32 tensor), read only.

    ``h[v] = tensors`` keeps version ``v``. The newest kept version's tensors stay in RAM (they
    are the fragment's value: shared, not copied); an older one is held in RAM only while it has
    no published ref in ``refs`` (the fragment's ``refs``, shared: version → ObjectRef), else it
    is dropped from RAM and read back from the store when asked for (exact: versions are
    published fp32). The last older version read is cached (a round's contributions mostly share
    a base). ``del h[v]`` forgets a version. Safe to read from merge worker threads.

    Args:
        store: where the versions are published (None: nothing is read back; versions without
            a store stay in RAM).
        shapes: the fragment's tensor names and shapes.
        refs: version → ref of the published object (read, never written here).

    Raises (on ``h[v]``):
        KeyError: ``v`` is not kept. FileNotFoundError, IntegrityError, ValueError: as
        :func:`read_version` (the published object is gone or damaged).
    """

    def __init__(self, store: ObjectStore | None, shapes: Mapping[str, tuple[int, ...]],
                 refs: Mapping[int, ObjectRef]) -> None:
        self.store, self.shapes, self.refs = store, dict(shapes), refs
        self._kept: set[int] = set()
        self._ram: dict[int, dict[str, torch.Tensor]] = {}  # the newest, and versions not published yet
        self._cache: tuple[int, dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()

    def _readable(self, v: int) -> bool:
        return self.store is not None and self.refs.get(v) is not None

    def _drop_old(self) -> None:
        newest = max(self._kept, default=None)
        for v in [v for v in self._ram if v != newest and self._readable(v)]:
            del self._ram[v]

    def __setitem__(self, v: int, tensors: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._kept.add(v)
            self._ram[v] = tensors
            if self._cache is not None and self._cache[0] == v:
                self._cache = None
            self._drop_old()

    def __getitem__(self, v: int) -> dict[str, torch.Tensor]:
        with self._lock:
            if v not in self._kept:
                raise KeyError(v)
            self._drop_old()  # refs may have been recorded since the version was kept
            if v in self._ram:
                return self._ram[v]
            if self._cache is not None and self._cache[0] == v:
                return self._cache[1]
            ref = self.refs[v]
        assert self.store is not None
        tensors = read_version(self.store, ref, self.shapes)
        with self._lock:
            if v in self._kept:
                self._cache = (v, tensors)
        return tensors

    def __delitem__(self, v: int) -> None:
        with self._lock:
            self._kept.remove(v)
            self._ram.pop(v, None)
            if self._cache is not None and self._cache[0] == v:
                self._cache = None

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._kept))

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, v: object) -> bool:
        return v in self._kept

    def in_ram(self) -> list[int]:
        """The versions whose tensors are held in RAM now (the newest, unpublished ones and the
        cached one), for tests and reports."""
        with self._lock:
            self._drop_old()
            return sorted(set(self._ram) | ({self._cache[0]} if self._cache else set()))
