"""One-way link latency added by the processes themselves (issue 13: the kernel here has no
``netem``; the WAN harness passes each region's delay to the processes in that region).

:data:`LINK_DELAY_ENV` holds the one-way delay in milliseconds of the link the process's traffic
crosses. Each process adds it to every exchange that crosses that link:

* a learner's synchronizer client (:class:`~diloco_async.protocol.client.SyncClient`): each HTTP request
  and the WebSocket handshake wait one round trip (2 x delay), each pushed message one delay;
* a learner's object store (:class:`~diloco_async.storage.latency.LatencyStore`): each request one round trip;
* a DDP rank (:mod:`diloco_async.baselines.ddp`): each gradient all-reduce waits
  :func:`ring_allreduce_latency_s`.

The latency is per exchange, not per packet: TCP's window growth and the bandwidth-delay product
are not modelled (the rate is the kernel's ``tc`` shaping).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

__all__ = ["LINK_DELAY_ENV", "link_delay_s_from_env", "ring_allreduce_latency_s"]

#: environment variable: the one-way added latency of this process's link, milliseconds (unset: 0)
LINK_DELAY_ENV = "DILOCO_LINK_DELAY_MS"


def link_delay_s_from_env(environ: Mapping[str, str] | None = None) -> float:
    """The one-way delay in seconds from :data:`LINK_DELAY_ENV` (0.0 when unset or empty).

    Raises:
        ValueError: not a number, negative or not finite (the message names the variable).
    """
    text = ((os.environ if environ is None else environ).get(LINK_DELAY_ENV, "") or "").strip()
    if not text:
        return 0.0
    try:
        ms = float(text)
    except ValueError:
        raise ValueError(f"{LINK_DELAY_ENV}={text!r} is not a number of milliseconds") from None
    if not math.isfinite(ms) or ms < 0:
        raise ValueError(f"{LINK_DELAY_ENV}={text!r}: the delay must be a finite number of milliseconds >= 0")
    return ms / 1000.0


def ring_allreduce_latency_s(delay_s: float, world_size: int) -> float:
    """Latency one ring all-reduce of ``world_size`` workers adds when its ring crosses regions
    joined through a hub: 2 (N - 1) sequential steps (reduce-scatter, then all-gather), each
    waiting for a hop that crosses two links (up out of the sender's region, down into the
    receiver's), so ``2 (N - 1) x 2 x delay_s`` seconds; 0 for one worker.

    Raises:
        ValueError: ``world_size`` < 1 or ``delay_s`` < 0.
    """
    if world_size < 1 or delay_s < 0:
        raise ValueError(f"need world_size >= 1 and delay_s >= 0, got {world_size}, {delay_s}")
    return 2 * (world_size - 1) * 2 * delay_s
