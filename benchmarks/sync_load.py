"""Load on one synchronizer: N simulated learners speaking the real protocol on loopback (issue 17).

A real synchronizer process (``python -m diloco_async.sync``, a tiny model of two fragments, a
``file://`` store under ``/dev/shm``) and, in this process, N asyncio learners. Each learner joins
with its own token, holds the WebSocket push channel (``GET /ws``), heartbeats every
``heartbeat_s`` (its step grows at ``STEPS_PER_S``, so the schedule opens rounds), and, when it
hears of an open round (pushed ``round_open`` or a heartbeat's ``open_rounds``) and its last
announcement is at least ``announce_s`` old, writes a real contribution object (fp32, the
fragment's shapes, about 1.5 KiB) into the store and announces it. Heartbeats and announcements
go over the WebSocket as the real learner sends them (:mod:`diloco_async.sync.ws_requests`;
over HTTP when the socket is down), or over ``POST /heartbeat`` and ``POST /announce`` with
``--http-requests`` (and always on a ``--baseline-tree`` whose synchronizer does not answer them). The
synchronizer fetches, verifies and merges it for real.

Rates, and why:

* 256 learners heartbeat every 0.25 s (the learner's default ``learners.heartbeat_s``; the load
  of the issue's measurement on main); 1,000 learners every 1 s (1,000 heartbeats/s, what one
  Python load generator sustains on a core of the 2-core machine next to the synchronizer).
* Each learner announces at most every 8 s (256) or 10 s (1,000): 32 and 100 announcements/s,
  each a real object read and hashed by the synchronizer; with real models a learner contributes
  a fragment every ``sync_every / num_fragments`` inner steps, seconds to minutes apart.
* Synchronizer: ``heartbeat_timeout_s=5`` (the default), ``min_quorum=4``, grace 0.2 s (capped
  at 0.5 s), ``sync_every=40`` over 2 fragments (at 10 steps/s a round every ~2 s, each pushed
  twice to every WebSocket: ``round_open`` and ``version``), ``max_learners`` = N, no budget but
  the wall clock. Announcements that arrive after their round merged are answered ``late``
  (answered, so not dropped).

The learners are spread over load generator processes, one per 250 learners and at least two
(``LoadSpec.generators``, :func:`~benchmarks.sync_load_learners.generators_for`: 2 at 256
learners, 4 at 1,000; a generator of 500 learners lagged up to 52 ms on its own loop after each
merge's pushes and timed that backlog as the synchronizer's). The code they run is
:mod:`benchmarks.sync_load_learners`; each one's collector is frozen and disabled over the run,
so the generator is not what stalls, and each one's loop lag is printed beside the p99s. The
synchronizer runs with ``DILOCO_LOOP_WATCH_S=1``: its own loop lag, collections and slowest
actor part over the measured window are read back from its log and printed too
(``SYNC_LOAD_LOG=path`` keeps that log).

Figures printed besides the bars: p50s, the generator's loop lag (large when the machine is
shared: then the latencies are the machine's, not the synchronizer's), both processes' CPU, and
the synchronizer's CPU per request answered, which contention changes little. With
``--baseline-tree DIR`` the same load runs first on the synchronizer of another source tree
(an export of main) for context.

Every request sent is counted, and every answer: a request without a 200 answer, or a
WebSocket closed before the end, counts as dropped. Latency is measured from send to answer on
the load generator's clock, after a warm-up; the generator's own event-loop lag is measured and
printed too. The baseline measured in the same run is ``GET /health`` (served from the status
snapshot without the actor): the floor of the HTTP layer and both event loops under that load.

Bars: 1,000 learners: announce p99 < 50 ms, heartbeat p99 < 50 ms, none dropped; 256 learners:
both p99 < 20 ms. Each load runs ``--repeats`` times (3), each time with a fresh synchronizer and
generators; a bar's value is the mean of the runs' p99s, printed with its 95% t-interval (the p99
of one 30 s run on the 2-core machine varied 17.7-69.1 ms at 1,000 learners on one day). ``quick``:
32 learners for 5 s, once (a test runs it).

Usage: python -m benchmarks.sync_load [--quick] [--repeats R] [--learners N --seconds S]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from benchmarks.args import description, positive_float, positive_int
from benchmarks.bars import Bar, print_bars
from benchmarks.stats import mean_over_runs
from benchmarks.sync_load_learners import RUN_ID, LoadResult, LoadSpec, _generator, generators_for
from diloco_async.protocol.client import TOKEN_ENV

__all__ = ["LoadSpec", "LoadResult", "run_load", "bars", "main"]

GOAL_P99_MS_1000 = 50.0
GOAL_P99_MS_256 = 20.0
REPEATS = 3  # runs of each load in `make bench`: a p99 of one 30 s run swings with the machine


def percentile_ms(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1, nearest rank: the ``ceil(q n)``-th smallest, numpy's
    ``inverted_cdf``) of ``values`` (s), in ms; None when empty."""
    if not values:
        return None
    return 1000.0 * float(np.quantile(values, q, method="inverted_cdf"))


