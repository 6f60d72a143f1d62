"""Merge benchmark: anchoring + token-weighted RDA + outer Nesterov step against a memcpy.

What is timed is the synchronizer's merge of one round (``diloco_async.sync.work``): for each of
M contributions an ``AnchoredDelta``, then ``merge.merge_and_step``, which goes tensor by tensor:
``check_anchored`` (norms and finite checks), ``merge_outer_gradients`` (RDA, into buffers of the
optimizer's pool, its last multiplication deferred) and the outer step
(``OuterOptimizer.step_shared_from``, with the finite check of the result; the merged buffers
become the momentum), in the workspace ``work.merge_workspace`` makes. It runs as in the
synchronizer's process: one torch thread and the C heap set up as ``sync/process.py`` does at
start (``limit_heap_retention``, with its mmap threshold), the merge in a worker thread (as
``asyncio.to_thread``), the heap trimmed after each merge as the actor does after adopting one
(``release_free_memory``, untimed). Half the contributions are anchored on an older version, so
the anchoring is real work. The norms each outer gradient's verification computed when it
arrived (``work.fetch_and_verify``, float32, the merge's own) are passed in as the synchronizer
passes them, computed before the timing: the merge reuses them where ``Δ'`` is ``Δ``. Fragments
are fp32 transformer-block shapes (d_model d: qkv (3d, d),
out (d, d), up (4d, d), down (d, 4d), two norms (d,), one (r, d) tensor to reach the size).

**Rate.** Bytes of outer gradients consumed per second: ``M × fragment bytes / merge seconds``.
The baseline is a memcpy of one fragment-sized fp32 tensor into an existing one
(``dst.copy_(src)``): ``fragment bytes / copy seconds``. The figure is their ratio,
``M × copy_s / merge_s``, both best-of-N in the same process, interleaved (at 16 MiB the merge
is best of 9 by default: a single merge is milliseconds and on a shared 2-core machine varies by
half from one to the next, while the memcpy it is divided by is the best of 6 copies per merge). This counts what the
merge has to read at least once (each outer gradient) against the cheapest full pass over that
much memory, so 1.0 would mean the whole merge costs one memcpy per contribution. The memcpy's
source is read from memory: a 128 MiB sweep is read before each copy, because the merge's M
outer gradients never sit in the cache, while a repeated 16 MiB copy runs from the 32 MiB L3
(several times memory speed). The cache-hot copy and the ratio against it are printed too.
Goals (issue 17): ≥ 0.25 at 16 MiB, ≥ 0.2 at 256 MiB, for M = 2, 8 and 16.

**Peak memory.** In a child process: the inputs are built the way the synchronizer holds them
(M decoded fp32 outer gradients, as ``Contribution.delta``, the current value and the kept
versions), then ``/proc/self/clear_refs`` ("5") resets the RSS high-water mark, one merge + outer
step runs, and ``VmHWM`` is read. The figure is the memory the merge *adds beyond its inputs*
(HWM minus the RSS just before), in GB (10^9 bytes); goal ≤ 2 GB for 256 MiB and M = 16 (the
inputs alone are 4.3 GB there). The total HWM is printed beside it.

The previous implementation (``tests/merge_reference.py``, as ``work.py`` used it: anchored
copies, whole-tensor RDA, torch SGD with clone snapshots for the rollback) is measured beside
it as context (shown rows): at 16 MiB for every M, at 256 MiB for M = 2 only (its M = 16 peak
was 12.3 GB, too much to run next to others).

**Direction guard** (context, shown rows): before a merge of 3 or more contributions with the
guard on (the default), ``work._screen`` computes each one's leave-one-out cosine
(``guard.leave_one_out_cosines``); its time at the first size, M = 8, is printed beside the
previous implementation's (``tests/guard_reference.py``).

Run: ``python -m benchmarks.merge [--quick] [--repeat N]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.args import description, positive_int
from benchmarks.bars import Bar, print_bars
from diloco_async.merge import core as new
from diloco_async.runtime.heap import limit_heap_retention, release_free_memory
from diloco_async.sync import process as sync_process
from diloco_async.sync.work import merge_workspace

__all__ = ["bars", "main"]

MiB = 1 << 20
GB = 1e9
SWEEP_BYTES = 128 * MiB  # read before each baseline copy: 4x the 32 MiB L3 of the 2-core machine
ROOT = Path(__file__).resolve().parents[1]


def fragment_shapes(nbytes: int) -> dict[str, tuple[int, ...]]:
    """Transformer-block shapes of ``nbytes`` of fp32 (the module docstring says which)."""
    n = nbytes // 4
    d = max(64, int(math.sqrt(n / 13)) // 64 * 64)
    shapes = {"qkv": (3 * d, d), "out": (d, d), "up": (4 * d, d), "down": (d, 4 * d), "ln1": (d,), "ln2": (d,)}
    rest = n - sum(math.prod(s) for s in shapes.values())
    if rest >= d:
        shapes["extra"] = (rest // d, d)
        rest -= (rest // d) * d
    if rest:
        shapes["bias"] = (rest,)
    return shapes


def _inputs(nbytes: int, m: int, seed: int = 0):
    """(current, older version, M outer gradients, M base indices, M weights); cheap to build."""
    gen = torch.Generator().manual_seed(seed)
    shapes = fragment_shapes(nbytes)
    current = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    older = {k: t - 0.01 * torch.randn(t.shape, generator=gen) for k, t in current.items()}
    noise = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    deltas = []
    for i in range(m):  # distinct directions without m calls to randn
        deltas.append({k: torch.roll(noise[k].view(-1), 977 * i).view(s).mul_(0.01 * (1 + i % 5))
                       for k, s in shapes.items()})
    weights = [float((1000 + 37 * i) ** 2) / (10 + i % 3) for i in range(m)]
    return current, older, deltas, [i % 2 for i in range(m)], weights


def verified_norms(deltas: list[dict]) -> list[dict]:
    """Each outer gradient's float32 norms, as ``work.fetch_and_verify`` returns them when it
    arrives (before its round merges; untimed here, as there)."""
    return [{k: torch.linalg.vector_norm(t) for k, t in d.items()} for d in deltas]


def _merge_new(opt, current, versions, deltas, bases, weights, norms=None) -> dict:
    ws = merge_workspace(opt)  # as work.py: buffers from the fragment's pool, anchored Δ' kept
    norms = norms or [{} for _ in deltas]
    anchored = [new.AnchoredDelta(d, current, versions[b], norms=n)
                for d, b, n in zip(deltas, bases, norms, strict=True)]
    before = opt.shared_state()  # what work.py keeps for a rollback
    out = new.merge_and_step(opt, anchored, weights, "rda", workspace=ws)  # raises on non-finite input
    del before
    return out


def _merge_old(opt, current, versions, deltas, bases, weights, norms=None) -> dict:
    from tests import merge_reference as ref

    anchored = []
    for d, b in zip(deltas, bases, strict=True):
        a = ref.anchor(d, current, versions[b])
        if any(int((~torch.isfinite(t)).sum()) for t in a.values()):
            raise AssertionError("benchmark inputs must be finite")
        anchored.append(a)
    before = opt.params(), opt.momentum()  # the previous work.py's rollback snapshot
    g = ref.merge_outer_gradients(anchored, weights, mode="rda")
    out = opt.step(g)
    if any(not bool(torch.isfinite(t).all()) for t in out.values()):
        raise AssertionError("non-finite")
    momentum = opt.momentum()  # Merged.momentum
    del before, momentum
    return out


def _optimizer(impl: str, current: dict):
    from tests import merge_reference as ref

    opt = (new.OuterOptimizer if impl == "new" else ref.OuterOptimizer)(current)
    if impl == "new":  # the synchronizer's pool: shared by its fragments, a fixed budget of free buffers
        from diloco_async.sync.state import merge_pool

        opt.pool = merge_pool(sum(t.numel() * t.element_size() for t in current.values()))
    opt.step({k: torch.full_like(t, 1e-3) for k, t in current.items()})  # steady state: momentum exists
    return opt


def _copy_s(src: torch.Tensor, dst: torch.Tensor, sweep: torch.Tensor | None, n: int = 3) -> float:
    """Best-of-``n`` seconds of ``dst.copy_(src)``; with ``sweep``, read first (``sweep.sum()``)
    so that ``src`` comes from memory, not from the last-level cache."""
    best = math.inf
    for _ in range(n):
        if sweep is not None:
            sweep.sum()
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def _as_the_synchronizer() -> None:
    """The settings ``sync/process.py`` makes at start: one torch thread (so the merge's kernels
    run on one thread, as in the synchronizer) and the C heap's (with its mmap threshold, where
    that version of the process sets one)."""
    torch.set_num_threads(1)
    threshold = getattr(sync_process, "SYNC_MMAP_THRESHOLD_BYTES", None)
    if threshold is None:
        limit_heap_retention()
    else:
        limit_heap_retention(mmap_threshold_bytes=threshold)


def measure_speed(nbytes: int, ms: list[int], repeat: int, ref_ms: list[int]) -> list[dict]:
    """Best-of-``repeat`` merge seconds and memcpy seconds for each M (and the reference's)."""
    _as_the_synchronizer()
    current, older, deltas, bases, weights = _inputs(nbytes, max(ms))
    versions, norms = [current, older], verified_norms(deltas)
    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    sweep = torch.ones(max(SWEEP_BYTES, 2 * nbytes) // 4)
    rows = []
    for impl, impl_ms in (("new", ms), ("previous", ref_ms)):
        for m in impl_ms:
            opt = _optimizer(impl, current)
            fn = _merge_new if impl == "new" else _merge_old
            merge_s, copy_s, hot_s = math.inf, math.inf, math.inf
            for _ in range(repeat):  # interleaved: a load change hits both
                copy_s = min(copy_s, _copy_s(src, dst, sweep))
                hot_s = min(hot_s, _copy_s(src, dst, None))
                with ThreadPoolExecutor(1) as worker:  # a worker thread, as asyncio.to_thread
                    t0 = time.perf_counter()
                    worker.submit(fn, opt, current, versions, deltas[:m], bases[:m], weights[:m], norms[:m]).result()
                    merge_s = min(merge_s, time.perf_counter() - t0)
                if impl == "new":
                    opt.pool.trim()
                release_free_memory()  # what the actor does after adopting a merge (sync/rounds.py)
                copy_s = min(copy_s, _copy_s(src, dst, sweep))
            ratio = m * copy_s / merge_s
            rows.append({"impl": impl, "mib": nbytes // MiB, "m": m, "merge_s": merge_s, "copy_s": copy_s,
                         "hot_copy_s": hot_s, "ratio": ratio})
            print(f"merge {impl:8s} {nbytes // MiB:4d} MiB M={m:2d}: {merge_s * 1e3:9.1f} ms, memcpy "
                  f"{copy_s * 1e3:7.2f} ms (cache-hot {hot_s * 1e3:6.2f} ms), rate "
                  f"{m * nbytes / merge_s / 1e9:6.2f} GB/s = {ratio:.3f} of memcpy's "
                  f"({m * hot_s / merge_s:.3f} of the cache-hot one's)", flush=True)
    return rows


def measure_guard(nbytes: int, m: int, repeat: int) -> dict:
    """Best-of-``repeat`` seconds of the direction guard's cosines over one round (``work._screen``
    computes them before a merge of 3 or more with the guard on, the default), piece by piece
    and as the previous implementation did (``tests/guard_reference.py``), interleaved."""
    from diloco_async.policy.guard import leave_one_out_cosines
    from tests import guard_reference

    _as_the_synchronizer()
    _current, _older, deltas, _bases, weights = _inputs(nbytes, m)
    best = {"new": math.inf, "previous": math.inf}
    for _ in range(repeat):
        for impl, fn in (("new", leave_one_out_cosines), ("previous", guard_reference.leave_one_out_cosines)):
            t0 = time.perf_counter()
            fn(deltas, weights)
            best[impl] = min(best[impl], time.perf_counter() - t0)
    return {"mib": nbytes // MiB, "m": m, "new_s": best["new"], "previous_s": best["previous"]}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_peak(nbytes: int, m: int, impl: str, publish: bool = False) -> dict:
    """In this process: RSS high-water mark of one merge + outer step (+ fp32 serialization of
    the new version with ``publish``) beyond the inputs held as the synchronizer holds them."""
    _as_the_synchronizer()
    current, older, deltas, bases, weights = _inputs(nbytes, m)
    opt = _optimizer(impl, current)
    fn = _merge_new if impl == "new" else _merge_old
    norms = verified_norms(deltas)
    rss0 = _status_kib("VmRSS") * 1024
    Path("/proc/self/clear_refs").write_text("5")
    out = fn(opt, current, [current, older], deltas, bases, weights, norms)
    if publish:
        from diloco_async.sync.work import _fp32_bytes

        data = _fp32_bytes(out, {"fragment": "0", "version": "1"})
        del data
    hwm = _status_kib("VmHWM") * 1024
    return {"impl": impl, "mib": nbytes // MiB, "m": m, "publish": publish, "inputs_bytes": rss0,
            "added_bytes": hwm - rss0, "hwm_bytes": hwm}


def _child(what: str, **kw) -> dict:
    """Run ``measure_<what>`` in a fresh interpreter (its memory is its own and given back)."""
    code = ("import json, sys; from benchmarks import merge as b; "
            f"r = b.measure_{what}(**json.loads(sys.argv[1])); print('RESULT ' + json.dumps(r))")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(kw)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    sys.stdout.write("".join(line + "\n" for line in proc.stdout.splitlines() if not line.startswith("RESULT ")))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"benchmark child {what} {kw} failed (rc {proc.returncode}): {proc.stderr[-2000:]}")


def bars(quick: bool = False, repeat: int | None = None) -> list[Bar]:
    """Measure (printing as it goes) and return the bars rows (module docstring)."""
    if quick:  # seconds: small fragments, same code paths
        sizes, ms, repeat = [(1 * MiB, 0.25), (4 * MiB, 0.2)], [2, 8], repeat or 2
        peak_size, peak_m = 4 * MiB, 8
    else:
        sizes, ms, repeat = [(16 * MiB, 0.25), (256 * MiB, 0.2)], [2, 8, 16], repeat or 3
        peak_size, peak_m = 256 * MiB, 16
    out: list[Bar] = []
    for i, (nbytes, goal) in enumerate(sizes):
        ref_ms = ms if i == 0 else ms[:1]
        # best of 3 x repeat merges at the first size (milliseconds each; the memcpy is best of
        # 18 x repeat), of repeat - 1 (at least 2) at 256 MiB
        reps = 3 * repeat if i == 0 else max(2, repeat - 1)
        rows = _child("speed", nbytes=nbytes, ms=ms, repeat=reps, ref_ms=ref_ms)
        for r in rows:
            fig = f"merge+outer step {r['mib']} MiB M={r['m']} / memcpy rate"
            detail = f"{r['merge_s'] * 1e3:.1f} ms vs memcpy {r['copy_s'] * 1e3:.2f} ms per fragment"
            if r["impl"] == "new":
                out.append(Bar(fig, r["ratio"], goal, "min", detail=detail))
            else:
                out.append(Bar(fig + " (previous impl.)", r["ratio"], goal, "min", detail=detail, shown=True))
    g = _child("guard", nbytes=sizes[0][0], m=8, repeat=repeat)
    print(f"direction guard cosines {g['mib']} MiB M={g['m']}: {g['new_s'] * 1e3:.1f} ms, previous "
          f"{g['previous_s'] * 1e3:.1f} ms", flush=True)
    for impl in ("new", "previous"):
        out.append(Bar(f"direction guard cosines {g['mib']} MiB M={g['m']} (ms, {impl})", g[f"{impl}_s"] * 1e3, 0.0,
                       "max", detail="context: before the merge of a round of 3 or more, guard on", shown=True))
    peak = _child("peak", nbytes=peak_size, m=peak_m, impl="new")
    print(f"peak new {peak_size // MiB} MiB M={peak_m}: +{peak['added_bytes'] / GB:.3f} GB beyond inputs of "
          f"{peak['inputs_bytes'] / GB:.3f} GB (HWM {peak['hwm_bytes'] / GB:.3f} GB)", flush=True)
    out.append(Bar(f"merge+outer step {peak_size // MiB} MiB M={peak_m} peak added (GB)", peak["added_bytes"] / GB,
                   2.0, "max", detail=f"beyond {peak['inputs_bytes'] / GB:.2f} GB of inputs as held; "
                                      f"HWM {peak['hwm_bytes'] / GB:.2f} GB"))
    if quick:
        return out
    pub = _child("peak", nbytes=peak_size, m=peak_m, impl="new", publish=True)
    print(f"peak new +publish {peak_size // MiB} MiB M={peak_m}: +{pub['added_bytes'] / GB:.3f} GB", flush=True)
    out.append(Bar(f"merge+step+fp32 publish bytes {peak_size // MiB} MiB M={peak_m} peak added (GB)",
                   pub["added_bytes"] / GB, 2.0, "max", detail="context: serialization included", shown=True))
    small, small_m = sizes[0][0], ms[-1]
    for impl in ("new", "previous"):
        r = _child("peak", nbytes=small, m=small_m, impl=impl)
        added_mib = r["added_bytes"] / MiB
        print(f"peak {impl} {small // MiB} MiB M={small_m}: +{added_mib:.1f} MiB beyond inputs", flush=True)
        out.append(Bar(f"merge+outer step {small // MiB} MiB M={small_m} peak added / fragment ({impl})",
                       r["added_bytes"] / small, 0.0, "max", detail="context", shown=True))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.merge", description=description(__doc__))
    parser.add_argument("--quick", action="store_true", help="small fragments, seconds")
    parser.add_argument("--repeat", type=positive_int, default=None, help="best of N (default 3, quick 2)")
    args = parser.parse_args(argv)
    return print_bars(bars(quick=args.quick, repeat=args.repeat), title="merge bars")


if __name__ == "__main__":
    sys.exit(main())
