"""``python -m diloco_async.learner``: run one learner process, or one rank of a learner's
torchrun group (``RANK``/``WORLD_SIZE`` set by ``torch.distributed.run``; see
:mod:`diloco_async.learner.group`): rank 0 runs the :class:`Learner`, the others follow it.

Environment: ``DILOCO_LEARNER_TOKEN`` (required: this learner's own token, see
:func:`diloco_async.protocol.auth.learner_token` and ``diloco-async token``), ``DILOCO_STORAGE_OPTIONS`` (JSON
fsspec options of the store), ``DILOCO_TIMELINE_DIR`` (optional folder for timeline records),
``DILOCO_LINK_DELAY_MS`` (optional one-way link latency added to every exchange,
:mod:`diloco_async.runtime.link_delay`).
Exit codes: 0 stopped by the synchronizer, 2 usage or a device absent here, 3 the synchronizer was lost or
refused us (or, on a rank other than 0, rank 0 could not join).
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import sys
import time
from typing import Any

import torch

from diloco_async.learner.group import LearnerGroup, run_follower
from diloco_async.learner.process import Learner
from diloco_async.learner.state import LearnerSlot, SyncEndpoint
from diloco_async.metrics.timeline import Recorder
from diloco_async.protocol.client import LEARNER_TOKEN_ENV, ProtocolError
from diloco_async.protocol.tls import CA_ENV, CERT_ENV, KEY_ENV, check_client_files, read_certificates
from diloco_async.runtime.heap import limit_heap_retention
from diloco_async.runtime.link_delay import LINK_DELAY_ENV, link_delay_s_from_env
from diloco_async.runtime.process_clock import process_uptime_s
from diloco_async.storage.digest import set_hash_threads, usable_cores
from diloco_async.storage.latency import LatencyStore
from diloco_async.storage.options import storage_options_from_env
from diloco_async.storage.store import ObjectStore

__all__ = ["TIMELINE_DIR_ENV", "LEARNER_SWITCH_INTERVAL_S", "build_parser", "main", "set_up_interpreter",
           "check_tls_env"]

log = logging.getLogger("diloco.learner")

#: Folder for per-learner timeline records (``{dir}/{learner_id}.jsonl``); unset: none written.
TIMELINE_DIR_ENV = "DILOCO_TIMELINE_DIR"

#: the learner's C heap (diloco_async/runtime/heap.py): buffers of LEARNER_MMAP_THRESHOLD_BYTES and more are
#: mapped on their own and given back when freed; up to LEARNER_TRIM_THRESHOLD_BYTES free at the top
#: of the heap stay there; one arena for every thread. With a fixed mmap threshold glibc's trim
#: threshold stays at 128 KiB, so the buffers a step frees at its end went back to the system and
#: were faulted in again at the next step: the 49M plain loop (batch 4x64, one thread) took 10-17K
#: page faults and 20-32 ms of system time per ~0.95 s step at 4 MiB, with or without a larger trim
#: threshold (its AdamW and clipping temporaries are parameter-sized, 4-7 MB), and 24 at 16 / 32 MiB.
#: 32 / 64 MiB (32 MiB is glibc's own ceiling for its growing threshold): bench-hf's Llama loop at
#: 2,958-2,963 tokens/s against 2,713-2,742 at 4 MiB and 2,808-2,824 at 16 / 32, and the learner in
#: a run 0.895 +- 0.025 -> 0.938 +- 0.014 of its plain loop. One arena: the free memory a step keeps
#: is there for the comms thread's buffers too (RSS at 25M / 50M 5.77 / 5.48x the model with two
#: arenas at 16 / 32, 5.52 / 5.44x with one; 5.60 / 5.45x at 32 / 64; 5.35 / 5.26x at 4 MiB).
#: The training thread still hands the free pages back after large frees when that pays
#: (diloco_async.runtime.heap.ReleaseWhenItPays; without any release 5.88 / 5.58x at 16 / 32)
LEARNER_MMAP_THRESHOLD_BYTES = 32 << 20
LEARNER_TRIM_THRESHOLD_BYTES = 64 << 20
LEARNER_HEAP_ARENAS = 1
#: the interpreter's switch interval in a learner process (s; CPython's default is 5 ms). The comms
#: thread and its workers run Python (heartbeats, pushes, uploads, downloads) while the training
#: thread is inside a torch op; when the op returns, the training thread waits for the GIL until
#: the other thread blocks or its interval is up. At 49M parameters, 6 alternated pairs of
#: ``python -m benchmarks.memory_tokens --repeats 1``: the learner in a run made 223.4 +- 7.8
#: tokens/s at 0.5 ms against 215.5 +- 8.3 at 5 ms (paired +7.9 +- 3.1, 95%)
LEARNER_SWITCH_INTERVAL_S = 0.0005


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m diloco_async.learner`` (every option with its help and units)."""
    ap = argparse.ArgumentParser(
        prog="python -m diloco_async.learner",
        description="Run one learner: it joins the synchronizer, takes the run's recipe from it, trains on its "
                    "data shard and exchanges outer gradients through the store.",
        epilog=f"environment: {LEARNER_TOKEN_ENV} (required: this learner's own token, from the operator's "
               "`diloco-async token`), DILOCO_STORAGE_OPTIONS (optional JSON fsspec options of the store), "
               "DILOCO_TLS_CA, DILOCO_TLS_CERT, DILOCO_TLS_KEY (an https:// synchronizer: the CA bundle that "
               "verifies it, and with mutual TLS this learner's certificate and key), "
               f"{TIMELINE_DIR_ENV} (optional folder for timeline records), {LINK_DELAY_ENV} (optional one-way "
               "link latency in ms added to every store request and synchronizer exchange). exit codes: 0 "
               "stopped by the synchronizer, 2 usage or a device absent here, 3 the synchronizer was lost or "
               "refused it.")
    ap.add_argument("--learner-id", required=True,
                    help="this learner's id (at most 64 characters of A-Z a-z 0-9 _ . -); its token must be "
                         "this id's")
    ap.add_argument("--index", type=int, required=True,
                    help="data shard index, 0-based: learner i of M trains on the i-th M-th of the training tokens")
    ap.add_argument("--sync-url", required=True,
                    help="the synchronizer's base URL, e.g. http://host:8470; with synchronizer.shards = S > 1 the S "
                         "shards' URLs, comma-separated, in shard order (exit 2 when they disagree with the shards)")
    ap.add_argument("--store", required=True,
                    help="the run's object store root URL, without the run id (file://, s3://bucket/prefix, "
                         "gs://bucket/prefix)")
    ap.add_argument("--incarnation", type=int, default=0,
                    help="restart count of this learner id: 0 the first start, n+1 after the n-th restart "
                         "(default: %(default)s)")
    ap.add_argument("--give-up-after-s", type=float, default=120.0, metavar="SECONDS",
                    help="seconds without any answer from the synchronizer before exiting with code 3; training "
                         "goes on meanwhile (default: %(default)s)")
    ap.add_argument("--group-timeout-s", type=float, default=300.0, metavar="SECONDS",
                    help="seconds one collective inside a torchrun group may take (learners.group_timeout_s; "
                         "default: %(default)s)")
    return ap


