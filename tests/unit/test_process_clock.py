"""How long this process has existed (diloco_async.runtime.process_clock), read through psutil."""

from __future__ import annotations

import time

import psutil
import pytest

from diloco_async.runtime import process_clock
from diloco_async.runtime.process_clock import process_uptime_s

_TEST_IMPORTED_S = time.monotonic()


class _FakeProcess:
    def __init__(self, create_time_s: float) -> None:
        self._create_time_s = create_time_s

    def create_time(self) -> float:
        return self._create_time_s


def test_this_process_existed_before_this_test_module_was_imported():
    before_s = time.time()
    uptime_s = process_uptime_s()
    after_s = time.time()
    # the start is rounded down to a kernel tick, so the uptime is never short of the truth
    assert uptime_s >= time.monotonic() - _TEST_IMPORTED_S
    # psutil's own epoch reading of the start agrees to within its boot time's whole second (and a
    # tick), whenever between the two readings of the wall clock the uptime was taken
    start_s = psutil.Process().create_time()
    assert before_s - uptime_s - 1.02 <= start_s <= after_s - uptime_s + 1.02


def test_the_uptime_is_boot_clock_less_start_ticks_not_the_epoch_difference(monkeypatch):
    # boot at epoch 1000.6 s, reported by the kernel as 1000 s; the process started 30.25 s after boot
    monkeypatch.setattr(psutil, "Process", lambda: _FakeProcess(1000.0 + 30.25))
    monkeypatch.setattr(psutil, "boot_time", lambda: 1000.0)
    monkeypatch.setattr(process_clock, "_since_boot_s", lambda: 42.5)
    assert process_uptime_s() == pytest.approx(42.5 - 30.25, abs=1e-9)


def test_without_a_boot_clock_the_epoch_difference(monkeypatch):
    monkeypatch.setattr(process_clock, "_since_boot_s", lambda: None)
    monkeypatch.setattr(process_clock.time, "time", lambda: 5000.0)
    monkeypatch.setattr(psutil, "Process", lambda: _FakeProcess(4993.0))
    assert process_uptime_s() == 7.0
    monkeypatch.setattr(psutil, "Process", lambda: _FakeProcess(5060.0))  # the wall clock stepped back since
    assert process_uptime_s() == 0.0


def test_a_process_psutil_cannot_read_counts_from_the_import(monkeypatch):
    def denied():
        raise psutil.AccessDenied(pid=1)

    monkeypatch.setattr(psutil, "Process", denied)
    since_import_s = time.monotonic() - process_clock._IMPORTED_S
    assert since_import_s <= process_uptime_s() <= time.monotonic() - process_clock._IMPORTED_S
