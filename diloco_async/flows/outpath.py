"""``--out`` of the long commands (``chaos``, ``wan``, ``ablate``), checked before any run starts:
a comparison takes minutes to hours, and an ``--out`` it cannot write used to fail only at its end."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_out"]


def check_out(out: str | None, kind: str) -> None:
    """Refuse an ``--out`` that cannot be written: ``kind`` ``"file"`` (a JSON report: not an
    existing folder) or ``"dir"`` (records and report: not an existing file). The nearest folder
    that exists must be writable; nothing is created here.

    Raises:
        ValueError: naming the path and why.
    """
    if not out:
        return
    path = Path(out).expanduser()
    if kind == "file" and path.is_dir():
        raise ValueError(f"--out {out}: is a folder; give a file name for the JSON report")
    if kind == "dir" and path.exists() and not path.is_dir():
        raise ValueError(f"--out {out}: is a file; give a folder for the records and the report")
    probe = path if kind == "dir" and path.is_dir() else path.parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"--out {out}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: cannot write in {probe.resolve()}")
    if kind == "file" and path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"--out {out}: the file is not writable")
