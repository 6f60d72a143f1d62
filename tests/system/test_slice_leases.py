"""Leased slices with real processes (issue 45 items 2-3; DESIGN §5.2): a synchronizer and learners
over a file:// store, on Shakespeare, under a token budget that ends long before the corpus does.

1. A learner is SIGKILLed mid-run: afterwards every slice is exactly one of trained,
   thrown-away-and-returned or never reached; no slice was merged from two learners' leases (the
   version headers and the merge log say which learner's contribution trained which slices); the
   ledger's trained slices are exactly those the published versions name.
2. The synchronizer is SIGKILLed after a checkpoint and resumed on the same port while the learners
   keep training: the ledger comes back (plus the slices of versions published after the checkpoint)
   and the same holds across both lifetimes.

Which learner leases which slice, and which contribution lands in which round, depend on timing:
the assertions are those that hold for every order.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from resolved_config import resolved_args
from tiny_recipe import tiny_recipe_text

from diloco_async.chaos.exactly_once import merge_log_slices, version_slices
from diloco_async.policy.slices import SliceLedger
from diloco_async.protocol.auth import learner_token
from diloco_async.protocol.client import LEARNER_TOKEN_ENV, TOKEN_ENV, fetch_status
from diloco_async.runtime.procs import LocalProcessLauncher, wait_for_ready_file
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import latest_checkpoint
from diloco_async.storage.store import ObjectStore

from polling import wait_until

TOKEN = "slice-leases-run-secret-0123456789abcdef"
SLICE_TOKENS = 1024  # 4 inner steps of 8 windows of 32 tokens


def leased_recipe(tmp_path: Path, learners: int, budget_tokens: int, synchronizer: str = "") -> Path:
    text = tiny_recipe_text(learners, run=f'store = "file://{tmp_path}/store"', budget=f"tokens = {budget_tokens}",
                            synchronizer=synchronizer, checkpoint_every_s=1.0)
    text = text.replace("[data]\n", f"[data]\nslices = true\nslice_tokens = {SLICE_TOKENS}\n")
    text = text.replace("batch_size = 8", "batch_size = 8\ncheckpoint_every_s = 0")
    text = text.replace("heartbeat_timeout_s = 5.0", "heartbeat_timeout_s = 2.0")
    path = tmp_path / "leased.toml"
    path.write_text(text)
    return path


def start_learner(launcher: LocalProcessLauncher, tmp_path: Path, run_id: str, i: int, url: str):
    lid = f"learner-{i}"
    return launcher.start(lid, ["-m", "diloco_async.learner", "--learner-id", lid, "--index", str(i),
                                "--sync-url", url, "--store", f"file://{tmp_path}/store"],
                          {LEARNER_TOKEN_ENV: learner_token(TOKEN, run_id, lid)})


def check_ledger(store: ObjectStore, run_id: str, summary: dict, merged_by: dict[int, set[str]]) -> dict:
    """What must hold at the end whatever the order (``merged_by``: slice -> learners whose merged
    contributions named it, from the version headers and merge logs); returns the counts."""
    ckpt = latest_checkpoint(store, run_id)
    assert ckpt is not None and "slices" in ckpt.manifest
    ledger = SliceLedger.from_json(ckpt.manifest["slices"])
    states = ledger.states()
    assert states["leased"] == [] and not ledger.leases  # the stop ended every lease
    every = sorted(states["trained"] + states["returned"] + states["never_reached"])
    assert every == list(range(ledger.n_slices))  # each slice exactly one of them
    twice = {s: sorted(who) for s, who in merged_by.items() if len(who) > 1}
    assert not twice, f"slices merged from two learners' leases: {twice}"
    # (versions behind the newest checkpoint may have been garbage-collected: a subset)
    assert set(merged_by) <= set(states["trained"]), "every slice a merge named is trained in the ledger"
    assert summary["slices_trained_twice"] == 0 and summary["slices_merged_not_held"] == 0
    assert summary["slices_leased_now"] == 0 and summary["slices_never_reached"] == len(states["never_reached"])
    assert summary["tokens_trained"] == summary["slices_trained"] * SLICE_TOKENS
    assert states["never_reached"], "the budget ends before the corpus"
    return {"slices": ledger.n_slices, "trained": len(states["trained"]), "returned": len(states["returned"]),
            "never_reached": len(states["never_reached"]), "thrown_away": summary["slices_thrown_away"],
            "requeued": summary["slices_requeued"], "leased_total": summary["slices_leased_total"],
            "refused_not_held": summary["rejected_by_reason"].get("slices_not_held", 0),
            "clamped": summary["clamped_by_reason"].get("c_tokens_over_slices", 0)}


def test_a_learner_killed_mid_run_trains_no_slice_twice_and_loses_none(tmp_path):
    run_id = "leases"
    recipe = leased_recipe(tmp_path, learners=3, budget_tokens=700_000)
    launcher = LocalProcessLauncher(tmp_path / "logs")
    sync = launcher.start("synchronizer", ["-m", "diloco_async.server", *resolved_args(recipe, [], tmp_path),
                                           "--run-id", run_id, "--ready-file", str(tmp_path / "ready.json")],
                          {TOKEN_ENV: TOKEN})
    procs = {}
    try:
        url = wait_for_ready_file(tmp_path / "ready.json", sync, timeout_s=120)["url"]
        procs = {i: start_learner(launcher, tmp_path, run_id, i, url) for i in range(3)}

        def merges_and_leases() -> bool:
            st = fetch_status(url)
            return st["merges"] >= 6 and st["slices_leased_total"] >= 6 and all(
                st["learners"].get(f"learner-{i}", {}).get("live") for i in range(3))
        wait_until(merges_and_leases, 120, "six merges, three learners live with leases")
        procs[2].kill()  # SIGKILL: its leases end only when its heartbeat lapses

        def lost_or_over() -> bool:
            try:
                return sync.proc.poll() is not None or not fetch_status(url)["learners"]["learner-2"]["live"]
            except OSError:  # it stopped meanwhile
                return sync.proc.poll() is not None
        wait_until(lost_or_over, 120, "learner-2 lost (or the run over)")

        def requeued() -> int | None:  # None: the run is over
            try:
                return fetch_status(url)["slices_requeued"] if sync.proc.poll() is None else None
            except OSError:
                return None
        wait_until(lambda: requeued() != 0, 120, "learner-2's leases back in the pool (or the run over)")
        requeued_while_running = requeued()
        assert sync.proc.wait(timeout=300) == 0  # the token budget stops the run
        for i in (0, 1):
            assert procs[i].proc.wait(timeout=60) == 0
    finally:
        for p in [*procs.values(), sync]:
            p.terminate(grace_s=5)
    store = ObjectStore(f"file://{tmp_path}/store")
    epoch = json.loads((tmp_path / "ready.json").read_text())["epoch"]
    summary = store.get_json(keys.summary_key(run_id, epoch))
    assert summary["stop_reason"].startswith("token budget"), summary["stop_reason"]
    by_log, by_header = merge_log_slices(store, run_id, epoch), version_slices(store, run_id)
    merged_by = {s: by_log.get(s, set()) | by_header.get(s, set()) for s in set(by_log) | set(by_header)}
    counts = check_ledger(store, run_id, summary, merged_by)
    ckpt = latest_checkpoint(store, run_id)
    assert ckpt is not None
    assert set(by_log) == set(SliceLedger.from_json(ckpt.manifest["slices"]).states()["trained"])  # one lifetime: all
    assert counts["requeued"] >= 1  # learner-2's leases at least (it held one in hand and one ahead)
    if requeued_while_running is not None:
        assert requeued_while_running >= 1  # returned when its heartbeat lapsed, before the stop
    print(f"\nslice leases, learner killed: {counts}, requeued while running: {requeued_while_running}")
    (tmp_path / "counts.json").write_text(json.dumps(counts))


def test_resume_restores_the_ledger_and_trains_no_slice_twice(tmp_path):
    run_id = "leases-resume"
    recipe = leased_recipe(tmp_path, learners=2, budget_tokens=500_000,
                           synchronizer="lease_ttl_s = 4.0\nlease_renew_s = 1.0")
    launcher = LocalProcessLauncher(tmp_path / "logs")
    env = {TOKEN_ENV: TOKEN}
    first = launcher.start("synchronizer", ["-m", "diloco_async.server", *resolved_args(recipe, [], tmp_path),
                                            "--run-id", run_id, "--ready-file", str(tmp_path / "ready.json")], env)
    procs, second = {}, None
    try:
        url = wait_for_ready_file(tmp_path / "ready.json", first, timeout_s=120)["url"]
        procs = {i: start_learner(launcher, tmp_path, run_id, i, url) for i in range(2)}

        def checkpointed_with_trained_slices() -> bool:
            st = fetch_status(url)
            return st["merges"] >= 6 and (st["last_checkpoint_seq"] or 0) >= 1 and st["slices_trained"] >= 2
        wait_until(checkpointed_with_trained_slices, 120, "six merges, a checkpoint, trained slices")
        os.kill(first.pid, signal.SIGKILL)
        first.proc.wait(timeout=30)
        port = int(url.rsplit(":", 1)[1])
        second = launcher.start("synchronizer-2", ["-m", "diloco_async.server", "--resume",
                                                   f"file://{tmp_path}/store/{run_id}", "--port", str(port),
                                                   "--ready-file", str(tmp_path / "ready2.json")], env)
        wait_for_ready_file(tmp_path / "ready2.json", second, timeout_s=120)
        resumed = fetch_status(url)
        assert resumed["resumed_from"] is not None and resumed["slices_trained"] >= 2  # the ledger came back
        assert second.proc.wait(timeout=300) == 0  # the token budget stops the resumed run
        for i in (0, 1):
            assert procs[i].proc.wait(timeout=60) == 0
    finally:
        for p in [*procs.values(), first, *([second] if second else [])]:
            p.terminate(grace_s=5)
    store = ObjectStore(f"file://{tmp_path}/store")
    epoch = json.loads((tmp_path / "ready2.json").read_text())["epoch"]
    summary = store.get_json(keys.summary_key(run_id, epoch))
    assert summary["stop_reason"].startswith("token budget"), summary["stop_reason"]
    merged_by = version_slices(store, run_id)  # both lifetimes' versions (the first one's merge log died with it)
    for s, who in merge_log_slices(store, run_id, epoch).items():
        merged_by.setdefault(s, set()).update(who)
    counts = check_ledger(store, run_id, summary, merged_by)
    print(f"\nslice leases across a resume: {counts}")
