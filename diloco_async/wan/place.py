"""Where a WAN scenario's methods run: the shaped namespaces of a
:class:`~diloco_async.wan.netns.WanNet` with moto's S3 server in the hub, or (the unshaped
reference run) this namespace with moto on loopback.

:func:`placement` is a context manager: on the way out the S3 server stops and the namespaces,
veths and qdiscs are torn down, also after an exception or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from diloco_async.wan.hubio import hub_mkdir
from diloco_async.wan.methods import S3_TEST_ENV, WanPlacement
from diloco_async.wan.scenario import WanScenario

__all__ = ["placement", "loopback_moto", "make_bucket"]


def make_bucket(endpoint_url: str) -> str:
    """Create a bucket with a fresh name on the S3 endpoint; returns its name."""
    import fsspec

    name = f"wan-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", client_kwargs={"endpoint_url": endpoint_url}).mkdir(name)
    return name


@contextlib.contextmanager
def loopback_moto(log_path: Path, timeout_s: float = 60.0) -> Iterator[str]:
    """moto's S3 server as a subprocess on a free loopback port; yields its endpoint URL.

    Raises:
        TimeoutError: it did not listen within ``timeout_s``. RuntimeError: it exited first.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **S3_TEST_ENV}, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto exited with code {proc.returncode}; log {log_path}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"moto not listening on 127.0.0.1:{port} after {timeout_s} s")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def placement(sc: WanScenario, shaped: bool = True, workdir: Path = Path(".local/runs")) -> Iterator[WanPlacement]:
    """The namespaces and the S3 server of a WAN run (module docstring).

    With ``shaped``: a :class:`~diloco_async.wan.netns.WanNet` of the scenario's links (each link's
    rate verified, else :class:`~diloco_async.wan.netns.LinkRateError` before anything runs),
    moto in its hub. Without: moto on loopback, every process in this namespace.

    Raises:
        LinkRateError: a link measured outside the scenario's tolerance.
        RuntimeError: the harness cannot run here (not root, no ``tc``: see ``root_reason()``).
    """
    for k, v in S3_TEST_ENV.items():
        os.environ.setdefault(k, v)
    if not shaped:
        with loopback_moto(workdir / "wan-moto.log") as url:
            yield WanPlacement(sc, None, url, make_bucket(url))
        return
    from diloco_async.wan.launch import start_moto_server
    from diloco_async.wan.netns import LinkSpec, WanNet, root_reason

    why = root_reason()
    if why is not None:
        raise RuntimeError(f"the WAN harness cannot run here: {why}")
    links = [LinkSpec(region=r, up_mbit=up, down_mbit=down, delay_ms=delay)
             for r, up, down, delay in sc.link_settings()]
    with WanNet(links, tolerance=sc.links.tolerance, verify_bytes=sc.links.verify_bytes) as net:
        url, stop = start_moto_server(net)
        try:
            bucket = f"wan-{uuid.uuid4().hex[:12]}"
            hub_mkdir(net, url, bucket)  # the hub is not reachable from here: create it from inside
            yield WanPlacement(sc, net, url, bucket)
        finally:
            stop()
