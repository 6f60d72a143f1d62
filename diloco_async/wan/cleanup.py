"""``python -m diloco_async.wan.cleanup [--prefix dlw]``: remove what the WAN harness left behind
(processes inside its namespaces, veths and their qdiscs, namespaces) whose names start with the
prefix, e.g. after a harness was killed. Prints one line per item removed; exit 0, or 2 when this
machine cannot run the harness at all (not root, no ``ip``/``tc``: the reason is printed)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys

from diloco_async.wan.netns_core import cleanup

__all__ = ["main"]


def main(args: list[str] | None = None) -> int:
    """Parse ``args`` (default ``sys.argv[1:]``), remove the leftovers, print them; the exit code."""
    parser = argparse.ArgumentParser(prog="python -m diloco_async.wan.cleanup", description=__doc__)
    parser.add_argument("--prefix", default="dlw",
                        help="remove namespaces and veths whose names start with this (default: dlw, every "
                             "harness with the default prefix, also other people's on this machine)")
    ns = parser.parse_args(args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("wan cleanup needs root and `ip` (iproute2): nothing to remove without them", file=sys.stderr)
        return 2
    try:
        removed = cleanup(ns.prefix)
    except ValueError as err:
        parser.error(str(err))
    for line in removed:
        print(f"removed {line}")
    print(f"wan cleanup {ns.prefix}: {len(removed)} item(s) removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
