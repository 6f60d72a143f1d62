"""``make bench-scale`` (issue 40, part a): contribution bytes per second that two synchronizer
shards take in and merge against one, under a merge-bound load, on this machine.

Each run starts S real synchronizer processes (``python -m diloco_async.sync --shard i``, DESIGN
§2.2) over one ``file://`` store under ``/dev/shm``, and drives them with L scripted learners
from this process, over the real HTTP protocol: every ``tick_s`` each learner heartbeats to every
shard with a step that grows at ``steps_per_s`` (so every fragment's next round is always due and
the rounds open as fast as the shards close them), and each learner answers every open round it
has not answered with a contribution to the fragment's owner. A contribution is a real object
(int8, the fragment's shapes: a direction shared by the learners plus noise of its own, so the
update guard passes it) encoded once per (learner, fragment) and hard-linked under the round's
key: the learners' encoding and upload are not what is measured, the synchronizer's fetch,
digest check, decode, update guard, RDA merge, outer step and publish are, all for real. No grace
window (K = L: a round merges once every learner contributed), no checkpoint during the window.

The bar compares S = 1 and S = 2 on the same two cores (the issue's setting). One synchronizer
process already keeps about 1.5 of them busy (its verification threads and merge thread beside its
event loop), so a second process can add at most what is left: the ratio measured is about 1.2, a
MISS of the 1.6 bar. Shown beside it, one pair with each shard process pinned to a core of its own
(``os.sched_setaffinity`` before it starts): that is S = 1 on one core against S = 2 on two, hosts
of their own, not a comparison on equal hardware.

Figure: the contribution bytes the shards verified per second of the measured window (each shard's
``bytes_in`` from ``/status`` at the window's start and end, summed over shards; counted when a
contribution verifies, before its merge; the learners' acks are printed), for S = 2 over
S = 1, each the mean of ``--repeats`` runs (3; 95% t-interval shown); the same with S = 1 is the
baseline measured in the same command. Bar: ratio >= 1.6. The contributions are int8 (decoded by
the merge, so the merge dominates), and ``max_open_rounds`` is the fragment count, so each shard
always has a round of each of its fragments open.

Usage: python -m benchmarks.scale [--repeats R] [--seconds S] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import torch

from benchmarks.args import description, exit_on_sigterm, positive_float, positive_int
from benchmarks.bars import Bar, print_bars
from benchmarks.stats import mean_over_runs
from diloco_async.codec import wire
from diloco_async.protocol.client import TOKEN_ENV, SyncClient, call_blocking, fetch_status
from diloco_async.runtime.parent_death import guarded_argv
from diloco_async.storage import keys

__all__ = ["ScaleSpec", "run_scale", "main"]

GOAL_RATIO = 1.6
RUN_ID = "scale"


@dataclasses.dataclass(frozen=True)
class ScaleSpec:
    """One measured run: ``shards`` synchronizer processes, ``learners`` scripted learners,
    ``seconds`` measured after ``warmup_s``; the model (``n_layer`` x ``d_model``) in
    ``fragments`` fragments."""

    shards: int
    learners: int = 4
    seconds: float = 30.0
    warmup_s: float = 8.0
    n_layer: int = 8
    d_model: int = 512
    fragments: int = 4
    codec: str = "int8"
    pinned: bool = False
    sync_every: int = 24
    steps_per_s: float = 400.0
    tick_s: float = 0.05


def sync_config(spec: ScaleSpec, store_url: str, folder: Path) -> Path:
    """The synchronizers' resolved config for ``spec`` written under ``folder``; its path."""
    from diloco_async.config.resolved import with_fields, write_resolved
    from diloco_async.config.schema import Config

    return write_resolved(with_fields(Config(), {
        "model.n_layer": spec.n_layer, "model.d_model": spec.d_model, "model.n_head": 4, "model.context": 64,
        "model.vocab_size": 256, "learners.count": spec.learners, "learners.batch_size": 4,
        "synchronizer.num_fragments": spec.fragments, "synchronizer.shards": spec.shards,
        "synchronizer.sync_every": spec.sync_every, "synchronizer.min_quorum": spec.learners,
        "synchronizer.max_open_rounds": spec.fragments,
        "synchronizer.grace_enabled": False, "synchronizer.heartbeat_timeout_s": 30.0,
        "synchronizer.checkpoint_every_s": 100000.0, "synchronizer.drain_s": 0.0, "synchronizer.port": 0,
        "synchronizer.host": "127.0.0.1", "synchronizer.max_staleness": 8, "budget.wall_s": 100000.0,
        "budget.tokens": None, "guard.pace_initial_steps_per_s": 100 * spec.steps_per_s,
        "run.store": store_url}), folder)


