"""Check that this environment holds exactly the repository's pins (run inside the image build).

    python scripts/check_pins.py constraints.txt

Every installed distribution must be pinned in the constraints file at the installed version (a
local label such as ``+cpu`` is ignored), and every pin must be installed. The exceptions are the
installer itself (pip, setuptools, wheel), the project (diloco-async), and, with
``--allow-closure-of torch``, whatever only torch's own requirements pull in beyond the pins: the
CUDA build's ``nvidia-*`` and ``triton`` wheels, which torch's metadata pins exactly itself.
Exit 0 when it holds; exit 1 listing each difference.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import sys

from packaging.requirements import Requirement

_INSTALLER = {"pip", "setuptools", "wheel", "diloco-async"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: str) -> dict[str, str]:
    """``{canonical name: version}`` of a constraints file of ``name==version`` lines."""
    pins: dict[str, str] = {}
    for raw in open(path, encoding="utf-8"):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise ValueError(f"{path}: not an exact pin: {line!r}")
        pins[_canonical(name.split("[", 1)[0])] = version.strip()
    return pins


def closure(root: str, installed: dict[str, metadata.Distribution]) -> set[str]:
    """The installed distributions that ``root`` requires, directly or not (markers evaluated here)."""
    seen, todo = set(), [_canonical(root)]
    while todo:
        name = todo.pop()
        if name in seen or name not in installed:
            continue
        seen.add(name)
        for spec in installed[name].requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_canonical(req.name))
    return seen


def differences(pins: dict[str, str], allow_closure_of: list[str]) -> list[str]:
    """What differs between the pins and this environment, one line each (empty: it matches)."""
    installed = {_canonical(d.metadata["Name"]): d for d in metadata.distributions()}
    allowed = set().union(*(closure(root, installed) for root in allow_closure_of)) if allow_closure_of else set()
    out = []
    for name, dist in sorted(installed.items()):
        version = dist.version.split("+", 1)[0]
        if name in pins:
            if version != pins[name]:
                out.append(f"{name}: {dist.version} installed, {pins[name]} pinned")
        elif name not in _INSTALLER and name not in allowed:
            out.append(f"{name}: {dist.version} installed, not pinned")
    out += [f"{name}: pinned {version}, not installed" for name, version in sorted(pins.items())
            if name not in installed]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("constraints", help="the constraints file (name==version lines)")
    ap.add_argument("--allow-closure-of", action="append", default=[], metavar="DIST",
                    help="also accept unpinned distributions that DIST requires (e.g. torch: its CUDA wheels)")
    args = ap.parse_args(argv)
    found = differences(read_pins(args.constraints), args.allow_closure_of)
    for line in found:
        print(f"pin mismatch: {line}", file=sys.stderr)
    if not found:
        print(f"every installed distribution matches {args.constraints}")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
