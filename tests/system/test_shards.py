"""Synchronizer shards as real processes (issue 40 items 1-2; DESIGN §2.2).

* S = 1 leaves exactly today's keys in the store (no ``shards`` folder, no ``shards.json``);
* S = 2: two synchronizer processes (``--shard 0``, ``--shard 1``) driven by a scripted learner
  that heartbeats to both and announces each fragment to its owner publish the same versions,
  bit for bit (sha256 of every version object), as one synchronizer with the same seed and the
  same contributions; each shard's lease, checkpoints and epochs lie under its own root;
* a second process for a held shard exits 4 naming the holder; a shard index outside [0, S) exits 2.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from test_fencing import start_sync
from test_resume import TOKEN, SyncProcess
from tiny_recipe import ROOT

from diloco_async.codec import wire
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config
from diloco_async.learner.sharded_client import ShardedSyncClient, ShardListMismatch
from diloco_async.metrics.evaluation import model_from_checkpoint
from diloco_async.protocol.auth import learner_token
from diloco_async.protocol.client import (
    LEARNER_TOKEN_ENV,
    TOKEN_ENV,
    ProtocolError,
    call_blocking,
    fetch_status,
    request_checkpoint,
)
from diloco_async.run import RunProcesses
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import list_checkpoint_seqs
from diloco_async.storage.run_checkpoints import list_run_manifest_seqs
from diloco_async.storage.store import ObjectStore
from diloco_async.sync import open_run
from diloco_async.sync.process import EXIT_LEASE_HELD

from polling import wait_until

TWO_FRAGMENTS = ("synchronizer.num_fragments=2", "synchronizer.max_open_rounds=2")
ROUNDS = 3


class Shards:
    """``len(procs)`` synchronizer processes of one run, one per shard, in shard order."""

    def __init__(self, tmp: Path, store_url: str, run_id: str, shards: int, extra: tuple[str, ...] = (),
                 resume: str | None = None) -> None:
        extra = (*TWO_FRAGMENTS, f"synchronizer.shards={shards}", *extra)
        which = ["--resume", resume] if resume else ["--run-id", run_id]
        self.procs: list[SyncProcess] = []
        for i in range(shards):
            self.procs.append(SyncProcess(tmp, store_url, [*which, "--shard", str(i)], extra=extra))

    def owner(self, p: int) -> SyncProcess:
        return self.procs[p % len(self.procs)]

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


def drive(shards: Shards, store: ObjectStore, learner: str = "scripted", rounds: range = range(1, ROUNDS + 1)) -> None:
    """One scripted learner: joins every shard, then for rounds 1..ROUNDS reports step 4r+2 to every
    shard (round r of fragment 0 is due at 4r, of fragment 1 at 4r+2: H = 4, P = 2), contributes a
    fixed outer gradient per (fragment, round) to the fragment's owner and waits for the version."""
    plans = []
    for i, proc in enumerate(shards.procs):
        jr = call_blocking(proc.url, TOKEN, "join", {"learner_id": learner, "incarnation": 0})
        assert (jr["shard"], jr["shards"]) == (i, len(shards.procs)), jr
        plans.append(jr["plan"])
    assert all(plan == plans[0] for plan in plans)  # every shard serves the whole plan
    run_id = jr["run_id"]
    shapes = [{s["name"]: tuple(s["shape"]) for s in frag} for frag in plans[0]["fragments"]]
    for r in rounds:
        for p in range(2):
            owner = shards.owner(p)

            def round_open(p: int = p, r: int = r, owner: SyncProcess = owner) -> bool:
                for proc in shards.procs:
                    call_blocking(proc.url, TOKEN, "heartbeat", {"learner_id": learner, "step": 4 * r + 2})
                return any(x["fragment"] == p and x["round"] == r for x in owner.status()["rounds"])
            wait_until(round_open, 60, f"round {r} of fragment {p} to open", interval_s=0.05)
            g = torch.Generator().manual_seed(1000 * p + r)
            delta = {n: torch.randn(shape, generator=g) * 0.05 for n, shape in sorted(shapes[p].items())}
            ref = store.put(keys.contribution_key(run_id, p, r, learner, uuid.uuid4().hex[:8]),
                            wire.encode_to_bytes(delta, "fp32", {}))
            ack = call_blocking(owner.url, TOKEN, "announce", {
                "learner_id": learner, "fragment": p, "round_n": r, "base_version": r - 1, "c_steps": 4,
                "c_tokens": 4 * 64, "compute_s": 0.1, "key": ref.key, "nbytes": ref.nbytes, "sha256": ref.sha256,
                "codec": "fp32", "update_id": f"u{p}-{r}"})
            assert ack["status"] == "accepted", ack
        for p in range(2):
            wait_until(lambda p=p, r=r: shards.owner(p).status()["versions"][str(p)] >= r, 60,
                       f"version {r} of fragment {p}", interval_s=0.05)