def sync_config(spec: LoadSpec, store_url: str, folder: Path) -> Path:
    """Write the synchronizer's resolved config under ``spec`` (a tiny model, ``spec.learners``
    learner slots, K = 4) to ``folder``; returns its path."""
    from diloco_async.config.resolved import with_fields, write_resolved
    from diloco_async.config.schema import Config

    return write_resolved(with_fields(Config(), {
        "model.n_layer": 1, "model.d_model": 16, "model.n_head": 2, "model.context": 8, "model.vocab_size": 64,
        "learners.count": spec.learners, "synchronizer.num_fragments": 2, "synchronizer.sync_every": 40,
        "synchronizer.min_quorum": 4, "synchronizer.grace_initial_s": 0.2, "synchronizer.grace_cap_s": 0.5,
        "synchronizer.heartbeat_timeout_s": 5.0, "synchronizer.checkpoint_every_s": 100000.0,
        "synchronizer.max_learners": spec.learners, "synchronizer.drain_s": 0.0, "synchronizer.port": 0,
        "synchronizer.host": "127.0.0.1", "synchronizer.max_staleness": 8, "budget.wall_s": 100000.0,
        "budget.tokens": None, "run.store": store_url}), folder)


def _merge(spec: LoadSpec, parts: list[LoadResult]) -> LoadResult:
    out = LoadResult(spec)
    for r in parts:
        out.heartbeat_s += r.heartbeat_s
        out.announce_s += r.announce_s
        out.health_s += r.health_s
        for mine, theirs in ((out.sent, r.sent), (out.answered, r.answered), (out.acks, r.acks),
                             (out.pushed_by_type, r.pushed_by_type), (out.sent_by_transport, r.sent_by_transport)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
        out.pushed += r.pushed
        out.ws_lost += r.ws_lost
        out.errors += r.errors
        out.loop_lag_by_process += r.loop_lag_by_process
    out.loop_lag_max_s = max(out.loop_lag_by_process, default=0.0)
    return out


def _run_generators(spec: LoadSpec, url: str, secret: str, store_url: str, sync_pid: int) -> LoadResult:
    """Spread the learners over ``spec.generators`` processes; measure every process's CPU over the window."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no state of this one is shared
    procs, conns = [], []
    for shard in range(spec.generators):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_generator, args=(spec, url, secret, store_url, shard, spec.generators, child),
                           daemon=True)
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    try:
        for c in conns:
            if not c.poll(120) or c.recv() != "ready":
                raise RuntimeError("a load generator process did not start")
        t_go = time.monotonic() + 0.2
        for c in conns:
            c.send(t_go)
        gens, sync = [psutil.Process(p.pid) for p in procs], psutil.Process(sync_pid)
        time.sleep(max(0.0, t_go + spec.warmup_s - time.monotonic()))
        cpu0 = [sum(p.cpu_times()[:2]) for p in gens], sum(sync.cpu_times()[:2])
        time.sleep(max(0.0, t_go + spec.warmup_s + spec.seconds - time.monotonic()))
        cpu1 = [sum(p.cpu_times()[:2]) for p in gens], sum(sync.cpu_times()[:2])
        parts = []
        for c in conns:
            if not c.poll(120):
                raise RuntimeError("a load generator process did not finish")
            got = c.recv()
            if isinstance(got, str):
                raise RuntimeError(f"a load generator process failed: {got}")
            parts.append(got)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    res = _merge(spec, parts)
    res.cpu_s = {"load generators": sum(b - a for a, b in zip(cpu0[0], cpu1[0], strict=True)),
                 "synchronizer": cpu1[1] - cpu0[1]}
    res.cpu_by_generator_s = [b - a for a, b in zip(cpu0[0], cpu1[0], strict=True)]
    res.window_s = (t_go + spec.warmup_s, t_go + spec.warmup_s + spec.seconds)
    return res


def _sync_watch(log_text: str, t0: float, t1: float) -> dict:
    """The synchronizer's own ``loop watch`` lines (:class:`diloco_async.sync.process.LoopWatch`) of
    the window ``[t0, t1]`` (``time.monotonic()``): its loop lag, collections and slowest actor part."""
    out: dict = {"lag_max_ms": 0.0, "lag_over_20ms": 0, "ticks": 0, "gc": {}, "slow": ("-", 0.0), "lines": 0}
    for line in log_text.splitlines():
        at = line.find("loop watch mono=")
        if at < 0 or "stalled" in line:  # a stall's warning repeats the figures so far: not a period
            continue
        fields = dict(f.split("=", 1) for f in line[at + len("loop watch "):].split() if "=" in f)
        mono = float(fields["mono"])
        if not t0 + 1.0 <= mono <= t1 + 0.5:  # a line covers the second before it
            continue
        out["lines"] += 1
        out["lag_max_ms"] = max(out["lag_max_ms"], float(fields["lag_max_ms"]))
        out["lag_over_20ms"] += int(fields["lag_over_20ms"])
        out["ticks"] += int(fields["ticks"])
        if fields["gc"] != "-":
            for item in fields["gc"].split(","):
                gen, rest = item.split(":")
                n, mx, tot = (float(x) for x in rest.split("/"))
                row = out["gc"].setdefault(int(gen), [0, 0.0, 0.0])
                row[0] += int(n)
                row[1] = max(row[1], mx)
                row[2] += tot
        part, _, ms = fields["slow"].rpartition(":")
        if float(ms) > out["slow"][1]:
            out["slow"] = (part, float(ms))
    return out


def run_load(spec: LoadSpec, source_dir: str | None = None) -> LoadResult:
    """Start a synchronizer process, put ``spec``'s load on it from ``spec.generators`` processes,
    stop it; the measured result. ``source_dir``: run the synchronizer from that source tree
    instead (e.g. an export of main, for its figures as context).

    Raises:
        RuntimeError: the synchronizer did not start within 60 s (its log is in the message), or a
            load generator process failed.
    """
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="sync-load-", dir=root))
    store_url = f"file://{work / 'store'}"
    secret = secrets.token_hex(32)
    ready = work / "ready.json"
    log_path = work / "sync.log"
    env = {**os.environ, TOKEN_ENV: secret, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
           "DILOCO_LOOP_WATCH_S": "1"}
    if source_dir:
        env["PYTHONPATH"] = source_dir
    profile = os.environ.get("SYNC_LOAD_PROFILE")  # a path: the synchronizer runs under cProfile
    cmd = [sys.executable, *(["-m", "cProfile", "-o", profile] if profile else []), "-m", "diloco_async.sync",
           "--run-id", RUN_ID, "--ready-file", str(ready),
           "--resolved-config", str(sync_config(spec, store_url, work))]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=source_dir)
    try:
        t0 = time.monotonic()
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() - t0 > 60:
                raise RuntimeError(f"the synchronizer did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        url = json.loads(ready.read_text())["url"]
        res = _run_generators(spec, url, secret, store_url, proc.pid)
        res.sync_watch = _sync_watch(log_path.read_text(errors="replace"), *res.window_s)
        if os.environ.get("SYNC_LOAD_LOG"):  # a path: keep a copy of the synchronizer's log there
            shutil.copyfile(log_path, os.environ["SYNC_LOAD_LOG"])
        return res
    finally:  # SIGTERM stops it cleanly (a final checkpoint); it waits for its learners at most 5 s here
        proc.terminate()
        try:
            proc.wait(5 if not os.environ.get("SYNC_LOAD_PROFILE") else 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def report(res: LoadResult) -> dict[str, float | None]:
    """Print one load's figures; returns them (ms, counts)."""
    s = res.spec
    fig = {
        "heartbeat_p50_ms": percentile_ms(res.heartbeat_s, 0.50),
        "heartbeat_p99_ms": percentile_ms(res.heartbeat_s, 0.99),
        "announce_p50_ms": percentile_ms(res.announce_s, 0.50), "announce_p99_ms": percentile_ms(res.announce_s, 0.99),
        "health_p50_ms": percentile_ms(res.health_s, 0.50), "health_p99_ms": percentile_ms(res.health_s, 0.99),
        "dropped": float(res.dropped),
    }

    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1f}"

    print(f"{s.learners} learners, heartbeat every {s.heartbeat_s:g}s, announce every >= {s.announce_s:g}s, "
          f"{s.seconds:g}s measured after {s.warmup_s:g}s:")
    print(f"  heartbeat p50 {ms(fig['heartbeat_p50_ms'])} ms  p99 {ms(fig['heartbeat_p99_ms'])} ms  "
          f"({len(res.heartbeat_s)} measured, {len(res.heartbeat_s) / s.seconds:.0f}/s)")
    print(f"  announce  p50 {ms(fig['announce_p50_ms'])} ms  p99 {ms(fig['announce_p99_ms'])} ms  "
          f"({len(res.announce_s)} measured; acks {dict(sorted(res.acks.items()))})")
    base = fig["health_p99_ms"]
    ratio = (f"; heartbeat p99 / health p99 = {fig['heartbeat_p99_ms'] / base:.2f}"
             if base and fig["heartbeat_p99_ms"] is not None else "")
    print(f"  baseline GET /health p50 {ms(fig['health_p50_ms'])} ms  p99 {ms(base)} ms{ratio}")
    print(f"  sent {dict(sorted(res.sent.items()))}  answered {dict(sorted(res.answered.items()))}  "
          f"pushed events {dict(sorted(res.pushed_by_type.items()))}  websockets lost {res.ws_lost}  "
          f"dropped {res.dropped}")
    print(f"  heartbeats and announcements by transport {dict(sorted(res.sent_by_transport.items()))}")
    cpu = ", ".join(f"{k} {v / s.seconds:.0%}" for k, v in res.cpu_s.items())
    answered = len(res.heartbeat_s) + len(res.announce_s) + len(res.health_s)
    fig["sync_cpu_us_per_request"] = 1e6 * res.cpu_s.get("synchronizer", 0.0) / max(1, answered)
    print(f"  synchronizer CPU per request answered in the window: {fig['sync_cpu_us_per_request']:.0f} us "
          "(pushes included in the CPU, not in the count)")
    lags = ", ".join(f"{1000 * v:.1f}" for v in res.loop_lag_by_process)
    gen_cpu = ", ".join(f"{v / s.seconds:.0%}" for v in res.cpu_by_generator_s)
    print(f"  load generators ({len(res.loop_lag_by_process)} processes): loop lag max {lags} ms; CPU of one core: "
          f"{cpu} (each generator {gen_cpu})")
    w = res.sync_watch
    fig["sync_loop_lag_max_ms"] = w.get("lag_max_ms")
    fig["generator_loop_lag_max_ms"] = 1000 * res.loop_lag_max_s
    if w.get("lines"):
        gcs = "; ".join(f"gen{g} {int(n)}x max {mx:.1f} ms" for g, (n, mx, _tot) in sorted(w["gc"].items())) or "none"
        print(f"  synchronizer (its loop watch, {w['lines']} s): loop lag max {w['lag_max_ms']:.1f} ms, "
              f"{w['lag_over_20ms']} of {w['ticks']} ticks late > 20 ms; collections {gcs}; slowest actor part "
              f"{w['slow'][0]} {w['slow'][1]:.1f} ms", flush=True)
    for err in res.errors[:5]:
        print(f"  error: {err}")
    return fig


