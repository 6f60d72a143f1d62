"""The Prefect `synchronizer` flow serves one shard of a run (issue 40 item 4): two flow runs, one
per shard index, both given the run id, each own their shard's fragments on their own port and
lease, and end Completed. Real flow runs against the session's Prefect server, as the
`synchronizer` deployment would start them (one per work pool or host)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from diloco_async.storage import keys

ROOT = Path(__file__).resolve().parents[2]

_FLOW = """
import json, sys
from diloco_async.flows.deployments import synchronizer
out = synchronizer(config="configs/default.toml", overrides=json.loads(sys.argv[1]), run_id=sys.argv[2],
                   ready_file=sys.argv[3], shard=int(sys.argv[4]))
print("RESULT " + json.dumps(out))
"""


def test_a_synchronizer_flow_run_per_shard_serves_its_own_fragments(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    run_id = "20261206-000000-shards"
    overrides = [f"run.store=file://{tmp_path}/store", "synchronizer.shards=2", "synchronizer.num_fragments=4",
                 "synchronizer.port=0", "budget.wall_s=8", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
                 "model.context=32"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_API_URL": PREFECT_API_URL.value(),
           "DILOCO_RUN_TOKEN": "a-run-secret-of-at-least-32-characters-here"}
    procs = [subprocess.Popen([sys.executable, "-c", _FLOW, json.dumps(overrides), run_id,
                               str(tmp_path / f"ready-{i}.json"), str(i)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    results = [json.loads(next(ln for ln in o.splitlines() if ln.startswith("RESULT "))[7:]) for o in outs]
    assert [(r["run_id"], r["shard"]) for r in results] == [(run_id, 0), (run_id, 1)]
    ready = [json.loads((tmp_path / f"ready-{i}.json").read_text()) for i in (0, 1)]
    assert [(r["shard"], r["shards"]) for r in ready] == [(0, 2), (1, 2)]
    assert ready[0]["url"] != ready[1]["url"]
    # each shard's lease and checkpoints under its own root; fragments p mod 2 = shard
    store = tmp_path / "store"
    for i in (0, 1):
        root = store / keys.synchronizer_root(run_id, i, 2)
        assert (root / "checkpoints").is_dir(), sorted(p.name for p in root.iterdir())
    with get_client(sync_client=True) as client:
        ours = [r for r in client.read_flow_runs(limit=200) if r.parameters.get("run_id") == run_id]
    assert sorted((r.parameters["shard"], r.state_type.value) for r in ours) == [(0, "COMPLETED"), (1, "COMPLETED")]
