"""``make rehearse-hosts`` (``python -m diloco_async.flows.rehearsal``): a multi-host rehearsal on this machine
(issue 46 item 6, docs/multi-host.md). Needs root (network and mount namespaces).

On the machines of :mod:`diloco_async.flows.rehearsal_stack` (two learner hosts and the synchronizer's host,
each with its own disk, checkout and Prefect worker; the store on S3 and the Prefect and MLflow
servers in the hub):

1. deploys prefect.yaml's ``learner/region-a`` and ``learner/region-b`` (one region pool per
   host), ``train/train`` on the synchronizer host's pool and ``resume/resume`` on host-b's pool;
2. from inside each host, checks that every other machine's folder is an empty read-only tmpfs
   (:func:`diloco_async.flows.rehearsal_checks.isolation`);
3. runs ``train`` (tiny recipe, two learners, quorum 2): learner *i* on host ``a``, ``b`` in turn;
4. runs ``resume`` of that run from its newest S3 checkpoint on host-b, with each learner on the
   *other* host than in ``train`` (``run.regions`` swapped) and a larger step budget;
5. from inside each learner host, opens every path the run recorded in MLflow and in the store
   (:func:`diloco_async.flows.rehearsal_checks.paths`);
6. tears everything down and checks that no namespace, process or mount is left.

Every process of the rehearsal is sampled while it runs (:class:`~diloco_async.flows.rehearsal_stack.ProcessWatch`):
each must have run in the mount and network namespaces of the machine it belongs to. The result
is ``{folder}/result.json``; the last lines are a table check/value/ok|FAIL; exit 0 when every
check passed, 1 otherwise, 2 when this machine cannot run it (the reason is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from diloco_async.flows.rehearsal_stack import HOSTS, POOLS, SYNC, SYNC_POOL, ProcessWatch, Rehearsal

__all__ = ["refusal", "train_overrides", "resume_overrides", "verdicts", "main"]

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
RUN_TIMEOUT_S = 900.0
TRAIN_STEPS = 150
RESUME_STEPS = 300
TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context=32", "learners.count=2",
        "learners.batch_size=8", "synchronizer.num_fragments=3", "synchronizer.sync_every=12",
        "synchronizer.checkpoint_every_s=5", "synchronizer.min_quorum=2", "tracking.poll_s=0.5",
        "learners.restart_delay_s=1.0", "budget.tokens=1000000000", "budget.wall_s=400"]


def refusal() -> str | None:
    """Why this machine cannot run the rehearsal (None: it can): root, ``ip``, ``tc`` and
    ``nsenter`` are needed, and a namespace must be makeable."""
    import shutil

    from diloco_async.wan.netns import root_reason

    if os.geteuid() != 0:
        return ("the multi-host rehearsal needs root (network and mount namespaces, tmpfs mounts); "
                f"euid is {os.geteuid()}")
    if shutil.which("nsenter") is None:
        return "the multi-host rehearsal needs `nsenter` (util-linux), not found on PATH"
    return root_reason()


def train_overrides(r: Rehearsal) -> list[str]:
    """The ``train`` flow run's overrides: the tiny recipe, the store on the hub's S3, the hub's
    MLflow server, the synchronizer on the sync host's address, one learner per host."""
    endpoint = r.storage_options["client_kwargs"]["endpoint_url"]
    return [*TINY, "run.launcher=deployments", "run.regions=['region-a', 'region-b']", f"run.store={r.store}",
            f"run.storage_options={{client_kwargs={{endpoint_url={endpoint!r}}}}}",  # a TOML literal string
            f"tracking.mlflow_uri={r.mlflow_uri}",
            "tracking.register_model=diloco-rehearsal", f"synchronizer.host={r.machines[SYNC].addr}",
            f"budget.max_steps={TRAIN_STEPS}"]


def resume_overrides(r: Rehearsal) -> list[str]:
    """The ``resume`` flow run's overrides: learner *i* on the other host than in ``train``, the
    synchronizer on host-b (where the flow runs), a larger step budget. The store's options come
    from the worker's ``DILOCO_STORAGE_OPTIONS``."""
    return ["run.launcher=deployments", "run.regions=['region-b', 'region-a']",
            f"synchronizer.host={r.machines['host-b'].addr}", f"budget.max_steps={RESUME_STEPS}"]


def _run(r: Rehearsal, deployment: str, parameters: dict) -> str:
    """Create a flow run of ``deployment`` and wait until it is terminal; returns its id."""
    from prefect.deployments import run_deployment

    fr = run_deployment(deployment, parameters=parameters, timeout=0)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while _state(r, str(fr.id)) not in TERMINAL:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{deployment} flow run {fr.name} not finished after {RUN_TIMEOUT_S:.0f} s")
        time.sleep(1.0)
    return str(fr.id)