def version_digests(store: ObjectStore, run_id: str) -> dict[tuple[int, int], str]:
    """(fragment, version) -> sha256 of the version object, for every published version."""
    out = {}
    for key in store.list(keys.versions_prefix(run_id)):
        pv = keys.parse_version_key(run_id, key)
        if pv is not None:
            out[pv] = hashlib.sha256(store.get_unverified(key)).hexdigest()
    return out


def key_shapes(store: ObjectStore, run_id: str) -> set[str]:
    """Every key of the run with its epoch, nonce and lease renewal numbers replaced by placeholders."""
    out = set()
    for key in store.list(run_id):
        k = key[len(run_id) + 1:]
        k = re.sub(r"epochs/[0-9a-f]{12}/", "epochs/{epoch}/", k)
        k = re.sub(r"-[0-9a-f]{8}\.safetensors$", "-{nonce}.safetensors", k)
        k = re.sub(r"renewal-\d{8}\.json$", "renewal-{k}.json", k)
        out.add(k)
    return out


def run(tmp: Path, store_url: str, run_id: str, shards: int) -> ObjectStore:
    store = ObjectStore(store_url)
    procs = Shards(tmp, store_url, run_id, shards)
    try:
        drive(procs, store)
        for proc in procs.procs:
            request_checkpoint(proc.url, TOKEN, timeout_s=30.0)
    finally:
        procs.stop()
    return store


def wait_clean_exit(run) -> None:
    """Every shard of ``run``, then every learner, exits 0 (a stop already sent or decided)."""
    for shard in run.shard_syncs:
        assert shard.wait(timeout=300) == 0, shard.log_path
    run.finished_cleanly = True
    for handle in run.learners.values():
        assert handle.wait(timeout=60) == 0, handle.log_path


def test_one_shard_leaves_exactly_todays_keys(tmp_path):
    store_url = f"file://{tmp_path}/store"
    store = run(tmp_path, store_url, "one", 1)
    versions = {f"globals/p{p:03d}/v{v:08d}.safetensors" for p in range(2) for v in range(ROUNDS + 1)}
    contribs = {f"contrib/p{p:03d}/r{r:08d}/scripted-{{nonce}}.safetensors" for p in range(2)
                for r in range(1, ROUNDS + 1)}
    state = {f"checkpoints/{s:08d}/{name}" for s in (1, 2) for name in ("state.safetensors", "manifest.json")}
    epochs = {f"epochs/{{epoch}}/{name}" for name in ("summary.json", "metrics.jsonl", "merges.jsonl",
                                                       "contributions.jsonl")}
    lease = {"lease/00000001/claim.json", "lease/00000001/released.json"}
    shapes = {k for k in key_shapes(store, "one") if not k.startswith("lease/00000001/renewal-")}
    kept = {k for k in shapes if k.startswith("contrib/")}  # garbage collection removes those behind the checkpoint
    assert kept <= contribs and f"contrib/p001/r{ROUNDS:08d}/scripted-{{nonce}}.safetensors" in kept
    assert shapes - kept == {"plan.json", "config.json", *versions, *state, *epochs, *lease}


