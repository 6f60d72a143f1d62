"""Learning-rate schedules and gradient accumulation (issue 44 item 5): the schedules' values at
known points, bad schedules refused at load naming the values, gradient accumulation equal to one
large batch, the run's tokens in join and heartbeat answers (the highest of the shards'), and the
outer schedule continued across a synchronizer checkpoint and resume."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import uuid

import pytest
import torch

from diloco_async.config.schema import Config, _training_dict, config_hash, load_config
from diloco_async.inner.workload import Workload, accumulated_step, inner_step
from diloco_async.learner.sharded_client import ShardedSyncClient
from diloco_async.models.transformer import ByteGPT
from diloco_async.policy.schedules import (
    InnerSchedule,
    OuterSchedule,
    cosine_multiplier,
    linear_warmup_multiplier,
    progress,
    told_tokens,
    warmup_lr,
    wsd_multiplier,
)
from diloco_async.protocol.messages import Announcement, Heartbeat, JoinRequest
from diloco_async.storage.checkpoint import latest_checkpoint, write_checkpoint
from diloco_async.storage.store import ObjectStore
from diloco_async.sync import Synchronizer, persistence
from diloco_async.sync.state import Contribution
from diloco_async.sync.work import merge_and_publish

TINY = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8"]

# ------------------------------------------------------------------ the schedules' values -----


def test_cosine_wsd_and_warmup_at_known_points():
    assert cosine_multiplier(0.0, 0.1) == 1.0
    assert cosine_multiplier(0.5, 0.1) == pytest.approx(0.55)
    assert cosine_multiplier(1.0, 0.1) == pytest.approx(0.1)
    assert cosine_multiplier(0.25, 0.0) == pytest.approx((1 + math.cos(math.pi / 4)) / 2)  # 0.853553
    assert cosine_multiplier(3.0, 0.1) == pytest.approx(0.1)  # past the budget: the final value
    # wsd, decay over the last 20%, to 10%
    assert wsd_multiplier(0.0, 0.2, 0.1) == 1.0 and wsd_multiplier(0.8, 0.2, 0.1) == 1.0
    assert wsd_multiplier(0.9, 0.2, 0.1) == pytest.approx(0.55)
    assert wsd_multiplier(1.0, 0.2, 0.1) == pytest.approx(0.1)
    assert wsd_multiplier(0.5, 1.0, 0.0) == pytest.approx(0.5)  # all decay: linear from the start
    assert linear_warmup_multiplier(0.05, 0.1) == pytest.approx(0.5) and linear_warmup_multiplier(0.2, 0.1) == 1.0
    assert progress(250, 1000) == 0.25 and progress(2000, 1000) == 1.0 and progress(5, None) == 0.0
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="run tokens must be finite"):
            progress(bad, 1000)
    assert told_tokens(123_456, 1_000_000) == 123_000 and told_tokens(999, 1_000_000) == 0  # 0.1% steps
    assert told_tokens(17, 500) == 17 and told_tokens(5_000, None) == 0
    with pytest.raises(ValueError, match="decay fraction must be in"):
        wsd_multiplier(0.5, 0.0, 0.1)


def test_the_inner_schedule_is_the_warmup_times_the_shape_at_the_runs_tokens():
    constant = InnerSchedule("constant", 3e-3, 20, budget_tokens=1000)
    for step in (0, 5, 19, 20, 500):
        for merged in (0.0, 400.0, 5000.0):  # constant: the warm-up alone, whatever the progress
            assert constant.lr(step, merged) == warmup_lr(3e-3, step, 20)
    cosine = InnerSchedule("cosine", 3e-3, 20, budget_tokens=1000, final_fraction=0.1)
    assert cosine.lr(100, 0.0) == pytest.approx(3e-3)
    assert cosine.lr(100, 500.0) == pytest.approx(3e-3 * 0.55)  # half the budget merged
    assert cosine.lr(100, 1000.0) == pytest.approx(3e-4)
    assert cosine.lr(4, 500.0) == pytest.approx(3e-3 * 5 / 20 * 0.55)  # still warming up
    wsd = InnerSchedule("wsd", 1.0, 0, budget_tokens=1000, decay_fraction=0.2, final_fraction=0.0)
    assert [wsd.lr(50, t) for t in (0, 700, 800, 900, 1000)] == pytest.approx([1, 1, 1, 0.5, 0])


def test_the_outer_schedule_of_a_fragment():
    assert OuterSchedule("constant", 0.7, 1000).lr(123.0) == 0.7
    warm = OuterSchedule("linear_warmup", 0.7, 1000, warmup_fraction=0.1)
    assert warm.lr(50.0) == pytest.approx(0.35) and warm.lr(100.0) == pytest.approx(0.7) and warm.lr(900.0) == 0.7
    cos = OuterSchedule("cosine", 0.7, 1000, final_fraction=0.1)
    assert cos.lr(0.0) == pytest.approx(0.7) and cos.lr(500.0) == pytest.approx(0.7 * 0.55)
    assert OuterSchedule("cosine", 0.7, 1000, final_fraction=0.0).lr(1000.0) > 0  # the optimizer takes eta > 0


# ------------------------------------------------------------------ bad input ---------------


@pytest.mark.parametrize(("overrides", "message"), [
    (["learners.grad_accum_steps=0"], r"learners\.grad_accum_steps = 0: at least 1 micro-batch"),
    (["learners.grad_accum_steps=-3"], r"learners\.grad_accum_steps = -3"),
    (['learners.lr_schedule="wsd"', "learners.lr_decay_fraction=1.5"], r"learners\.lr_decay_fraction: .*\(got 1\.5\)"),
    (["learners.lr_decay_fraction=0"], r"learners\.lr_decay_fraction: .*greater than 0 \(got 0\)"),
    (["synchronizer.outer_lr_warmup_fraction=0"], r"synchronizer\.outer_lr_warmup_fraction: .*\(got 0\)"),
    (['learners.lr_schedule="cosine"', "learners.warmup_steps=20", "budget.tokens=10000"],
     r"learners\.warmup_steps = 20 is longer than the learning-rate schedule: 81920 tokens of warm-up .*"
     r"budget\.tokens = 10000"),
    (['learners.lr_schedule="wsd"', "learners.lr_decay_fraction=0.9", "budget.tokens=200000"],
     r"learners\.warmup_steps = 20 .* decay at \(1 - learners\.lr_decay_fraction = 0\.9\)"),
    (['learners.lr_schedule="linear"'], r"learners\.lr_schedule: .*'linear'"),
    (['synchronizer.outer_lr_schedule="step"'], r"synchronizer\.outer_lr_schedule: .*'step'"),
])
def test_a_bad_schedule_is_refused_at_load_naming_the_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config("configs/default.toml", overrides)


@pytest.mark.parametrize("key", ["learners.lr_schedule=cosine", "synchronizer.outer_lr_schedule=linear_warmup"])
def test_a_schedule_without_a_token_budget_is_refused(key):
    section, rest = key.split(".")
    field, value = rest.split("=")
    with pytest.raises(ValueError, match=rf"{key.split('=')[0]} = '{value}' follows the run's token budget, but "
                                         r"budget\.tokens is not set \(budget\.max_steps = None, budget\.wall_s = 60"):
        Config.model_validate({section: {field: value}, "budget": {"wall_s": 60}})
    assert Config.model_validate({"budget": {"wall_s": 60}}).learners.lr_schedule == "constant"  # constant needs none


def test_the_schedule_keys_at_their_defaults_hash_as_before_they_existed():
    """A checkpoint written before the schedules has a hash of a config without these keys: the
    default config must hash to that, or no old run could resume."""
    cfg = load_config("configs/default.toml")
    old = cfg.public_dict()
    for k in ("lr_schedule", "lr_decay_fraction", "lr_final_fraction", "grad_accum_steps"):
        del old["learners"][k]
    for k in ("outer_lr_schedule", "outer_lr_warmup_fraction", "outer_lr_final_fraction"):
        del old["synchronizer"][k]
    old_hash = hashlib.sha256(json.dumps(_training_dict(old), sort_keys=True, separators=(",", ":")).encode())
    assert config_hash(cfg) == old_hash.hexdigest()
    assert config_hash(load_config("configs/default.toml", ['learners.lr_schedule="cosine"'])) != config_hash(cfg)
    assert config_hash(load_config("configs/default.toml", ["learners.grad_accum_steps=2"])) != config_hash(cfg)


# ------------------------------------------------------------------ gradient accumulation ----


def _tiny() -> tuple[ByteGPT, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = ByteGPT(load_config(None, TINY).model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def test_accumulated_micro_batches_give_the_gradients_of_one_large_batch():
    batch = torch.randint(0, 256, (8, 9), generator=torch.Generator().manual_seed(3))
    x, y = batch[:, :-1], batch[:, 1:]
    big, opt_big = _tiny()
    acc, opt_acc = _tiny()
    loss_big = inner_step(big, opt_big, x, y, lr=1e-3, grad_clip=1e9)
    micro = [(x[i:i + 2], y[i:i + 2]) for i in range(0, 8, 2)]  # 4 micro-batches of 2 windows
    loss_acc = accumulated_step(acc, opt_acc, micro, lr=1e-3, grad_clip=1e9)
    assert loss_acc.item() == pytest.approx(loss_big.item(), rel=1e-6)
    for (name, a), b in zip(acc.named_parameters(), big.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), name  # and so the same AdamW step
    assert any(not torch.equal(a.grad, b.grad) for a, b in zip(acc.parameters(), big.parameters(), strict=True)), \
        "four backward passes in another order: equal within rounding, not bit for bit"


def test_accumulation_skips_the_all_reduce_of_every_micro_batch_but_the_last():
    model, opt = _tiny()
    batch = torch.randint(0, 256, (6, 9), generator=torch.Generator().manual_seed(4))
    micro = [(batch[i:i + 2, :-1], batch[i:i + 2, 1:]) for i in range(0, 6, 2)]
    quiet, hooks = [], []

    @contextlib.contextmanager
    def no_sync():
        quiet.append(len(hooks))
        yield

    accumulated_step(model, opt, micro, lr=1e-3, grad_clip=1.0, no_sync=no_sync, after_backward=lambda: hooks.append(1))
    assert quiet == [0, 0] and hooks == [1]  # micro-batches 1 and 2 under no_sync, the hook once after the third
    with pytest.raises(ValueError, match="at least one micro-batch"):
        accumulated_step(model, opt, [], lr=1e-3, grad_clip=1.0)


def test_a_workload_with_accumulation_counts_and_trains_on_every_micro_batch():
    cfg = load_config(None, [*TINY, "learners.batch_size=2", "learners.grad_accum_steps=3", "learners.warmup_steps=0"])
    w = Workload.from_config(cfg, index=0, incarnation=0)
    one = Workload.from_config(load_config(None, [*TINY, "learners.batch_size=6", "learners.warmup_steps=0"]), 0, 0)
    assert w.tokens_per_step == 3 * 2 * 8 == one.tokens_per_step
    shard = torch.arange(300, dtype=torch.uint8)
    w.shard, one.shard = shard, shard
    drawn = []
    sample = Workload.step.__globals__["Corpus"].sample

    def spy(data, n, context, gen):
        drawn.append(n)
        return sample(data, n, context, gen)

    Workload.step.__globals__["Corpus"].sample = spy
    try:
        w.step(0)
        one.step(0)
    finally:
        Workload.step.__globals__["Corpus"].sample = sample
    assert drawn == [2, 2, 2, 6]  # three micro-batches of batch_size windows, against one batch of 6


# ------------------------------------------------------------------ the run's tokens ---------


class _Run:
    """A synchronizer on a fake clock, driven as the actor's handlers and round table drive it."""

    def __init__(self, store: ObjectStore, *overrides: str) -> None:
        cfg = load_config(None, [*TINY, "synchronizer.num_fragments=2", "budget.tokens=4000", *overrides])
        self.now = [0.0]
        self.sync = Synchronizer(cfg, store, "run1", clock=lambda: self.now[0])
        self.tokens = {"a": 0, "b": 0}

    def beat(self, lid: str, tokens: int):
        """``tokens`` more tokens processed by ``lid``, heard 10 s later (within every pace bound)."""
        self.now[0] += 10.0
        self.tokens[lid] += tokens
        return self.sync._on_heartbeat(Heartbeat(learner_id=lid, step=self.tokens[lid] // 64,
                                                 tokens_total=self.tokens[lid], uptime_s=self.now[0]))

    def merge(self, p: int, seed: int) -> float:
        """One round of fragment ``p`` by a and b, merged as the round table does it (its outer lr
        set first); returns η."""
        sync, f = self.sync, self.sync.book[p]
        n, contribs = f.next_round, []
        for i, lid in enumerate("ab"):
            g = torch.Generator().manual_seed(seed * 10 + i)
            ann = Announcement(learner_id=lid, fragment=p, round_n=n, base_version=f.version, c_steps=4,
                               c_tokens=256, compute_s=1.0, key=f"k/{lid}/{n}", nbytes=1, sha256="0" * 64,
                               codec="fp32", update_id=f"u-{lid}-{p}-{n}")
            contribs.append(Contribution(ann, {m: torch.randn(s, generator=g) * 1e-2 for m, s in f.shapes.items()}))
        sync.book.begin_round(f, n)
        lr = sync.book.set_outer_lr(f, sync.table.outer_schedule, sync.registry.tokens_processed())
        res = merge_and_publish(sync.ctx.store, sync.ctx.run_id, f, n, contribs, sync.ctx.sc.merge)
        assert res.ok, res.reason
        sync.book.adopt(f, res, sync.ctx.sc.max_staleness)
        sync.book.end_round(f)
        return lr