def set_up_interpreter() -> None:
    """The learner process's interpreter settings, before the comms thread starts (issue 17): one
    torch thread (``learners.threads`` may raise it once the run's config is known), the switch
    interval :data:`LEARNER_SWITCH_INTERVAL_S`, the C heap's thresholds and arenas, and the object
    digest's hashing threads: one core fewer than the process may use (at most 4, at least 1), the
    training thread's core left to it (2 cores, ``make bench``'s learner section at 50M, 2 repeats
    each: 0.947 ± 0.040 of the plain loop hashing on both cores, 0.994 ± 0.094 on one)."""
    torch.set_num_threads(1)
    set_hash_threads(max(1, min(4, usable_cores() - 1)))
    sys.setswitchinterval(LEARNER_SWITCH_INTERVAL_S)
    limit_heap_retention(LEARNER_HEAP_ARENAS, mmap_threshold_bytes=LEARNER_MMAP_THRESHOLD_BYTES,
                         trim_threshold_bytes=LEARNER_TRIM_THRESHOLD_BYTES)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    rank = os.environ.get("RANK", "0") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    who = f"{args.learner_id} rank {rank}" if rank else args.learner_id
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s learner {who} %(levelname)s %(name)s: %(message)s")
    set_up_interpreter()
    token = os.environ.get(LEARNER_TOKEN_ENV, "")
    if not token:
        print(f"error: {LEARNER_TOKEN_ENV} is not set: give this learner its own token, from the operator's "
              f"`diloco-async token --run-id RUN --learner-id {args.learner_id}`", file=sys.stderr)
        return 2
    try:
        check_tls_env(args.learner_id, args.sync_url, os.environ, dt.datetime.now(dt.UTC))
    except ValueError as err:
        print(f"error: {args.learner_id}: {err}", file=sys.stderr)
        return 2
    group = LearnerGroup.from_env(args.group_timeout_s)
    try:
        store = _open_store(args)
        if group is not None and not group.is_leader:  # a sharded group's rank puts and reads its own shards
            return run_follower(group, args.index, args.incarnation, store=store, learner_id=args.learner_id)
        return _run_learner(args, token, group, store)
    except ValueError as err:  # e.g. a device that is absent here, named
        log.error("%s: %s", who, err, exc_info=True)
        return 2
    finally:
        if group is not None:
            group.close()


