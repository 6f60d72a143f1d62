"""The methods of a WAN scenario over the same shaped links (issue 13 item 2).

The chaos targets (:mod:`diloco_async.chaos.targets`) run each method; here they are placed in
the namespaces of a :class:`~diloco_async.wan.netns.WanNet`:

* ``sync-diloco`` and ``decoupled``: the synchronizer in the hub namespace
  (``synchronizer.host`` = the hub's address), the store on moto's S3 server in the hub (a
  ``file://`` store would bypass the links), learner slot ``i`` in the namespace of its region:
  every upload and download crosses that region's shaped link. Learners keep no inner-state
  checkpoints (they would cross the link too; ``learners.checkpoint_every_s = 0``).
* ``ddp``: rank ``r`` in the namespace of slot ``r``'s region, rank 0 the gloo master at its
  region's address; the all-reduce between regions crosses two shaped links (region -> hub ->
  region); every rank binds gloo to its region-side veth (``WanNet.region_ifname``, one name in
  every region). Its checkpoints (the snapshots of the held-out loss curve, not training traffic) go to
  a ``file://`` store beside the run.

Link latency: the kernel has no ``netem``, so each process in a region adds its link's one-way
delay (``links.delay_ms``) itself, told by :data:`~diloco_async.runtime.link_delay.LINK_DELAY_ENV`
(:meth:`WanPlacement.env_for`): learners to every store request and synchronizer exchange, DDP
ranks to every all-reduce (only when the ring crosses regions). The synchronizer and the store in
the hub add nothing (the learners' round trips already count both directions).

Every method has the same token budget (DDP: that many steps; DiLoCo: ``budget.tokens``) and the
same wall-time cap (the scenario's ``wall_s``), and stops at whichever comes first: over thin
links DDP reaches the wall time, and its final held-out loss is the target. :func:`run_method` returns the
:class:`~diloco_async.wan.report.WireRun` of a method: bytes on the wire from the veth counters
before and after, the held-out loss curve timed from the moment every learner was ready.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from diloco_async.baselines.ddp_group import RankPlacement
from diloco_async.chaos.measure import measure
from diloco_async.chaos.targets import DdpTarget, DilocoTarget, TargetRun
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config
from diloco_async.metrics.timeline import Timeline
from diloco_async.runtime.link_delay import LINK_DELAY_ENV
from diloco_async.wan.report import WireRun
from diloco_async.wan.scenario import WanScenario, ddp_max_steps, wan_config

__all__ = ["S3_TEST_ENV", "WanPlacement", "WanDilocoTarget", "WanDdpTarget", "run_method", "timeline_rates"]

log = logging.getLogger("diloco.wan")

#: credentials moto's S3 server accepts (it checks none); every process of a WAN run gets them
S3_TEST_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


class WanPlacement:
    """Where the processes of a run go: ``net`` (a :class:`~diloco_async.wan.netns.WanNet`,
    entered) and the S3 endpoint in its hub (``endpoint_url``; ``bucket`` exists on it). With
    ``net`` None every process stays in this namespace (the unshaped reference run) and the
    endpoint is a loopback one."""

    def __init__(self, sc: WanScenario, net, endpoint_url: str, bucket: str) -> None:
        self.sc, self.net, self.endpoint_url, self.bucket = sc, net, endpoint_url, bucket

    def ns_for(self, name: str) -> str | None:
        """Namespace of a process by its launcher name: ``synchronizer`` -> hub,
        ``learner-i`` / ``ddp-rank-i`` -> slot i's region; None without a net."""
        if self.net is None:
            return None
        if name == "synchronizer":
            return self.net.hub_ns
        slot = int(name.rsplit("-", 1)[1])
        return self.net.ns_of(self.sc.region_of(slot))

    def env_for(self, name: str) -> dict[str, str]:
        """Extra environment of a process by its launcher name: for a process in a region whose
        link has ``delay_ms`` > 0, :data:`~diloco_async.runtime.link_delay.LINK_DELAY_ENV` (learners; DDP
        ranks only when the ring crosses regions, i.e. more than one region); else ``{}``."""
        if self.net is None or name == "synchronizer" or self.sc.links.delay_ms <= 0:
            return {}
        if name.startswith("ddp-rank-") and len(self.sc.links.regions) < 2:
            return {}  # the whole ring is inside one region: no hop crosses a link
        return {LINK_DELAY_ENV: f"{self.sc.links.delay_ms:g}"}

    def wrap(self, launcher):
        """``launcher`` (the chaos targets' fork server) placing each process by :meth:`ns_for`
        with :meth:`env_for`: the fork enters its namespace, then runs the preloaded module
        (:mod:`diloco_async.wan.nsexec`)."""
        if self.net is None:
            return launcher
        from diloco_async.wan.launch import NetnsLauncher

        return NetnsLauncher(launcher, self.ns_for, self.env_for)

    def diloco_config(self, method: str, base: Config, seed: int | None, run_name: str) -> Config:
        """The config of a DiLoCo method here: :func:`~diloco_async.wan.scenario.wan_config` with the
        synchronizer in the hub, the store on the hub's S3 server under ``run_name``, no learner checkpoints."""
        host = self.net.hub_addr if self.net is not None else "127.0.0.1"
        return with_fields(wan_config(self.sc, method, base, seed), {
            "synchronizer.host": host, "run.store": f"s3://{self.bucket}/{run_name}",
            "learners.checkpoint_every_s": 0.0,
            "run.storage_options": {"client_kwargs": {"endpoint_url": self.endpoint_url}}})


