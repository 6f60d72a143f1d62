"""Prefect flow ``chaos`` and ``diloco-async chaos``: one fault schedule, three methods.

For a scenario file (:mod:`diloco_async.chaos`) this runs, one after the other and on the same
processes, data, token budget and seeded fault schedule:

* ``ddp``: data-parallel with ``torch.distributed`` (gloo), gradients all-reduced every step;
  any failure tears the whole group down and, once every slot is back, the group restarts from
  its last checkpoint (``torchrun`` semantics, DESIGN §8);
* ``sync-diloco``: K = M, no grace window, learners wait at every round;
* ``decoupled``: K = 1 with the adaptive grace window.

A driver thread applies the schedule to the real processes: SIGKILL of a slot's process group
at a failure and a restart after the drawn recovery delay (the learner rejoins from the store;
the synchronizer never waits for it), SIGSTOP/SIGCONT for stalls. Learners slow themselves down by
their speed factor and jitter, drop or delay control messages and see storage faults as the
scenario says. Each method's per-learner timeline (down, restarting, stalled, blocked, steps and
whether they were merged) gives compute goodput, token goodput and uptime (DESIGN §7); the held-out
loss is read at the end of the common wall time and at the scenario's token count. Each method is
one MLflow run (nested under one parent run) with its timeline PNG.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from prefect import flow, get_run_logger
from rich.console import Console
from rich.table import Table

from diloco_async.chaos import (METHODS, FaultEvent, Scenario, check_user_overrides, load_scenario, make_schedule,
                                 method_overrides)
from diloco_async.config import Config, load_config
from diloco_async.evaluation import heldout_batches, heldout_loss, model_from_checkpoint
from diloco_async.fragments import plan_fragments, specs_of
from diloco_async.learner import TIMELINE_DIR_ENV
from diloco_async.model import ByteGPT, embedding_names
from diloco_async.procs import ForkServerLauncher
from diloco_async.timeline import Interval, Step, Timeline, account, diloco_timeline_steps, read_records
from flows.timeline_report import plot_timeline
from flows.tracking import MlflowSink, flatten_params
from flows.train import TrainingRun, prepare_corpus
from storage import keys
from storage.checkpoint import list_checkpoint_seqs, load_checkpoint

__all__ = ["chaos", "run_chaos_cli", "MethodResult"]

log = logging.getLogger("diloco.flows.chaos")

#: What the fork server imports once, so that (re)starting a learner or a DDP rank costs a fork,
#: not seconds of imports on a shared CPU (every method gets the same launcher).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "diloco_async.learner", "diloco_async.server",
           "diloco_async.baselines.ddp"]

TABLE_FIELDS = ("compute_goodput", "token_goodput", "uptime", "eval_loss_equal_time", "eval_loss_equal_tokens",
                "wall_s")


@dataclass
class MethodResult:
    """What one method achieved under the scenario (one row of the table)."""

    method: str
    compute_goodput: float
    token_goodput: float
    uptime: float
    eval_loss_equal_time: float
    eval_loss_equal_tokens: Optional[float]
    wall_s: float
    availability: float
    tokens_merged: float
    failures: int
    restarts: int
    accounting: dict = field(repr=False)
    timeline_png: str = ""
    mlflow_run_id: str = ""
    #: held-out loss of each snapshot of the global model: (seconds, tokens, loss)
    curve: list[tuple[float, float, float]] = field(default_factory=list, repr=False)

    def row(self) -> dict:
        return {"method": self.method, **{k: getattr(self, k) for k in TABLE_FIELDS},
                "availability": self.availability, "tokens_merged": self.tokens_merged,
                "failures": self.failures, "restarts": self.restarts, "mlflow_run_id": self.mlflow_run_id,
                "eval_curve": [list(c) for c in self.curve]}


# ---------------------------------------------------------------- the fault driver -------------

class _Slots:
    """Bookkeeping shared by both runners: what each slot is doing and the intervals so far."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.intervals: list[Interval] = []
        self.down_since: dict[int, float] = {}
        self.stalled_since: dict[int, float] = {}
        self.launched: dict[int, list[float]] = {i: [] for i in range(n)}  # unix launch times
        self.ended: dict[int, list[float]] = {i: [] for i in range(n)}  # when the harness killed them
        self.failures = 0
        self.restarts = 0

    def open_down(self, slot: int, now: float) -> None:
        self.down_since.setdefault(slot, now)

    def close(self, kind: str, slot: int, now: float) -> None:
        since = (self.down_since if kind == "down" else self.stalled_since).pop(slot, None)
        if since is not None and now > since:
            self.intervals.append(Interval(f"slot-{slot}", kind, since, now))

    def close_all(self, now: float) -> None:
        for slot in list(self.down_since):
            self.close("down", slot, now)
        for slot in list(self.stalled_since):
            self.close("stalled", slot, now)


