"""Data-parallel baseline (DESIGN §8): one rank of synchronous training with ``torch.distributed``.

Run one process per rank::

    python -m diloco_async.baselines.ddp --rank R --world-size M [--master-addr A] --master-port PORT \\
        --run-id ID --store URL --timeline PATH --incarnation I [--config FILE] [--set section.field=value ...] \\
        [--speed F] [--jitter J] [--checkpoint-every-steps N] [--stop-at-unix T] [--max-steps N] \\
        [--gloo-timeout-s S] [--init-timeout-s S]

Rank r trains the same model (:class:`~diloco_async.models.transformer.ByteGPT`, ``cfg.model``) on the same
data shard as learner r (``Corpus.shard(r, M)``, windows drawn by ``Corpus.sample``), with the
learners' AdamW settings (``learners.lr``, ``weight_decay``, ``warmup_steps``, ``grad_clip``) and
batch size per rank (``learners.batch_size``). One step: sample, forward, backward, sleep to
emulate slower hardware (``dt*(1/speed-1) + dt*jitter*|N(0,1)|``; ``--speed``/``--jitter``
default to ``faults.speed_factors[r]``/``faults.step_jitter``; the jitter RNG is seeded like
learner r's), all-reduce the averaged
gradients (one flat fp32 buffer whose last two elements are the stop flags), clip, AdamW step.
With ``DILOCO_LINK_DELAY_MS`` set (the WAN harness's regions, :mod:`diloco_async.runtime.link_delay`),
each all-reduce also waits the ring's latency, ``2 (M - 1) x 2 x delay`` (counted in ``wait_s``).

Checkpoints are ``torchrun``-style: every ``--checkpoint-every-steps`` steps rank 0 writes the
parameters, the AdamW state, the step and the tokens committed under
``{run_id}/ddp/checkpoints/{seq:08d}/`` (``diloco_async.storage.checkpoint.write_state``: state file, then the
manifest that names its digest). At start every rank loads the newest verified checkpoint, or
starts from the seeded model of ``synchronizer.initial_parameters`` (the same Θ^0 as the DiLoCo
runs). Work done since the last checkpoint is lost when any rank fails: the caller kills the whole
group and starts the next incarnation (:class:`~diloco_async.baselines.ddp_group.DdpGroup`).

Stopping: SIGTERM, ``--stop-at-unix`` or ``--max-steps``. A stop request travels with the next
gradient all-reduce, so every rank stops after the same step; rank 0 then writes a final
checkpoint (unless one exists for that step) and every rank exits 0. A lost peer (gloo error or
timeout) makes a rank exit with code 4 at once; a failed rendezvous exits with code 5.

Timeline (one JSON object per line, appended to ``--timeline``, flushed per line; every line also
carries ``rank`` and ``incarnation``; times are unix seconds):

* ``{"kind": "start", "t": <process start>, "incarnation": I}``
* ``{"kind": "ready", "t": ..., "step": <restored step>}`` just before the first step
* ``{"kind": "step", "t0": ..., "t1": ..., "wait_s": <s in the all-reduce>, "step": <global step
  after it>, "tokens": <batch*context of this rank>, "loss": <local train loss, nats/token>}``
* ``{"kind": "checkpoint", "t": <commit time>, "step": s, "tokens_committed": n, "dur_s": ...,
  "key": <manifest key>}`` (rank 0 only); ``checkpoint_failed`` with ``error`` if a write failed
* ``{"kind": "stopped", "t": ..., "step": s, "reason": "signal"|"stop_at"|"max_steps",
  "param_sha256": ...}``
* ``{"kind": "error", "t": ..., "step": s, "error": "..."}`` before a non-zero exit
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from diloco_async.baselines.ddp_checkpoints import checkpoint_prefix, model_from_params, param_sha256
from diloco_async.config.resolved import read_resolved
from diloco_async.config.schema import Config, config_hash
from diloco_async.data.tokens import Corpus, open_corpus
from diloco_async.inner.state import InnerState, capture, restore
from diloco_async.inner.workload import (
    accumulated_step,
    data_generator,
    emulated_delay_s,
    inner_optimizer,
    jitter_random,
    optimizer_of,
)
from diloco_async.policy.schedules import InnerSchedule
from diloco_async.runtime.devices import set_cpu_math
from diloco_async.runtime.link_delay import LINK_DELAY_ENV, link_delay_s_from_env, ring_allreduce_latency_s
from diloco_async.runtime.process_clock import process_uptime_s
from diloco_async.storage.checkpoint import latest_state, list_state_seqs, write_state
from diloco_async.storage.options import storage_options_from_env
from diloco_async.storage.store import ObjectStore
from diloco_async.sync import initial_parameters

__all__ = ["EXIT_OK", "EXIT_USAGE", "EXIT_PEER_LOST", "EXIT_RENDEZVOUS", "rank_speed", "rank_jitter", "tokens_per_step",
           "main"]

log = logging.getLogger("diloco.ddp")

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_PEER_LOST = 4
EXIT_RENDEZVOUS = 5


# ------------------------------------------------------------------ pure helpers -------------

def rank_speed(cfg: Config, rank: int, speed: float | None) -> float:
    """``speed`` when given, else ``faults.speed_factors[rank]`` of the config (1.0 when unset)."""
    if speed is not None:
        return float(speed)
    factors = cfg.faults.speed_factors
    return float(factors[rank]) if rank < len(factors) else 1.0


def rank_jitter(cfg: Config, jitter: float | None) -> float:
    """``jitter`` when given, else ``faults.step_jitter`` of the config (0.0 when unset)."""
    return float(jitter) if jitter is not None else cfg.faults.step_jitter


def tokens_per_step(world_size: int, batch_size: int, context: int) -> int:
    """Tokens one step of the whole group commits: ``M * batch * context``."""
    return world_size * batch_size * context


# ------------------------------------------------------------------ the rank process ---------

class _Timeline:
    """Append-only JSON-lines file of one rank; each line flushed as written."""

    def __init__(self, path: str | os.PathLike, rank: int, incarnation: int) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(path, "a", buffering=1)
        self.extra = {"rank": rank, "incarnation": incarnation}

    def write(self, kind: str, **fields: Any) -> None:
        self.fh.write(json.dumps({"kind": kind, **fields, **self.extra}) + "\n")
        self.fh.flush()


class _Stop:
    """Why this rank wants to stop (set by the SIGTERM handler or the clock)."""

    reason: str | None = None


class _GradAllReduce:
    """What a rank does between backward and clip (the ``after_backward`` of :func:`inner_step`):
    sleep to emulate slower hardware, then all-reduce the averaged gradients in one flat fp32
    buffer whose last two elements are the stop flags [asked by a signal, asked by the clock]."""

    def __init__(self, rank: _Rank, plist: list[torch.nn.Parameter], pg: Any, speed: float, jitter: float,
                 jitter_rng: random.Random) -> None:
        self.rank, self.plist, self.pg = rank, plist, pg
        self.numels = [p.numel() for p in plist]
        self.speed, self.jitter, self.jitter_rng = speed, jitter, jitter_rng
        self.compute_t0 = 0.0  # perf_counter at the start of the step's compute
        self.wait_s = 0.0
        self.by_signal = self.by_clock = False
        #: seconds of link latency each all-reduce waits (emulated WAN regions; 0: none)
        self.latency_s = float(getattr(rank.args, "allreduce_latency_s", 0.0))

    def __call__(self) -> None:
        delay = emulated_delay_s(time.perf_counter() - self.compute_t0, self.speed, self.jitter, self.jitter_rng)
        if delay > 0:
            time.sleep(delay)
        reason = self.rank.stop.reason
        flag = torch.tensor([float(reason == "signal"), float(reason == "stop_at")])
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.plist]
                         + [flag])
        w0 = time.perf_counter()
        try:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.pg)
        except Exception as err:
            self.rank.fail("lost a peer", err, EXIT_PEER_LOST)
        if self.latency_s > 0:  # the ring's 2 (N - 1) hops over links without netem: every rank waits alike
            time.sleep(self.latency_s)
        self.wait_s = time.perf_counter() - w0
        self.by_signal, self.by_clock = flat[-2].item() > 0, flat[-1].item() > 0
        flat = flat[:-2].div_(self.rank.world)
        with torch.no_grad():
            for p, g in zip(self.plist, flat.split(self.numels), strict=True):
                p.grad = g.view_as(p)


class _Rank:
    def __init__(self, args: argparse.Namespace, cfg: Config, timeline: _Timeline, stop: _Stop) -> None:
        self.args = args
        self.cfg = cfg
        self.timeline = timeline
        self.stop = stop
        self.rank = args.rank
        self.world = args.world_size
        self.step = 0
        self.tokens_committed = 0

    def fail(self, what: str, err: BaseException, code: int) -> None:
        """Log and leave at once: after a lost peer, gloo teardown may block."""
        msg = f"{what}: {type(err).__name__}: {err}"
        log.error("rank %d %s", self.rank, msg)
        self.timeline.write("error", t=time.time(), step=self.step, error=msg[:2000])
        sys.stderr.flush()
        os._exit(code)

    def run(self) -> int:
        a, cfg, lc = self.args, self.cfg, self.cfg.learners
        pg = self._rendezvous()
        self.store = ObjectStore(a.store, storage_options_from_env())
        self.prefix = checkpoint_prefix(a.run_id)
        self._restore()
        self._agree_on_step(pg)
        corpus = open_corpus(cfg.data, cfg.model.context, model_vocab=cfg.model.vocab_size)
        shard = corpus.shard(self.rank, self.world)
        self.gen = data_generator(cfg.run.seed, self.rank, a.incarnation)
        plist = list(self.params.values())
        reduce = _GradAllReduce(self, plist, pg, rank_speed(cfg, self.rank, a.speed), rank_jitter(cfg, a.jitter),
                                jitter_random(cfg.run.seed, self.rank, a.incarnation))
        log.info("rank %d/%d ready at step %d: shard of %d tokens, %d parameters", self.rank, self.world,
                 self.step, len(shard), sum(reduce.numels))
        if cfg.faults.nice_after_ready:  # as the learners do (chaos runs: many machines on one host)
            os.nice(cfg.faults.nice_after_ready)
        self.timeline.write("ready", t=time.time(), step=self.step)
        if isinstance(lc.batch_size, list):
            raise ValueError(f"the DDP baseline needs one learners.batch_size for every rank, got {lc.batch_size}")
        k = lc.grad_accum_steps  # micro-batches per step; the lr schedule follows the tokens trained
        per_step = tokens_per_step(self.world, lc.batch_size, cfg.model.context) * k
        schedule = InnerSchedule.from_config(cfg)
        reason: str | None = None
        while True:
            if a.max_steps is not None and self.step >= a.max_steps:
                reason = "max_steps"  # every rank has the same step: no agreement needed
                break
            if a.stop_at_unix is not None and self.stop.reason is None and time.time() >= a.stop_at_unix:
                self.stop.reason = "stop_at"
            t0 = time.time()
            reduce.compute_t0 = time.perf_counter()
            batches = [Corpus.sample(shard, lc.batch_size, cfg.model.context, self.gen) for _ in range(k)]
            loss = accumulated_step(self.model, self.opt, batches, lr=schedule.lr(self.step, self.tokens_committed),
                                    grad_clip=lc.grad_clip, after_backward=reduce)
            self.step += 1
            self.tokens_committed += per_step
            self.timeline.write("step", t0=t0, t1=time.time(), wait_s=reduce.wait_s, step=self.step,
                                tokens=k * lc.batch_size * cfg.model.context, loss=float(loss))
            if self.rank == 0 and a.checkpoint_every_steps > 0 and self.step % a.checkpoint_every_steps == 0:
                self._checkpoint()
            if reduce.by_signal or reduce.by_clock:  # every rank sees the same flags: the same step, the same reason
                reason = "signal" if reduce.by_signal else "stop_at"
                break
        return self._finish(reason)

    def _rendezvous(self) -> Any:
        """Join the gloo group; returns the process group whose collectives time out quickly."""
        a = self.args
        if a.master_addr.startswith("127."):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the master is on loopback
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{a.master_addr}:{a.master_port}", rank=self.rank,
                                    world_size=self.world,
                                    timeout=datetime.timedelta(seconds=a.init_timeout_s))
            # Collectives run in a group with the short timeout: a lost peer ends this rank quickly.
            return dist.new_group(list(range(self.world)), timeout=datetime.timedelta(seconds=a.gloo_timeout_s),
                                  backend="gloo")
        except Exception as err:  # rendezvous failed: a peer or the master never came
            self.fail("rendezvous failed", err, EXIT_RENDEZVOUS)
            raise  # not reached: fail exits

    def _restore(self) -> None:
        """The model and its inner optimizer (``learners.optimizer``): from the newest verified
        checkpoint, else the seeded Θ^0."""
        cfg, lc = self.cfg, self.cfg.learners
        params0, _ = initial_parameters(cfg)
        self.model = model_from_params(cfg, params0)
        self.params = dict(self.model.named_parameters())
        self.opt = (optimizer_of("muon", self.model, lr=lc.lr, weight_decay=lc.weight_decay, what=repr(cfg.model.kind))
                    if lc.optimizer == "muon" else
                    inner_optimizer(list(self.params.values()), lr=lc.lr, weight_decay=lc.weight_decay))
        saved = latest_state(self.store, self.prefix)
        if saved is not None:
            self.step = restore(InnerState(saved.tensors, saved.manifest["inner"]), self.params, self.opt,
                                torch.Generator())[0]
            self.tokens_committed = int(saved.manifest["tokens_committed"])
            log.info("rank %d restored checkpoint %d (step %d)", self.rank, saved.seq, self.step)
        self.last_ckpt_step = self.step
        self.next_seq = max(list_state_seqs(self.store, self.prefix), default=0) + 1 if self.rank == 0 else 0

    def _agree_on_step(self, pg: Any) -> None:
        """Every rank must have restored the same step; exits otherwise."""
        agree = torch.tensor([float(self.step), -float(self.step)], dtype=torch.float64)
        try:
            dist.all_reduce(agree, op=dist.ReduceOp.MAX, group=pg)
        except Exception as err:
            self.fail("lost a peer", err, EXIT_PEER_LOST)
        if agree[0].item() != -agree[1].item():
            self.fail("ranks restored different steps", RuntimeError(f"{-agree[1].item()}..{agree[0].item()}"),
                      EXIT_PEER_LOST)

    def _checkpoint(self) -> None:
        """Rank 0: write a checkpoint of this step (a failure is logged; the next period tries again)."""
        a, cfg, lc = self.args, self.cfg, self.cfg.learners
        c0 = time.time()
        state = capture(self.params, self.opt, self.gen, step=self.step, base_tensors={}, base_versions={},
                        counters={})
        manifest = {"kind": "ddp", "step": self.step, "tokens_committed": self.tokens_committed,
                    "wall_unix": time.time(), "world_size": self.world, "incarnation": a.incarnation,
                    "batch_size": lc.batch_size, "context": cfg.model.context, "config_hash": config_hash(cfg),
                    "param_sha256": param_sha256(self.params), "inner": state.meta}
        try:
            ref = write_state(self.store, self.prefix, self.next_seq, state.tensors, manifest)
        except Exception as err:  # training goes on; the next period tries again
            log.warning("rank 0 could not write checkpoint %d: %s", self.next_seq, err)
            self.timeline.write("checkpoint_failed", t=time.time(), step=self.step,
                                error=f"{type(err).__name__}: {err}"[:2000])
            self.next_seq += 1
            return
        self.next_seq += 1
        self.last_ckpt_step = self.step
        self.timeline.write("checkpoint", t=time.time(), step=self.step, tokens_committed=self.tokens_committed,
                            dur_s=time.time() - c0, key=ref.key)

    def _finish(self, reason: str | None) -> int:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping already; a late SIGTERM must not kill the exit
        if self.rank == 0 and self.last_ckpt_step != self.step:
            self._checkpoint()
        self.timeline.write("stopped", t=time.time(), step=self.step, reason=reason,
                            param_sha256=param_sha256(self.params))
        log.info("rank %d stopped at step %d (%s)", self.rank, self.step, reason)
        try:
            dist.destroy_process_group()
        except Exception:  # a peer that already left: nothing to tear down with it
            pass
        return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m diloco_async.baselines.ddp",
                                 description="One rank of the data-parallel baseline (gloo, torchrun-style restarts).")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True, help="M, the number of ranks")
    ap.add_argument("--master-addr", default="127.0.0.1",
                    help="rank 0's address (an address of its own network namespace in WAN runs)")
    ap.add_argument("--master-port", type=int, required=True, help="rank 0 listens on MASTER_ADDR:PORT")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--store", required=True, help="object store root URL")
    ap.add_argument("--timeline", required=True, help="JSON-lines file this rank appends to")
    ap.add_argument("--incarnation", type=int, default=0, help="restart count of the group")
    ap.add_argument("--resolved-config", default=None, metavar="RESOLVED.json",
                    help="the run's resolved config (JSON, diloco_async.config.resolved; defaults when omitted)")
    ap.add_argument("--speed", type=float, default=None,
                    help="relative hardware speed (0.5: half speed); default faults.speed_factors[rank] or 1.0")
    ap.add_argument("--jitter", type=float, default=None,
                    help="per-step jitter, fraction of the step time; default faults.step_jitter or 0.0")
    ap.add_argument("--checkpoint-every-steps", type=int, default=0, help="0: only the final checkpoint")
    ap.add_argument("--stop-at-unix", type=float, default=None, help="stop (all ranks) at this unix time")
    ap.add_argument("--max-steps", type=int, default=None, help="stop when the group step reaches this")
    ap.add_argument("--gloo-timeout-s", type=float, default=30.0, help="timeout of one collective")
    ap.add_argument("--init-timeout-s", type=float, default=120.0, help="timeout of the rendezvous")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s ddp rank {args.rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    timeline = _Timeline(args.timeline, args.rank, args.incarnation)
    timeline.write("start", t=time.time() - process_uptime_s(), incarnation=args.incarnation)
    stop = _Stop()

    def on_term(signum: int, frame: Any) -> None:
        stop.reason = stop.reason or "signal"

    signal.signal(signal.SIGTERM, on_term)
    try:
        cfg = read_resolved(args.resolved_config) if args.resolved_config else Config()
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if (not 0 <= args.rank < args.world_size or rank_speed(cfg, args.rank, args.speed) <= 0
            or rank_jitter(cfg, args.jitter) < 0):
        print("error: need 0 <= rank < world-size, speed > 0, jitter >= 0", file=sys.stderr)
        return EXIT_USAGE
    set_cpu_math(1, cfg.learners.flush_denormal)  # as the learners compute
    try:
        args.allreduce_latency_s = ring_allreduce_latency_s(link_delay_s_from_env(), args.world_size)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if args.allreduce_latency_s > 0:
        log.info("rank %d: %.1f ms of link latency added to every all-reduce (%s)", args.rank,
                 args.allreduce_latency_s * 1000, LINK_DELAY_ENV)
    return _Rank(args, cfg, timeline, stop).run()


if __name__ == "__main__":
    raise SystemExit(main())