class WanDilocoTarget(DilocoTarget):
    """``sync-diloco`` / ``decoupled`` placed by a :class:`WanPlacement`; finished once the
    synchronizer exited 0 (the token budget is reached)."""

    def __init__(self, sc: WanScenario, method: str, base: Config, place: WanPlacement, seed: int | None,
                 on_metrics: Callable[[list[dict]], None] = lambda points: None) -> None:
        self.place, self.prefix = place, f"{method}-{time.time_ns()}"
        super().__init__(sc, place.diloco_config(method, base, seed, self.prefix), on_metrics)
        self.procs.launcher = place.wrap(self.procs.launcher)
        self.finished = False

    def _collect(self, t_start: float, t_end: float):
        """As the chaos target, from a copy of the run's objects when the store is in the hub
        (not reachable from this namespace; :mod:`diloco_async.wan.hubio`)."""
        if self.place.net is not None:
            from diloco_async.storage.store import ObjectStore
            from diloco_async.wan.hubio import hub_mirror

            dest = hub_mirror(self.place.net, self.place.endpoint_url, f"{self.place.bucket}/{self.prefix}",
                              self.procs.workdir / "store-copy")
            self.procs.store = ObjectStore(f"file://{dest.resolve()}", {})
        return super()._collect(t_start, t_end)

    def tick(self, now: float) -> None:
        code = self.procs.sync.poll() if self.procs.sync is not None else None
        if code == 0:
            self.finished = True
            return
        if code is not None:
            raise RuntimeError(f"synchronizer exited early (code {code}); log {self.procs.sync.log_path}")
        for i in range(self.slots.n):
            h = self.procs.learners.get(f"learner-{i}")
            if h is not None and h.poll() not in (None, 0):  # 0: done (the budget is reached)
                log.warning("learner-%d exited with %s; restarting", i, h.poll())
                self.on_recover(i)
        if now - self.last_pull > 2.0:
            self.last_pull = now
            self.on_metrics(self.procs.pull_metrics())