def _state(r: Rehearsal, flow_run_id: str) -> str:
    with r.client() as c:
        fr = c.read_flow_run(flow_run_id)
    return fr.state.type.value if fr.state else "?"


def _flow_runs(r: Rehearsal, parent_id: str) -> list[dict]:
    """The learner flow runs a train/resume flow run created, oldest first."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with r.client() as c:
        parent = c.read_flow_run(parent_id)
        tag = FlowRunFilterTags(all_=[f"train-flow-run:{parent_id}"])
        runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(tags=tag))
    learners = [{"id": str(x.id), "learner_id": x.parameters["learner_id"], "pool": x.work_pool_name,
                 "run_id": x.parameters.get("run_id"), "state": x.state.type.value if x.state else "?"}
                for x in sorted(runs, key=lambda x: (x.parameters["index"], x.parameters.get("incarnation", 0)))]
    return [{"id": parent_id, "learner_id": "", "pool": parent.work_pool_name, "run_id": None,
             "state": parent.state.type.value if parent.state else "?"}, *learners]


def _in_host_json(r: Rehearsal, host: str, args: list[str]) -> dict:
    done = r.in_host(host, [sys.executable, "-m", "diloco_async.flows.rehearsal_checks", *args])
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr[-3000:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _isolation(r: Rehearsal) -> dict:
    """:func:`diloco_async.flows.rehearsal_checks.isolation` from inside every host: its own checkout, the other
    machines' folders, and the other hosts' ``prefect.yaml`` by full path."""
    out = {}
    for host in (*HOSTS, SYNC):
        probes = [str(r.machines[o].checkout / "prefect.yaml") for o in (*HOSTS, SYNC) if o != host]
        args = ["isolation", "--own", str(r.machines[host].checkout)]
        args += [a for d in r.hidden_from(host) for a in ("--hidden", d)] + [a for p in probes for a in ("--probe", p)]
        out[host] = {**_in_host_json(r, host, args), "worker_ns": list(r.machines[host].ns_inodes())}
    return out


def rehearse(r: Rehearsal) -> dict:
    """Steps 1-5 of the module docstring on a built :class:`Rehearsal`; the raw findings."""
    for name, pool in (("region-a", None), ("region-b", None), ("train", SYNC_POOL), ("resume", POOLS["host-b"])):
        r.deploy(name, pool)
    found: dict = {"machines": {n: {"ns": m.ns, "addr": m.addr, "checkout": str(m.checkout or "")}
                                for n, m in r.machines.items()}}
    found["isolation"] = _isolation(r)
    train_id = _run(r, "train/train", {"config": "configs/default.toml", "overrides": train_overrides(r)})
    found["train"] = _flow_runs(r, train_id)
    run_id = next((x["run_id"] for x in found["train"] if x["run_id"]), None)
    found["run_id"] = run_id
    if found["train"][0]["state"] != "COMPLETED" or run_id is None:
        return found
    resume_id = _run(r, "resume/resume", {"checkpoint_url": f"{r.store}/{run_id}", "overrides": resume_overrides(r)})
    found["resume"] = _flow_runs(r, resume_id)
    found["paths"] = {host: _in_host_json(r, host, ["paths", "--mlflow", r.mlflow_uri, "--store", r.store,
                                                    "--run-id", run_id]) for host in HOSTS}
    return found


def _placement_errors(found: dict, seen: list[dict], ns_of: dict[str, list[int]]) -> list[str]:
    """Processes that ran outside their machine's namespaces, and flow runs whose processes ran on
    another host than their pool's."""
    host_of_pool = {pool: host for host, pool in POOLS.items()}
    pool_of_run = {x["id"]: x["pool"] for key in ("train", "resume") for x in found.get(key, [])}
    errors = []
    for p in seen:
        expected = ns_of.get(p["host"])
        if expected is not None and [p["mnt"], p["net"]] != expected:
            errors.append(f"pid {p['pid']} of {p['host']} ran in other namespaces: {p['cmd'][:80]}")
        want = host_of_pool.get(pool_of_run.get(p["flow_run_id"], ""))
        if want is not None and p["host"] != want:
            errors.append(f"pid {p['pid']} of flow run {p['flow_run_id']} ran on {p['host']}, its pool is {want}'s")
    return errors