def _drive(events: list[FaultEvent], t_start: float, wall_s: float, on_fail: Callable[[int, float], None],
           on_recover: Callable[[int], None], on_stall: Callable[[int], None], on_cont: Callable[[int], None],
           tick: Callable[[float], None], poll_s: float = 0.05) -> None:
    """Apply the schedule in real time: events at ``t_start + t_s``; recoveries and stall ends at
    their drawn times; ``tick(now)`` between them (supervision, metrics)."""
    timers: list[tuple[float, str, int]] = []
    pending = sorted(events, key=lambda e: e.t_s)
    end = t_start + wall_s
    while True:
        now = time.time()
        if now >= end:
            return
        while pending and t_start + pending[0].t_s <= now:
            e = pending.pop(0)
            if e.kind == "fail":
                on_fail(e.slot, e.duration_s)
                timers.append((now + e.duration_s, "recover", e.slot))
            else:
                on_stall(e.slot)
                timers.append((now + e.duration_s, "cont", e.slot))
        timers.sort()
        while timers and timers[0][0] <= now:
            _, what, slot = timers.pop(0)
            (on_recover if what == "recover" else on_cont)(slot)
        tick(now)
        time.sleep(poll_s)


# ---------------------------------------------------------------- evaluation ---------------------

@dataclass
class _Snapshot:
    t: float  # unix
    tokens: float  # tokens in the global model
    load: Callable[[], ByteGPT]


def _initial_model(cfg: Config) -> ByteGPT:
    from diloco_async.synchronizer import initial_parameters

    model = ByteGPT(cfg.model)
    model.load_state_dict(initial_parameters(cfg)[0], strict=False)
    return model


def _eval_curve(snaps: list[_Snapshot], batches) -> list[tuple[float, float, float]]:
    """Held-out loss (nats/byte) of every snapshot: ``(seconds since the first, tokens, loss)``."""
    t0 = snaps[0].t
    return [(s.t - t0, s.tokens, heldout_loss(s.load(), batches)) for s in snaps]


def _eval_at(curve: list[tuple[float, float, float]], eval_tokens: int) -> tuple[float, Optional[float]]:
    """Loss of the last snapshot (equal wall time) and at ``eval_tokens`` tokens, linearly
    interpolated in tokens between the two snapshots around it (None if never reached)."""
    final = curve[-1][2]
    idx = next((i for i, c in enumerate(curve) if c[1] >= eval_tokens), None)
    if idx is None:
        return final, None
    if idx == 0 or curve[idx][1] == curve[idx - 1][1]:
        return final, curve[idx][2]
    (_, ta, la), (_, tb, lb) = curve[idx - 1], curve[idx]
    w = (eval_tokens - ta) / (tb - ta)
    return final, (1 - w) * la + w * lb


# ---------------------------------------------------------------- DiLoCo methods -----------------