class _Learners:
    """The scripted learners: one asyncio task each, with a client per shard held open; heartbeats
    to every shard, then one contribution to each open round not answered yet."""

    def __init__(self, spec: ScaleSpec, urls: list[str], secret: str, root: Path) -> None:
        self.spec, self.urls, self.secret, self.root = spec, urls, secret, root
        self.ids = [f"learner-{i}" for i in range(spec.learners)]
        self.acks: dict[str, int] = {}
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.templates: dict[tuple[str, int], tuple[Path, int, str]] = {}

    def encode(self, plan: dict) -> None:
        """Each learner's outer gradient of each fragment, encoded once: a direction the learners
        share plus noise of their own (cosines about 0.96, so the update guard merges them whole)."""
        for p, frag in enumerate(plan["fragments"]):
            g = torch.Generator().manual_seed(p)
            shared = {s["name"]: torch.randn(tuple(s["shape"]), generator=g) * 1e-3 for s in frag}
            for lid in self.ids:
                own = {n: t + 0.3 * torch.randn(t.shape, generator=g) * 1e-3 for n, t in shared.items()}
                data = wire.encode_to_bytes(own, self.spec.codec, {})
                path = self.root / f"template-{lid}-{p}.safetensors"
                path.write_bytes(data)
                self.templates[(lid, p)] = (path, len(data), hashlib.sha256(data).hexdigest())

    def run(self, store_root: Path, t0: float) -> None:
        asyncio.run(self._all(store_root, t0))

    async def _all(self, store_root: Path, t0: float) -> None:
        done = await asyncio.gather(*(self._one(lid, store_root, t0) for lid in self.ids), return_exceptions=True)
        self.errors += [f"{type(e).__name__}: {e}" for e in done if isinstance(e, BaseException)]

    async def _one(self, lid: str, store_root: Path, t0: float) -> None:
        sp, answered = self.spec, set()
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(SyncClient(url, self.secret)) for url in self.urls]
            for client in clients:
                await client.join({"learner_id": lid, "incarnation": 0})
            while not self.stop.is_set():
                step = int((time.monotonic() - t0) * sp.steps_per_s) + sp.sync_every
                try:
                    for client in clients:
                        resp = await client.heartbeat({"learner_id": lid, "step": step})
                        for r in resp.get("open_rounds") or []:
                            if (r["fragment"], r["round_n"]) not in answered:
                                answered.add((r["fragment"], r["round_n"]))
                                await self._contribute(client, lid, r, store_root)
                except Exception as err:  # any failure ends the run as an error, never as a low rate
                    self.errors.append(f"{lid}: {type(err).__name__}: {err}")
                    return
                await asyncio.sleep(sp.tick_s)

    async def _contribute(self, client: SyncClient, lid: str, r: dict, store_root: Path) -> None:
        p, n, v = int(r["fragment"]), int(r["round_n"]), int(r["version"])
        path, nbytes, sha = self.templates[(lid, p)]
        key = keys.contribution_key(RUN_ID, p, n, lid, uuid.uuid4().hex[:8])
        dest = store_root / key
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.link(path, dest)  # the same bytes under a fresh key: the learner's upload is not measured
        steps = self.spec.sync_every
        ack = await client.announce({
            "learner_id": lid, "fragment": p, "round_n": n, "base_version": v, "c_steps": steps,
            "c_tokens": steps * 4 * 64, "compute_s": 0.1, "key": key, "nbytes": nbytes, "sha256": sha,
            "codec": self.spec.codec, "update_id": uuid.uuid4().hex[:16]})
        self.acks[ack["status"]] = self.acks.get(ack["status"], 0) + 1


def _shard_counts(urls: list[str]) -> list[tuple[int, int]]:
    """Per shard: (contribution bytes verified, contributions merged) so far, from ``/status``."""
    docs = [fetch_status(url, timeout_s=30.0) for url in urls]
    return [(int(d.get("bytes_in") or 0), int(d.get("contributions_merged") or 0)) for d in docs]


