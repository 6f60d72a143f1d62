"""One-time build of the merge's fused C kernels (``merge_kernels.c``, DESIGN §4.5c).

The only module of the merge that does I/O: on first use it compiles the C source with the system
compiler into a per-user cache directory, under a name keyed by a hash of the source, the
compiler, the flags and the CPU, and loads it with ``ctypes``. Several processes may build at
once: each compiles into its own temporary file and renames it into place (atomic on POSIX), so
a reader never sees a half-written library. When the kernels cannot be had (``DILOCO_NATIVE=0``,
no compiler, a failed build or load), :func:`kernels` returns None, the reason is logged once
(logger ``diloco.native``) and kept in :func:`unavailable_reason`, and the merge uses its torch
code, which gives the same bits.

Environment: ``DILOCO_NATIVE=0`` forces the torch code; ``DILOCO_NATIVE_CACHE`` overrides the
cache directory (default ``$XDG_CACHE_HOME/diloco_async`` or ``~/.cache/diloco_async``); ``CC``
names the compiler (default ``cc``, then ``gcc``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["SOURCE", "FLAGS", "BuildError", "build", "kernels", "unavailable_reason", "reset"]

log = logging.getLogger("diloco.native")

#: the C source of the kernels, shipped in the package
SOURCE = Path(__file__).with_name("merge_kernels.c")
#: compiler flags: no contraction of a*b+c except the explicit fmaf (the rounding must be torch's)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11", "-shared", "-fPIC", "-pthread")
#: seconds a build may take before it counts as failed
BUILD_TIMEOUT_S = 120.0

_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}  # source path → the loaded library, or None
_reasons: dict[str, str | None] = {}  # source path → why None
_build_s: dict[str, float] = {}  # source path → seconds the first load took


class BuildError(RuntimeError):
    """The kernels could not be built or loaded; the message says why."""


def _cpu_id() -> str:
    """What the compiled code depends on: the machine and the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    keep = [line for line in text.splitlines()[:40] if line.startswith(("model name", "flags", "vendor_id"))]
    return platform.machine() + "\n" + "\n".join(keep)


def _compiler() -> str | None:
    named = os.environ.get("CC")
    if named:
        return shutil.which(named)
    return shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    """Where built libraries go (``DILOCO_NATIVE_CACHE``, else the user's cache directory)."""
    env = os.environ.get("DILOCO_NATIVE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "diloco_async"


def build(source: Path = SOURCE, directory: Path | None = None, compiler: str | None = None) -> Path:
    """The path of the compiled library of ``source``, built into ``directory`` if not there yet.

    Args:
        source: the C file.
        directory: the cache directory (created), default :func:`cache_dir`.
        compiler: the compiler's path, default ``CC`` or ``cc``/``gcc`` on the PATH.

    Returns:
        The shared library's path, named by the hash of source, compiler, flags and CPU.

    Raises:
        BuildError: no compiler, an unreadable source, a failed or timed-out compile (with the
            compiler's message).
    """
    cc = compiler or _compiler()
    if not cc:
        raise BuildError("no C compiler found (CC, cc, gcc)")
    try:
        text = source.read_bytes()
    except OSError as err:
        raise BuildError(f"cannot read {source}: {err}") from err
    key = hashlib.sha256(b"\0".join([text, cc.encode(), " ".join(FLAGS).encode(), _cpu_id().encode()]))
    directory = cache_dir() if directory is None else directory
    target = directory / f"{source.stem}-{key.hexdigest()[:24]}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        try:
            proc = subprocess.run([cc, *FLAGS, "-o", tmp, str(source), "-lm"], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise BuildError(f"compiler {cc} failed to run: {err}") from err
        if proc.returncode != 0:
            raise BuildError(f"{cc} exited with {proc.returncode}: {proc.stderr.strip()[-800:]}")
        os.replace(tmp, target)  # atomic: concurrent builders each rename a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(source: Path) -> ctypes.CDLL:
    if os.environ.get("DILOCO_NATIVE", "1").strip() == "0":
        raise BuildError("disabled by DILOCO_NATIVE=0")
    try:
        path = build(source)
    except (OSError, RuntimeError) as err:  # e.g. a cache directory that cannot be written
        raise BuildError(f"cannot build into the cache directory: {type(err).__name__}: {err}") from err
    try:
        return ctypes.CDLL(str(path))
    except OSError as err:
        raise BuildError(f"cannot load {path}: {err}") from err


def kernels(source: Path = SOURCE) -> ctypes.CDLL | None:
    """The loaded kernels of ``source`` (default the merge's; built on the first call of the
    process), or None when unavailable (then :func:`unavailable_reason` says why; logged once at
    WARNING)."""
    key = str(source)
    if key in _state:
        return _state[key]  # type: ignore[return-value]
    with _lock:
        if key not in _state:
            t0 = time.perf_counter()
            try:
                _state[key], _reasons[key] = _load(source), None
            except BuildError as err:
                _state[key], _reasons[key] = None, str(err)
                log.warning("fused kernels of %s unavailable, using the torch code: %s", source.name, err)
            _build_s[key] = time.perf_counter() - t0
    return _state[key]  # type: ignore[return-value]


def unavailable_reason(source: Path = SOURCE) -> str | None:
    """Why :func:`kernels` returned None for ``source`` (None when it has not been called or
    succeeded)."""
    return _reasons.get(str(source))


def reset() -> None:
    """Forget the loaded kernels so that the next :func:`kernels` loads again (tests; the
    environment is read again then)."""
    with _lock:
        _state.clear()
        _reasons.clear()
        _build_s.clear()
