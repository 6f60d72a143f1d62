"""A tiny Decoupled DiLoCo run across an emulated WAN link, as one process (run by
tests/system/test_wan_netns.py as a child, so that a test can SIGKILL it mid-run).

``python tests/wan_tiny_run.py --prefix P --workdir DIR [--learners 1] [--mbit 4]``:

1. builds a :class:`~diloco_async.wan.netns.WanNet` (hub + region ``r0``, ``--mbit`` both ways)
   and verifies the link (the run refuses to start outside ±15 %);
2. enters the hub namespace (this process drives the run from there), starts moto's S3 server in
   the hub and makes the bucket;
3. starts the synchronizer in the hub (``synchronizer.host`` = the hub's address) and the learners
   in ``r0`` through a :class:`~diloco_async.wan.launch.NetnsLauncher` over a fork server;
4. waits for the token budget to end the run, and writes ``{workdir}/result.json`` (verified
   rates, link bytes during the run, summary). ``{workdir}/progress.json`` says how far it got
   (``"stage"``: ``verified``, ``started``, ``merging``, ``done``) with the pids it started.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tiny_recipe import tiny_recipe_text  # noqa: E402

from diloco_async.config.schema import load_config  # noqa: E402
from diloco_async.run import RunProcesses  # noqa: E402
from diloco_async.runtime.procs import ForkServerLauncher  # noqa: E402
from diloco_async.storage import keys  # noqa: E402
from diloco_async.wan.launch import NetnsLauncher, start_moto_server  # noqa: E402
from diloco_async.wan.netns import LinkSpec, WanNet, enter_netns  # noqa: E402

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
          "AWS_DEFAULT_REGION": "us-east-1"}
PRELOAD = ["torch", "diloco_async.learner", "diloco_async.server"]
RUN_TIMEOUT_S = 240.0


def recipe(workdir: Path, endpoint: str, hub_addr: str, learners: int, tokens: int) -> Path:
    """The tiny recipe of the system tests (tests/tiny_recipe.py), its store on moto in the hub."""
    run = f'store = "s3://wan-tiny/runs"\nworkdir = "{workdir}/runs"\n[run.storage_options.client_kwargs]\n' \
          f'endpoint_url = "{endpoint}"'
    text = tiny_recipe_text(learners, run=run, budget=f"tokens = {tokens}\nwall_s = 120",
                            synchronizer=f'host = "{hub_addr}"', checkpoint_every_s=5.0)
    path = workdir / "tiny-wan.toml"
    path.write_text(text)
    return path


def progress(workdir: Path, **fields) -> None:
    tmp = workdir / "progress.json.tmp"
    tmp.write_text(json.dumps(fields))
    tmp.replace(workdir / "progress.json")


def drive(net: WanNet, endpoint: str, workdir: Path, learners: int, tokens: int) -> dict:
    """Run the tiny recipe with the synchronizer in the hub and the learners in ``r0``."""
    import fsspec

    path = recipe(workdir, endpoint, net.hub_addr, learners, tokens)
    cfg = load_config(str(path), [])
    fsspec.filesystem("s3", **cfg.run.storage_options).mkdir("wan-tiny")
    inner = ForkServerLauncher(workdir / "logs", preload=PRELOAD)
    launcher = NetnsLauncher(inner, lambda name: net.ns_of(None if name == "synchronizer" else "r0"))
    rp = RunProcesses(cfg, launcher=launcher)
    try:
        sync_url = rp.start_synchronizer()
        for i in range(learners):
            rp.start_learner(i)
        pids = {"synchronizer": rp.sync.pid, **{k: h.pid for k, h in rp.learners.items()}}
        progress(workdir, stage="started", name=net.name, sync_url=sync_url, pids=pids)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while rp.sync.poll() is None and time.monotonic() < deadline:
            rp.supervise()
            status = rp.status()
            if status and status["merges"] > 0:
                progress(workdir, stage="merging", name=net.name, sync_url=sync_url, pids=pids,
                         merges=status["merges"])
            time.sleep(0.5)
        code = rp.sync.wait(timeout=60)
        rp.finished_cleanly = code == 0
    finally:
        rp.stop_all()
    summary = rp.store.get_json(keys.summary_key(rp.run_id, str(rp.epoch)))
    return {"sync_url": sync_url, "sync_exit": code, "pids": pids, "summary": summary}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--learners", type=int, default=1)
    parser.add_argument("--mbit", type=float, default=4.0)
    parser.add_argument("--tokens", type=int, default=40_000)
    args = parser.parse_args()
    os.environ.update(S3_ENV)
    args.workdir.mkdir(parents=True, exist_ok=True)
    with WanNet([LinkSpec("r0", up_mbit=args.mbit, down_mbit=args.mbit)], prefix=args.prefix) as net:
        progress(args.workdir, stage="verified", name=net.name, verified=net.verified)
        enter_netns(net.hub_ns)  # this process drives the run from the hub (before any thread starts)
        endpoint, stop_moto = start_moto_server(net)
        try:
            result = drive(net, endpoint, args.workdir, args.learners, args.tokens)
        finally:
            stop_moto()
        counters = net.link_counters()
        run_bytes = {r: {k: counters[r][k] - net.counters_at_ready[r][k] for k in counters[r]} for r in counters}
        result.update(name=net.name, hub_addr=net.hub_addr, hub_ns=net.hub_ns, verified=net.verified,
                      link_bytes=run_bytes, region_ns=net.ns_of("r0"))
    (args.workdir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    progress(args.workdir, stage="done", name=result["name"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