def _start_shards(spec: ScaleSpec, work: Path, config: Path, secret: str, procs: list[subprocess.Popen]) -> list[str]:
    """Start ``spec.shards`` synchronizer processes (appended to ``procs`` as they start, for the
    caller to stop), shard i pinned to core i (mod the cores) when ``spec.pinned``; their URLs.

    Raises:
        RuntimeError: a shard exited or wrote no ready file within 60 s (its log's end in the message).
    """
    env = {**os.environ, TOKEN_ENV: secret, "PYTHONUNBUFFERED": "1"}
    cores = sorted(os.sched_getaffinity(0))
    urls = []
    for i in range(spec.shards):
        ready, log = work / f"ready-{i}.json", work / f"sync-{i}.log"
        core = cores[i % len(cores)]
        pin = (lambda core=core: os.sched_setaffinity(0, {core})) if spec.pinned else None
        with open(log, "wb") as fh:
            # a shard gets SIGTERM when this process dies (a kill of the benchmark leaves no shard behind)
            procs.append(subprocess.Popen([sys.executable, *guarded_argv("diloco_async.sync", [
                "--run-id", RUN_ID, "--shard", str(i), "--ready-file", str(ready), "--resolved-config", str(config)])],
                                          stdout=fh, stderr=subprocess.STDOUT, env=env, preexec_fn=pin))
        t_start = time.monotonic()
        while not ready.exists():
            if procs[-1].poll() is not None or time.monotonic() - t_start > 60:
                raise RuntimeError(f"synchronizer shard {i} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        urls.append(json.loads(ready.read_text())["url"])
    return urls


def run_scale(spec: ScaleSpec) -> dict:
    """One measured run of ``spec``: merged bytes per second, merges, the learners' acks.

    Raises:
        RuntimeError: a synchronizer did not start within 60 s (its log's end in the message), or
            the learners met errors.
    """
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=root))
    store_root = work / "store"
    store_url = f"file://{store_root}"
    secret = secrets.token_hex(32)
    config = sync_config(spec, store_url, work)
    procs: list[subprocess.Popen] = []
    try:
        urls = _start_shards(spec, work, config, secret, procs)
        learners = _Learners(spec, urls, secret, work)
        joined = call_blocking(urls[0], secret, "join", {"learner_id": learners.ids[0], "incarnation": 0})
        learners.encode(joined["plan"])
        t0 = time.monotonic()
        thread = threading.Thread(target=learners.run, args=(store_root, t0), daemon=True)
        thread.start()
        time.sleep(spec.warmup_s)
        watched = [psutil.Process(p.pid) for p in procs] + [psutil.Process()]  # the shards, then the learners
        c0, cpu0 = _shard_counts(urls), [sum(p.cpu_times()[:2]) for p in watched]
        w0 = time.monotonic()
        time.sleep(spec.seconds)
        c1, cpu1 = _shard_counts(urls), [sum(p.cpu_times()[:2]) for p in watched]
        w1 = time.monotonic()
        cores = [(b - a) / (w1 - w0) for a, b in zip(cpu0, cpu1, strict=True)]
        (b0, m0), (b1, m1) = ([sum(x) for x in zip(*c, strict=True)] for c in (c0, c1))
        learners.stop.set()
        thread.join(30)
        if learners.errors:
            raise RuntimeError(f"the scripted learners met errors: {learners.errors[:3]}")
        out = {"shards": spec.shards, "merged_bytes_per_s": (b1 - b0) / (w1 - w0),
               "merged_per_s": (m1 - m0) / (w1 - w0), "acks": dict(learners.acks),
               "merged_by_shard": [b[1] - a[1] for a, b in zip(c0, c1, strict=True)],
               "shard_cores": cores[:-1], "learner_cores": cores[-1]}
        print(f"S = {spec.shards}: {out['merged_bytes_per_s'] / 1e6:.1f} MB/s verified, "
              f"{out['merged_per_s']:.1f} contributions/s, acks {out['acks']}; cores busy: shards "
              f"{', '.join(f'{c:.2f}' for c in cores[:-1])}, scripted learners {cores[-1]:.2f}", flush=True)
        return out
    finally:
        try:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:  # a second interrupt while the shards stop still removes the folder
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=description(__doc__))
    ap.add_argument("--repeats", type=positive_int, default=3, help="pinned runs of each S (default 3)")
    ap.add_argument("--seconds", type=positive_float, default=30.0, help="measured seconds per run (default 30)")
    ap.add_argument("--quick", action="store_true", help="one short run of each S, a small model (a test runs it)")
    args = ap.parse_args(argv)
    exit_on_sigterm()  # a kill runs run_scale's clean-up
    extra = {"seconds": 4.0, "warmup_s": 3.0, "n_layer": 1, "d_model": 64} if args.quick else {"seconds": args.seconds}
    repeats = 1 if args.quick else args.repeats
    rates: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(repeats):
        for shards in (1, 2):  # interleaved, so a slow spell of the machine touches both
            rates[shards].append(run_scale(ScaleSpec(shards=shards, pinned=False, **extra))["merged_bytes_per_s"])
    pinned = {s: run_scale(ScaleSpec(shards=s, pinned=True, **extra))["merged_bytes_per_s"] for s in (1, 2)}
    ratios = [b / a if a > 0 else None for a, b in zip(rates[1], rates[2], strict=True)]
    one, one_detail = mean_over_runs([r / 1e6 for r in rates[1]], " MB/s", 1)
    two, two_detail = mean_over_runs([r / 1e6 for r in rates[2]], " MB/s", 1)
    ratio, ratio_detail = mean_over_runs(ratios)
    return print_bars([
        Bar("S = 1: contribution MB/s verified (baseline)", one, 0.0, detail=one_detail, shown=True),
        Bar("S = 2: contribution MB/s verified", two, 0.0, detail=two_detail, shown=True),
        Bar("contribution bytes verified per s, S = 2 / S = 1", ratio, GOAL_RATIO, detail=ratio_detail,
            shown=args.quick),
        Bar("the same, each shard on a core of its own (shown)", pinned[2] / pinned[1] if pinned[1] > 0 else None,
            0.0, shown=True, detail=f"one pair: {pinned[1] / 1e6:.1f} -> {pinned[2] / 1e6:.1f} MB/s; S = 1 gets one "
            "core, S = 2 two: hosts of their own, not the same two cores"),
    ], title="synchronizer shards (issue 40)")


if __name__ == "__main__":
    sys.exit(main())
