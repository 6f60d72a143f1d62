"""A poisoned learner among three honest ones, real processes (issue 14, item 3).

The fourth learner sends its outer gradients x 1e6 (``faults.poison``): every one of them is
rejected as ``norm_outlier``, nothing non-finite or huge is published, and the run still trains.
How close its held-out loss stays to that of the three honest learners alone is a quality claim
judged over seeds: ``make bench-poison`` (benchmarks/poison.py: within 2% of the honest run's, at
make run's recipe, for scale, sign flip and constant poison). Here no honest run is made, only a
floor that a run wrecked by its poisoner would not reach.
"""

from __future__ import annotations

import pytest
from test_integration import tiny_recipe

from benchmarks.poison import run_once
from diloco_async.config.schema import load_config

pytestmark = [pytest.mark.timeout(600)]

#: the poisoned run's held-out loss must end this far below its initial loss (~5.5 nats/byte): an honest
#: run of this size ends ~2.5 nats lower and a poisoned one that the guards hold ~2.3 (the 2% bar
#: against an honest run is make bench-poison's); a run wrecked by its poisoner covers little of it
PROGRESS_FLOOR_NATS = 1.0


def assert_trained(poisoned: dict) -> None:
    progress = poisoned["initial_loss"] - poisoned["loss"]
    assert progress >= PROGRESS_FLOOR_NATS, (poisoned["loss"], poisoned["initial_loss"])


def test_scaled_poison_rejected_and_loss_kept(tmp_path):
    recipe = str(tiny_recipe(tmp_path, learners=3, wall_s=240))
    # 960 steps: on a loaded machine the poisoner (started last) can lose its first rounds to lateness,
    # and a late contribution is dropped before it is judged; 160 once left it no judged contribution,
    # and 320 (about 2 s of this tiny model's training) once ended before it was ready: it started
    # 2.3 s after the others under CI's load
    common = [f"run.workdir={tmp_path}/runs", "budget.max_steps=960"]
    poisoned = run_once(load_config(recipe, [*common, "learners.count=4",
                                             'faults.poison=["none", "none", "none", "scale"]']), timeout_s=280)
    print(f"poisoned: {poisoned}")
    assert poisoned["global_step"] >= 960
    assert poisoned["all_finite"] and poisoned["max_abs_published"] < 100, poisoned
    rejected = poisoned["rejected_by_reason"]
    assert rejected.get("norm_outlier", 0) >= 3, rejected
    assert set(rejected) <= {"norm_outlier", "too_stale"}, rejected
    poisoner = poisoned["learners"]["learner-3"]
    assert poisoner.get("merged", 0) == 0 and poisoner.get("rejected", 0) >= 3, poisoned["learners"]
    # the guard's false positives: an honest contribution anchored far from its base was once rejected
    # (1 of 64 under CI load), so honest rejections are bounded at 5% of honest merges, not forbidden
    honest = [d for lid, d in poisoned["learners"].items() if lid != "learner-3"]
    honest_rejected = sum(d.get("rejected", 0) for d in honest)
    assert honest_rejected <= 0.05 * sum(d.get("merged", 0) for d in honest), poisoned["learners"]
    assert_trained(poisoned)


def test_sign_flipped_poison_left_out_by_the_direction_guard(tmp_path):
    """A fourth learner sends the negative of its outer gradient (its norm is the honest one, so
    the norm guard passes it): once the direction guard is warm, its contributions are left out as
    direction_outlier (from its second anti-aligned one on: direction_memory), an honest one at most
    now and then, and the run still trains (the loss against an honest run's: make bench-poison)."""
    recipe = str(tiny_recipe(tmp_path, learners=3, wall_s=240))
    # K = 3: every round holds 3 or more contributions, a majority to judge the fourth by
    common = [f"run.workdir={tmp_path}/runs", "budget.max_steps=720", "synchronizer.min_quorum=3"]  # see above
    poisoned = run_once(load_config(recipe, [*common, "learners.count=4",
                                             'faults.poison=["none", "none", "none", "sign_flip"]']), timeout_s=280)
    print(f"poisoned: {poisoned}")
    rejected = poisoned["rejected_by_reason"]
    poisoner = poisoned["learners"]["learner-3"]
    assert rejected.get("direction_outlier", 0) >= 3, rejected
    # the guard's false positives: an honest learner's contribution was left out in 3 of about 30
    # runs on the 2-core machine, one each time (e.g. its last four cosines 0.356, -0.173, -0.615, -0.444 against
    # a usual 0.312, late in a run under make test's load); so they are bounded at 2% of honest
    # merges, not forbidden
    honest = [d for lid, d in poisoned["learners"].items() if lid != "learner-3"]
    honest_rejected = sum(d.get("rejected", 0) for d in honest)
    assert honest_rejected <= 0.02 * sum(d.get("merged", 0) for d in honest), poisoned["learners"]
    # once judged, the poisoner moves nothing: its merges with weight outnumbered by those left out or
    # merged at zero weight (its first anti-aligned contribution, and those before the guard is warm)
    weighted = poisoner.get("merged", 0) - poisoner.get("zero_weight", 0)
    assert poisoner.get("rejected", 0) + poisoner.get("zero_weight", 0) > weighted, poisoner
    assert_trained(poisoned)
