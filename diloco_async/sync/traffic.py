"""Peak bytes per second of the synchronizer's traffic over fixed windows (issue 16, the
fragmentation ablation: balanced fragments should give the lowest and smoothest peak).

Pure: no I/O; the clock is injected. Bytes are credited when the synchronizer counts them
(:class:`~diloco_async.sync.reporting.Reporter`): ``in`` when a contribution it fetched is
verified, ``out`` when a learner's heartbeat reports what it downloaded since its last one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["PeakRate", "TrafficPeaks", "WINDOW_S"]

WINDOW_S = 1.0
"""Width of one window (s)."""


class PeakRate:
    """The largest number of bytes credited within one window, as bytes per second.

    Windows are consecutive, ``[start + k·window_s, start + (k+1)·window_s)`` from the clock's
    value at construction; a window's rate is its bytes divided by ``window_s``. Memory is O(1):
    only the current window and the peak so far are kept.

    Args:
        clock: seconds, monotonic (e.g. ``time.monotonic``, or the synchronizer's clock).
        window_s: window width (s), > 0.

    Raises:
        ValueError: ``window_s`` not finite and > 0.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be finite and > 0, got {window_s}")
        self._clock, self._window_s = clock, float(window_s)
        self._start_s = clock()
        self._window = 0  # index of the current window
        self._bytes = 0  # bytes credited in the current window
        self._peak_bytes = 0  # most bytes credited in one window so far

    def add(self, nbytes: int) -> None:
        """Credit ``nbytes`` (≥ 0; negative values are ignored) to the window of now."""
        if nbytes <= 0:
            return
        k = math.floor((self._clock() - self._start_s) / self._window_s)
        if k != self._window:
            self._window, self._bytes = k, 0
        self._bytes += int(nbytes)
        self._peak_bytes = max(self._peak_bytes, self._bytes)

    @property
    def peak_bytes_per_s(self) -> float:
        """The busiest window's bytes per second so far (0.0 before any traffic)."""
        return self._peak_bytes / self._window_s


class TrafficPeaks:
    """Peak rates of the synchronizer's incoming, outgoing and total traffic (same windows).

    Args:
        clock, window_s: as :class:`PeakRate`.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S) -> None:
        self.incoming = PeakRate(clock, window_s)
        self.outgoing = PeakRate(clock, window_s)
        self.total = PeakRate(clock, window_s)

    def add_in(self, nbytes: int) -> None:
        """Credit bytes received (an outer gradient fetched and verified)."""
        self.incoming.add(nbytes)
        self.total.add(nbytes)

    def add_out(self, nbytes: int) -> None:
        """Credit bytes sent (versions learners report as downloaded)."""
        self.outgoing.add(nbytes)
        self.total.add(nbytes)

    def figures(self) -> dict[str, float]:
        """``peak_bytes_in_per_s``, ``peak_bytes_out_per_s`` and ``peak_bytes_per_s`` (in + out)."""
        return {"peak_bytes_in_per_s": self.incoming.peak_bytes_per_s,
                "peak_bytes_out_per_s": self.outgoing.peak_bytes_per_s,
                "peak_bytes_per_s": self.total.peak_bytes_per_s}