def test_two_shards_publish_the_same_versions_bit_for_bit_as_one(tmp_path):
    store_url = f"file://{tmp_path}/store"
    one = version_digests(run(tmp_path, store_url, "one", 1), "one")
    store = run(tmp_path, store_url, "two", 2)
    two = version_digests(store, "two")
    assert set(one) == {(p, v) for p in range(2) for v in range(ROUNDS + 1)}
    assert two == one
    shapes = key_shapes(store, "two")
    assert "shards.json" in shapes and "lease/00000001/claim.json" not in shapes
    assert store.get_json(keys.shards_manifest_key("two"))["fragments"] == {"0": [0], "1": [1]}
    for i in range(2):
        root = f"shards/{i:03d}"
        assert {f"{root}/lease/00000001/claim.json", f"{root}/lease/00000001/released.json",
                f"{root}/checkpoints/00000001/manifest.json", f"{root}/epochs/{{epoch}}/summary.json"} <= shapes
        manifest = store.get_json(f"two/{root}/checkpoints/00000001/manifest.json")
        assert set(manifest["versions"]) == {str(i)}, manifest["versions"]  # each shard checkpoints its own


def test_a_resume_from_one_run_checkpoint_restores_both_shards_bit_for_bit(tmp_path):
    """S = 1 and S = 2 driven alike, checkpointed and stopped; S = 2 resumed from its newest run
    checkpoint (each shard from the checkpoint of its own it names), S = 1 from its checkpoint; the
    same contributions for three more rounds publish the same versions, bit for bit: each shard's
    values, momentum and rounds were restored exactly (issue 40 item 3)."""
    store_url = f"file://{tmp_path}/store"
    store = run(tmp_path, store_url, "one", 1)
    run(tmp_path, store_url, "two", 2)
    seq = list_run_manifest_seqs(store, "two")[-1]
    named = store.get_json(keys.run_manifest_key("two", seq))["checkpoints"]
    assert {i: e["versions"] for i, e in named.items()} == {"0": {"0": ROUNDS}, "1": {"1": ROUNDS}}
    more = range(ROUNDS + 1, 2 * ROUNDS + 1)
    for run_id, shards, url in (("one", 1, f"{store_url}/one"),
                                ("two", 2, keys.checkpoint_url(store_url, "two", seq))):
        procs = Shards(tmp_path, store_url, run_id, shards, resume=url)
        try:
            if shards == 2:
                assert [p.status()["resumed_from"] for p in procs.procs] == [named["0"]["seq"], named["1"]["seq"]]
            drive(procs, store, rounds=more)
        finally:
            procs.stop()
    one, two = version_digests(store, "one"), version_digests(store, "two")
    assert {(p, v) for p in range(2) for v in more} <= set(one)  # (older ones: collected behind the checkpoints)
    assert two == one


def test_a_second_process_for_a_held_shard_exits_naming_the_holder(tmp_path):
    store_url = f"file://{tmp_path}/store"
    extra = ["--set", TWO_FRAGMENTS[0], "--set", "synchronizer.shards=2"]
    procs = Shards(tmp_path, store_url, "held", 2)
    try:
        holder = procs.procs[1]
        second, log = start_sync(tmp_path, store_url, ["--run-id", "held", "--shard", "1", *extra])
        bad, bad_log = start_sync(tmp_path, store_url, ["--run-id", "held2", "--shard", "2", *extra])
        assert second.wait(timeout=90) == EXIT_LEASE_HELD, log.read_text()
        out = log.read_text()
        assert f"pid={holder.proc.pid} epoch=1" in out and "held/shards/001" in out, out
        assert bad.wait(timeout=90) == 2, bad_log.read_text()
        assert "shard 2 is outside [0, 2)" in bad_log.read_text()
        assert fetch_status(holder.url)["versions"] == {"1": 0}  # the holder serves on
    finally:
        procs.stop()


