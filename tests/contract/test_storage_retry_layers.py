"""One retry layer under the store (docs/storage.md, "Which layer retries"): against an endpoint
that answers every request with 503, a store told not to retry sends exactly one request, so
neither s3fs, nor botocore, nor gcsfs tries again underneath; told to retry twice, it sends three."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from diloco_async.storage.retry import RetryPolicy, is_transient
from diloco_async.storage.store import ObjectStore

from storage_servers import S3_ENV

_S3_BODY = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
            b"<Message>Please reduce your request rate.</Message></Error>")


class Unavailable:
    """An HTTP endpoint on loopback that answers every request with 503 and counts them."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                owner.requests.append(f"{self.command} {self.path}")
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(_S3_BODY)))
                self.end_headers()
                self.wfile.write(_S3_BODY)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def unavailable() -> Iterator[Unavailable]:
    server = Unavailable()
    yield server
    server.stop()


def _store(kind: str, server: Unavailable, monkeypatch, retries: int) -> ObjectStore:
    if kind == "s3":
        for name, value in S3_ENV.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "7")  # the environment cannot switch botocore's retries back on
        options: dict = {"client_kwargs": {"endpoint_url": server.url}}
    else:
        monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        options = {"endpoint_url": server.url, "token": "anon"}
    policy = RetryPolicy(timeout_s=30.0, retries=retries, backoff_s=0.01, max_backoff_s=0.01, deadline_s=60.0)
    return ObjectStore(f"{kind}://bucket/root", options, policy=policy, part_nbytes=5 * 2**20)


@pytest.mark.parametrize("kind", ["s3", "gs"])
@pytest.mark.parametrize("retries", [0, 2])
def test_only_the_store_retries_a_request_the_endpoint_refuses(kind, retries, unavailable, monkeypatch):
    store = _store(kind, unavailable, monkeypatch, retries)
    with pytest.raises(Exception) as err:  # noqa: PT011 - the backend's own error type, whatever it is
        store.get_unverified("k")
    assert is_transient(err.value), repr(err.value)
    assert len(unavailable.requests) == retries + 1, unavailable.requests
    assert store.counters["retries"] == retries