def _load_bars(results: list[LoadResult], goal_ms: float) -> list[Bar]:
    """The bars of one load measured ``len(results)`` times: each p99 is the mean of the runs' p99s
    (with its 95% t-interval in the detail; a run without a figure makes the bar unmeasured);
    dropped messages are summed over the runs."""
    figs = []
    for i, res in enumerate(results):
        if len(results) > 1:
            print(f"[{i + 1}/{len(results)}]", end=" ")
        figs.append(report(res))
    n = results[0].spec.learners

    def mean_of(key: str) -> tuple[float | None, str]:
        return mean_over_runs([f[key] for f in figs], " ms", digits=1)

    def also(name: str, key: str) -> str:  # context: a p50, or the /health baseline of the same runs
        mean = mean_of(key)[0]
        return f"{name} {'n/a' if mean is None else f'{mean:.1f} ms'}"

    ann, ann_detail = mean_of("announce_p99_ms")
    hb, hb_detail = mean_of("heartbeat_p99_ms")
    sent = sum(sum(res.sent.values()) for res in results)
    return [
        Bar(f"sync load {n} learners: announce p99 (ms)", ann, goal_ms, "max",
            detail=f"{ann_detail}; {also('p50', 'announce_p50_ms')}, {also('/health p99', 'health_p99_ms')}"),
        Bar(f"sync load {n} learners: heartbeat p99 (ms)", hb, goal_ms, "max",
            detail=f"{hb_detail}; {also('p50', 'heartbeat_p50_ms')}"),
        Bar(f"sync load {n} learners: messages dropped", sum(f["dropped"] for f in figs), 0, "max",
            detail=f"{sent} sent over {len(results)} run(s)"),
    ]


