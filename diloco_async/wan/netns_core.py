"""Low-level namespace plumbing for :mod:`diloco_async.wan.netns`: running ``ip``/``tc`` (argv
lists, never a shell), entering a network namespace with ``setns(2)``, listing and removing what a
prefix names, and :func:`root_reason`.

Everything the harness creates carries its prefix: namespaces are ``{name}-hub`` and
``{name}-{region}``, veths ``{name}h{i}`` (hub side) and ``{name}r`` (region side), where
``name`` is the prefix plus a random tag. :func:`cleanup` finds them by that prefix alone, so it
also works after the process that made them was killed: it SIGKILLs the processes still inside the
matching namespaces (never itself), deletes the matching veths (their ``tbf`` qdiscs go with them)
and then the namespaces.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["NETNS_DIR", "run_cmd", "enter_netns", "call_in_netns", "list_netns", "list_links", "netns_pids",
           "cleanup", "root_reason"]

log = logging.getLogger("diloco.wan")

NETNS_DIR = "/var/run/netns"
CLONE_NEWNET = 0x40000000
CMD_TIMEOUT_S = 20.0
KILL_WAIT_S = 5.0


def run_cmd(argv: list[str], timeout_s: float = CMD_TIMEOUT_S) -> str:
    """Run ``argv`` (no shell) and return its stdout.

    Raises:
        RuntimeError: non-zero exit (the message carries the command and its stderr), or no exit
            within ``timeout_s`` seconds.
        FileNotFoundError: the program is not installed.
    """
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"{' '.join(argv)}: no exit after {timeout_s} s") from err
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def enter_netns(ns: str) -> None:
    """Move the calling thread into network namespace ``ns`` (``/var/run/netns/{ns}``) with
    ``setns(2)``. Sockets it opens afterwards live there, and threads and processes it starts
    afterwards inherit it; sockets already open stay where they were. To move a whole process,
    call it from the main thread before any other thread starts (fsspec's event loop, a fork server).

    Raises:
        FileNotFoundError: no namespace of that name. OSError: setns failed (errno), e.g. not root.
    """
    fd = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc().setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def call_in_netns(ns: str, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0) -> Any:
    """``fn(*args)`` on a fresh thread that first enters namespace ``ns``; returns its result.
    The caller's own namespace never changes.

    Raises:
        TimeoutError: ``fn`` still running after ``timeout_s`` (the thread is a daemon and is left).
        Whatever ``enter_netns`` or ``fn`` raised.
    """
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            enter_netns(ns)
            box["value"] = fn(*args)
        except BaseException as err:  # handed to the caller
            box["error"] = err

    thread = threading.Thread(target=body, name=f"in-netns-{ns}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} in namespace {ns} still running after {timeout_s} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def list_netns() -> list[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    out = run_cmd(["ip", "-j", "netns", "list"]).strip()
    return [entry["name"] for entry in json.loads(out)] if out else []


def list_links(ns: str | None) -> list[str]:
    """Interface names in namespace ``ns`` (None: this process's namespace)."""
    where = ["-n", ns] if ns else []
    out = run_cmd(["ip", *where, "-j", "link", "show"]).strip()
    return [entry["ifname"] for entry in json.loads(out)] if out else []


def netns_pids(ns: str) -> list[int]:
    """Processes whose network namespace is ``ns`` (``ip netns pids``)."""
    return [int(p) for p in run_cmd(["ip", "netns", "pids", ns]).split()]


def _zombie(pid: int) -> bool:
    """``pid`` has exited and waits for its parent to reap it (or is gone); reaps it when it is ours."""
    try:
        os.waitpid(pid, os.WNOHANG)  # a child of this process (a fork server): reap it
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _kill_inside(ns: str, removed: list[str]) -> None:
    """SIGKILL every process inside ``ns`` except this one; wait up to KILL_WAIT_S for them to go."""
    me = os.getpid()
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        try:
            pids = [p for p in netns_pids(ns) if p != me and not _zombie(p)]
        except RuntimeError:
            return  # the namespace is gone
        if not pids or time.monotonic() > deadline:
            if pids:
                log.warning("processes %s still inside %s after SIGKILL", pids, ns)
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                if f"process {pid} (in {ns})" not in removed:
                    removed.append(f"process {pid} (in {ns})")
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _delete_link(ns: str | None, link: str, removed: list[str]) -> None:
    where = ["-n", ns] if ns else []
    try:
        run_cmd(["ip", *where, "link", "del", "dev", link])
        removed.append(f"link {link}" + (f" (in {ns})" if ns else ""))
    except RuntimeError as err:  # already gone with its veth peer
        if link in list_links(ns):
            log.warning("could not delete %s: %s", link, err)


def teardown(namespaces: list[str], links: list[tuple[str | None, str]]) -> list[str]:
    """Kill the processes inside ``namespaces``, delete ``links`` ((namespace or None, name)), then
    the namespaces; what is already gone is skipped. Returns what was removed. Never raises for a
    single item that could not go (it is logged), so one failure does not leave the rest."""
    removed: list[str] = []
    present = set(list_netns())
    for ns in namespaces:
        if ns in present:
            _kill_inside(ns, removed)
    for ns, link in links:
        if ns is None or ns in present:
            _delete_link(ns, link, removed)
    for ns in namespaces:
        if ns in present:
            try:
                run_cmd(["ip", "netns", "del", ns])
                removed.append(f"netns {ns}")
            except RuntimeError as err:
                log.warning("could not delete namespace %s: %s", ns, err)
    return removed


_CLEANUP_PREFIX_RE = re.compile(r"[a-z][a-z0-9]{2,9}")


def cleanup(prefix: str = "dlw") -> list[str]:
    """Remove every namespace, veth (and so its qdisc) and process-in-namespace whose name starts
    with ``prefix``: what a :class:`~diloco_async.wan.netns.WanNet` with that prefix made, also
    after a crash. Other names are never touched. Returns what it removed (``"netns X"``,
    ``"link X (in NS)"``, ``"process PID (in NS)"``).

    Only names of the harness's own shapes match: namespaces ``{prefix}…-{region}`` and, outside
    them, veths ``{prefix}…h{i}``; so a host interface (``eth0``, ``lo``) is never touched whatever
    the prefix. It does not know whether the harness that made them still runs: give the prefix of
    one crashed net (its name, e.g. ``dlwpbh2``) when other runs may be live on this machine.

    Raises:
        ValueError: a prefix that is not 3-10 characters of ``[a-z0-9]`` starting with a letter.
    """
    if not _CLEANUP_PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"cleanup prefix must be 3-10 characters [a-z0-9] starting with a letter, got {prefix!r}")
    ns_re = re.compile(rf"{prefix}[a-z0-9]*-[a-z0-9-]+")
    veth_re = re.compile(rf"{prefix}[a-z0-9]*h[0-9]{{1,3}}")
    namespaces = [ns for ns in list_netns() if ns_re.fullmatch(ns)]
    links: list[tuple[str | None, str]] = [(None, name) for name in list_links(None) if veth_re.fullmatch(name)]
    for ns in namespaces:
        try:
            links += [(ns, name) for name in list_links(ns) if name.startswith(prefix)]
        except RuntimeError as err:
            log.warning("could not list links of %s: %s", ns, err)
    removed = teardown(namespaces, links)
    for line in removed:
        log.info("cleanup %s: removed %s", prefix, line)
    return removed


def _probe_root() -> None:
    """Create a scratch namespace with a veth pair and a tbf qdisc, then remove it."""
    ns = f"dlwprobe{secrets.token_hex(3)}"
    run_cmd(["ip", "netns", "add", ns])
    try:
        run_cmd(["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
        run_cmd(["tc", "-n", ns, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1000000bit",
                 "burst", "12112", "latency", "100ms"])
        enter_check = call_in_netns(ns, lambda: True, timeout_s=10)
        assert enter_check
    finally:
        teardown([ns], [])


@functools.cache
def root_reason() -> str | None:
    """None when this process can build emulated regions (root, ``ip`` and ``tc`` installed, a
    namespace with a veth pair and a ``tbf`` qdisc can be made and entered); else why not, in one
    line (what tests skip with). The probe runs once per process."""
    if os.geteuid() != 0:
        return "the WAN harness needs root (network namespaces, veth pairs, tc qdiscs); euid is " \
               f"{os.geteuid()}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the WAN harness needs `{tool}` (iproute2), not found on PATH"
    try:
        _probe_root()
    except (OSError, RuntimeError, AssertionError, TimeoutError) as err:
        return f"cannot build a shaped namespace link here: {err}"
    return None
