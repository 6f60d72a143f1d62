"""Storage benchmark: a large fragment through ObjectStore vs raw s3fs on the same S3 endpoint.

Starts moto's S3 server as a child process on a free loopback port (so its memory and CPU are
not this process's), then, in one run and alternating the two:

* put: ``ObjectStore.put`` (exclusive create, parts of ``part_nbytes``, sha256) vs
  ``s3fs.pipe_file`` (s3fs's own multipart upload);
* get: ``ObjectStore.get`` (ranged reads, size and sha256 verified) vs ``s3fs.cat_file``;

and prints throughput and the ratio ObjectStore/raw (goal: >= 0.9). It also reports the peak
memory an upload adds on top of the caller's buffer: Python allocations (tracemalloc) and the
resident-set high-water mark (``/proc/self/clear_refs``), for put and put_from_file.

Run: ``python -m benchmarks.storage [--mib 256] [--repeat 3]`` (also part of ``make bench``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
import urllib.request
import uuid
from collections.abc import Callable, Iterator

from benchmarks.args import description, positive_int
from diloco_async.runtime.procs import stop_process
from diloco_async.storage.store import ObjectStore

__all__ = ["bench_storage", "main"]

MiB = 1 << 20
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


class MotoProcess:
    """moto_server in a child process on a free port; stopped by :meth:`stop`."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-c",
                                      "import sys; from moto.server import main; main(sys.argv[1:])",
                                      "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1):
                    return
            except OSError as err:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server did not start on {self.url}") from err
                time.sleep(0.1)

    def stop(self) -> None:
        stop_process(self.proc, grace_s=10)


def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_memory(fn: Callable[[], object]) -> tuple[float, float | None]:
    """(traced Python peak, RSS high-water rise), in MiB, that ``fn()`` adds."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset the RSS high-water mark (Linux)
        rss0 = _rss_kib("VmRSS")
    except OSError:
        rss0 = None
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    hwm = _rss_kib("VmHWM")
    rss = (hwm - rss0) / 1024 if rss0 is not None and hwm is not None else None
    return (peak - base) / MiB, rss


@contextlib.contextmanager
def _moto_s3() -> Iterator[MotoProcess]:
    """A fresh moto server with the test credentials in the environment (restored afterwards)."""
    saved = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)
    server = MotoProcess()
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _report(mib: int, repeat: int, times: dict[str, list[float]], part_nbytes: int,
            mems: dict[str, tuple[float, float | None]]) -> dict:
    """Print the ratios and peak memories; return them as one dict."""
    best = {k: min(v) for k, v in times.items()}
    out = {"mib": mib, "part_mib": part_nbytes / MiB, **{f"{k} MiB/s": mib / t for k, t in best.items()}}
    for op in ("put", "get"):
        ratio = best[f"raw {op}"] / best[f"ours {op}"]
        out[f"{op} ratio"] = ratio
        print(f"storage s3 (moto, same endpoint) {mib} MiB {op}:  raw s3fs {mib / best[f'raw {op}']:7.1f} MiB/s"
              f"   ObjectStore {mib / best[f'ours {op}']:7.1f} MiB/s   ratio {ratio:5.2f}"
              f" (goal >= 0.90, best of {repeat})")

    def fmt(m: tuple[float, float | None]) -> str:
        rss = f", RSS +{m[1]:6.1f} MiB" if m[1] is not None else ""
        return f"traced +{m[0]:6.1f} MiB ({m[0] / mib:4.2f}x object){rss}"

    print(f"storage s3 {mib} MiB put peak memory beyond the caller's buffer:  ObjectStore.put {fmt(mems['mem_ours'])}")
    print(f"{'':>55}  ObjectStore.put_from_file {fmt(mems['mem_file'])}")
    print(f"{'':>55}  raw s3fs pipe_file {fmt(mems['mem_raw'])}")
    out.update(mems)
    return out


def bench_storage(mib: int = 256, repeat: int = 3) -> dict:
    """Run the comparison on a fresh moto server; print it and return the figures."""
    import s3fs

    with _moto_s3() as server:
        options = {"client_kwargs": {"endpoint_url": server.url}}
        raw = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **options)
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        raw.mkdir(bucket)
        store = ObjectStore(f"s3://{bucket}/ours", options)
        data = os.urandom(mib * MiB)
        times: dict[str, list[float]] = {"raw put": [], "raw get": [], "ours put": [], "ours get": []}

        def timed(name: str, fn: Callable[[], object]) -> object:
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            return out

        def run_raw(i: int) -> None:
            path = f"{bucket}/raw/{i}"
            timed("raw put", lambda: raw.pipe_file(path, data))
            got = timed("raw get", lambda: raw.cat_file(path))
            assert len(got) == len(data)
            raw.rm_file(path)

        def run_ours(i: int) -> None:
            ref = timed("ours put", lambda: store.put(f"obj-{i}", data))
            got = timed("ours get", lambda: store.get(ref))
            assert got == data
            store.delete(ref.key)

        raw.exists(f"{bucket}/warm-up"), store.exists("warm-up")  # clients and connections ready
        for i in range(repeat):  # alternate who goes first
            for run in ((run_raw, run_ours) if i % 2 == 0 else (run_ours, run_raw)):
                run(i)

        mems = {"mem_ours": peak_memory(lambda: store.put("mem-ours", data)),
                "mem_raw": peak_memory(lambda: raw.pipe_file(f"{bucket}/raw/mem", data))}
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "fragment.bin")
            with open(src, "wb") as fh:
                fh.write(data)
            mems["mem_file"] = peak_memory(lambda: store.put_from_file("mem-file", src))
    return _report(mib, repeat, times, store.part_nbytes, mems)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.storage", description=description(__doc__))
    parser.add_argument("--mib", type=positive_int, default=256, help="object size in MiB")
    parser.add_argument("--repeat", type=positive_int, default=3, help="timed repeats of each (best is kept)")
    args = parser.parse_args(argv)
    bench_storage(args.mib, args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