def test_join_and_heartbeat_answers_carry_the_runs_tokens():
    run = _Run(ObjectStore(f"memory://sched-{uuid.uuid4().hex}"))
    sync = run.sync
    try:
        sync.publish_initial()
        assert sync._on_join(JoinRequest(learner_id="a", uptime_s=1.0)).run_tokens == 0.0
        sync._on_join(JoinRequest(learner_id="b", uptime_s=1.0))
        for _ in range(3):
            run.beat("a", 300)
            reply = run.beat("b", 217)
        assert sync.registry.tokens_processed() == 1551
        assert reply.run_tokens == 1548  # rounded down to 0.1% of the 4000-token budget: steps of 4
        assert sync._on_join(JoinRequest(learner_id="c", uptime_s=1.0)).run_tokens == 1548  # a late joiner
    finally:
        sync.close()


class _Shard:
    def __init__(self, i: int, told: list[float]) -> None:
        self.i, self.told, self.down = i, told, False

    async def join(self, body: dict) -> dict:
        return {"shard": self.i, "shards": 2, "schema_hash": "s", "run_id": "r", "versions": [], "epoch": f"e{self.i}",
                "start_step": 0, "run_tokens": self.told[self.i]}

    async def heartbeat(self, body: dict) -> dict:
        if self.down:
            raise ConnectionError("shard down")
        return {"open_rounds": [], "versions": [], "epoch": f"e{self.i}", "run_tokens": self.told[self.i]}


