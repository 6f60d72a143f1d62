"""Bit-exact resume of the synchronizer from a checkpoint after SIGKILL (DESIGN §5, case C02).

A scripted learner drives a real synchronizer process over HTTP. Run A makes 3 outer steps
without interruption. Run B makes 2, checkpoints, is killed with SIGKILL, resumes from the
checkpoint in another process and makes step 3: Θ and the momentum equal run A's bit for bit,
and the version number continues (3, not 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import safetensors.torch
import torch
from resolved_config import resolved_args

from diloco_async.codec import wire
from diloco_async.protocol.client import TOKEN_ENV, call_blocking, fetch_status, request_checkpoint
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import load_checkpoint
from diloco_async.storage.options import STORAGE_OPTIONS_ENV
from diloco_async.storage.store import ObjectRef, ObjectStore

from polling import wait_until
from storage_servers import make_bucket

TOKEN = "resume-run-secret-0123456789abcdef"
OVERRIDES = [
    "model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8", "learners.count=1",
    "synchronizer.num_fragments=1", "synchronizer.sync_every=4", "synchronizer.grace_initial_s=0.0",
    "synchronizer.checkpoint_every_s=100000", "synchronizer.heartbeat_timeout_s=60", "synchronizer.drain_s=0",
    "budget.wall_s=600",
]


def sync_command(tmp: Path, store_url: str, args: list[str], extra: tuple[str, ...] = ()) -> list[str]:
    """The synchronizer's arguments: ``--set X`` items of ``args`` join :data:`OVERRIDES`, the store
    and ``extra``, resolved once into ``--resolved-config``; the rest of ``args`` follows."""
    sets, rest = [*OVERRIDES, f"run.store={store_url}", *extra], []
    items = iter(args)
    for a in items:
        if a == "--set":
            sets.append(next(items))
        else:
            rest.append(a)
    return [*resolved_args(None, sets, tmp / f"config-{uuid.uuid4().hex[:6]}"), *rest]


class SyncProcess:
    def __init__(self, tmp: Path, store_url: str, args: list[str], options: dict | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.ready = tmp / f"ready-{uuid.uuid4().hex[:6]}.json"
        env = {TOKEN_ENV: TOKEN, "PATH": "/usr/bin:/bin", STORAGE_OPTIONS_ENV: json.dumps(options or {}),
               **{k: v for k, v in os.environ.items() if k.startswith("AWS_")}}
        self.log = open(tmp / f"sync-{uuid.uuid4().hex[:6]}.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "diloco_async.server",
                                      *sync_command(tmp, store_url, args, extra),
                                      "--ready-file", str(self.ready)], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        def ready() -> bool:
            assert self.proc.poll() is None, f"synchronizer exited: {self.proc.returncode}"
            return self.ready.exists()
        wait_until(ready, 60, "the synchronizer's ready file", interval_s=0.05)
        self.url = json.loads(self.ready.read_text())["url"]

    def status(self) -> dict:
        return fetch_status(self.url, timeout_s=30.0)

    def stop(self) -> None:
        """SIGTERM (final checkpoint and summary); the scripted learner's heartbeats hear "stop",
        so the synchronizer need not wait for it. SIGKILL after 20 s."""
        if self.proc.poll() is None:
            self.proc.terminate()

            def gone() -> bool:
                try:
                    call_blocking(self.url, TOKEN, "heartbeat", {"learner_id": "scripted", "step": 0},
                                  request_timeout_s=2.0)
                except OSError:  # refused or reset once the server is down
                    pass
                return self.proc.poll() is not None
            try:
                wait_until(gone, 20, "the synchronizer to exit", interval_s=0.1)
            except AssertionError:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


class ScriptedLearner:
    """Joins, reports steps, and contributes fixed outer gradients to fragment 0."""

    def __init__(self, sync: SyncProcess, store: ObjectStore) -> None:
        self.store = store
        self.attach(sync)

    def attach(self, sync: SyncProcess) -> None:
        self.sync = sync
        jr = call_blocking(sync.url, TOKEN, "join", {"learner_id": "scripted", "incarnation": 0})
        self.run_id = jr["run_id"]
        self.shapes = {s["name"]: tuple(s["shape"]) for s in jr["plan"]["fragments"][0]}

    def delta(self, r: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + r)
        return {n: torch.randn(shape, generator=g) * 0.05 for n, shape in sorted(self.shapes.items())}

    def outer_step(self, r: int) -> None:
        """Round r of fragment 0: report step 4r, wait for the round, contribute, wait for version r."""
        def round_open() -> bool:
            call_blocking(self.sync.url, TOKEN, "heartbeat", {"learner_id": "scripted", "step": 4 * r})
            return any(x["fragment"] == 0 and x["round"] == r for x in self.sync.status()["rounds"])
        wait_until(round_open, 60, f"round {r} to open", interval_s=0.05)
        data = wire.encode_to_bytes(self.delta(r), "fp32", {})
        ref = self.store.put(keys.contribution_key(self.run_id, 0, r, "scripted", uuid.uuid4().hex[:8]), data)
        ack = call_blocking(self.sync.url, TOKEN, "announce", {
            "learner_id": "scripted", "fragment": 0, "round_n": r, "base_version": r - 1, "c_steps": 4,
            "c_tokens": 4 * 64, "compute_s": 0.1, "key": ref.key, "nbytes": ref.nbytes, "sha256": ref.sha256,
            "codec": "fp32", "update_id": f"u{r}"})
        assert ack["status"] == "accepted", ack
        wait_until(lambda: self.sync.status()["versions"]["0"] >= r, 60, f"version {r} to be published",
                   interval_s=0.05)


def one_checkpoint(tmp: Path, store_url: str, run_id: str) -> int:
    """A synchronizer process of a new run ``run_id``, one outer step of a scripted learner (it
    reports step 4), a checkpoint, a clean stop; returns the checkpoint's sequence number."""
    sync = SyncProcess(tmp, store_url, ["--run-id", run_id])
    try:
        ScriptedLearner(sync, ObjectStore(store_url)).outer_step(1)
        return request_checkpoint(sync.url, TOKEN, timeout_s=30.0)["seq"]
    finally:
        sync.stop()


