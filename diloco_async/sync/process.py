"""The synchronizer process: ``python -m diloco_async.server`` (or ``python -m diloco_async.sync``).

:func:`serve` runs the actor behind its HTTP server until the budget is spent; :func:`main`
is the command line. The run's secret comes from the environment (``DILOCO_RUN_TOKEN``) and is
never logged; learners authenticate with tokens derived from it (:mod:`diloco_async.protocol.auth`).
Extra storage options (JSON) come from ``DILOCO_STORAGE_OPTIONS``.

Before it publishes anything the process takes the run's lease (:mod:`~diloco_async.sync.lease`).
Exit codes: 0 finished, 2 bad arguments or checkpoint, :data:`EXIT_LEASE_HELD` another
synchronizer holds the run (the message names it), :data:`EXIT_LEASE_LOST` the lease was taken
over while running (nothing was published after that).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import time
from functools import partial
from pathlib import Path

from aiohttp import web

from diloco_async.config.resolved import read_resolved, with_fields
from diloco_async.config.schema import Config
from diloco_async.policy.shards import check_shard
from diloco_async.protocol.auth import MIN_SECRET_CHARS, check_run_secret
from diloco_async.protocol.client import TOKEN_ENV
from diloco_async.runtime.heap import limit_heap_retention
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import Checkpoint, list_checkpoint_seqs
from diloco_async.storage.options import STORAGE_OPTIONS_ENV, storage_options_from_env
from diloco_async.storage.store import ObjectStore
from diloco_async.sync.actor import Stopped, Synchronizer
from diloco_async.sync.gate import quiet_protocol_errors
from diloco_async.sync.http import GATE, make_app, runner_options
from diloco_async.sync.lease import Lease, LeaseHeld, LeaseLost, acquire
from diloco_async.sync.persistence import open_checkpoint
from diloco_async.sync.run_stop import RunStop
from diloco_async.sync.tls_setup import check_network, edge_context

__all__ = ["serve", "main", "TOKEN_ENV", "STORAGE_OPTIONS_ENV", "EXIT_LEASE_HELD", "EXIT_LEASE_LOST",
           "LoopWatch", "LOOP_WATCH_ENV", "freeze_long_lived", "FREEZE_EVERY_S", "SWEEP_EVERY_S", "GC_THRESHOLDS"]

log = logging.getLogger("diloco.server")

#: exit code of a synchronizer that refused to start: another one holds the run's lease
EXIT_LEASE_HELD = 4
#: exit code of a synchronizer whose lease was taken over while it ran
EXIT_LEASE_LOST = 5


LOOP_WATCH_ENV = "DILOCO_LOOP_WATCH_S"
"""Set to a period (s): the synchronizer logs one ``loop watch`` line per period (for benchmarks)."""
_TICK_S = 0.01  # the watch's sleep: its lateness is the event loop's lag
_STALL_S = 0.1  # a lag this long is logged as a warning (at most every 10 s)

FREEZE_EVERY_S = 5.0
"""Seconds between two freezes of what survived the young collections (:func:`freeze_long_lived`)."""
SWEEP_EVERY_S = 600.0
"""Seconds between two full collections of everything, frozen objects included."""
GC_THRESHOLDS = (700, 10, 1_000_000)
"""``gc.set_threshold`` of the synchronizer: the young generations as Python's defaults; no
automatic full collection (at 1,000 learners on the shared 2-core machine they came every 2-5 s and
held the loop 30-340 ms of wall time):
what survives the young ones is frozen every :data:`FREEZE_EVERY_S` instead, and a full sweep runs
every :data:`SWEEP_EVERY_S` (:func:`freeze_long_lived`)."""

#: the synchronizer's C heap maps buffers of 4 MiB and more on their own (diloco_async/runtime/heap.py):
#: at 25M parameters its peak RSS beyond the baseline fell from 5.6-6.8x to 4-5x the model
SYNC_MMAP_THRESHOLD_BYTES = 4 << 20

#: stop signals (names) received by :func:`main` before the server's own handlers were in place
#: (while it took the lease, restored a checkpoint or opened its socket): served as a clean stop
#: as soon as the synchronizer runs, so a Ctrl-C during start-up never kills it half-way
_EARLY_STOP_SIGNALS: list[str] = []


async def freeze_long_lived(every_s: float = FREEZE_EVERY_S, sweep_every_s: float = SWEEP_EVERY_S) -> None:
    """Keep the collector's full collections short (issue 17: at 1,000 learners one took 115 ms).

    What the synchronizer keeps (its learners, the metric and merge tails, settled rounds) is
    long-lived, and a full collection traverses all of it. Every ``every_s`` this collects the young
    generations (0 and 1: milliseconds) and freezes what survived (``gc.freeze``, O(1)), so a full
    collection only traverses what was promoted since. Frozen objects are still freed by reference
    counting; only a reference cycle that became garbage after it was frozen waits for the full
    sweep every ``sweep_every_s`` (unfreeze, collect, freeze: one longer pause, logged). Runs until
    cancelled.
    """
    swept_s = time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        if time.monotonic() - swept_s >= sweep_every_s:
            swept_s = time.monotonic()
            gc.unfreeze()
            found = gc.collect()
            log.info("full collection: %d unreachable objects, %.0f ms", found, 1000 * (time.monotonic() - swept_s))
        else:
            gc.collect(1)
        gc.freeze()


class LoopWatch:
    """The event loop's lag and the collector's pauses, measured in the synchronizer itself (issue 17).

    A task sleeps :data:`_TICK_S` over and over; how late it wakes is the loop's lag (s): the
    longest time some callback, handler or actor pass held the loop. ``gc.callbacks`` time every
    collection (s, by generation). Every ``period_s`` (when given) one line is logged::

        loop watch mono=<time.monotonic()> lag_max_ms=.. lag_over_20ms=.. ticks=.. gc=<gen>:<n>/<max ms>/<total ms>,..
        slow=<the actor's slowest part>:<ms>

    ``mono`` lets a reader (``benchmarks/sync_load.py``) keep the lines of its own window. A lag
    over :data:`_STALL_S` is always logged, at most once every 10 s.
    """

    def __init__(self, period_s: float | None = None, part_times: dict[str, float] | None = None) -> None:
        self.period_s = period_s
        self.part_times = part_times if part_times is not None else {}  # the actor's slowest parts (s)
        self._gc_t0 = 0.0
        self._reset()
        self._stall_logged_s = -float("inf")

    def _reset(self) -> None:
        self.lag_max_s = 0.0
        self.lag_over_20ms = 0
        self.ticks = 0
        self.gc_pauses: dict[int, list[float]] = {}  # generation -> [count, max s, total s]

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
            return
        pause = time.perf_counter() - self._gc_t0
        row = self.gc_pauses.setdefault(int(info.get("generation", -1)), [0, 0.0, 0.0])
        row[0] += 1
        row[1] = max(row[1], pause)
        row[2] += pause

    def line(self) -> str:
        """The current period's figures as one log line (see the class docstring)."""
        gcs = ",".join(f"{g}:{n}/{1000 * mx:.1f}/{1000 * tot:.1f}"
                       for g, (n, mx, tot) in sorted(self.gc_pauses.items()))
        slow = max(self.part_times.items(), key=lambda kv: kv[1], default=("-", 0.0))
        return (f"loop watch mono={time.monotonic():.3f} lag_max_ms={1000 * self.lag_max_s:.1f} "
                f"lag_over_20ms={self.lag_over_20ms} ticks={self.ticks} gc={gcs or '-'} "
                f"slow={slow[0]}:{1000 * slow[1]:.1f}")

    async def run(self) -> None:
        """Measure until cancelled."""
        gc.callbacks.append(self._on_gc)
        try:
            period_t0 = time.monotonic()
            while True:
                t0 = time.monotonic()
                await asyncio.sleep(_TICK_S)
                now = time.monotonic()
                lag = now - t0 - _TICK_S
                self.ticks += 1
                self.lag_max_s = max(self.lag_max_s, lag)
                self.lag_over_20ms += lag > 0.02
                if lag > _STALL_S and now - self._stall_logged_s >= 10.0:
                    self._stall_logged_s = now
                    log.warning("event loop stalled %.0f ms (%s)", 1000 * lag, self.line())
                if self.period_s and now - period_t0 >= self.period_s:
                    log.info("%s", self.line())
                    self._reset()
                    self.part_times.clear()
                    period_t0 = now
        finally:
            gc.callbacks.remove(self._on_gc)