def test_a_sharded_learner_takes_the_highest_run_tokens_of_its_shards():
    """Every shard hears every heartbeat, so each counts the whole run; one that heard a
    heartbeat fewer (or restarted from a checkpoint) lags, and the learner takes the highest."""
    told = [100.0, 140.0]
    client = ShardedSyncClient(["http://a", "http://b"], None)
    client.clients = [_Shard(0, told), _Shard(1, told)]
    assert asyncio.run(client.join({}))["run_tokens"] == 140.0
    told[:] = [300.0, 290.0]
    assert asyncio.run(client.heartbeat({}))["run_tokens"] == 300.0
    client.clients[0].down, told[1] = True, 320.0
    assert asyncio.run(client.heartbeat({}))["run_tokens"] == 320.0
    told[1] = 200.0  # shard 1 restarted from an older checkpoint: shard 0 as it last answered is higher
    assert asyncio.run(client.heartbeat({}))["run_tokens"] == 300.0


# ------------------------------------------------------------------ the outer schedule resumes


def test_a_resume_mid_schedule_gives_the_outer_lr_and_values_of_an_uninterrupted_run():
    """Four merges of fragment 0 under the cosine outer schedule, 1000 tokens processed before each,
    against two, a checkpoint, a resume in a new synchronizer, and two more: the same η at every
    step and the same values, bit for bit."""
    schedule = ('synchronizer.outer_lr_schedule="cosine"', "synchronizer.outer_lr_final_fraction=0.0")

    def run(interrupt: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        store = ObjectStore(f"memory://outer-{uuid.uuid4().hex}")
        r = _Run(store, *schedule)
        r.sync.publish_initial()
        for lid in "ab":
            r.sync._on_join(JoinRequest(learner_id=lid, uptime_s=1.0))
        lrs = []
        for k in range(4):
            if interrupt and k == 2:  # a checkpoint, the process gone, a new one resumed from it
                s = r.sync
                tensors, manifest = persistence.checkpoint_payload(s.ctx, book=s.book, table=s.table,
                                                                   registry=s.registry, report=s.report)
                write_checkpoint(store, "run1", 1, tensors, manifest)
                s.close()
                tokens, now = r.tokens, r.now[0]
                r = _Run(store, *schedule)
                r.tokens, r.now[0] = tokens, now
                r.sync.restore(latest_checkpoint(store, "run1"))
            r.beat("a", 500)
            r.beat("b", 500)
            lrs.append(r.merge(0, seed=k))
        values = {n: t.clone() for n, t in r.sync.book[0].current.items()}
        r.sync.close()
        return lrs, values

    straight, straight_values = run(False)
    resumed, resumed_values = run(True)
    # progress 0.25, 0.5, 0.75 and 1 of the 4000-token budget at the four merges
    assert straight == pytest.approx([0.7 * (1 + math.cos(math.pi * k / 4)) / 2 for k in (1, 2, 3)] + [0.7e-6])
    assert resumed == straight
    assert all(torch.equal(resumed_values[n], straight_values[n]) for n in straight_values)