def fragment_state(store: ObjectStore, run_id: str, seq: int) -> tuple[dict, dict, dict]:
    ck = load_checkpoint(store, run_id, seq)
    params = {k: v for k, v in ck.tensors.items() if "/param/" in k}
    mom = {k: v for k, v in ck.tensors.items() if "/momentum/" in k}
    return params, mom, ck.manifest


@pytest.fixture
def store_url(tmp_path):
    return f"file://{tmp_path}/store"


@pytest.fixture(params=["file", "s3"])
def any_store(request, tmp_path):
    """(root URL, storage options): a local folder, or a bucket on moto's S3 server on loopback."""
    if request.param == "file":
        return f"file://{tmp_path}/store", {}
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = make_bucket("s3", endpoint.storage_options)
    return f"s3://{bucket}/runs", endpoint.storage_options


def test_sigkill_after_checkpoint_then_resume_is_bit_exact(tmp_path, any_store):
    store_url, options = any_store
    _resume_is_bit_exact(tmp_path, store_url, options, [])


@pytest.mark.parametrize("codec,mode", [("int4", "delta"), ("bf16", "whole")])
def test_resume_is_bit_exact_with_compressed_downloads(tmp_path, store_url, codec, mode):
    """The same with compressed downloads: the master value, the momentum and the published value
    (the checkpoint's ``published`` tensors: the master value less its residual) continue bit for
    bit, and version 3's published value and compact payload equal the uninterrupted run's."""
    extra = ["--set", f"synchronizer.download_codec={codec}", "--set", f"synchronizer.download_mode={mode}"]
    store = ObjectStore(store_url, {})
    params_a, params_b = _resume_is_bit_exact(tmp_path, store_url, {}, extra)
    pub_a = {k: v for k, v in params_a.items() if "/published/" in k}
    assert pub_a and pub_a.keys() == {k for k in params_b if "/published/" in k}
    assert all(torch.equal(pub_a[k], params_b[k]) for k in pub_a)
    # the published value is not the master value: the residual is kept, not lost
    assert any(not torch.equal(pub_a[k], params_a[k.replace("/published/", "/param/")]) for k in pub_a)
    compact = [sorted(k for k in store.list(keys.compact_prefix(run)) if "/v00000003." in k)
               for run in ("runA", "runB")]
    assert len(compact[0]) == len(compact[1]) == 1, compact
    (ta, ma), (tb, mb) = (_load(store.get_unverified(c[0])) for c in compact)
    assert ma == mb and ma["base_version"] == ("2" if mode == "delta" else "-1")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def _load(data: bytes) -> tuple[dict[str, torch.Tensor], dict]:
    return safetensors.torch.load(data), json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]


