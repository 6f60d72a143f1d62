"""The ``[faults]`` section and the wrappers that apply it where a learner is assembled (issue 42):
a faulty store, a faulty client transport, a slowed workload; none of it in the learner's
production code paths."""

from __future__ import annotations

import asyncio
import random
import re
import uuid
from pathlib import Path

import aiohttp
import pytest
import torch

from diloco_async.codec import wire
from diloco_async.config.faults import MOVED_FROM_LEARNERS, FaultsConfig
from diloco_async.config.schema import config_differences, config_hash, load_config
from diloco_async.learner import faults as faults_module
from diloco_async.learner.faults import (
    POISON_SCALE,
    ControlFaults,
    LearnerFaults,
    PoisonedPayloads,
    SlowedWorkload,
    poison_outer_gradient,
)
from diloco_async.learner.state import LearnerSlot, UploadJob
from diloco_async.storage.faults import FaultyStore
from diloco_async.storage.store import ObjectStore

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ the config section ------

@pytest.mark.parametrize("key", MOVED_FROM_LEARNERS)
def test_a_learners_key_that_moved_names_its_new_place(key):
    value = {"poison": '["scale"]', "speed_factors": "[0.5]", "storage_faults": "{p_slow=0.5}",
             "control_drop_prob": "0.5"}.get(key, "1")
    with pytest.raises(ValueError, match=rf"learners\.{key} moved to faults\.{key}"):
        load_config(None, [f"learners.{key}={value}"])
    assert getattr(load_config(None, [f"faults.{key}={value}"]).faults, key) != getattr(FaultsConfig(), key)


def test_faults_keep_their_validation():
    with pytest.raises(ValueError, match=r"faults\.speed_factors must be in \(0, 1\]"):
        load_config(None, ["faults.speed_factors=[1.0, 2.0]"])
    with pytest.raises(ValueError, match=r"faults\.control_drop_prob"):
        load_config(None, ["faults.control_drop_prob=1.0"])
    with pytest.raises(ValueError, match=r"faults\.poison\.0"):
        load_config(None, ['faults.poison=["bogus"]'])


def test_faults_are_operational_and_leave_the_hash_alone():
    plain = load_config(None)
    chaotic = load_config(None, ['faults.poison=["none", "scale"]', "faults.speed_factors=[0.5]",
                                 "faults.storage_faults={p_slow=0.5}", "faults.nice_after_ready=10"])
    assert config_hash(chaotic) == config_hash(plain)
    assert config_differences(plain.public_dict(), chaotic.public_dict()) == []


# ------------------------------------------------------------------ the wrappers -------------

def faults_of(*overrides: str, index: int = 1, incarnation: int = 0) -> LearnerFaults:
    cfg = load_config(None, list(overrides))
    return LearnerFaults(cfg.faults, cfg.run.seed, LearnerSlot(f"learner-{index}", index, incarnation))


class _Comms:
    """What :meth:`LearnerFaults.wrap_transport` touches of the comms."""

    def __init__(self) -> None:
        from diloco_async.learner.uploads import Uploads

        self.client = type("Client", (), {"before_post": None})()
        self.uploads = Uploads.__new__(Uploads)
        self.uploads.codec = "bf16"
        self.uploads.encode_payload = self.uploads.encode
        self.shapes = {0: {"w": (2, 3)}}


def test_without_faults_every_wrapper_hands_back_what_it_was_given():
    f = faults_of()
    store = ObjectStore(f"memory://nofaults-{uuid.uuid4().hex}")
    workload = object()
    comms = _Comms()
    before = comms.uploads.encode_payload
    assert f.wrap_store(store) is store
    assert f.wrap_workload(workload) is workload  # type: ignore[arg-type]
    f.wrap_transport(comms)  # type: ignore[arg-type]
    assert comms.client.before_post is None and comms.uploads.encode_payload == before


def test_storage_faults_wrap_the_store_with_a_seeded_plan():
    f = faults_of("faults.storage_faults={p_slow=1.0, slow_s=0.0, ops=[\"put\"]}", "run.seed=3", index=2, incarnation=1)
    store = f.wrap_store(ObjectStore(f"memory://faulty-{uuid.uuid4().hex}"))
    assert isinstance(store, FaultyStore)
    assert store.faults.p_slow == 1.0 and store.faults.ops == ("put",)
    # the learner's schedule: seed * 31 + index * 1_000_003 + incarnation
    assert store.faults.rng.random() == random.Random(3 * 31 + 2 * 1_000_003 + 1).random()
    store.put("k", b"x")
    assert store.faults.injected["slow"] == 1


def test_storage_faults_go_only_to_the_chosen_learners():
    """``faults.storage_fault_learners``: one learner with a faulty store beside healthy ones (issue 47)."""
    overrides = ("faults.storage_faults={p_slow=1.0, slow_s=0.0, ops=[\"read\"]}", "faults.storage_fault_learners=[1]")
    for index, faulty in ((0, False), (1, True), (2, False)):
        store = ObjectStore(f"memory://chosen-{uuid.uuid4().hex}")
        assert isinstance(faults_of(*overrides, index=index).wrap_store(store), FaultyStore) is faulty
    with pytest.raises(ValueError, match=r"faults\.storage_fault_learners must be learner indexes >= 0, got \[-1\]"):
        load_config(None, ["faults.storage_fault_learners=[-1]"])
    assert all(k in FaultsConfig.model_fields for k in MOVED_FROM_LEARNERS)
    assert "storage_fault_learners" not in MOVED_FROM_LEARNERS  # added under [faults], never under [learners]


