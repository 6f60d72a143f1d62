"""A golden quality test (issue 44 item 6): a short replayed run of ``make run``'s recipe, shrunk,
through the Python API, whose final held-out loss is pinned.

``run.schedule = "replay"`` makes the run the same run whatever the machine's load (the order of
contributions, rounds and adoptions follows a seeded virtual clock; test_replay_run.py shows the
same version digests beside a CPU hog), so the final loss is one number for a given code, recipe
and torch build. A change that moves the model's quality moves it and fails here, even when
everything else passes; a change meant to move it updates :data:`GOLDEN_LOSS` in the same commit
and says why.

Tolerance: :data:`TOLERANCE_NATS`. Replay is bit for bit on one machine and build (pinned at
2.515054 on the 2-core CI machine, torch 2.13.0 CPU; the same to the last digit twice more, once
beside a ``make setup``); another CPU's SIMD width or another torch build changes float sums, which
the tolerance allows for. What it catches, measured when it was pinned (50 merges): the outer
learning rate 0.7 → 0.6 moves the loss to 2.474179 (−0.041), the inner learning rate 3e-3 → 9e-4
to 2.480413 (−0.035). The direction guard off changed nothing then: its rounds held fewer than the
three contributions it judges (late contributions that wait for the next round make some rounds of
three since).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: the final held-out loss (nats/token) of the run below: 2.515054 when the test was written; 2.451109
#: since a late contribution waits for its fragment's next round instead of being thrown away (issue
#: 47, DESIGN §3; the same code with waiting turned off still gives 2.515054); 2.445034 since the
#: direction guard's weight ramp ends at 0.3 of the usual agreement, not 0.5 (issue 47,
#: guard.direction_weight_fraction; the same code with it at 0.5 still gives 2.451109); 2.451017
#: since the ramp is back at 0.5 for contributions of the usual size and lower for smaller ones
#: (guard.direction_weight_size_power 0.5; with 0.3 and power 0 the same code still gives 2.445034)
GOLDEN_LOSS = 2.451017
#: how far the final loss may move before the test fails (nats/token)
TOLERANCE_NATS = 0.005

#: the recipe: make run's (configs/default.toml) with a smaller model, 3 learners of seeded virtual
#: speeds, replayed; the budget is a few hundred inner steps per learner
OVERRIDES = ["run.schedule=\"replay\"", "run.seed=3", "replay.step_s=0.5", "replay.speed_spread=0.5",
             "faults.step_jitter=0.2", "model.n_layer=2", "model.d_model=64", "model.n_head=2",
             "model.context=64", "learners.count=3", "learners.batch_size=8", "synchronizer.num_fragments=2",
             "synchronizer.sync_every=20", "synchronizer.checkpoint_every_s=100000",
             "budget.tokens=400000", "budget.wall_s=1200", "data.eval_batches=8"]

_SCRIPT = """
import json, sys
import diloco_async
tmp = sys.argv[1]
summary = diloco_async.train("default", [f"run.store=file://{tmp}/store", f"run.workdir={tmp}/runs",
                                         *json.loads(sys.argv[2])], poll_s=1.0)
print("RESULT " + json.dumps(summary))
"""


def replayed_summary(tmp_path: Path, overrides: list[str]) -> dict:
    """Run the replayed recipe with ``overrides`` to its end; its summary."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path), json.dumps(overrides)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))[7:])


def test_the_replayed_run_ends_at_the_pinned_held_out_loss(tmp_path):
    summary = replayed_summary(tmp_path, OVERRIDES)
    assert summary["stop_reason"].startswith("token budget"), summary["stop_reason"]
    final = summary["eval_loss_final"]
    print(f"final held-out loss {final:.6f} nats/token (golden {GOLDEN_LOSS:.6f}), {summary['merges']} merges")
    assert final == pytest.approx(GOLDEN_LOSS, abs=TOLERANCE_NATS), (
        f"the replayed run's final held-out loss is {final:.6f} nats/token, the golden value {GOLDEN_LOSS:.6f} "
        f"(tolerance {TOLERANCE_NATS}): this change moved the model's quality; if it was meant to, pin the new "
        "value here and say why in the commit")
