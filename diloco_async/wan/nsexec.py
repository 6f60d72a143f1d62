"""Run a Python entry point inside a network namespace: ``python -m diloco_async.wan.nsexec NS ARGV...``.

``ARGV`` is what would follow ``python`` (``-m module args...``, ``-c code``, a script). The process
enters namespace ``NS`` with ``setns(2)`` (no mount tricks, unlike ``ip netns exec``), then:

* if ``ARGV`` is ``-m module ...`` and ``module`` is already imported (a fork of a
  :class:`~diloco_async.runtime.procs.ForkServerLauncher` server that preloaded it), it calls
  ``module.main(args)`` in this process, as the fork server would have, keeping the fork's speed;
* otherwise it replaces itself with ``python ARGV...`` (``execv``: same pid, session, environment
  and open log), which keeps the namespace.
"""

from __future__ import annotations

import os
import sys

from diloco_async.wan.netns_core import enter_netns

__all__ = ["main", "nsexec_argv"]


def nsexec_argv(ns: str, argv: list[str]) -> list[str]:
    """The arguments (after ``python``) that run ``python argv...`` inside namespace ``ns``."""
    return ["-m", "diloco_async.wan.nsexec", ns, *argv]


def main(args: list[str] | None = None) -> int:
    """Enter the namespace ``args[0]`` and run ``args[1:]`` (see the module docstring).

    Raises:
        SystemExit(2): fewer than two arguments. FileNotFoundError: no such namespace.
    """
    args = list(sys.argv[1:] if args is None else args)
    if len(args) < 2:
        print("usage: python -m diloco_async.wan.nsexec NAMESPACE -m module args... | -c code | script",
              file=sys.stderr)
        raise SystemExit(2)
    ns, argv = args[0], args[1:]
    enter_netns(ns)
    if argv[0] == "-m" and len(argv) > 1 and argv[1] in sys.modules and argv[1] != __name__:
        module = sys.modules[argv[1]]
        sys.argv = [argv[1], *argv[2:]]
        return int(module.main(argv[2:]) or 0)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *argv])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