def _signal_group(handle: Any, sig: int) -> None:
    try:
        os.killpg(handle.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _run_diloco(sc: Scenario, method: str, events: list[FaultEvent], sink: MlflowSink) -> tuple[Timeline, list[_Snapshot], Config, _Slots]:
    s = sc.scenario
    overrides = method_overrides(sc, method)
    cfg = load_config(s.config, overrides)
    run = TrainingRun(cfg, s.config, overrides)
    run.launcher = ForkServerLauncher(run.workdir / "logs", PRELOAD)
    tl_dir = run.workdir / "timeline"
    run.env[TIMELINE_DIR_ENV] = str(tl_dir)
    slots = _Slots(s.slots)
    incarnation = {i: 0 for i in range(s.slots)}
    killed: set[int] = set()
    try:
        run.start_synchronizer()
        t_start = time.time()
        for i in range(s.slots):
            slots.launched[i].append(time.time())
            run.start_learner(i, 0)

        def on_fail(slot: int, _d: float) -> None:
            slots.failures += 1
            now = time.time()
            if slot in slots.stalled_since:
                _signal_group(run.learners[f"learner-{slot}"], signal.SIGCONT)
                slots.close("stalled", slot, now)
            run.learners[f"learner-{slot}"].kill()
            slots.ended[slot].append(now)
            killed.add(slot)
            slots.open_down(slot, now)

        def on_recover(slot: int) -> None:
            slots.close("down", slot, time.time())
            incarnation[slot] += 1
            slots.restarts += 1
            slots.launched[slot].append(time.time())
            run.start_learner(slot, incarnation[slot])
            killed.discard(slot)

        def on_stall(slot: int) -> None:
            if slot in killed:
                return
            _signal_group(run.learners[f"learner-{slot}"], signal.SIGSTOP)
            slots.stalled_since[slot] = time.time()

        def on_cont(slot: int) -> None:
            if slot in slots.stalled_since:
                _signal_group(run.learners[f"learner-{slot}"], signal.SIGCONT)
                slots.close("stalled", slot, time.time())

        last_pull = [0.0]

        def tick(now: float) -> None:
            if run.sync is not None and run.sync.poll() is not None:
                raise RuntimeError(f"synchronizer exited early (code {run.sync.poll()}); log {run.sync.log_path}")
            for i in range(s.slots):
                h = run.learners.get(f"learner-{i}")
                if i not in killed and h is not None and h.poll() is not None:
                    # died on its own: supervision restarts it at once
                    log.warning("learner-%d exited with %s; restarting", i, h.poll())
                    on_recover(i)
            if now - last_pull[0] > 2.0:
                last_pull[0] = now
                sink.log_points(run.pull_metrics())

        _drive(events, t_start, s.wall_s, on_fail, on_recover, on_stall, on_cont, tick)
        t_end = time.time()
        for slot in list(slots.stalled_since):
            on_cont(slot)
        slots.close_all(t_end)
        _signal_group(run.sync, signal.SIGTERM)  # clean stop: open rounds, final checkpoint, summary
        run.sync.wait(timeout=180)
        sink.log_points(run.pull_metrics())
    finally:
        run.stop_all()
    # -- timeline --
    epoch = str(run.epoch)
    merges = [json.loads(x) for x in run.store.get_unverified(keys.merge_log_key(run.run_id, epoch)).decode().splitlines()
              if x.strip()]
    merged_ids = {u for m in merges for u in m["update_ids"]}
    model = ByteGPT(cfg.model)
    plan = plan_fragments(specs_of({n: p.detach() for n, p in model.named_parameters()}),
                          cfg.synchronizer.num_fragments, embedding_names(model))
    shares = [plan.numel_fraction(p) for p in range(plan.num_fragments)]
    tl = Timeline(learners=[f"slot-{i}" for i in range(s.slots)], start_s=t_start, end_s=t_end,
                  intervals=list(slots.intervals), merges_s=[m["t"] for m in merges])
    for i in range(s.slots):
        recs = read_records(tl_dir / f"learner-{i}.jsonl")
        tl.steps += diloco_timeline_steps(f"slot-{i}", recs, merged_ids, shares)
        tl.intervals += _restarting_intervals(f"slot-{i}", slots.launched[i], recs, slots.ended[i], t_end)
        tl.intervals += [Interval(f"slot-{i}", "blocked", r["t0"], r["t1"]) for r in recs if r["kind"] == "blocked"]
    # -- snapshots: the synchronizer's checkpoints (tokens merged so far) --
    snaps = []
    for seq in list_checkpoint_seqs(run.store, run.run_id):
        ck = load_checkpoint(run.store, run.run_id, seq)
        tokens = sum(float(led["tokens_merged"]) for led in ck.manifest["ledgers"].values())
        snaps.append(_Snapshot(t_start + float(ck.manifest["wall_s"]), tokens,
                               lambda ck=ck: model_from_checkpoint(cfg, ck)))
    return tl, snaps, cfg, slots


def _restarting_intervals(lid: str, launches: list[float], recs: list[dict], ends: list[float],
                          t_end: float) -> list[Interval]:
    """From each launch of a slot's process to its ``ready`` record (or to its kill)."""
    readies = sorted(float(r["t"]) for r in recs if r["kind"] == "ready")
    out = []
    for t0 in launches:
        ready = next((t for t in readies if t >= t0 - 1e-3), None)
        death = next((t for t in sorted(ends) if t > t0), t_end)
        t1 = min(x for x in (ready, death, t_end) if x is not None)
        if t1 > t0:
            out.append(Interval(lid, "restarting", t0, t1))
    return out


# ---------------------------------------------------------------- DDP baseline -------------------

def _run_ddp(sc: Scenario, events: list[FaultEvent], sink: MlflowSink) -> tuple[Timeline, list[_Snapshot], Config, _Slots]:
    from diloco_async.baselines.ddp import ddp_checkpoints, load_ddp_model
    from diloco_async.baselines.ddp_group import DdpGroup
    from storage.store import ObjectStore
    from diloco_async.synchronizer import new_run_id

    s = sc.scenario
    overrides = method_overrides(sc, "ddp")
    cfg = load_config(s.config, overrides)
    run_id = new_run_id()
    workdir = Path(cfg.run.workdir).resolve() / run_id
    store = ObjectStore(cfg.run.store, cfg.run.storage_options)
    group = DdpGroup(config=s.config, overrides=overrides, world_size=s.slots, run_id=run_id, store=store.url,
                     workdir=workdir, speeds=sc.speed_factors(), jitter=sc.stragglers.jitter,
                     checkpoint_every_steps=sc.ddp.checkpoint_every_steps,
                     storage_options=cfg.run.storage_options)
    group.launcher = ForkServerLauncher(workdir / "logs", PRELOAD)
    slots = _Slots(s.slots)
    state = {"running": False, "incarnation": 0}
    up_at = {i: 0.0 for i in range(s.slots)}
    blocked_since: dict[int, float] = {}

    def launch(now: float) -> None:
        for i in range(s.slots):
            if i in blocked_since:
                t0 = blocked_since.pop(i)
                if now > t0:
                    slots.intervals.append(Interval(f"slot-{i}", "blocked", t0, now))
            slots.launched[i].append(now)
        group.start(state["incarnation"])
        state["running"] = True

    def tear_down(now: float, except_slot: Optional[int]) -> None:
        group.kill_all()
        state["running"] = False
        state["incarnation"] += 1
        for i in range(s.slots):
            slots.ended[i].append(now)
            if i in slots.stalled_since:
                slots.close("stalled", i, now)
            if i != except_slot and i not in slots.down_since:
                blocked_since.setdefault(i, now)  # waiting for the group to come back

    try:
        t_start = time.time()
        launch(t_start)

        def on_fail(slot: int, d: float) -> None:
            now = time.time()
            slots.failures += 1
            up_at[slot] = max(up_at[slot], now + d)
            blocked_since.pop(slot, None)
            if slot in slots.stalled_since:
                group.cont_rank(slot)
            slots.open_down(slot, now)
            if state["running"]:
                tear_down(now, slot)

        def on_recover(slot: int) -> None:
            now = time.time()
            slots.close("down", slot, now)
            if slots.down_since:
                blocked_since.setdefault(slot, now)  # up again, waiting for the slots still down
            elif not state["running"]:
                slots.restarts += 1
                launch(now)  # every slot is back: the whole group restarts from its checkpoint

        def on_stall(slot: int) -> None:
            if state["running"] and slot not in slots.down_since:
                group.stop_rank(slot)
                slots.stalled_since[slot] = time.time()

        def on_cont(slot: int) -> None:
            if slot in slots.stalled_since:
                group.cont_rank(slot)
                slots.close("stalled", slot, time.time())

        def tick(now: float) -> None:
            if state["running"]:
                codes = group.poll()
                if any(c is not None for c in codes.values()):
                    # a rank died on its own (e.g. a gloo timeout): torchrun restarts the group
                    log.warning("DDP rank exited %s; restarting the group", codes)
                    for slot in list(slots.stalled_since):
                        group.cont_rank(slot)
                    tear_down(now, None)
            if not state["running"] and not slots.down_since:
                slots.restarts += 1
                launch(now)

        _drive(events, t_start, s.wall_s, on_fail, on_recover, on_stall, on_cont, tick)
        t_end = time.time()
        for slot in list(slots.stalled_since):
            on_cont(slot)
        slots.close_all(t_end)
        for i, t0 in list(blocked_since.items()):
            if t_end > t0:
                slots.intervals.append(Interval(f"slot-{i}", "blocked", t0, t_end))
        if state["running"]:
            group.terminate_all(grace_s=120.0)  # ranks agree on a last step and checkpoint it
    finally:
        group.kill_all()
    # -- timeline: a step survives if the next incarnation resumed from a checkpoint at or after it
    steps: list[Step] = []
    ckpts = ddp_checkpoints(store, run_id)
    final_step = max((c.step for c in ckpts), default=0)
    for i in range(s.slots):
        recs = read_records(workdir / "timeline" / f"ddp-rank-{i}.jsonl")
        by_inc: dict[int, list[dict]] = {}
        readies: dict[int, int] = {}
        inc = -1
        for r in recs:
            inc = int(r.get("incarnation", inc))
            if r["kind"] == "ready":
                readies[inc] = int(r["step"])
            elif r["kind"] == "step":
                by_inc.setdefault(inc, []).append(r)
        incs = sorted(by_inc)
        for k in incs:
            later = [readies[x] for x in sorted(readies) if x > k]
            survived_to = later[0] if later else final_step
            for r in by_inc[k]:
                useful = 1.0 if int(r["step"]) <= survived_to else 0.0
                steps.append(Step(f"slot-{i}", float(r["t0"]), float(r["t1"]), int(r["tokens"]), useful,
                                  float(r.get("wait_s", 0.0))))
        slots.intervals += _restarting_intervals(f"slot-{i}", slots.launched[i], recs, slots.ended[i], t_end)
    # the global model "advances" when a step survives; merges are the surviving steps of rank 0
    merges = sorted(st.t1 for st in steps if st.learner == "slot-0" and st.useful > 0)
    tl = Timeline(learners=[f"slot-{i}" for i in range(s.slots)], start_s=t_start, end_s=t_end,
                  intervals=list(slots.intervals), steps=steps, merges_s=merges)
    snaps = [_Snapshot(c.wall_unix, float(c.tokens_committed), lambda c=c: load_ddp_model(cfg, store, c))
             for c in ckpts]
    return tl, snaps, cfg, slots


# ---------------------------------------------------------------- the flow -----------------------

def _run_method(sc: Scenario, method: str, events: list[FaultEvent], parent: MlflowSink, outdir: Path,
                batches) -> MethodResult:
    s = sc.scenario
    cfg0 = load_config(s.config, method_overrides(sc, method))
    sink = MlflowSink(cfg0.tracking)
    sink.start(f"chaos-{s.name}-{method}", flatten_params({"scenario": sc.model_dump(), "method": method}),
               {"mlflow.parentRunId": parent.run_id or "", "diloco.chaos.scenario": s.name,
                "diloco.chaos.method": method})
    status = "FAILED"
    try:
        if method == "ddp":
            tl, snaps, cfg, slots = _run_ddp(sc, events, sink)
        else:
            tl, snaps, cfg, slots = _run_diloco(sc, method, events, sink)
        # Goodput is measured from the moment every slot's first process was up (or had failed):
        # the initial start-up is the same for every method and not part of the comparison;
        # every restart after a failure is.
        first_up = [min((iv for iv in tl.intervals if iv.learner == lid and iv.state == "restarting"),
                        key=lambda iv: iv.t0, default=None) for lid in tl.learners]
        launched_s = tl.start_s
        tl.start_s = min(tl.end_s, max([tl.start_s] + [iv.t1 for iv in first_up if iv is not None]))
        step_s = [st.t1 - st.t0 for st in tl.steps]
        typical = sorted(step_s)[len(step_s) // 2] if step_s else 1.0
        max_gap = max(5.0, 4 * typical * cfg.synchronizer.sync_every / max(1, cfg.synchronizer.num_fragments))
        acc = account(tl, max_gap)
        snaps = [_Snapshot(tl.start_s, 0.0, lambda: _initial_model(cfg))] + snaps  # Θ^0, the same for all
        curve = _eval_curve(snaps, batches)
        eq_time, eq_tokens = _eval_at(curve, s.eval_tokens)
        now_ms = int(time.time() * 1000)  # the loss curve in tokens, one point per snapshot
        sink.log_points([{"key": "chaos/eval_loss_by_tokens", "value": loss, "step": int(tokens),
                          "timestamp_ms": now_ms} for _, tokens, loss in curve])
        png = outdir / f"timeline-{method}.png"
        shown = Timeline(tl.learners, launched_s, tl.end_s, tl.intervals, tl.steps, tl.merges_s)
        plot_timeline(shown, png, mark_s=tl.start_s,
                      title=f"{s.name}: {method} (compute goodput {acc.compute_goodput:.3f} from the dashed line)")
        res = MethodResult(method=method, compute_goodput=acc.compute_goodput, token_goodput=acc.token_goodput,
                           uptime=acc.uptime, eval_loss_equal_time=eq_time, eval_loss_equal_tokens=eq_tokens,
                           wall_s=acc.wall_s, availability=acc.availability, tokens_merged=acc.to_json()["tokens_merged"],
                           failures=slots.failures, restarts=slots.restarts, accounting=acc.to_json(),
                           timeline_png=str(png), mlflow_run_id=sink.run_id or "", curve=curve)
        for key, value in res.row().items():
            if isinstance(value, (int, float)) and value is not None and math.isfinite(value):
                sink.log_metric(f"chaos/{key}", float(value))
        for lid, a in acc.learners.items():
            sink.log_metric(f"chaos/{lid}/compute_goodput", a.compute_goodput)
        sink.log_artifact(png)
        sink.log_dict(acc.to_json(), "goodput_accounting.json")
        sink.log_dict({"timeline": {"start_s": tl.start_s, "end_s": tl.end_s, "merges_s": tl.merges_s,
                                    "intervals": [iv.__dict__ for iv in tl.intervals]}}, "timeline.json")
        status = "FINISHED"
        return res
    finally:
        sink.end(status)


def _table(name: str, rows: list[dict], availability: float) -> Table:
    t = Table(title=f"chaos scenario {name}: mean slot availability {availability:.3f}")
    for col in ("method", "compute goodput", "token goodput", "uptime", "eval loss @ equal time",
                "eval loss @ equal tokens", "wall s", "failures"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        eqt = "not reached" if r["eval_loss_equal_tokens"] is None else f"{r['eval_loss_equal_tokens']:.4f}"
        t.add_row(r["method"], f"{r['compute_goodput']:.3f}", f"{r['token_goodput']:.3f}", f"{r['uptime']:.3f}",
                  f"{r['eval_loss_equal_time']:.4f}", eqt, f"{r['wall_s']:.1f}", str(r["failures"]))
    return t


@flow(name="chaos", log_prints=True)
def chaos(scenario: str = "configs/chaos/storm-ci.toml", methods: Optional[list[str]] = None,
          overrides: Optional[list[str]] = None, log_table: bool = True) -> list[dict]:
    """Run every method of a chaos scenario under its fault schedule; return the table rows.

    Args:
        scenario: path of a scenario TOML (``configs/chaos/``).
        methods: a subset of ``ddp``, ``sync-diloco``, ``decoupled`` (default: the scenario's).
        overrides: ``section.field=value`` applied to every method's recipe after the scenario's
            own (e.g. where the store, process logs and MLflow runs go).
        log_table: also write the table to the flow run's log (the CLI prints it itself).

    Returns:
        One dict per method: ``method``, ``compute_goodput``, ``token_goodput``, ``uptime``,
        ``eval_loss_equal_time``, ``eval_loss_equal_tokens`` (None when the method never had
        that many tokens in its model), ``wall_s``, plus ``availability``, ``tokens_merged``,
        ``failures``, ``restarts`` and ``mlflow_run_id``.

    Raises:
        ValueError: a bad scenario file or an unknown method.
    """
    logger = get_run_logger()
    sc = load_scenario(scenario)
    check_user_overrides(sc, list(overrides or []))
    if overrides:
        sc = sc.model_copy(update={"scenario": sc.scenario.model_copy(
            update={"overrides": [*sc.scenario.overrides, *overrides]})})
    chosen = list(methods or sc.scenario.methods)
    for m in chosen:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; known: {', '.join(METHODS)}")
    schedule = make_schedule(sc)
    cfg = load_config(sc.scenario.config, method_overrides(sc, "decoupled"))
    prepare_corpus(cfg)
    batches = heldout_batches(cfg)
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the fork server and every process forked from it
    parent = MlflowSink(cfg.tracking)
    parent.start(f"chaos-{sc.scenario.name}", flatten_params({"scenario": sc.model_dump()}),
                 {"diloco.chaos.scenario": sc.scenario.name})
    outdir = Path(cfg.run.workdir).resolve() / f"chaos-{sc.scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    outdir.mkdir(parents=True, exist_ok=True)
    logger.info("scenario %s: %d slots, %.0f s per method, %d fault events, planned availability %.3f",
                sc.scenario.name, sc.scenario.slots, sc.scenario.wall_s, len(schedule.events), schedule.availability())
    status = "FAILED"
    rows: list[dict] = []
    try:
        for m in chosen:
            logger.info("method %s: starting", m)
            res = _run_method(sc, m, list(schedule.events), parent, outdir, batches)
            rows.append(res.row())
            parent.log_artifact(res.timeline_png)
            logger.info("method %s: compute goodput %.3f, token goodput %.3f, eval loss %.4f", m,
                        res.compute_goodput, res.token_goodput, res.eval_loss_equal_time)
        parent.log_dict(rows, "chaos_table.json")
        (outdir / "chaos_table.json").write_text(json.dumps(rows, indent=1))
        status = "FINISHED"
    finally:
        parent.end(status)
    if log_table:
        console = Console(width=140, record=True, file=open(os.devnull, "w"))
        console.print(_table(sc.scenario.name, rows, schedule.availability()))
        logger.info("\n%s", console.export_text())
    return rows


def run_chaos_cli(scenario: str, methods: Optional[list[str]], as_json: bool,
                  overrides: Optional[list[str]] = None, out: Optional[str] = None) -> int:
    """Entry of ``diloco-async chaos``; ``out``: also write the full rows (with ``availability``,
    ``tokens_merged``, ``failures`` and ``eval_curve``) there as JSON."""
    try:
        rows = chaos(scenario=scenario, methods=methods, overrides=list(overrides or []), log_table=False)
    except Exception as err:
        print(f"chaos run failed: {err}", file=sys.stderr)
        return 1
    sc = load_scenario(scenario)
    availability = make_schedule(sc).availability()
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"scenario": sc.scenario.name, "availability": availability,
                                         "eval_tokens": sc.scenario.eval_tokens, "rows": rows}, indent=1))
    Console(file=sys.stderr if as_json else sys.stdout, width=None if sys.stdout.isatty() else 140).print(
        _table(sc.scenario.name, rows, availability))
    if as_json:
        keys_ = ("method",) + TABLE_FIELDS
        print(json.dumps([{k: r[k] for k in keys_} for r in rows]))
    return 0