def test_the_fan_out_client_joins_every_shard_routes_announcements_and_merges_answers(tmp_path):
    store_url = f"file://{tmp_path}/store"
    store = ObjectStore(store_url)
    procs = Shards(tmp_path, store_url, "fan", 2)
    urls = [p.url for p in procs.procs]

    async def scenario() -> None:
        async with ShardedSyncClient(urls, learner_token(TOKEN, "fan", "L")) as client:
            jr = await client.join({"learner_id": "L", "incarnation": 0})
            assert sorted(v["fragment"] for v in jr["versions"]) == [0, 1]  # one version 0 from each shard
            assert jr["epoch"].count("+") == 1
            events: list[dict] = []
            async with client.push("L") as stream:
                async def read() -> None:
                    async for event in stream:
                        events.append(event)
                reader = asyncio.create_task(read())
                for _ in range(600):  # step 6: round 1 of both fragments due (offsets 0 and 2, H = 4)
                    hb = await client.heartbeat({"learner_id": "L", "step": 6})
                    if {r["fragment"] for r in hb["open_rounds"]} == {0, 1}:
                        break
                    await asyncio.sleep(0.05)
                assert {(r["fragment"], r["round_n"]) for r in hb["open_rounds"]} == {(0, 1), (1, 1)}, hb
                assert not hb["stop"] and hb["known"]
                shapes = {s["name"]: tuple(s["shape"]) for s in jr["plan"]["fragments"][1]}
                data = wire.encode_to_bytes({n: torch.full(s, 0.01) for n, s in sorted(shapes.items())}, "fp32", {})
                ref = store.put(keys.contribution_key("fan", 1, 1, "L", uuid.uuid4().hex[:8]), data)
                ack = await client.announce({
                    "learner_id": "L", "fragment": 1, "round_n": 1, "base_version": 0, "c_steps": 4, "c_tokens": 256,
                    "compute_s": 0.1, "key": ref.key, "nbytes": ref.nbytes, "sha256": ref.sha256, "codec": "fp32",
                    "update_id": "u1"})
                assert ack["status"] == "accepted", ack  # shard 1 owns fragment 1
                wrong = await client.clients[1].announce({  # fragment 0 handed to shard 1 by hand: named, counted
                    "learner_id": "L", "fragment": 0, "round_n": 1, "base_version": 0, "c_steps": 4, "c_tokens": 256,
                    "compute_s": 0.1, "key": keys.contribution_key("fan", 0, 1, "L", "beef0000"), "nbytes": 1,
                    "sha256": "0" * 64, "codec": "fp32", "update_id": "u0"})
                assert wrong["status"] == "rejected" and "belongs to synchronizer shard 0, not to this shard 1" \
                    in wrong["reason"], wrong
                for _ in range(600):
                    if any(e.get("type") == "version" and e.get("fragment") == 1 for e in events):
                        break
                    await asyncio.sleep(0.05)
                reader.cancel()
            assert any(e.get("type") == "version" and e["fragment"] == 1 and e["version"] == 1 for e in events), events
            assert any(e.get("type") == "round_open" and e["fragment"] == 0 for e in events), events  # from shard 0

        async with ShardedSyncClient(urls[::-1], learner_token(TOKEN, "fan", "M")) as wrong:
            with pytest.raises(ShardListMismatch, match=rf"{urls[1]} is position 0 .* answers shard=1 of "
                                                        r"synchronizer\.shards=2"):
                await wrong.join({"learner_id": "M", "incarnation": 0})
        async with ShardedSyncClient(urls[:1], learner_token(TOKEN, "fan", "N")) as short:
            with pytest.raises(ShardListMismatch, match=r"lists 1 shard URL\(s\)"):
                await short.join({"learner_id": "N", "incarnation": 0})

    try:
        asyncio.run(scenario())
    finally:
        procs.stop()