async def serve(cfg: Config, store: ObjectStore, run_id: str, token: str, ready_file: str | None = None,
                resume: Checkpoint | None = None, lease: Lease | None = None, shard: int = 0) -> dict:
    """Run a synchronizer (shard ``shard`` of ``synchronizer.shards``) until its budget is spent;
    returns the run summary.

    With ``synchronizer.shards = S > 1`` it owns the fragments of
    :func:`~diloco_async.policy.shards.fragments_of` ``shard``, takes the lease of that shard (under
    :func:`diloco_async.storage.keys.synchronizer_root`); it listens on ``synchronizer.port`` (0: a free port; the
    command line puts shard ``I`` on the recipe's port + ``I``, or on ``--port``).

    With ``resume``, the outer state comes from that verified checkpoint of the same run. The
    run's ``lease`` is taken here when not given; it is released after a clean finish.

    Writes ``{"url", "run_id", "pid", "epoch", "lease_epoch", "shard", "shards"}`` to ``ready_file`` (atomically)
    once the server listens. SIGTERM and SIGINT start a clean stop (final checkpoint, learners told).

    Raises:
        LeaseHeld: another synchronizer holds the run's lease (nothing was written).
        LeaseLost: the lease was taken over while running (nothing was written after that).
    """
    sc = cfg.synchronizer
    if lease is None:
        lease = await asyncio.to_thread(acquire, store, keys.synchronizer_root(run_id, shard, sc.shards),
                                        sc.lease_ttl_s, sc.lease_renew_s)
    lease.start_renewing()
    sync = Synchronizer(cfg, store, run_id, lease=lease, shard=shard)
    try:
        await asyncio.to_thread(sync.publish_initial if resume is None else partial(sync.restore, resume))
    except BaseException:
        sync.close()
        await asyncio.to_thread(_release, lease)
        raise
    quiet_protocol_errors()  # unparseable requests: one rate-limited line, not a traceback each
    runner, url = await _listen(cfg, sync, token)
    log.info("synchronizer run=%s shard %d/%d listening on %s", run_id, shard, sc.shards, url)
    loop = asyncio.get_running_loop()
    _handle_stop_signals(loop, sync)
    _freeze_startup()
    _write_ready(ready_file, {"url": url, "run_id": run_id, "pid": os.getpid(), "epoch": sync.epoch,
                              "lease_epoch": lease.lease_epoch, "shard": shard, "shards": sc.shards})
    run_stop = RunStop(sync) if sc.shards > 1 else None  # the budget stop is the run's (DESIGN §2.2)
    watchers = [loop.create_task(LoopWatch(_watch_period_s(), sync.part_times).run()),
                loop.create_task(freeze_long_lived()), *([loop.create_task(run_stop.run())] if run_stop else [])]
    try:
        summary = await sync.run()
        if run_stop is not None:
            await run_stop.finish()
    finally:
        await _cancel(watchers)
        _ignore_stop_signals(loop)
        await runner.cleanup()
    await asyncio.to_thread(_release, lease)
    log.info("synchronizer run=%s finished: %s", run_id, sync.stop_reason)
    return summary


