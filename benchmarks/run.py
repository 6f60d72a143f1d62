"""`make bench`: speed and size figures, each as a ratio against a baseline measured in this run.

* merge: RDA over M outer gradients vs the plain weighted mean (same tensors);
* codecs: encoded size and encode+decode time vs fp32;
* store: put+get of a 64 MiB object through ObjectStore (exclusive create, sha256 verify) vs raw
  file writes and reads in the same folder.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid

import torch

from benchmarks.storage import bench_storage
from diloco_async import codec as wire
from diloco_async.merge import rda, weighted_mean
from storage.store import ObjectStore


def best_of(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_merge() -> None:
    torch.manual_seed(0)
    deltas = [torch.randn(1 << 20) for _ in range(8)]
    weights = [float(i + 1) for i in range(8)]
    t_mean = best_of(lambda: weighted_mean(deltas, weights))
    t_rda = best_of(lambda: rda(deltas, weights))
    print(f"merge  M=8 x 1Mi fp32   mean {t_mean*1e3:7.2f} ms   rda {t_rda*1e3:7.2f} ms   "
          f"rda/mean {t_rda/t_mean:5.2f}x")


def bench_codecs() -> None:
    torch.manual_seed(0)
    tensors = {"w": torch.randn(2048, 1024) * 0.01}
    specs = {"w": (2048, 1024)}
    base = {}
    for codec in wire.CODECS:
        data = wire.encode_to_bytes(tensors, codec, {})
        t = best_of(lambda codec=codec: wire.decode_from_bytes(wire.encode_to_bytes(tensors, codec, {}), codec, specs),
                    3)
        base.setdefault("size", len(data))
        base.setdefault("time", t)
        print(f"codec  {codec:5s} {len(data)/2**20:7.2f} MiB  size/fp32 {len(data)/base['size']:5.3f}   "
              f"enc+dec {t*1e3:7.1f} ms  time/fp32 {t/base['time']:5.2f}x")


def bench_store() -> None:
    data = os.urandom(64 << 20)
    with tempfile.TemporaryDirectory() as tmp:
        def raw():
            path = os.path.join(tmp, f"raw-{uuid.uuid4().hex}")
            with open(path, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            with open(path, "rb") as fh:
                assert len(fh.read()) == len(data)

        store = ObjectStore(f"file://{tmp}/store")

        def ours():
            ref = store.put(f"obj-{uuid.uuid4().hex}", data)
            assert len(store.get(ref)) == len(data)

        t_raw, t_ours = best_of(raw, 3), best_of(ours, 3)
        mib = len(data) / 2**20
        print(f"store  file:// 64 MiB put+get   raw {mib/t_raw:7.1f} MiB/s   ObjectStore {mib/t_ours:7.1f} MiB/s"
              f"   throughput ratio {t_raw/t_ours:5.2f}")


def main() -> int:
    torch.set_num_threads(1)
    bench_merge()
    bench_codecs()
    bench_store()
    bench_storage()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