def bars(quick: bool = False, repeats: int = REPEATS) -> list[Bar]:
    """The load's bars: 1,000 learners (p99 < 50 ms) and 256 (p99 < 20 ms), none dropped, each
    load run ``repeats`` times (a fresh synchronizer and generators each time; the bar is the mean
    p99); ``quick``: 32 learners for 5 s once (p99 < 50 ms)."""
    if quick:
        return _load_bars([run_load(LoadSpec(32, 0.25, 2.0, seconds=5.0, warmup_s=3.0))], GOAL_P99_MS_1000)
    out = _load_bars([run_load(LoadSpec(256, 0.25, 8.0, seconds=30.0)) for _ in range(repeats)], GOAL_P99_MS_256)
    out += _load_bars([run_load(LoadSpec(1000, 1.0, 10.0, seconds=30.0, warmup_s=8.0, generators=generators_for(1000)))
                       for _ in range(repeats)],
                      GOAL_P99_MS_1000)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sync_load", description=description(__doc__))
    ap.add_argument("--quick", action="store_true", help="32 learners for 5 s")
    ap.add_argument("--learners", type=positive_int, default=None, help="one load of N learners instead of the two")
    ap.add_argument("--seconds", type=positive_float, default=30.0, help="measured seconds (with --learners)")
    ap.add_argument("--heartbeat-s", type=positive_float, default=None, help="heartbeat period (with --learners)")
    ap.add_argument("--generators", type=positive_int, default=None,
                    help="load generator processes (with --learners; default one per 250 learners, at least 2)")
    ap.add_argument("--baseline-tree", default=None, metavar="DIR",
                    help="with --learners: the same load first on a synchronizer run from DIR (e.g. "
                         "`git archive main | tar -x -C DIR`), printed as context")
    ap.add_argument("--repeats", type=positive_int, default=None,
                    help=f"runs of each load, for the mean p99 and its interval (default {REPEATS}; 1 with --learners)")
    ap.add_argument("--http-requests", action="store_true",
                    help="heartbeats and announcements over HTTP POSTs, not the WebSocket (as learners before it)")
    args = ap.parse_args(argv)
    if args.learners is not None:
        hb = args.heartbeat_s or (0.25 if args.learners <= 256 else 1.0)
        goal = GOAL_P99_MS_256 if args.learners <= 256 else GOAL_P99_MS_1000
        spec = LoadSpec(args.learners, hb, 8.0 if args.learners <= 256 else 10.0, args.seconds,
                        warmup_s=5.0 if args.learners <= 256 else 8.0,
                        generators=args.generators or generators_for(args.learners))
        if args.http_requests:
            spec = dataclasses.replace(spec, ws_requests=False)
        if args.baseline_tree:
            base = os.path.abspath(args.baseline_tree)
            ws = spec.ws_requests and (Path(base) / "diloco_async/sync/ws_requests.py").exists()
            print(f"baseline: the synchronizer of {args.baseline_tree}, learners' requests over "
                  f"{'the WebSocket' if ws else 'HTTP (its learners do not speak the WebSocket requests)'}")
            report(run_load(dataclasses.replace(spec, ws_requests=ws), base))
            print("this tree:")
        return print_bars(_load_bars([run_load(spec) for _ in range(args.repeats or 1)], goal))
    return print_bars(bars(args.quick, args.repeats or REPEATS))


if __name__ == "__main__":
    sys.exit(main())