def _write_ready(ready_file: str | None, doc: dict) -> None:
    """``doc`` as JSON at ``ready_file`` (written beside it, then renamed: atomically); nothing without one."""
    if ready_file:
        tmp = Path(ready_file).with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(ready_file)


async def _listen(cfg: Config, sync: Synchronizer, token: str) -> tuple[web.AppRunner, str]:
    """Serve the HTTP edge on ``synchronizer.host:port``: HTTPS when some learner is in ``tls``
    mode (one scheme per port, docs/network-modes.md), mutual TLS with ``network.client_ca``.
    Returns the runner and the URL learners use."""
    tls = cfg.network.serves_tls(cfg.learners.count)
    app = make_app(sync, token, "tls" if tls else "direct", peers_checked=cfg.network.client_ca is not None)
    runner = web.AppRunner(app, **runner_options(sync))
    await runner.setup()
    site = web.TCPSite(runner, cfg.synchronizer.host, cfg.synchronizer.port,
                       ssl_context=edge_context(cfg, app[GATE].refuse_handshake))
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"{'https' if tls else 'http'}://{cfg.synchronizer.host}:{port}"


def _handle_stop_signals(loop: asyncio.AbstractEventLoop, sync: Synchronizer) -> None:
    """SIGTERM and SIGINT start a clean stop from now on; one received during start-up (noted
    by :func:`main`) starts it at once."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, lambda s=sig: loop.create_task(_stop(sync, f"signal {s.name}")))
        except (NotImplementedError, RuntimeError):
            pass
    if _EARLY_STOP_SIGNALS:
        log.warning("%s during start-up: stopping cleanly", _EARLY_STOP_SIGNALS[0])
        loop.create_task(_stop(sync, f"signal {_EARLY_STOP_SIGNALS[0]}"))


async def _stop(sync: Synchronizer, reason: str) -> None:
    """A clean stop for ``reason``; nothing to do when the actor has stopped already."""
    with contextlib.suppress(Stopped):
        await sync.request("stop", reason)


def _freeze_startup() -> None:
    """What start-up built (torch, the model's fragments, the config) lives as long as the process:
    frozen out of the collector, so a full collection later never pauses the loop for it, and
    no automatic full collection from now on (:data:`GC_THRESHOLDS`; issue 17)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _watch_period_s() -> float | None:
    return float(os.environ[LOOP_WATCH_ENV]) if os.environ.get(LOOP_WATCH_ENV) else None


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _ignore_stop_signals(loop: asyncio.AbstractEventLoop) -> None:
    """The run is over (its summary written): a SIGINT or SIGTERM from now on (a Ctrl-C that lands
    as the run ends on its own) changes nothing and must not turn a finished run into a process
    killed by a signal while it tears down."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)


def _release(lease: Lease) -> None:
    try:
        lease.release()
    except Exception as err:  # the lease then expires after its ttl
        log.warning("could not release lease epoch %d: %s: %s", lease.lease_epoch, type(err).__name__, err)


def _take_lease(resume_url: str | None, cfg: Config, store: ObjectStore, run_id: str, ckpt: Checkpoint | None,
                env_options: dict, shard: int = 0) -> tuple[Lease, Config, ObjectStore, Checkpoint | None]:
    """Take the lease of the run's shard ``shard`` (the run's own with one shard); a resume from the
    newest checkpoint then picks it again, so one written by the previous holder meanwhile is not missed."""
    owner = keys.synchronizer_root(run_id, shard, cfg.synchronizer.shards)
    lease = acquire(store, owner, cfg.synchronizer.lease_ttl_s, cfg.synchronizer.lease_renew_s)
    lease.start_renewing()
    if ckpt is not None and resume_url is not None and keys.split_checkpoint_url(resume_url)[2] is None \
            and max(list_checkpoint_seqs(store, owner), default=0) > ckpt.seq:
        cfg, store, _, ckpt = open_checkpoint(resume_url, cfg, env_options, shard)
    return lease, cfg, store, ckpt



def _shard_port(cfg: Config, shard: int, port: int | None) -> Config:
    """``cfg`` listening where shard ``shard`` does: on ``port`` when given (a restarted shard keeps
    its learners' URL), else on ``synchronizer.port + shard`` (a free port when it is 0). The port is
    operational: the config hash is unchanged.

    Raises:
        ValueError: the port is outside [0, 65535] (named).
    """
    sc = cfg.synchronizer
    chosen = port if port is not None else (sc.port and sc.port + shard)
    return cfg if chosen == sc.port else with_fields(cfg, {"synchronizer.port": chosen})


def _given_config(path: str | None) -> Config | None:
    """The resolved config at ``path`` (None: none given). Raises ValueError: no such file, or not a config."""
    if path is None:
        return None
    try:
        return read_resolved(path)
    except FileNotFoundError:
        raise ValueError(f"no resolved config at {path}") from None


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m diloco_async.server`` (every option with its help and units)."""
    ap = argparse.ArgumentParser(
        prog="python -m diloco_async.server",
        description="Run the synchronizer of one run: the HTTP server learners join and the actor that merges "
                    "their outer gradients. Give exactly one of --run-id or --resume.",
        epilog=f"environment: {TOKEN_ENV} (required: the run's secret, at least {MIN_SECRET_CHARS} characters; "
               f"learner tokens derive from it), {STORAGE_OPTIONS_ENV} (optional JSON fsspec options of the store). "
               f"exit codes: 0 finished, 2 bad arguments, config, secret or checkpoint, {EXIT_LEASE_HELD} another "
               f"synchronizer holds the run, {EXIT_LEASE_LOST} the lease was taken over while running.")
    ap.add_argument("--resolved-config", default=None, metavar="RESOLVED.json",
                    help="the run's resolved config (JSON written by diloco_async.config.resolved.write_resolved: the "
                         "recipe and its overrides, parsed once by whoever starts the run); without it the built-in "
                         "defaults, or with --resume the run's own config.json from the store")
    ap.add_argument("--run-id", default=None,
                    help="id of a new run: its objects go under {run.store}/{run_id}/ (not with --resume)")
    ap.add_argument("--resume", default=None, metavar="CHECKPOINT_URL",
                    help="continue a run: {store}/{run_id}/checkpoints/{seq}, or {store}/{run_id} for the newest")
    ap.add_argument("--shard", type=int, default=0, metavar="I",
                    help="serve shard I of synchronizer.shards (0 <= I < shards; default 0): the fragments p with "
                         "p mod shards = I, on port synchronizer.port + I (a free port when it is 0)")
    ap.add_argument("--port", type=int, default=None, metavar="PORT",
                    help="listen on this port instead of synchronizer.port + I (a launcher restarting a shard passes "
                         "the port it had, so the learners' URLs stay valid)")
    ap.add_argument("--ready-file", default=None, metavar="PATH",
                    help="once the server listens, write {url, run_id, pid, epoch, lease_epoch} as JSON to this "
                         "file (atomically; for the process that started this one)")
    return ap


def _note_early_stop(signum: int, _frame: object) -> None:
    _EARLY_STOP_SIGNALS.append(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    limit_heap_retention(mmap_threshold_bytes=SYNC_MMAP_THRESHOLD_BYTES)  # before any worker thread starts (issue 17)
    for sig in (signal.SIGTERM, signal.SIGINT):  # until serve() installs its own: noted, served later
        signal.signal(sig, _note_early_stop)
    if (args.run_id is None) == (args.resume is None):
        ap.error("give exactly one of --run-id (new run) or --resume (continue a run)")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s synchronizer %(levelname)s %(name)s: %(message)s")
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        print(f"error: {TOKEN_ENV} is not set; the synchronizer needs the run's secret token", file=sys.stderr)
        return 2
    try:
        check_run_secret(token, TOKEN_ENV)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    env_options = storage_options_from_env()
    try:
        given = _given_config(args.resolved_config)
        if args.resume:
            cfg, store, run_id, ckpt = open_checkpoint(args.resume, given, env_options, args.shard)
        else:
            cfg = given if given is not None else Config()
            store = ObjectStore(cfg.run.store, {**cfg.run.storage_options, **env_options})
            run_id, ckpt = args.run_id, None
        check_shard(args.shard, cfg.synchronizer.shards)
        cfg = _shard_port(cfg, args.shard, args.port)
        check_network(cfg, learners=False)  # its certificate and key, before the lease (docs/network-modes.md)
        lease, cfg, store, ckpt = _take_lease(args.resume, cfg, store, run_id, ckpt, env_options, args.shard)
        asyncio.run(serve(cfg, store, run_id, token, args.ready_file, resume=ckpt, lease=lease, shard=args.shard))
    except ValueError as err:
        log.error("%s", err)
        print(f"error: {err}", file=sys.stderr)
        return 2
    except LeaseHeld as err:
        log.error("%s", err)
        print(f"error: {err}", file=sys.stderr)
        return EXIT_LEASE_HELD
    except LeaseLost as err:
        log.error("%s", err)
        print(f"error: {err}; stopped publishing and checkpointing", file=sys.stderr)
        return EXIT_LEASE_LOST
    return 0