def test_control_faults_go_on_the_client_and_drop_messages():
    f = faults_of("faults.control_drop_prob=0.5", "faults.control_delay_s=0.0")
    comms = _Comms()
    f.wrap_transport(comms)  # type: ignore[arg-type]
    hook = comms.client.before_post
    assert isinstance(hook, ControlFaults) and hook.drop_prob == 0.5
    hook.rng = random.Random(0)  # 0.844, 0.758, 0.421: two sent, the third dropped
    asyncio.run(hook("/heartbeat"))
    asyncio.run(hook("/heartbeat"))
    with pytest.raises(aiohttp.ClientConnectionError, match="/announce dropped"):
        asyncio.run(hook("/announce"))


def job_of(delta: dict[str, torch.Tensor] | None = None, encoded: dict[str, torch.Tensor] | None = None) -> UploadJob:
    return UploadJob(0, 1, 0, 1, 1, 0.1, delta or {}, encoded=encoded)


def sent(comms: _Comms, job: UploadJob) -> dict[str, torch.Tensor]:
    data = comms.uploads.encode_payload(job, {"learner": "learner-1"})
    return wire.decode_from_bytes(data, "bf16", comms.shapes[0])[0]


def test_poison_of_the_learners_index_is_applied_on_send():
    delta = {"w": torch.tensor([[0.5, -0.25, 1.0], [2.0, 0.0, -1.0]])}
    honest = _Comms()
    faults_of('faults.poison=["none", "scale"]', index=0).wrap_transport(honest)  # type: ignore[arg-type]
    assert torch.equal(sent(honest, job_of(dict(delta)))["w"], delta["w"])
    poisoner = _Comms()
    faults_of('faults.poison=["none", "scale"]', index=1).wrap_transport(poisoner)  # type: ignore[arg-type]
    assert isinstance(poisoner.uploads.encode_payload, PoisonedPayloads)
    want = (delta["w"] * POISON_SCALE).to(torch.bfloat16).float()
    assert torch.equal(sent(poisoner, job_of(dict(delta)))["w"], want)
    # one the training thread encoded already (a late learner) is poisoned too
    pre = wire.encode(delta, "bf16")
    assert torch.equal(sent(poisoner, job_of(encoded=pre))["w"], want)


def test_poison_modes_keep_or_wreck_the_norm():
    d = {"w": torch.tensor([3.0, -4.0])}
    assert torch.equal(poison_outer_gradient(d, "sign_flip")["w"], torch.tensor([-3.0, 4.0]))
    const = poison_outer_gradient(d, "constant")["w"]
    assert torch.allclose(const.norm(), d["w"].norm()) and const[0] == const[1]
    with pytest.raises(ValueError, match="unknown poison mode"):
        PoisonedPayloads(lambda job, meta: b"", "bogus", "bf16", lambda p: {})


class _Workload:
    """A workload whose step takes 0.2 s of (fake) compute."""

    tokens_per_step = 64

    def __init__(self, clock: list[float]) -> None:
        self.clock, self.loaded = clock, 0

    def step(self, step: int, tokens_merged: float = 0.0) -> float:
        self.clock[0] += 0.2
        return 1.5

    def load_data(self, cfg, index: int) -> int:
        self.loaded += 1
        return 1000


def test_a_slowed_workload_sleeps_its_emulated_delay_and_lowers_its_priority(monkeypatch):
    clock, slept, niced = [0.0], [], []
    monkeypatch.setattr(faults_module.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(faults_module.time, "sleep", slept.append)
    monkeypatch.setattr(faults_module.os, "nice", niced.append)
    inner = _Workload(clock)
    w = faults_of("faults.speed_factors=[1.0, 0.5]", "faults.nice_after_ready=7").wrap_workload(inner)  # type: ignore
    assert isinstance(w, SlowedWorkload)
    assert w.step(0) == 1.5 and slept == [pytest.approx(0.2)]  # half speed: the step takes twice as long
    assert w.tokens_per_step == 64  # the rest is the wrapped workload's
    assert niced == [] and w.load_data(None, 1) == 1000 and niced == [7] and inner.loaded == 1
    # index 0 runs at full speed: no wrapper
    assert faults_of("faults.speed_factors=[1.0, 0.5]", index=0).wrap_workload(inner) is inner  # type: ignore


# ------------------------------------------------------------------ no chaos branch ----------

def test_the_learners_production_code_has_no_chaos_branch():
    """Only the assembly point (diloco_async/learner/faults.py) names the [faults] keys."""
    names = re.compile(r"\b(" + "|".join(MOVED_FROM_LEARNERS) + r")\b")
    modules = [*sorted((ROOT / "diloco_async" / "learner").glob("*.py")), ROOT / "diloco_async/inner/workload.py"]
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in modules if p.name != "faults.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if names.search(line)]
    assert not found, found