def _resume_is_bit_exact(tmp_path, store_url: str, options: dict, extra: list[str]) -> tuple[dict, dict]:
    store = ObjectStore(store_url, options)
    # Run A: three outer steps, no interruption.
    a = SyncProcess(tmp_path, store_url, ["--run-id", "runA", *extra], options)
    try:
        la = ScriptedLearner(a, store)
        for r in (1, 2, 3):
            la.outer_step(r)
        seq_a = request_checkpoint(a.url, TOKEN, timeout_s=30.0)["seq"]
    finally:
        a.stop()
    params_a, mom_a, man_a = fragment_state(store, "runA", seq_a)
    assert man_a["versions"] == {"0": 3}

    # Run B: two steps, checkpoint, SIGKILL, resume, step three.
    b = SyncProcess(tmp_path, store_url, ["--run-id", "runB", *extra], options)
    lb = ScriptedLearner(b, store)
    lb.outer_step(1)
    lb.outer_step(2)
    seq_b = request_checkpoint(b.url, TOKEN, timeout_s=30.0)["seq"]
    b.proc.kill()
    b.proc.wait(10)
    b.log.close()
    saved_params, saved_mom, saved = fragment_state(store, "runB", seq_b)
    assert saved["versions"] == {"0": 2} and saved["outer_steps"] == {"0": 2}

    c = SyncProcess(tmp_path, store_url, ["--resume", keys.checkpoint_url(store_url, "runB", seq_b), *extra],
                    options)
    try:
        lb.attach(c)
        assert c.status()["versions"] == {"0": 2}
        # right after the restore, a checkpoint holds exactly the saved state
        seq_r = request_checkpoint(c.url, TOKEN, timeout_s=30.0)["seq"]
        assert seq_r > seq_b
        p_r, m_r, man_r = fragment_state(store, "runB", seq_r)
        assert all(torch.equal(m_r[k], saved_mom[k]) for k in saved_mom)
        assert all(torch.equal(p_r[k], saved_params[k]) for k in saved_params)
        assert man_r["next_round"] == {"0": 3}
        lb.outer_step(3)
        assert c.status()["versions"] == {"0": 3}  # continues at 3, not 1
        seq_c = request_checkpoint(c.url, TOKEN, timeout_s=30.0)["seq"]
    finally:
        c.stop()
    params_b, mom_b, man_b = fragment_state(store, "runB", seq_c)
    assert man_b["versions"] == {"0": 3} and man_b["outer_steps"] == {"0": 3}
    for k in params_a:
        assert torch.equal(params_a[k], params_b[k]), f"{k} differs after resume"
        assert torch.equal(mom_a[k.replace('/param/', '/momentum/')], mom_b[k.replace('/param/', '/momentum/')])
    # the published version 3 of both runs holds the same tensors
    shapes = {k.split("/param/")[1]: tuple(v.shape) for k, v in params_a.items()}
    va, _ = wire.decode_from_bytes(store.get(ObjectRef.from_json(man_a["version_refs"]["0"]["3"])), "fp32", shapes)
    vb, _ = wire.decode_from_bytes(store.get(ObjectRef.from_json(man_b["version_refs"]["0"]["3"])), "fp32", shapes)
    assert all(torch.equal(va[n], vb[n]) for n in shapes)
    return (load_checkpoint(store, "runA", seq_a).tensors, load_checkpoint(store, "runB", seq_c).tensors)