def check_tls_env(learner_id: str, sync_url: str, env: dict | os._Environ, now: dt.datetime) -> None:
    """Before anything starts, a learner of an ``https://`` synchronizer checks its TLS files
    (docs/network-modes.md): the CA bundle of ``DILOCO_TLS_CA`` holds a certificate; its own
    ``DILOCO_TLS_CERT`` / ``DILOCO_TLS_KEY`` (mutual TLS) are a pair, valid at ``now`` and name
    ``learner_id``. Raises ValueError naming the file (and the expiry)."""
    if not sync_url.startswith("https://"):
        return
    if env.get(CA_ENV):
        read_certificates(env[CA_ENV], f"{CA_ENV} bundle")
    if bool(env.get(CERT_ENV)) != bool(env.get(KEY_ENV)):
        raise ValueError(f"{CERT_ENV} and {KEY_ENV} go together: set both or neither")
    if env.get(CERT_ENV):
        check_client_files(env[CERT_ENV], env[KEY_ENV], now, learner_id)


def _open_store(args: argparse.Namespace) -> ObjectStore:
    options: dict[str, Any] = storage_options_from_env()
    delay_s = link_delay_s_from_env()
    store = ObjectStore(args.store, options)
    if delay_s > 0:  # the emulated WAN's regions (issue 13): every store request waits a round trip
        store = LatencyStore(store, delay_s)
        log.info("%s: link latency %.1f ms one way added to every store request and synchronizer exchange",
                 args.learner_id, delay_s * 1000)
    return store


def _run_learner(args: argparse.Namespace, token: str, group: LearnerGroup | None, store: ObjectStore) -> int:
    delay_s = link_delay_s_from_env()
    tl_dir = os.environ.get(TIMELINE_DIR_ENV)
    recorder = Recorder(os.path.join(tl_dir, f"{args.learner_id}.jsonl") if tl_dir else None, inc=args.incarnation)
    # the process's own start (interpreter and imports included), as the synchronizer's ledger counts it
    recorder.record("start", t=time.time() - process_uptime_s())
    slot = LearnerSlot(args.learner_id, args.index, args.incarnation)
    endpoint = SyncEndpoint(args.sync_url, token, give_up_after_s=args.give_up_after_s, link_delay_s=delay_s)
    learner = Learner(slot, endpoint, store, recorder=recorder, group=group)
    try:
        code = learner.run()
    except ProtocolError as err:
        log.error("%s: %s", args.learner_id, err)
        code = 3
    recorder.record("stopped", code=code)
    recorder.close()
    return code
