"""The object digest's hashing pool (diloco_async/storage/digest.py, issue 17 item 4) in a fresh process: one lane,
then widened, then no pool, all agree (the digest's definition is tests/unit/test_digest.py's)."""

from __future__ import annotations

import subprocess
import sys

from test_digest import blob, store  # noqa: F401, F811 (shared with unit/test_digest.py; fixtures among them)

from diloco_async.storage import digest
from diloco_async.storage.digest import PIECE_NBYTES, PieceHasher
from tests.digest_reference import reference_digest


def test_one_lane_then_widened_and_no_pool_agree(monkeypatch):
    data = blob(5 * PIECE_NBYTES + 9, seed=3)
    narrow = PieceHasher(lanes=1)
    narrow.update(data)
    narrow.widen()
    assert narrow.hexdigest() == reference_digest(data)
    monkeypatch.setenv(digest.HASH_THREADS_ENV, "1")  # in a fresh process: hashed in the caller's thread
    code = ("import sys, tempfile; from diloco_async.storage.digest import object_digest, _shared_pool; "
            "from diloco_async.storage.store import ObjectStore; d = sys.stdin.buffer.read(); "
            "s = ObjectStore('file://' + tempfile.mkdtemp()); ref = s.put('k', d); assert s.get(ref) == d; "
            "print(_shared_pool() is None, object_digest(d), ref.sha256)")
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, check=True)
    assert out.stdout.split() == [b"True", reference_digest(data).encode(), reference_digest(data).encode()]