@pytest.mark.parametrize("optimizer", ["sgd", "delayed-nesterov"])
def test_other_outer_optimizers_resume_bit_exact_mid_period(tmp_path, store_url, optimizer):
    """Delayed Nesterov with N = 2 checkpointed after its 1st step (mid-period), SGD likewise: the
    resumed run's steps 2 and 3 equal an uninterrupted run's bit for bit (Θ and the buffer)."""
    extra = (f"synchronizer.outer_optimizer={optimizer}", "synchronizer.outer_momentum_every=2")
    store = ObjectStore(store_url)
    a = SyncProcess(tmp_path, store_url, ["--run-id", "runA"], extra=extra)
    try:
        la = ScriptedLearner(a, store)
        for r in (1, 2, 3):
            la.outer_step(r)
        seq_a = request_checkpoint(a.url, TOKEN, timeout_s=30.0)["seq"]
    finally:
        a.stop()
    b = SyncProcess(tmp_path, store_url, ["--run-id", "runB"], extra=extra)
    lb = ScriptedLearner(b, store)
    lb.outer_step(1)
    seq_b = request_checkpoint(b.url, TOKEN, timeout_s=30.0)["seq"]
    b.proc.kill()
    b.proc.wait(10)
    b.log.close()
    c = SyncProcess(tmp_path, store_url, ["--resume", keys.checkpoint_url(store_url, "runB", seq_b)], extra=extra)
    try:
        lb.attach(c)
        lb.outer_step(2)
        lb.outer_step(3)
        seq_c = request_checkpoint(c.url, TOKEN, timeout_s=30.0)["seq"]
    finally:
        c.stop()
    params_a, mom_a, man_a = fragment_state(store, "runA", seq_a)
    params_b, mom_b, man_b = fragment_state(store, "runB", seq_c)
    assert man_a["outer_steps"] == man_b["outer_steps"] == {"0": 3}
    assert all(torch.equal(params_a[k], params_b[k]) for k in params_a)
    assert all(torch.equal(mom_a[k], mom_b[k]) for k in mom_a)
    if optimizer == "sgd":
        assert all(not m.any() for m in mom_a.values())
    else:
        assert any(m.any() for m in mom_a.values())


def test_resume_skips_a_checkpoint_torn_by_a_crash(tmp_path, store_url):
    store = ObjectStore(store_url)
    b = SyncProcess(tmp_path, store_url, ["--run-id", "runT"])
    lb = ScriptedLearner(b, store)
    lb.outer_step(1)
    seq = request_checkpoint(b.url, TOKEN, timeout_s=30.0)["seq"]
    b.proc.kill()
    b.proc.wait(10)
    b.log.close()
    # a synchronizer killed in the middle of its next checkpoint: state half written, no manifest
    store.put(keys.checkpoint_state_key("runT", seq + 1), b"\x00" * 100)
    c = SyncProcess(tmp_path, store_url, ["--resume", f"{store_url}/runT"])  # newest that verifies
    try:
        st = c.status()
        assert st["versions"] == {"0": 1}
        lb.attach(c)
        lb.outer_step(2)
        assert request_checkpoint(c.url, TOKEN, timeout_s=30.0)["seq"] == seq + 2  # the torn seq is never reused
    finally:
        c.stop()
    log = Path(c.log.name).read_text()
    assert f"skipping incomplete checkpoint {seq + 1}" in log


def test_resume_refuses_a_different_config(tmp_path, store_url):
    seq = one_checkpoint(tmp_path, store_url, "runC")
    given = resolved_args("configs/default.toml", [*OVERRIDES, f"run.store={store_url}", "synchronizer.outer_lr=0.5"],
                          tmp_path)
    url = keys.checkpoint_url(store_url, "runC", seq)
    proc = subprocess.run([sys.executable, "-m", "diloco_async.server", *given, "--resume", url],
                          env={TOKEN_ENV: TOKEN, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "synchronizer.outer_lr: 0.7 -> 0.5" in proc.stderr


def test_resume_of_a_spent_budget_is_refused_at_once_with_the_override_that_extends_it(tmp_path, store_url):
    store = ObjectStore(store_url)
    seq = one_checkpoint(tmp_path, store_url, "runD")  # the learner reports step 4: g = 4 at the checkpoint
    epochs_before = sorted(store.list("runD/epochs"))
    proc = subprocess.run([sys.executable, "-m", "diloco_async.flows.cli", "resume",
                           keys.checkpoint_url(store_url, "runD", seq),
                           "--set", "budget.max_steps=4"],
                          env={**os.environ, TOKEN_ENV: TOKEN, "PREFECT_HOME": str(tmp_path / "prefect")},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "step budget reached (g = 4)" in proc.stderr
    assert "--set budget.max_steps=<more than 4>" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(store.list("runD/epochs")) == epochs_before  # nothing was started