def verdicts(found: dict, seen: list[dict], leftovers: list[str]) -> list[tuple[str, str, bool]]:
    """(check, value, ok) for every claim of the rehearsal, from its findings (pure)."""
    out = []
    iso = found.get("isolation", {})
    for host in (*HOSTS, SYNC):  # a host that was not checked fails
        got = iso.get(host, {})
        hidden = got.get("hidden", {})
        sealed = bool(hidden) and all(not h["entries"] and h["tmpfs"] and not h["writable"] for h in hidden.values())
        probes = set(got.get("probes", {}).values())
        out.append((f"{host}: other machines' folders hidden", f"{len(hidden)} empty read-only tmpfs",
                    sealed and got.get("own_checkout") is True and probes == {"not found"}
                    and [got.get("mnt_ns"), got.get("net_ns")] == got.get("worker_ns")))
    ns_of = {h: got["worker_ns"] for h, got in iso.items() if "worker_ns" in got}
    for key, regions in (("train", ["region-a", "region-b"]), ("resume", ["region-b", "region-a"])):
        runs = found.get(key, [])
        pools = [x["pool"] for x in runs[1:]]
        ok = bool(runs) and all(x["state"] == "COMPLETED" for x in runs) and pools == regions
        out.append((f"{key}: flow run and learner flow runs completed", f"{[x['state'] for x in runs]} on {pools}", ok))
    out.append(("resume ran on host-b, learners swapped hosts", str([x["pool"] for x in found.get("resume", [])]),
                [x["pool"] for x in found.get("resume", [])][:1] == [POOLS["host-b"]]))
    errors = _placement_errors(found, seen, ns_of)
    hosts_seen = sorted({p["host"] for p in seen if p["flow_run_id"]})
    out.append(("every process ran in its machine's namespaces", f"{len(seen)} processes, {len(errors)} outside",
                not errors and hosts_seen == sorted([*HOSTS, SYNC])))
    for host in HOSTS:
        got = found.get("paths", {}).get(host, {})
        res = got.get("resolved", [])
        bad = [f"{x['where']}: {x['value']} ({x['error']})" for x in res if x["error"]]
        out.append((f"recorded paths open from {host}", f"{len(res) - len(bad)}/{len(res)}; " + "; ".join(bad[:3]),
                    bool(res) and not bad and got.get("checkpoint_seq") is not None))
    out.append(("nothing left (namespaces, processes, mounts)", "; ".join(leftovers) or "none", not leftovers))
    return out


def _leftovers(r: Rehearsal, removed: list[str]) -> list[str]:
    from diloco_async.wan.netns_core import list_netns

    left = list(removed)
    left += [f"netns {ns}" for ns in list_netns() if r.net is not None and ns.startswith(r.net.name)]
    with open("/proc/self/mountinfo") as fh:
        left += [f"mount {line.split()[4]}" for line in fh if str(r.folder) in line.split()[4]]
    return left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco_async.flows.rehearsal", description=__doc__.split("\n")[0])
    parser.add_argument("--folder", type=Path, default=Path(".local/rehearse-hosts") / time.strftime("%Y%m%d-%H%M%S"),
                        help="the machines' disks and result.json (must not exist)")
    parser.add_argument("--prefix", default="dlh", help="prefix of the namespaces ([a-z][a-z0-9]{0,5})")
    ns = parser.parse_args(argv)
    if ns.folder.exists() and any(ns.folder.iterdir()):
        parser.error(f"--folder {str(ns.folder)!r} is not empty: give a new folder")
    reason = refusal()
    if reason is not None:
        print(f"rehearse-hosts refused: {reason}", file=sys.stderr)
        return 2
    found: dict = {}
    r = Rehearsal(ns.folder, ns.prefix)
    watch = ProcessWatch(r.marker)
    try:
        with r:
            watch.start()
            try:
                found = rehearse(r)
            except Exception as err:  # the verdicts name what was not reached
                found["error"] = f"{type(err).__name__}: {err}"
                print(r.logs_tail(), file=sys.stderr)
            watch.stop()
    finally:
        removed = r.close()
    result = {**found, "marker": r.marker, "processes": list(watch.seen.values()),
              "leftovers": _leftovers(r, removed)}
    table = verdicts(found, result["processes"], result["leftovers"])
    result["verdicts"] = [{"check": c, "value": v, "ok": ok} for c, v, ok in table]
    (r.folder / "result.json").write_text(json.dumps(result, indent=1, default=str))
    if "error" in found:
        print(f"rehearsal stopped: {found['error']}", file=sys.stderr)
    print(f"{'check':<52} {'ok':<5} value")
    for check, value, ok in table:
        print(f"{check:<52} {'ok' if ok else 'FAIL':<5} {value[:160]}")
    print(f"result: {r.folder / 'result.json'}")
    return 0 if all(ok for _, _, ok in table) and "error" not in found else 1


if __name__ == "__main__":
    sys.exit(main())
