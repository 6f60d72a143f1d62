"""The data-parallel baseline: pure helpers, and real rank processes (gloo on loopback, tiny model)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch

from diloco_async.baselines.ddp import EXIT_PEER_LOST, rank_jitter, rank_speed, tokens_per_step
from diloco_async.baselines.ddp_checkpoints import (
    DdpCheckpointInfo,
    checkpoint_prefix,
    ddp_checkpoints,
    load_ddp_model,
    load_ddp_params,
    load_final_ddp_model,
    param_sha256,
    select_checkpoint,
)
from diloco_async.baselines.ddp_group import DdpGroup, RankSchedule
from diloco_async.config.resolved import read_resolved
from diloco_async.config.schema import load_config
from diloco_async.inner.optimizers import muon_parameter_names
from diloco_async.inner.workload import data_generator, emulated_delay_s, jitter_random
from diloco_async.models.transformer import evaluate_loss
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_state
from diloco_async.storage.store import ObjectStore
from diloco_async.sync import initial_parameters

from polling import wait_until

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context=32", "learners.batch_size=4",
        "learners.count=2", f"data.cache_dir=\"{Path('data').resolve()}\""]
TOKENS_PER_RANK_STEP = 4 * 32


# ------------------------------------------------------------------ pure helpers -------------

def test_emulated_delay():
    rng = random.Random(1)
    assert emulated_delay_s(0.2, 1.0, 0.0, rng) == 0.0
    assert emulated_delay_s(0.2, 0.5, 0.0, rng) == pytest.approx(0.2)  # half speed: the step takes twice as long
    assert emulated_delay_s(0.2, 0.25, 0.0, rng) == pytest.approx(0.6)
    assert emulated_delay_s(0.2, 2.0, 0.0, rng) == 0.0  # never faster than the real compute
    a, b = random.Random(7), random.Random(7)
    expected = 0.1 * 0.3 * abs(b.gauss(0.0, 1.0))
    assert emulated_delay_s(0.1, 1.0, 0.3, a) == pytest.approx(expected)
    with pytest.raises(ValueError):
        emulated_delay_s(0.1, 0.0, 0.0, rng)
    with pytest.raises(ValueError):
        emulated_delay_s(0.1, 1.0, -1.0, rng)


def test_speed_and_jitter_defaults_come_from_the_config():
    cfg = load_config(None, TINY)
    assert rank_speed(cfg, 1, None) == 1.0 and rank_speed(cfg, 1, 0.25) == 0.25
    assert rank_jitter(cfg, None) == 0.0 and rank_jitter(cfg, 0.3) == 0.3
    cfg2 = load_config(None, TINY + ["faults.speed_factors=[1.0, 0.5]", "faults.step_jitter=0.2"])
    assert rank_speed(cfg2, 1, None) == 0.5 and rank_speed(cfg2, 0, None) == 1.0
    assert rank_jitter(cfg2, None) == 0.2
    # the learners' jitter RNG (diloco_async.inner.workload.jitter_random: seed * 65537 + index * 257 + incarnation)
    assert jitter_random(3, 2, 1).random() == random.Random(3 * 65537 + 2 * 257 + 1).random()


def test_select_checkpoint_and_helpers():
    cps = [DdpCheckpointInfo(5, 1280, 100.0, "a"), DdpCheckpointInfo(10, 2560, 110.0, "b"),
           DdpCheckpointInfo(15, 3840, 130.0, "c")]
    assert select_checkpoint(cps) == cps[2]
    assert select_checkpoint(cps, max_tokens=3000) == cps[1]
    assert select_checkpoint(cps, max_tokens=2560) == cps[1]
    assert select_checkpoint(cps, max_wall_unix=105.0) == cps[0]
    assert select_checkpoint(cps, max_tokens=5000, max_wall_unix=120.0) == cps[1]
    assert select_checkpoint(cps, max_tokens=100) is None
    assert select_checkpoint([]) is None
    assert tokens_per_step(8, 16, 64) == 8192
    assert checkpoint_prefix("run") == "run/ddp/checkpoints"
    assert keys.split_state_key("run/ddp/checkpoints/00000012/manifest.json") == ("run/ddp/checkpoints", 12)
    assert keys.split_state_key("run/ddp/checkpoints/00000012") == ("run/ddp/checkpoints", 12)
    with pytest.raises(ValueError):
        keys.split_state_key("run/ddp/checkpoints/x/manifest.json")
    p = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    assert param_sha256(p) == param_sha256({"b": torch.zeros(2, 2), "a": torch.ones(3)})
    assert param_sha256(p) != param_sha256({"a": torch.ones(3), "b": torch.full((2, 2), 1e-9)})
    g1, g2 = data_generator(0, 1, 0), data_generator(0, 1, 0)
    assert torch.equal(torch.randint(0, 100, (5,), generator=g1), torch.randint(0, 100, (5,), generator=g2))
    # learner r's seed formula (diloco_async.inner.workload.data_generator)
    expected_seed = 3 * 1_000_003 + 2 * 1009 + 1
    assert torch.equal(torch.randint(0, 100, (5,), generator=data_generator(3, 2, 1)),
                       torch.randint(0, 100, (5,), generator=torch.Generator().manual_seed(expected_seed)))


def test_group_argv_and_validation(tmp_path):
    cfg = load_config(None, ["model.n_layer=1"])
    g = DdpGroup(cfg, 2, "rid", "memory://x", tmp_path,
                 RankSchedule(speeds=[1.0, 0.5], jitter=0.1, checkpoint_every_steps=7, stop_at_unix=123.5, max_steps=9,
                              gloo_timeout_s=5))
    argv = g.argv(1, 3, 4242)
    s = " ".join(argv)
    for part in ["-m diloco_async.baselines.ddp", "--rank 1", "--world-size 2", "--master-port 4242", "--run-id rid",
                 "--incarnation 3", "--speed 0.5", "--jitter 0.1", "--checkpoint-every-steps 7",
                 "--stop-at-unix 123.5", "--max-steps 9", "--gloo-timeout-s 5.0",
                 f"--resolved-config {tmp_path / 'resolved-config.json'}",
                 f"--timeline {tmp_path / 'timeline' / 'ddp-rank-1.jsonl'}"]:
        assert part in s, part
    assert "--config" not in argv and "--set" not in argv  # the ranks read the value, never a recipe
    assert read_resolved(argv[argv.index("--resolved-config") + 1]).model_dump() == cfg.model_dump()
    plain = DdpGroup(load_config("configs/default.toml"), 2, "rid", "memory://x", tmp_path / "p").argv(0, 0, 1)
    assert "--speed" not in plain and "--jitter" not in plain and "--stop-at-unix" not in plain
    assert g.poll() == {}
    with pytest.raises(ValueError):
        DdpGroup(cfg, 2, "rid", "memory://x", tmp_path, RankSchedule(speeds=[1.0]))
    with pytest.raises(ValueError):
        DdpGroup(cfg, 0, "rid", "memory://x", tmp_path)


# ------------------------------------------------------------------ real processes -----------

def read_timeline(path: Path) -> list[dict]:
    if not path.exists():
        return []
    complete = path.read_text().split("\n")[:-1]  # a last piece without its newline is still being written
    return [json.loads(line) for line in complete if line.strip()]


def check_step_lines(lines: list[dict]) -> None:
    for ln in lines:
        if ln["kind"] == "step":
            assert set(ln) >= {"t0", "t1", "wait_s", "step", "tokens", "rank", "incarnation"}
            assert ln["t0"] <= ln["t1"] and 0 <= ln["wait_s"] <= ln["t1"] - ln["t0"] + 1e-3
            assert ln["tokens"] == TOKENS_PER_RANK_STEP


@pytest.fixture
def group_factory(tmp_path):
    groups = []

    def make(extra: tuple[str, ...] = (), **schedule) -> DdpGroup:
        g = DdpGroup(load_config(None, [*TINY, *extra]), 2, "ddp-test", f"file://{tmp_path}/store", tmp_path / "work",
                     RankSchedule(**schedule))
        groups.append(g)
        return g

    yield make
    for g in groups:
        g.kill_all()


def test_two_ranks_train_checkpoint_and_agree(tmp_path, group_factory):
    g = group_factory(checkpoint_every_steps=5, max_steps=20, speeds=[1.0, 0.5], jitter=0.2)
    g.start(0)
    codes = g.wait(60)
    assert codes == {0: 0, 1: 0}, [h.log_path.read_text()[-2000:] for h in g.handles.values()]
    store = ObjectStore(f"file://{tmp_path}/store")
    cps = ddp_checkpoints(store, "ddp-test")
    assert [c.step for c in cps] == [5, 10, 15, 20]
    assert [c.tokens_committed for c in cps] == [s * 2 * TOKENS_PER_RANK_STEP for s in (5, 10, 15, 20)]
    assert all(a.wall_unix < b.wall_unix for a, b in zip(cps, cps[1:], strict=False))
    final = load_ddp_params(store, cps[-1])
    hashes = set()
    for r in range(2):
        lines = read_timeline(g.timeline_path(r))
        kinds = [ln["kind"] for ln in lines]
        assert kinds[0] == "start" and kinds[1] == "ready" and kinds[-1] == "stopped"
        assert lines[1]["step"] == 0
        assert [ln["step"] for ln in lines if ln["kind"] == "step"] == list(range(1, 21))
        check_step_lines(lines)
        assert lines[-1]["step"] == 20 and lines[-1]["reason"] == "max_steps"
        hashes.add(lines[-1]["param_sha256"])
        if r == 0:
            assert [ln["step"] for ln in lines if ln["kind"] == "checkpoint"] == [5, 10, 15, 20]
        else:
            assert "checkpoint" not in kinds
    # Every rank ends with the same parameters, and they are the ones checkpointed.
    assert hashes == {param_sha256(final)}
    cfg = load_config(None, TINY)
    model = load_final_ddp_model(cfg, store, "ddp-test")
    assert param_sha256(dict(model.named_parameters())) == param_sha256(final)
    # Training moved the model away from the common starting point Θ^0.
    theta0, _ = initial_parameters(cfg)
    assert param_sha256(theta0) != param_sha256(final)
    early = load_ddp_model(cfg, store, cps[0].key)
    assert param_sha256(dict(early.named_parameters())) != param_sha256(final)
    x = torch.randint(0, 256, (2, 32))
    assert evaluate_loss(model, [(x[:, :-1], x[:, 1:])]) > 0


def test_two_ranks_train_with_muon_and_checkpoint_its_momentum(tmp_path, group_factory):
    g = group_factory(("learners.optimizer=muon",), checkpoint_every_steps=5, max_steps=10)
    g.start(0)
    codes = g.wait(60)
    assert codes == {0: 0, 1: 0}, [h.log_path.read_text()[-2000:] for h in g.handles.values()]
    store = ObjectStore(f"file://{tmp_path}/store")
    saved = latest_state(store, keys.ddp_checkpoint_prefix("ddp-test"))
    assert saved is not None and saved.manifest["inner"]["step"] == 10
    hidden = muon_parameter_names(load_final_ddp_model(load_config(None, TINY), store, "ddp-test"))
    assert hidden and {f"muon_momentum/{n}" for n in hidden} <= set(saved.tensors)
    assert "exp_avg/tok_emb.weight" in saved.tensors
    ends = {read_timeline(g.timeline_path(r))[-1]["param_sha256"] for r in range(2)}
    assert len(ends) == 1  # both ranks took the same Muon and AdamW steps


def test_kill_rank_then_restart_resumes_from_last_checkpoint(tmp_path, group_factory):
    g = group_factory(checkpoint_every_steps=5, gloo_timeout_s=10.0, speeds=[1.0, 0.5])
    store = ObjectStore(f"file://{tmp_path}/store")
    g.start(0)
    wait_until(lambda: any(c.step >= 10 for c in ddp_checkpoints(store, "ddp-test")), 40, "checkpoint at step 10")
    g.kill_rank(1)
    # rank 0 leaves on its own, as one that lost a peer (gloo's timeout is 10 s: 60 s of waiting is
    # the failure mode, not a bound on how soon)
    code = wait_until(lambda: g.poll()[0] is not None and (g.poll()[0],), 60, "rank 0 to exit")[0]
    assert code == EXIT_PEER_LOST
    lines0 = read_timeline(g.timeline_path(0))
    assert lines0[-1]["kind"] == "error" and lines0[-1]["error"].startswith("lost a peer: "), lines0[-1]
    last_before = max(ln["step"] for ln in lines0 if ln["kind"] == "step")
    last_ckpt = ddp_checkpoints(store, "ddp-test")[-1].step
    assert last_ckpt <= last_before

    g.kill_all()  # torchrun: the whole group goes down, then restarts from the last checkpoint
    g.start(1)

    def ready_of_1(r: int):
        return [ln for ln in read_timeline(g.timeline_path(r)) if ln["kind"] == "ready" and ln["incarnation"] == 1]

    for r in range(2):
        ready = wait_until(lambda r=r: ready_of_1(r), 30, f"rank {r} ready in incarnation 1")
        assert ready[0]["step"] == last_ckpt
    wait_until(lambda: any(ln["kind"] == "step" and ln["incarnation"] == 1 and ln["step"] >= last_ckpt + 3
                           for ln in read_timeline(g.timeline_path(1))), 20, "steps after the restart")
    codes = g.terminate_all(grace_s=20)
    assert codes == {0: 0, 1: 0}
    lines = {r: read_timeline(g.timeline_path(r)) for r in range(2)}
    for r in range(2):
        inc1 = [ln for ln in lines[r] if ln["incarnation"] == 1]
        assert inc1[0]["kind"] == "start"
        steps = [ln["step"] for ln in inc1 if ln["kind"] == "step"]
        assert steps == list(range(last_ckpt + 1, last_ckpt + 1 + len(steps)))
        check_step_lines(inc1)
        assert inc1[-1]["kind"] == "stopped" and inc1[-1]["reason"] == "signal"
    stop0, stop1 = lines[0][-1], lines[1][-1]
    assert stop0["step"] == stop1["step"] and stop0["param_sha256"] == stop1["param_sha256"]
    final = ddp_checkpoints(store, "ddp-test")[-1]
    assert final.step == stop0["step"]
    assert param_sha256(load_ddp_params(store, final)) == stop0["param_sha256"]


def test_stop_at_unix_and_sigterm_write_a_final_checkpoint(tmp_path, group_factory):
    # No periodic checkpoints: the only one is written at the stop.
    g = group_factory(checkpoint_every_steps=0, stop_at_unix=time.time() + 6.0)
    g.start(0)
    codes = g.wait(40)
    assert codes == {0: 0, 1: 0}, [h.log_path.read_text()[-2000:] for h in g.handles.values()]
    store = ObjectStore(f"file://{tmp_path}/store")
    cps = ddp_checkpoints(store, "ddp-test")
    stops = [read_timeline(g.timeline_path(r))[-1] for r in range(2)]
    assert {s["kind"] for s in stops} == {"stopped"} and stops[0]["step"] == stops[1]["step"] > 0
    assert {s["reason"] for s in stops} == {"stop_at"}
    assert [c.step for c in cps] == [stops[0]["step"]]
    # A second incarnation stopped by SIGTERM right after it is ready adds one step and its checkpoint.
    g.stop_at_unix = None
    g.start(1)
    wait_until(lambda: any(ln["kind"] == "ready" and ln["incarnation"] == 1
                           for ln in read_timeline(g.timeline_path(0))), 30, "ready in incarnation 1")
    assert g.terminate_all(grace_s=20) == {0: 0, 1: 0}
    last = read_timeline(g.timeline_path(0))[-1]
    assert last["kind"] == "stopped" and last["step"] > stops[0]["step"]
    assert ddp_checkpoints(store, "ddp-test")[-1].step == last["step"]
