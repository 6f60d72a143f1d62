"""``diloco-async runs ls STORE``: a real ``file://`` store written through the storage API as runs
write it (config.json, fragment versions, checkpoints with manifests last, epoch summaries), with a
torn checkpoint (no manifest), a corrupted state file on disk and a folder that is not a run."""

from __future__ import annotations

import json

import pytest
import torch

from diloco_async.flows.cli import main
from diloco_async.storage import keys
from diloco_async.storage.checkpoint import tensor_key, write_checkpoint
from diloco_async.storage.store import ObjectStore

RUN_DONE, RUN_STOPPED, RUN_ON = "20261201-090000-aaaaaa", "20261202-090000-bbbbbb", "20261203-090000-cccccc"


def _checkpoint(store: ObjectStore, run_id: str, seq: int, versions: dict[int, int], step: int) -> None:
    tensors = {tensor_key(p, kind, "w"): torch.full((4,), float(seq))
               for p in versions for kind in ("param", "momentum")}
    write_checkpoint(store, run_id, seq, tensors, {"versions": {str(p): v for p, v in versions.items()},
                                                   "global_step": step, "lease_epoch": 1, "epoch": "e1"})


def _run(store: ObjectStore, run_id: str, newest: dict[int, int]) -> None:
    store.put_json(keys.config_key(run_id), {"run": {"name": run_id}})
    for p, top in newest.items():
        for v in range(max(0, top - 2), top + 1):  # older versions were collected
            store.put(keys.version_key(run_id, p, v), b"version")


@pytest.fixture
def store_url(tmp_path) -> str:
    url = f"file://{tmp_path}/store"
    store = ObjectStore(url)
    _run(store, RUN_DONE, {0: 5, 1: 4})
    _checkpoint(store, RUN_DONE, 1, {0: 2, 1: 2}, 20)
    _checkpoint(store, RUN_DONE, 2, {0: 5, 1: 4}, 48)
    store.put(keys.checkpoint_state_key(RUN_DONE, 3), b"torn write: no manifest")
    store.put_json(keys.summary_key(RUN_DONE, "e1"), {"stop_reason": "token budget reached", "last_checkpoint_seq": 2})
    state = tmp_path / "store" / keys.checkpoint_state_key(RUN_DONE, 2)
    data = bytearray(state.read_bytes())
    data[-1] ^= 0xFF  # same size, another sha256: corrupt on disk after its manifest was written
    state.write_bytes(bytes(data))
    _run(store, RUN_STOPPED, {0: 3})
    _checkpoint(store, RUN_STOPPED, 1, {0: 3}, 30)
    store.put_json(keys.summary_key(RUN_STOPPED, "e1"), {"stop_reason": "signal SIGINT", "last_checkpoint_seq": 1})
    _run(store, RUN_ON, {0: 2})  # stopped by a signal, resumed: running (or ended without a summary)
    _checkpoint(store, RUN_ON, 1, {0: 1}, 12)
    store.put_json(keys.summary_key(RUN_ON, "e1"), {"stop_reason": "signal SIGTERM", "last_checkpoint_seq": 1})
    _checkpoint(store, RUN_ON, 2, {0: 2}, 24)
    store.put("mlartifacts/1/meta.yaml", b"not a run")
    return url


