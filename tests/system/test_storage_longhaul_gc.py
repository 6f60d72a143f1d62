"""Storage garbage collection after a writer process is SIGKILLed mid-upload (issue 14, item 6): its
uploads are collected once older than the threshold, on file:// and on moto's S3."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from diloco_async.storage.gc import collect_garbage
from diloco_async.storage.options import STORAGE_OPTIONS_ENV
from diloco_async.storage.orphans import find_orphans
from diloco_async.storage.store import ObjectStore

from storage_servers import make_bucket

MiB, GiB = 1 << 20, 1 << 30


def blob(nbytes: int, seed: int = 0) -> bytes:
    return hashlib.shake_256(f"longhaul-{seed}".encode()).digest(nbytes)


# -- leftovers of killed writers -------------------------------------------------------------------

_KILLED_WRITER = """
import sys, time
from diloco_async.storage.options import storage_options_from_env
from diloco_async.storage.store import ObjectStore
store = ObjectStore(sys.argv[1], storage_options_from_env(), part_nbytes=5 << 20, max_concurrency=1)
w = store.open_writer("run/contrib/p0/r1/A-dead")
w.write(bytes(11 << 20))  # two parts sent (one at a time: both landed), the upload never finished
print("uploading", flush=True)
time.sleep(600)
"""


def _leftovers(store: ObjectStore) -> list[str]:
    return sorted(o.kind for o in find_orphans(store, "run", 0.0))


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_gc_collects_uploads_of_a_killed_writer_after_the_threshold(kind, tmp_path, request):
    """Defect 12: a writer SIGKILLed mid-upload leaves a temp file (file://) or an incomplete
    multipart upload (S3). gc leaves it while younger than orphan_age_s, removes it after, and
    never touches a live upload younger than the threshold, which then publishes normally."""
    if kind == "s3":
        server = request.getfixturevalue("s3_endpoint")
        url = f"s3://{make_bucket('s3', server.storage_options)}/root"
        options = server.storage_options
    else:
        url, options = f"file://{tmp_path}/store", {}
    # copied once the S3 server runs: it puts its test credentials into the environment when it starts
    # (copied before, the writer had none whenever this test was the session's first to use S3)
    env = {**os.environ, STORAGE_OPTIONS_ENV: json.dumps(options)}
    # one part at a time: write() returns once its parts landed (moto reports a fixed 2010 initiation
    # time, so an upload's age there comes from its parts' upload times)
    store = ObjectStore(url, options, part_nbytes=5 * MiB, max_concurrency=1)
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, url], env=env, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "uploading"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    # gc reads ages off an injected wall clock: the dead upload's last write is before t_dead, the
    # live one's first after t_live; nothing depends on how long a step took on a loaded machine
    t_dead = time.time()
    expected = "temp_file" if kind == "file" else "multipart_upload"
    assert _leftovers(store) == [expected]
    threshold_s = 600.0
    young = collect_garbage(store, "run", orphan_age_s=threshold_s, clock=lambda: t_dead)
    assert young.objects == 0 and _leftovers(store) == [expected]
    time.sleep(2.0)  # a lower bound: the live upload starts at least 2 s after the dead one's last part
    t_live = time.time()
    live = store.open_writer("run/contrib/p0/r1/B-live")
    live.write(blob(11 * MiB))
    # threshold_s - 1.5 s after t_live: the live upload is younger than the threshold (store clocks
    # may truncate to the second), the dead one at least 2 - 1.5 s older
    report = collect_garbage(store, "run", orphan_age_s=threshold_s, clock=lambda: t_live + threshold_s - 1.5)
    assert report.deleted == {expected: 1} and report.checkpoint is None
    assert _leftovers(store) == [expected]  # the live one only
    ref = live.close()
    assert store.get(ref) == blob(11 * MiB) and _leftovers(store) == []
    assert store.list("run") == ["run/contrib/p0/r1/B-live"]