def test_a_learner_given_the_shards_in_the_wrong_order_exits_2_naming_both(tmp_path):
    store_url = f"file://{tmp_path}/store"
    procs = Shards(tmp_path, store_url, "order", 2)
    try:
        urls = ",".join(p.url for p in procs.procs[::-1])
        env = {**os.environ, LEARNER_TOKEN_ENV: learner_token(TOKEN, "order", "L0")}
        out = subprocess.run([sys.executable, "-m", "diloco_async.learner", "--learner-id", "L0", "--index", "0",
                              "--sync-url", urls, "--store", store_url], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2, out.stderr[-3000:]
        assert f"{procs.procs[1].url} is position 0" in out.stderr and "answers shard=1" in out.stderr, out.stderr
    finally:
        procs.stop()


def test_the_budget_stop_is_the_runs_one_shard_decides_and_every_shard_stops(tmp_path):
    """Only shard 0 hears the steps that spend ``budget.max_steps`` (the scripted learner tells shard 1
    step 2): shard 0 stops on its budget and publishes the run's stop, shard 1 follows it with that
    reason; both exit 0 and the store holds one stop (DESIGN §2.2)."""
    store_url = f"file://{tmp_path}/store"
    store = ObjectStore(store_url)
    procs = Shards(tmp_path, store_url, "stop", 2, extra=("budget.max_steps=10",))
    try:
        for proc in procs.procs:
            call_blocking(proc.url, TOKEN, "join", {"learner_id": "scripted", "incarnation": 0})

        def both_exited() -> bool:
            for proc, step in zip(procs.procs, (12, 2), strict=True):
                if proc.proc.poll() is None:
                    try:
                        call_blocking(proc.url, TOKEN, "heartbeat", {"learner_id": "scripted", "step": step},
                                      request_timeout_s=5.0)
                    except (OSError, ProtocolError):
                        pass  # stopping: the server is closing
            return all(p.proc.poll() is not None for p in procs.procs)
        wait_until(both_exited, 120, "both shards to stop", interval_s=0.1)
        assert [p.proc.returncode for p in procs.procs] == [0, 0]
    finally:
        procs.stop()
    stops = [k for k in store.list("stop/stops") if k.endswith(".json")]
    assert len(stops) == 1, stops
    marker = store.get_json(stops[0])
    assert marker["shard"] == 0 and marker["reason"].startswith("step budget reached"), marker
    reasons = [store.get_json(next(k for k in store.list(f"stop/shards/{i:03d}/epochs") if k.endswith("summary.json")))
               for i in range(2)]
    assert reasons[0]["stop_reason"] == marker["reason"]
    assert reasons[1]["stop_reason"] == f"{marker['reason']} (the run's stop, decided by synchronizer shard 0)"
    assert reasons[1]["global_step"] < 10  # shard 1 never saw the budget spent itself


def two_shard_run(tmp_path, *, checkpoint_every_s: float, wall_s: float, tokens: int | None = None) -> Config:
    """A tiny model, 2 learners, 2 fragments on 2 shards, under ``tmp_path``."""
    return with_fields(Config(), {
        "run.store": f"file://{tmp_path}/store", "run.workdir": f"{tmp_path}/runs",
        "data.cache_dir": str((ROOT / "data").resolve()),
        "model.n_layer": 1, "model.d_model": 16, "model.n_head": 2, "model.context": 16,
        "learners.count": 2, "learners.batch_size": 2, "learners.heartbeat_s": 0.25,
        "synchronizer.num_fragments": 2, "synchronizer.shards": 2, "synchronizer.sync_every": 8,
        "synchronizer.heartbeat_timeout_s": 10.0, "synchronizer.checkpoint_every_s": checkpoint_every_s,
        "synchronizer.drain_s": 0.0, "budget.tokens": tokens, "budget.wall_s": wall_s})


def newest_version(store: ObjectStore, run_id: str, p: int) -> int:
    """The newest published version of fragment ``p``, from the keys alone: a running shard's garbage
    collection may delete an older version between a listing and a read of it."""
    listed = (keys.parse_version_key(run_id, k) for k in store.list(keys.versions_prefix(run_id)))
    return max((v for pv in listed if pv is not None and pv[0] == p for v in [pv[1]]), default=-1)


def test_real_learners_on_two_shards_one_run_seen_as_one_stopped_once_and_resumed_from_one_run_checkpoint(tmp_path):
    """RunProcesses with S = 2 and two real learners under a token budget: the launcher's status is
    the run's (a row per shard, every fragment's version, each learner's tokens counted once), the run
    stops once on the tokens, the final summary aggregates both shards' figures, the run checkpoint
    names both shards' final checkpoints and holds the whole model, and a resume from it starts every
    shard from the checkpoint it names (issue 40 item 3; DESIGN §2.2)."""
    budget = 3000
    cfg = two_shard_run(tmp_path, checkpoint_every_s=100000.0, wall_s=600.0, tokens=budget)
    store = ObjectStore(cfg.run.store)
    run = RunProcesses(cfg, run_id="real")
    try:
        run.start_synchronizer()
        assert len(run.shard_syncs) == 2 and run.learner_sync_url == ",".join(run.shard_urls)
        for i in range(2):
            run.start_learner(i)

        st = run.status()  # while the run trains (the shards wait for the learners' first heartbeats)
        assert st is not None
        assert [(r["shard"], r["url"], r["reachable"]) for r in st["shards"]] == [
            (0, run.shard_urls[0], True), (1, run.shard_urls[1], True)]
        assert set(st["versions"]) == {"0", "1"} and st["merges"] == sum(r["merges"] for r in st["shards"])
        assert st["tokens_processed"] == sum(led["tokens_processed"] for led in st["learners"].values())
        wait_clean_exit(run)
    finally:
        run.stop_all()
    shard_docs = [store.get_json(keys.summary_key(root, epoch)) for root, epoch in zip(run.owner_roots(),
                                                                                      run.shard_epochs, strict=True)]
    summary = run.final_summary()
    assert summary["stop_reason"].startswith("token budget reached"), summary["stop_reason"]
    assert all(d["stop_reason"].startswith("token budget reached") for d in shard_docs)
    assert len([k for k in store.list("real/stops") if k.endswith(".json")]) == 1  # the run stopped once
    # each learner's tokens once (as with one synchronizer), not once per shard
    assert budget <= summary["tokens_processed"] < sum(d["tokens_processed"] for d in shard_docs)
    # whatever the learners' pace (a loaded machine may spend the budget before a round closes): the
    # run's merges are the shards' and each fragment's version is its owner's
    assert summary["merges"] == sum(d["merges"] for d in shard_docs)
    assert summary["versions"] == {str(p): shard_docs[p % 2]["versions"][str(p)] for p in range(2)}
    # a learner's merged tokens: summed over the shards (each merges its own fragments), capped at the
    # tokens it processed, as for one synchronizer (goodput.LearnerLedger); whatever order the merges took
    ids = {lid for d in shard_docs for lid in d["learners"]}
    expected = sum(min(sum(d["learners"][lid]["tokens_merged"] for d in shard_docs if lid in d["learners"]),
                       max(d["learners"][lid]["tokens_processed"] for d in shard_docs if lid in d["learners"]))
                   for lid in ids)
    assert summary["tokens_merged"] == pytest.approx(expected)
    ckpt = run.final_checkpoint()
    named = store.get_json(keys.run_manifest_key("real", ckpt.seq))["checkpoints"]
    finals = {str(i): d["last_checkpoint_seq"] for i, d in enumerate(shard_docs)}
    assert {i: e["seq"] for i, e in named.items()} == finals
    assert ckpt.manifest["versions"] == summary["versions"]
    model_from_checkpoint(cfg, ckpt)  # every fragment's tensors: the whole model

    more = with_fields(cfg, {"budget.tokens": 10 * budget})
    resumed = RunProcesses(more, run_id="real", resume_url=keys.checkpoint_url(store.url, "real", ckpt.seq))
    try:
        resumed.start_synchronizer()
        st = resumed.status()
        assert [r["resumed_from"] for r in st["shards"]] == [named["0"]["seq"], named["1"]["seq"]]
        assert st["versions"] == summary["versions"]
    finally:
        resumed.stop_all()

    # a run checkpoint naming a shard that never started: refused before anything starts, naming it
    forged = {**store.get_json(keys.run_manifest_key("real", ckpt.seq)), "seq": 90}
    forged["checkpoints"]["2"] = dict(forged["checkpoints"]["1"])
    store.put_json(keys.run_manifest_key("real", 90), forged)
    url = keys.checkpoint_url(store.url, "real", 90)
    with pytest.raises(ValueError, match="run checkpoint 90 of run real names synchronizer shard 2, which never "
                                         r"started: the run has synchronizer\.shards=2"):
        open_run(url, None, {})
    refused = subprocess.run([sys.executable, "-m", "diloco_async.server", "--resume", url, "--shard", "1"],
                             env={**os.environ, TOKEN_ENV: TOKEN}, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "names synchronizer shard 2, which never started" in refused.stderr, \
        refused.stderr[-2000:]


def merged_learners(store: ObjectStore, root: str, epoch: str) -> set[tuple[int, str]]:
    """(fragment, learner) of every contribution a shard process merged, from its merge log."""
    lines = store.get_unverified(keys.merge_log_key(root, epoch)).decode().splitlines()
    return {(m["fragment"], c["learner"]) for m in map(json.loads, filter(None, lines)) for c in m["contributions"]}


def test_a_learner_cut_off_from_one_shard_keeps_contributing_to_the_other_and_counts_what_it_could_not_deliver(
        tmp_path):
    """learner-1's announcements to shard 1 all fail (faults.unreachable_shard, in its client): its
    contributions of fragment 0 are merged by shard 0 as usual, those of fragment 1 are given up
    after learners.announce_timeout_s and counted undeliverable, in the run's status while it runs
    and in its summary on shard 1's row (DESIGN §2.2). The run is stopped once both were seen."""
    cfg = with_fields(two_shard_run(tmp_path, checkpoint_every_s=100000.0, wall_s=600.0),
                      {"faults.unreachable_shard": [-1, 1], "learners.announce_timeout_s": 2.0})
    store = ObjectStore(cfg.run.store)
    run = RunProcesses(cfg, run_id="cut")
    try:
        run.start_synchronizer()
        for i in range(2):
            run.start_learner(i)

        def counted() -> bool:  # however fast the learners train: stop once both have happened
            st = run.status()
            return st is not None and st["contributions_undeliverable"] >= 1 and \
                st["learners"].get("learner-1", {}).get("contributions", {}).get("merged", 0) >= 1
        wait_until(counted, 300, "learner-1 merged by shard 0 and a contribution counted undeliverable")
        for shard in run.shard_syncs:
            shard.signal_group(signal.SIGTERM)  # a clean stop of the run: final checkpoints and summaries
        wait_clean_exit(run)
    finally:
        run.stop_all()
    merged = [merged_learners(store, root, epoch) for root, epoch in zip(run.owner_roots(), run.shard_epochs,
                                                                       strict=True)]
    assert (0, "learner-1") in merged[0] and (1, "learner-0") in merged[1]
    assert (1, "learner-1") not in merged[1]  # nothing of learner-1 reached shard 1
    summary = run.final_summary()
    lost = summary["contributions_undeliverable"]
    assert lost >= 1 and summary["undeliverable_by_fragment"] == {"1": lost}, summary["undeliverable_by_fragment"]
    assert [r["contributions_undeliverable"] for r in summary["shards"]] == [0, lost]
    assert summary["learners"]["learner-1"]["undeliverable"] == lost and \
        summary["learners"]["learner-0"]["undeliverable"] == 0
    assert "counted undeliverable" in (run.workdir / "logs" / "learner-1.log").read_text()


def test_a_killed_shard_stops_only_its_fragments_and_resumes_on_its_old_port(tmp_path):
    cfg = two_shard_run(tmp_path, checkpoint_every_s=1.0, wall_s=600.0)
    store = ObjectStore(cfg.run.store)
    run = RunProcesses(cfg, run_id="kill")
    try:
        run.start_synchronizer()
        for i in range(2):
            run.start_learner(i)
        wait_until(lambda: min(newest_version(store, "kill", p) for p in range(2)) >= 2
                   and list_checkpoint_seqs(store, "kill/shards/001"), 120,
                   "both fragments merged, shard 1 checkpointed")
        old_url, victim = run.shard_urls[1], run.shard_syncs[1]
        victim.kill()
        wait_until(lambda: victim.poll() is not None, 30, "shard 1 to die")
        v0, v1 = newest_version(store, "kill", 0), newest_version(store, "kill", 1)
        wait_until(lambda: newest_version(store, "kill", 0) >= v0 + 3, 120, "shard 0 to merge on without shard 1")
        assert victim.poll() is not None and newest_version(store, "kill", 1) == v1  # nobody merged fragment 1
        run.supervise()  # the launcher restarts the dead shard from its newest checkpoint
        assert run.shard_syncs[1] is not victim and run.shard_syncs[1].poll() is None
        assert json.loads((run.workdir / "synchronizer-1.ready.json").read_text())["url"] == old_url
        wait_until(lambda: newest_version(store, "kill", 1) >= v1 + 2, 120, "the resumed shard 1 to merge again")
        assert run.shard_syncs[0].poll() is None  # shard 0 never stopped
    finally:
        run.stop_all()
