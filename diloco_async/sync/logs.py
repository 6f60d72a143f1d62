"""Bounded memory for the synchronizer's long-lived records.

A run with 4 learners produces millions of metric points a day. :class:`JsonLinesLog` appends
every record to a local JSON-lines spill file (on disk, not in memory) and keeps only the newest
``tail`` records in memory; readers that fell further behind read the file. :class:`BoundedMap` keeps the newest
``cap`` entries of a mapping; :class:`RateLimitedLog` writes at most one line per reason and
period however many events come. Memory and log volume stay flat over a run of any length.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

__all__ = ["JsonLinesLog", "BoundedMap", "RateLimitedLog"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_READ_CHUNK_BYTES = 1 << 20


class JsonLinesLog:
    """An append-only log of JSON records, numbered from 0, with a bounded in-memory tail.

    Every record is written as one line to a local spill file; the newest ``tail`` records are
    also kept in memory, encoded. On Linux the spill file is unlinked at once and lives only as
    long as it is open (nothing is left behind, even after SIGKILL); :attr:`source` is a path
    that reads it while the log is open. Owned by one task: :meth:`append`, :meth:`read`,
    :meth:`flush` and :meth:`seal` are not thread-safe with each other; :meth:`read_spilled` may
    run in another thread, for lines flushed before it was called.

    Args:
        tail: records kept in memory (≥ 1).
        prefix: name prefix of the spill file.
        spill_dir: its folder (default: the temporary folder).

    Raises:
        ValueError: ``tail`` < 1.
    """

    def __init__(self, tail: int, *, prefix: str = "diloco-log-",
                 spill_dir: str | os.PathLike | None = None) -> None:
        if tail < 1:
            raise ValueError(f"tail must be >= 1, got {tail}")
        self.tail = tail
        self._lines: deque[str] = deque(maxlen=tail)
        self._total = 0
        fd, path = tempfile.mkstemp(prefix=prefix, suffix=".jsonl", dir=spill_dir)
        self._file = os.fdopen(fd, "w+b")
        self._lock = threading.Lock()  # spilled reads against close
        self._sealed = False
        proc = Path(f"/proc/self/fd/{fd}")
        if proc.exists():
            os.unlink(path)
            self.source, self._path = proc, None
        else:
            self.source, self._path = Path(path), path

    def append(self, record: dict) -> None:
        self.append_line(json.dumps(record))

    def append_line(self, line: str) -> None:
        """Append a record already encoded as one line of JSON (``json.dumps`` of a dict; no newline)."""
        self._lines.append(line)
        self._total += 1
        if not self._sealed:
            self._file.write(line.encode() + b"\n")

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

    def read(self, since: int, limit: int) -> list[dict] | None:
        """Records ``since`` .. ``since + limit - 1`` from memory; None if some are only on disk."""
        since = max(0, since)
        if since < self.first_in_memory:
            return None
        start = since - self.first_in_memory
        return [json.loads(self._lines[i]) for i in range(start, min(len(self._lines), start + limit))]

    def flush(self) -> None:
        if not self._sealed:
            self._file.flush()

    def seal(self) -> None:
        """Flush and stop spilling: the file holds every record appended so far and :attr:`source`
        can be uploaded; later records stay in memory only."""
        self.flush()
        self._sealed = True

    def read_spilled(self, since: int, limit: int, upto: int) -> list[dict]:
        """Records ``since`` .. ``min(since + limit, upto) - 1`` read from the spill file.

        Blocking (disk); run it in a thread. Call :meth:`flush` first, on the owner's task, and
        pass ``upto = len(log)`` as it was then: only lines flushed by then are read.

        Raises:
            ValueError: the log is closed.
        """
        stop = min(since + limit, upto)
        out: list[dict] = []
        with self._lock:
            if self._file.closed:
                raise ValueError("the log is closed")
            fd, offset, n, pending = self._file.fileno(), 0, 0, b""
            while n < stop and (chunk := os.pread(fd, _READ_CHUNK_BYTES, offset)):
                offset += len(chunk)
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if since <= n < stop:
                        out.append(json.loads(line))
                    n += 1
        return out

    def close(self) -> None:
        """Close and delete the spill file; the in-memory tail stays readable."""
        self.seal()
        with self._lock:
            self._file.close()
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)


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

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._items.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


class RateLimitedLog:
    """Log lines about repeated events (e.g. refused requests), at most one per reason every
    ``period_s`` seconds: the first event of a reason is logged at once, later ones are counted
    and reported with the next line, ``"... (N more since the last line)"``.

    Args:
        logger: where the lines go (at WARNING).
        period_s: seconds between two lines of one reason (> 0).
        clock: monotonic clock in seconds (injectable for tests).

    Raises:
        ValueError: ``period_s`` <= 0.
    """

    def __init__(self, logger: logging.Logger, period_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self.logger, self.period_s, self.clock = logger, period_s, clock
        self._last_s: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def note(self, reason: str, detail: str) -> bool:
        """One event of ``reason`` (a name from a bounded set); returns whether a line was written."""
        now = self.clock()
        last = self._last_s.get(reason)
        if last is not None and now - last < self.period_s:
            self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
            return False
        more = self._unlogged.pop(reason, 0)
        self._last_s[reason] = now
        self.logger.warning("%s: %s%s", reason, detail, f" ({more} more since the last line)" if more else "")
        return True
