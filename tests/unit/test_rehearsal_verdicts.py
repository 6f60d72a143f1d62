"""The multi-host rehearsal's verdicts (diloco_async/flows/rehearsal.py ``verdicts``): what each finding makes of
a claim, on findings shaped as the rehearsal records them (the rehearsal itself runs in
tests/system/test_hosts_rehearsal.py, as root)."""

from __future__ import annotations

import copy

from diloco_async.flows.rehearsal import verdicts

NS = {"host-a": [11, 21], "host-b": [12, 22], "sync": [13, 23]}


def sealed(host: str) -> dict:
    others = [h for h in NS if h != host] + ["hub"]
    return {"mnt_ns": NS[host][0], "net_ns": NS[host][1], "worker_ns": NS[host], "own_checkout": True,
            "hidden": {f"/r/{o}": {"entries": [], "tmpfs": True, "writable": False} for o in others},
            "probes": {f"/r/{o}/checkout/prefect.yaml": "not found" for o in others if o != "hub"}}


def flow_runs(parent_pool: str, pools: list[str]) -> list[dict]:
    runs = [{"id": f"{parent_pool}-parent", "learner_id": "", "pool": parent_pool, "run_id": None,
             "state": "COMPLETED"}]
    return runs + [{"id": f"{parent_pool}-l{i}", "learner_id": f"learner-{i}", "pool": pool, "run_id": "run-1",
                    "state": "COMPLETED"} for i, pool in enumerate(pools)]


def good() -> tuple[dict, list[dict]]:
    found = {"isolation": {h: sealed(h) for h in NS},
             "train": flow_runs("hosts-sync", ["region-a", "region-b"]),
             "resume": flow_runs("region-b", ["region-b", "region-a"]),
             "paths": {h: {"checkpoint_seq": 3, "resolved": [
                 {"where": "store key k", "value": "s3://b/runs/run-1/checkpoints/3/manifest.json", "error": None}]}
                 for h in ("host-a", "host-b")}}
    host_of = {"hosts-sync": "sync", "region-a": "host-a", "region-b": "host-b"}
    seen = [{"pid": 100 + i, "host": host_of[x["pool"]], "flow_run_id": x["id"], "mnt": NS[host_of[x["pool"]]][0],
             "net": NS[host_of[x["pool"]]][1], "cmd": "python"}
            for i, x in enumerate(found["train"] + found["resume"])]
    return found, seen


def failing(found: dict, seen: list[dict], leftovers: list[str] | None = None) -> list[str]:
    return [check for check, _, ok in verdicts(found, seen, leftovers or []) if not ok]


def test_a_rehearsal_where_everything_held_passes_every_claim():
    found, seen = good()
    table = verdicts(found, seen, [])
    assert len(table) == 10 and all(ok for _, _, ok in table), table


def test_a_folder_another_host_can_see_fails_that_hosts_isolation():
    found, seen = good()
    found["isolation"]["host-b"]["hidden"]["/r/host-a"]["entries"] = ["checkout"]
    assert failing(found, seen) == ["host-b: other machines' folders hidden"]
    found, seen = good()
    found["isolation"]["sync"]["probes"]["/r/host-a/checkout/prefect.yaml"] = "opened"
    assert failing(found, seen) == ["sync: other machines' folders hidden"]


def test_a_learner_on_the_wrong_pool_or_not_completed_fails_its_run():
    found, seen = good()
    found["resume"][1]["pool"] = "region-a"  # learner-0 resumed on the host it trained on
    assert "resume: flow run and learner flow runs completed" in failing(found, seen)
    found, seen = good()
    found["train"][2]["state"] = "CRASHED"
    assert failing(found, seen) == ["train: flow run and learner flow runs completed"]


def test_a_process_outside_its_hosts_namespaces_fails_placement():
    found, seen = good()
    seen[1] = {**seen[1], "mnt": NS["host-b"][0]}  # host-a's learner, in host-b's mounts
    assert failing(found, seen) == ["every process ran in its machine's namespaces"]
    found, seen = good()
    # in host-b's namespaces and saying so, but its flow run's pool is host-a's
    seen[1] = {**seen[1], "host": "host-b", "mnt": NS["host-b"][0], "net": NS["host-b"][1]}
    assert failing(found, seen) == ["every process ran in its machine's namespaces"]


def test_an_unresolved_path_or_a_leftover_fails():
    found, seen = good()
    bad = copy.deepcopy(found)
    bad["paths"]["host-a"]["resolved"].append({"where": "run r summary.json.logs", "value": "/srv/x/logs",
                                               "error": "a local path: no other host has it"})
    assert failing(bad, seen) == ["recorded paths open from host-a"]
    bad = copy.deepcopy(found)
    bad["paths"]["host-b"]["resolved"] = []
    assert failing(bad, seen) == ["recorded paths open from host-b"]
    assert failing(found, seen, ["netns dlhx-hub"]) == ["nothing left (namespaces, processes, mounts)"]


def test_a_rehearsal_that_stopped_early_fails_what_it_did_not_reach():
    found, seen = good()
    del found["resume"], found["paths"]
    assert failing(found, seen) == ["resume: flow run and learner flow runs completed",
                                    "resume ran on host-b, learners swapped hosts",
                                    "recorded paths open from host-a", "recorded paths open from host-b"]
    del found["isolation"]["sync"]
    assert "sync: other machines' folders hidden" in failing(found, seen)
