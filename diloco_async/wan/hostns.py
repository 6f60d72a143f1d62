"""Run a program as if on a host of its own:
``python -m diloco_async.wan.hostns NETNS --hide DIR ... --cwd DIR -- PROGRAM ARGS...``.

The multi-host rehearsal (docs/multi-host.md) starts each host's Prefect worker through this. The
process

1. moves into a mount namespace of its own (``unshare(CLONE_NEWNS)``) whose mounts propagate
   nowhere (``/`` made recursively private), so what it mounts is seen by it and its descendants
   only, and goes away with the last of them;
2. mounts an empty, read-only ``tmpfs`` over every ``--hide`` folder (the other hosts' folders):
   neither it nor any process it starts can read or write a file there;
3. enters the network namespace ``NETNS`` (``setns(2)``, :func:`~diloco_async.wan.netns_core.enter_netns`);
4. changes into ``--cwd`` and replaces itself with ``PROGRAM ARGS...`` (``execvp``: same pid).

Every process it starts inherits both namespaces (a fork or exec never leaves them), so a Prefect
worker's flow runs, their learners and synchronizers are all "on" that host.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import sys

from diloco_async.wan.netns_core import enter_netns

__all__ = ["CLONE_NEWNS", "hostns_argv", "private_mounts", "hide", "main"]

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REC, MS_PRIVATE = 0x4000, 0x40000
HIDE_OPTIONS = "size=64k,mode=0555"


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def private_mounts() -> None:
    """Move this (single-threaded) process into a new mount namespace whose mounts propagate
    nowhere.

    Raises:
        OSError: not root (EPERM), or the process already runs other threads (EINVAL).
    """
    _check(_libc().unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc().mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")


def hide(folder: str) -> None:
    """Mount an empty read-only tmpfs over ``folder`` (in this mount namespace; call
    :func:`private_mounts` first so the host's own namespace never sees it).

    Raises:
        FileNotFoundError: ``folder`` does not exist. OSError: the mount failed (errno).
    """
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot hide {folder!r}: no such folder")
    flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
    _check(_libc().mount(b"tmpfs", os.fsencode(folder), b"tmpfs", flags, HIDE_OPTIONS.encode()),
           f"mount tmpfs over {folder}")


def hostns_argv(netns: str, hidden: list[str], cwd: str, program: list[str]) -> list[str]:
    """The arguments (after ``python``) that run ``program`` on the host that ``netns``, ``hidden``
    and ``cwd`` describe (see the module docstring)."""
    return ["-m", "diloco_async.wan.hostns", netns, *[a for d in hidden for a in ("--hide", d)], "--cwd", cwd,
            "--", *program]


def main(args: list[str] | None = None) -> int:
    """Parse ``args`` (default ``sys.argv[1:]``), enter the host, exec the program.

    Raises:
        SystemExit(2): bad arguments. OSError / FileNotFoundError: as :func:`private_mounts`,
            :func:`hide`, :func:`~diloco_async.wan.netns_core.enter_netns`, ``execvp``.
    """
    parser = argparse.ArgumentParser(prog="python -m diloco_async.wan.hostns", description=__doc__.split("\n")[0],
                                     usage="%(prog)s NETNS [--hide DIR]... --cwd DIR -- PROGRAM [ARGS...]")
    parser.add_argument("netns", help="network namespace to enter (/var/run/netns/NAME)")
    parser.add_argument("--hide", action="append", default=[], help="folder covered by an empty read-only tmpfs")
    parser.add_argument("--cwd", required=True, help="working directory of the program")
    args = list(sys.argv[1:] if args is None else args)
    if "--" not in args or args.index("--") == len(args) - 1:
        parser.error("no program: give it after --")
    cut = args.index("--")
    ns, program = parser.parse_args(args[:cut]), args[cut + 1:]
    private_mounts()
    for folder in ns.hide:
        hide(os.path.abspath(folder))
    enter_netns(ns.netns)
    os.chdir(ns.cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(program[0], program)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
