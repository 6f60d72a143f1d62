"""A child process that dies with its parent (Linux ``prctl(PR_SET_PDEATHSIG)``).

A process started in a session of its own (so that the terminal's Ctrl-C does not reach it) is not
stopped either when its parent is SIGKILLed or killed by the OOM killer: the command's temporary
Prefect server, for one, kept its port and database. :func:`die_with_parent` asks the kernel to
send a signal when the parent goes; ``python -m diloco_async.runtime.parent_death SIG -m MODULE ARGS...``
does so and then runs ``MODULE`` as ``python -m MODULE ARGS...`` would. Elsewhere than Linux it
does nothing.

The signal is sent when the *thread* that started the child exits: start such children from a
thread that lives as long as the process (the main thread).
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

__all__ = ["die_with_parent", "guarded_argv"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Get ``sig`` when the parent dies; exits at once (code 1) if it is already gone. True where
    applied (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the parent was already gone before the request
        os._exit(1)
    return True


def guarded_argv(module: str, args: list[str], sig: int = signal.SIGTERM) -> list[str]:
    """``python`` arguments that run ``python -m module *args`` as a child that gets ``sig`` when
    its parent dies."""
    return ["-m", __name__, str(int(sig)), "-m", module, *args]


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "-m":
        raise SystemExit("usage: python -m diloco_async.runtime.parent_death SIGNAL -m MODULE [ARGS...]")
    die_with_parent(int(argv[0]))
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
