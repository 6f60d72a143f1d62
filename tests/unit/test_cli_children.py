"""The command's children as its Ctrl-C handling sees them (diloco_async.flows.interrupts.children, on psutil)."""

from __future__ import annotations

import psutil

from diloco_async.flows.interrupts import children as _children


class _Child:
    def __init__(self, pid: int, cmdline: list[str] | None = None, error: psutil.Error | None = None) -> None:
        self.pid, self._cmdline, self._error = pid, cmdline, error

    def cmdline(self) -> list[str]:
        if self._error is not None:
            raise self._error
        return self._cmdline


class _Me:
    def children(self) -> list[_Child]:
        return [_Child(11, ["python", "-m", "diloco_async.server", "--port", "0"]),
                _Child(12, error=psutil.ZombieProcess(12)),
                _Child(13, error=psutil.NoSuchProcess(13))]


def test_children_are_listed_with_their_command_lines_zombies_kept_the_gone_left_out(monkeypatch):
    monkeypatch.setattr(psutil, "Process", _Me)
    assert _children() == [(11, "python -m diloco_async.server --port 0"), (12, "")]
