"""Timed TCP transfers between two network namespaces: how :class:`~diloco_async.wan.netns.WanNet`
verifies a shaped link before a run.

A receiver thread (inside the receiving namespace) listens on the receiving address; a sender
thread (inside the sending namespace) connects and writes a bounded number of bytes. The rate is
taken over the steady part of the transfer only: the clock starts once ``skip_bytes`` have
arrived, so the token bucket's initial burst (which passes at the veth's own speed) and TCP's slow
start do not inflate it. Both threads stop at ``timeout_s`` whatever happened; a link slower than
expected then gives the rate of what arrived, never a hang. Plain sockets, nothing but the two
addresses given (inside namespaces the caller created).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

from diloco_async.wan.netns_core import enter_netns

__all__ = ["Transfer", "transfer_plan", "timed_transfer"]

CHUNK_BYTES = 64 * 1024
#: seconds of steady transfer aimed at by :func:`transfer_plan` (1-2 s, as asked of a verification)
STEADY_S = 1.5
MIN_SKIP_BYTES = 64 * 1024


@dataclass(frozen=True)
class Transfer:
    """What one timed transfer measured.

    Attributes:
        sent_bytes: payload bytes the sender wrote; ``received_bytes``: that arrived.
        steady_bytes / steady_s: bytes and seconds after the first ``skip_bytes`` had arrived.
        mbit: payload rate of the steady part, Mbit/s (10^6 bit/s); 0.0 when nothing steady arrived.
        timed_out: the transfer was cut at its deadline (the rate is then of what arrived).
    """

    sent_bytes: int
    received_bytes: int
    steady_bytes: int
    steady_s: float
    mbit: float
    timed_out: bool


def transfer_plan(rate_mbit: float, burst_bytes: int, total_bytes: int | None = None) -> tuple[int, int, float]:
    """``(total_bytes, skip_bytes, timeout_s)`` for verifying a link shaped to ``rate_mbit`` with a
    token bucket of ``burst_bytes``: about :data:`STEADY_S` seconds of steady transfer after
    ``skip_bytes`` (four buckets, at least 64 KiB), and a deadline of three times the expected
    duration plus 5 s. ``total_bytes`` (``WanNet(verify_bytes=...)``) overrides the size; the skip
    is then at most a quarter of it.

    Raises:
        ValueError: a rate or size that is not positive.
    """
    if rate_mbit <= 0 or burst_bytes <= 0:
        raise ValueError(f"rate_mbit and burst_bytes must be positive, got {rate_mbit}, {burst_bytes}")
    rate_bytes_s = rate_mbit * 1e6 / 8
    skip = max(4 * burst_bytes, MIN_SKIP_BYTES)
    if total_bytes is None:
        total_bytes = skip + int(rate_bytes_s * STEADY_S)
    elif total_bytes <= 0:
        raise ValueError(f"verify_bytes must be positive, got {total_bytes}")
    else:
        skip = min(skip, total_bytes // 4)
    timeout_s = 3.0 * total_bytes / rate_bytes_s + 5.0
    return total_bytes, skip, timeout_s


class _Receiver(threading.Thread):
    """Listens on ``addr`` inside ``ns``, reads until ``total_bytes``, EOF or the deadline."""

    def __init__(self, ns: str, addr: str, total_bytes: int, skip_bytes: int, deadline: float) -> None:
        super().__init__(name=f"wan-probe-recv-{ns}", daemon=True)
        self.ns, self.addr, self.total, self.skip, self.deadline = ns, addr, total_bytes, skip_bytes, deadline
        self.port = 0
        self.listening = threading.Event()
        self.received = 0
        self.t_skip: float | None = None
        self.at_skip = 0
        self.t_last = 0.0
        self.timed_out = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            enter_netns(self.ns)
            with socket.create_server((self.addr, 0)) as srv:
                self.port = srv.getsockname()[1]
                self.listening.set()
                srv.settimeout(max(0.1, self.deadline - time.monotonic()))
                conn, _ = srv.accept()
                with conn:
                    self._read(conn)
        except TimeoutError:
            self.timed_out = True
        except BaseException as err:  # handed to the caller
            self.error = err
        finally:
            self.listening.set()

    def _read(self, conn: socket.socket) -> None:
        buf = bytearray(CHUNK_BYTES)
        while self.received < self.total:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.timed_out = True
                return
            conn.settimeout(left)
            n = conn.recv_into(buf)
            if n == 0:
                return
            now = time.monotonic()
            self.received += n
            self.t_last = now
            if self.t_skip is None and self.received >= self.skip:
                self.t_skip, self.at_skip = now, self.received


def _send(ns: str, addr: str, port: int, total_bytes: int, deadline: float, out: dict) -> None:
    """Connect from inside ``ns`` and write ``total_bytes`` (or until the deadline)."""
    try:
        enter_netns(ns)
        payload = memoryview(bytes(CHUNK_BYTES))
        with socket.create_connection((addr, port), timeout=max(0.1, deadline - time.monotonic())) as s:
            while out["sent"] < total_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                s.settimeout(left)
                n = min(CHUNK_BYTES, total_bytes - out["sent"])
                s.sendall(payload[:n])
                out["sent"] += n
    except TimeoutError:
        return
    except BaseException as err:  # handed to the caller
        out["error"] = err


def timed_transfer(recv_ns: str, recv_addr: str, send_ns: str, total_bytes: int, skip_bytes: int,
                   timeout_s: float) -> Transfer:
    """Send ``total_bytes`` from namespace ``send_ns`` to ``recv_addr`` in ``recv_ns`` over TCP and
    time the steady part (after ``skip_bytes`` arrived). Bounded by ``timeout_s`` in all cases.

    Raises:
        OSError: the receiver could not listen or the sender could not connect (no route, the
            namespace is gone); the error names the namespaces and address.
    """
    deadline = time.monotonic() + timeout_s
    recv = _Receiver(recv_ns, recv_addr, total_bytes, skip_bytes, deadline)
    recv.start()
    recv.listening.wait(timeout_s)
    out: dict = {"sent": 0, "error": recv.error}
    if recv.error is None and recv.port:
        sender = threading.Thread(target=_send, args=(send_ns, recv_addr, recv.port, total_bytes, deadline, out),
                                  name=f"wan-probe-send-{send_ns}", daemon=True)
        sender.start()
        sender.join(timeout_s + 1)
    recv.join(max(0.1, deadline - time.monotonic()) + 1)
    error = out["error"] or recv.error
    if error is not None:
        raise OSError(f"timed transfer {send_ns} -> {recv_addr} (in {recv_ns}) failed: {error!r}") from error
    steady_bytes = recv.received - recv.at_skip if recv.t_skip is not None else 0
    t_end = recv.t_last if not recv.timed_out else max(recv.t_last, deadline)
    steady_s = t_end - recv.t_skip if recv.t_skip is not None else 0.0
    mbit = steady_bytes * 8 / steady_s / 1e6 if steady_s > 0 else 0.0
    return Transfer(sent_bytes=out["sent"], received_bytes=recv.received, steady_bytes=steady_bytes,
                    steady_s=steady_s, mbit=mbit, timed_out=recv.timed_out or out["sent"] < total_bytes)