class WanDdpTarget(DdpTarget):
    """``ddp`` placed by a :class:`WanPlacement`: ``max_steps`` of the token budget, rank 0 the
    master at its region's address; finished once every rank exited 0."""

    def __init__(self, sc: WanScenario, base: Config, place: WanPlacement, seed: int | None, store_dir: Path) -> None:
        cfg = with_fields(wan_config(sc, "ddp", base, seed),
                          {"run.store": f"file://{store_dir.resolve()}", "run.storage_options": {}})
        placement = RankPlacement()
        if place.net is not None:  # every rank's gloo socket on its region-side veth: one name in every region
            placement = RankPlacement(master_addr=place.net.regions[sc.region_of(0)].addr,
                                      env={"GLOO_SOCKET_IFNAME": place.net.region_ifname})
        super().__init__(sc, cfg, max_steps=ddp_max_steps(sc, int(cfg.learners.batch_size), cfg.model.context),
                         placement=placement)
        self.group.launcher = place.wrap(self.group.launcher)
        self.finished = False

    def tick(self, now: float) -> None:
        codes = self.group.poll()
        if self.running and codes and all(c == 0 for c in codes.values()):
            self.finished, self.running = True, False
            return
        super().tick(now)


def timeline_rates(tl: Timeline) -> tuple[int, float, float, float]:
    """``(steps, tokens, median compute seconds of a step without waits, mean over learners of
    tokens per second from their first step's start to their last step's end)``."""
    steps = tl.steps
    compute = sorted(max(0.0, st.t1 - st.t0 - st.wait_s) for st in steps)
    per_learner = []
    for lid in tl.learners:
        mine = [st for st in steps if st.learner == lid]
        span = max((st.t1 for st in mine), default=0.0) - min((st.t0 for st in mine), default=0.0)
        if mine and span > 0:
            per_learner.append(sum(st.tokens for st in mine) / span)
    return (len(steps), float(sum(st.tokens for st in steps)), statistics.median(compute) if compute else 0.0,
            statistics.fmean(per_learner) if per_learner else 0.0)


def _counters(net) -> dict[str, dict[str, int]]:
    return net.link_counters() if net is not None else {}


def run_method(sc: WanScenario, method: str, base: Config, place: WanPlacement, batches, seed: int | None = None,
               on_metrics: Callable[[list[dict]], None] = lambda points: None) -> tuple[WireRun, TargetRun]:
    """Run one method over the placement's links until its token budget; return what was
    measured (:class:`~diloco_async.wan.report.WireRun`) and the chaos target's run. ``base``: the
    scenario's recipe with every override, resolved once by the entry point."""
    for k, v in S3_TEST_ENV.items():
        os.environ.setdefault(k, v)
    if method == "ddp":
        store_dir = Path(".local/wan-ddp-store")
        target = WanDdpTarget(sc, base, place, seed, store_dir)
    else:
        target = WanDilocoTarget(sc, method, base, place, seed, on_metrics)
    before, t0 = _counters(place.net), time.time()
    run = target.run([])  # no fault events: a WAN scenario's faults are its links
    after, t1 = _counters(place.net), time.time()
    if not target.finished:
        log.info("%s reached the wall time (%.0f s) before its token budget (%d tokens)", method,
                 sc.scenario.wall_s, sc.budget.tokens)
    m = measure(run.timeline, run.snapshots, run.cfg, batches, sc.scenario.eval_tokens)
    steps, tokens, compute_s, tps = timeline_rates(run.timeline)
    counters = {r: {d: int(after[r][d]) - int(before[r][d]) for d in ("up_bytes", "down_bytes")} for r in after}
    rates = None
    if place.net is not None:
        rates = {r: {"up_mbit": up, "down_mbit": down} for r, up, down, _ in sc.link_settings()}
    wire = WireRun(method=method, curve=m.curve, eval_loss_equal_tokens=m.eval_loss_equal_tokens, tokens=tokens,
                   learner_steps=steps, compute_s_per_step=compute_s, tokens_per_s_per_learner=tps,
                   link_s=t1 - t0, counters=counters, rates=rates,
                   verified=dict(getattr(place.net, "verified", {}) or {}),
                   learners_per_region=sc.links.learners_per_region)
    return wire, run
