"""Bounded memory for the synchronizer's long-lived records.

A run with 4 learners produces millions of metric points a day. :class:`JsonLinesLog` appends
every record to a local JSON-lines spill file and keeps only the newest ``tail`` records in
memory; readers that fell further behind read the file. :class:`BoundedMap` keeps the newest
``cap`` entries of a mapping. Memory stays flat over a run of any length.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import OrderedDict, deque
from pathlib import Path
from typing import Generic, Hashable, Iterator, Optional, TypeVar

__all__ = ["JsonLinesLog", "BoundedMap", "SpillDir"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_READ_CHUNK_BYTES = 1 << 20


class SpillDir:
    """A private temporary folder for spill files, removed by :meth:`remove`."""

    def __init__(self, prefix: str, parent: Optional[str | os.PathLike] = None) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class JsonLinesLog:
    """An append-only log of JSON records, numbered from 0, with a bounded in-memory tail.

    Every record is written as one line to ``path`` (created empty); the newest ``tail`` records
    are also kept in memory, encoded. Owned by one task: :meth:`append` and :meth:`read` are not
    thread-safe with each other; :meth:`read_spilled` is, for lines the owner has flushed.

    Args:
        path: the spill file (local disk).
        tail: records kept in memory (≥ 1).

    Raises:
        ValueError: ``tail`` < 1.
    """

    def __init__(self, path: str | os.PathLike, tail: int) -> None:
        if tail < 1:
            raise ValueError(f"tail must be >= 1, got {tail}")
        self.path = Path(path)
        self.tail = tail
        self._lines: deque[str] = deque(maxlen=tail)
        self._total = 0
        self._file = open(self.path, "w", encoding="utf-8")

    def append(self, record: dict) -> None:
        line = json.dumps(record)
        self._lines.append(line)
        self._total += 1
        if not self._file.closed:
            self._file.write(line + "\n")

    def __len__(self) -> int:
        """Records appended since the start (not only those in memory)."""
        return self._total

    @property
    def first_in_memory(self) -> int:
        """Number of the oldest record still held in memory."""
        return self._total - len(self._lines)

    @property
    def in_memory(self) -> int:
        return len(self._lines)

    def __iter__(self) -> Iterator[dict]:
        """The records held in memory, oldest first."""
        return (json.loads(line) for line in list(self._lines))

    def read(self, since: int, limit: int) -> Optional[list[dict]]:
        """Records ``since`` .. ``since + limit - 1`` from memory; None if some are only on disk."""
        since = max(0, since)
        if since < self.first_in_memory:
            return None
        start = since - self.first_in_memory
        return [json.loads(self._lines[i]) for i in range(start, min(len(self._lines), start + limit))]

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def read_spilled(self, since: int, limit: int, upto: int) -> list[dict]:
        """Records ``since`` .. ``min(since + limit, upto) - 1`` read from the spill file.

        Blocking (disk); run it in a thread. Call :meth:`flush` first, on the owner's task, and
        pass ``upto = len(log)`` as it was then: only lines flushed by then are read.
        """
        stop = min(since + limit, upto)
        out: list[dict] = []
        with open(self.path, "rb") as fh:
            n, pending = 0, b""
            while n < stop and (chunk := fh.read(_READ_CHUNK_BYTES)):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if since <= n < stop:
                        out.append(json.loads(line))
                    n += 1
        return out

    def close(self) -> None:
        """Close the spill file (kept on disk); the in-memory tail stays readable."""
        self._file.close()


class BoundedMap(Generic[K, V]):
    """A mapping that keeps its newest ``cap`` entries (oldest inserted evicted first).

    Raises:
        ValueError: ``cap`` < 1.
    """

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        self.cap = cap
        self._items: OrderedDict[K, V] = OrderedDict()

    def __setitem__(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.cap:
            self._items.popitem(last=False)

    def get(self, key: K, default: Optional[V] = None) -> Optional[V]:
        return self._items.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