def _json(capsys, *argv: str) -> dict:
    assert main(["runs", "ls", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_runs_ls_lists_runs_checkpoints_states_versions_and_ends(store_url, capsys):
    doc = _json(capsys, store_url)
    runs = {r["run_id"]: r for r in doc["runs"]}
    assert list(runs) == [RUN_DONE, RUN_STOPPED, RUN_ON]  # not mlartifacts: it has no config.json
    done = runs[RUN_DONE]
    assert [(c["seq"], c["state"], c["resume"]) for c in done["checkpoints"]] == [
        (3, "partial", False), (2, "unverified", False), (1, "verified", True)]  # resume skips the corrupt 2
    assert done["resume_seq"] == 1 and done["checkpoints"][2]["versions"] == {"0": 2, "1": 2}
    assert done["checkpoints"][2]["global_step"] == 20 and done["newest_versions"] == {"0": 5, "1": 4}
    assert (done["status"], done["finished"], done["stop_reason"]) == ("finished", True, "token budget reached")
    assert (runs[RUN_STOPPED]["status"], runs[RUN_STOPPED]["finished"]) == ("stopped", False)
    assert (runs[RUN_ON]["status"], runs[RUN_ON]["stop_reason"]) == ("unfinished", None)
    assert runs[RUN_ON]["url"] == f"{store_url}/{RUN_ON}"

    verified = {r["run_id"]: r for r in _json(capsys, store_url, "--verify")["runs"]}
    assert [c["state"] for c in verified[RUN_DONE]["checkpoints"]] == ["partial", "corrupt", "verified"]
    assert "IntegrityError" in verified[RUN_DONE]["checkpoints"][1]["detail"]


def test_runs_ls_prints_a_table_per_run(store_url, capsys):
    assert main(["runs", "ls", store_url]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    assert out.startswith(f"3 run(s) in {store_url}\n")
    assert [RUN_DONE, "finished:", "token", "budget", "reached"] in lines
    assert ["fragments", "2,", "newest", "versions", "p0:v5", "p1:v4"] in lines
    assert ["checkpoint", "state", "lease", "step", "versions"] in lines
    assert ["1", "verified", "1", "20", "p0:v2", "p1:v2", "resume"] in lines
    assert ["2", "unverified", "1", "48", "p0:v5", "p1:v4"] in lines and ["3", "partial", "-", "-", "-"] in lines
    resume = f"{store_url}/{RUN_STOPPED}"
    assert ["continue", "from", "checkpoint", "1", "with:", "diloco-async", "resume", resume] in lines
    assert f"resume {store_url}/{RUN_DONE}" not in out  # finished: nothing to continue


def test_runs_ls_of_an_empty_store_a_missing_folder_and_a_bad_url(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["runs", "ls", f"file://{tmp_path}/empty"]) == 0
    assert capsys.readouterr().out.strip() == f"no run (no folder with a config.json) in file://{tmp_path}/empty"
    assert main(["runs", "ls", f"file://{tmp_path}/nothing"]) == 2  # a typo is not an empty store
    err = capsys.readouterr().err
    assert f"no folder {tmp_path}/nothing" in err and "Traceback" not in err
    (tmp_path / "afile").write_text("x")
    assert main(["runs", "ls", f"file://{tmp_path}/afile"]) == 2
    assert f"{tmp_path}/afile is a file, not a folder" in capsys.readouterr().err
    assert main(["runs", "ls", "ftp://host/x"]) == 2
    err = capsys.readouterr().err
    assert "ftp://host/x" in err and "Traceback" not in err


RUN_SHARDED = "20261204-090000-dddddd"


def _shard_checkpoint(store: ObjectStore, shard: int, seq: int, version: int) -> None:
    """Shard ``shard`` of 2 checkpoints its fragment (p = shard) at version ``version``, then marks a
    run checkpoint as the shard process does (diloco_async.storage.run_checkpoints.write_run_manifest)."""
    from diloco_async.storage.run_checkpoints import write_run_manifest

    root = keys.synchronizer_root(RUN_SHARDED, shard, 2)
    tensors = {tensor_key(shard, kind, "w"): torch.full((4,), float(seq)) for kind in ("param", "momentum")}
    write_checkpoint(store, root, seq, tensors, {"versions": {str(shard): version}, "lease_epoch": 1 + shard,
                                                 "epoch": "e1", "learners": {}})
    write_run_manifest(store, RUN_SHARDED, 2)


def test_runs_ls_of_a_run_of_two_synchronizer_shards_lists_its_run_checkpoints(tmp_path, capsys):
    """issue 40: a run of S = 2 shards is listed by its run checkpoints (each naming a checkpoint
    per shard), the resume one being what `resume` restores; finished once both shards' summaries
    cover their newest checkpoints; --verify finds a run checkpoint whose shard state is corrupt."""
    url = f"file://{tmp_path}/store"
    store = ObjectStore(url)
    store.put_json(keys.config_key(RUN_SHARDED), {"run": {"name": "s"}, "synchronizer": {"shards": 2}})
    for p, top in ((0, 6), (1, 5)):
        store.put(keys.version_key(RUN_SHARDED, p, top), b"version")
    _shard_checkpoint(store, 0, 1, 3)
    _shard_checkpoint(store, 1, 1, 2)  # run checkpoint 1: shard 0's 1 and shard 1's 1
    _shard_checkpoint(store, 0, 2, 6)  # run checkpoint 2: shard 0's 2, shard 1's 1
    run = {r["run_id"]: r for r in _json(capsys, url)["runs"]}[RUN_SHARDED]
    assert run["shards"] == 2 and run["status"] == "unfinished"  # no shard summary yet
    assert [(c["seq"], c["state"], c["resume"], c["shard_seqs"], c["versions"]) for c in run["checkpoints"]] == [
        (2, "verified", True, {"0": 2, "1": 1}, {"0": 6, "1": 2}),
        (1, "unverified", False, {"0": 1, "1": 1}, {"0": 3, "1": 2})]
    for shard, seq, reason in ((0, 2, "token budget reached (the run's)"), (1, 1, "token budget reached (the run's)")):
        store.put_json(keys.summary_key(keys.synchronizer_root(RUN_SHARDED, shard, 2), "e1"),
                       {"stop_reason": reason, "last_checkpoint_seq": seq})
    run = {r["run_id"]: r for r in _json(capsys, url)["runs"]}[RUN_SHARDED]
    assert (run["status"], run["stop_reason"]) == ("finished", "token budget reached (the run's)")
    # shard 0's checkpoint 1 corrupted on disk: run checkpoint 1 no longer verifies, 2 still does
    state = tmp_path / "store" / keys.checkpoint_state_key(keys.synchronizer_root(RUN_SHARDED, 0, 2), 1)
    state.write_bytes(state.read_bytes()[:-1] + b"\x00")
    run = {r["run_id"]: r for r in _json(capsys, url, "--verify")["runs"]}[RUN_SHARDED]
    assert [c["state"] for c in run["checkpoints"]] == ["verified", "corrupt"]
    assert "synchronizer shard 0" in run["checkpoints"][1]["detail"]
    assert main(["runs", "ls", url]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["fragments", "2,", "newest", "versions", "p0:v6", "p1:v5,", "2", "synchronizer", "shards", "(run",
            "checkpoints)"] in lines
    assert ["checkpoint", "state", "lease", "step", "versions", "shards"] in lines
    assert ["2", "verified", "2", "-", "p0:v6", "p1:v2", "s0:2", "s1:1", "resume"] in lines
