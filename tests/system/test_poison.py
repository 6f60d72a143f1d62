"""A poisoned learner among three honest ones, real processes (issue 14, item 3; make bench-poison
measures the same at make run's recipe).

The fourth learner sends its outer gradients x 1e6 (``learners.poison``): every one of them is
rejected as ``norm_outlier``, nothing non-finite or huge is published, and the held-out loss stays
close to that of the three honest learners alone (the poisoner's slot left empty, so each keeps its data
shard), stopped at the same global step.
"""

from __future__ import annotations

import pytest
from test_integration import tiny_recipe

from benchmarks.poison import run_once

pytestmark = [pytest.mark.timeout(600)]

# at this scale two honest runs differ by up to ~10% in final loss (baselines 2.80-3.09 nats over 8 runs
# of the sign-flip test; a poisoned run once ended at 3.22 against a lucky 2.78), so the bar is on
# progress: the poisoned run must cover most of the honest run's way down from the initial loss
# (~5.5 nats/byte). A run wrecked by its poisoner covers little of it. The loss bar proper (2%, several
# seeds) is make bench-poison at make run's recipe.
PROGRESS_FLOOR = 0.75


def assert_progress_kept(poisoned: dict, base: dict) -> None:
    progress = poisoned["initial_loss"] - poisoned["loss"]
    honest = base["initial_loss"] - base["loss"]
    assert honest > 1.0, base  # the honest run learned something to compare with
    assert progress >= PROGRESS_FLOOR * honest, (poisoned["loss"], base["loss"], base["initial_loss"])


def test_scaled_poison_rejected_and_loss_kept(tmp_path):
    recipe = str(tiny_recipe(tmp_path, learners=3, wall_s=240))
    # 960 steps: on a loaded machine the poisoner (started last) can lose its first rounds to lateness,
    # and a late contribution is dropped before it is judged; 160 once left it no judged contribution,
    # and 320 (about 2 s of this tiny model's training) once ended before it was ready: it started
    # 2.3 s after the others under CI's load
    common = [f"run.workdir={tmp_path}/runs", "budget.max_steps=960"]
    base = run_once(recipe, [*common, "learners.count=4"], timeout_s=280, started=3)  # the poisoner's slot empty
    poisoned = run_once(recipe, [*common, "learners.count=4", 'learners.poison=["none", "none", "none", "scale"]'],
                        timeout_s=280)
    print(f"baseline: {base}\npoisoned: {poisoned}")
    assert base["global_step"] >= 960 and poisoned["global_step"] >= 960
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
    assert_progress_kept(poisoned, base)


def test_sign_flipped_poison_left_out_by_the_direction_guard(tmp_path):
    """A fourth learner sends the negative of its outer gradient (its norm is the honest one, so
    the norm guard passes it): once the direction guard is warm, its contributions are left out as
    direction_outlier (from its second anti-aligned one on: direction_memory), an honest one at most
    now and then, and the loss stays close to the honest run's."""
    recipe = str(tiny_recipe(tmp_path, learners=3, wall_s=240))
    # K = 3: every round holds 3 or more contributions, a majority to judge the fourth by
    common = [f"run.workdir={tmp_path}/runs", "budget.max_steps=720", "synchronizer.min_quorum=3"]  # see above
    base = run_once(recipe, [*common, "learners.count=4"], timeout_s=280, started=3)  # the poisoner's slot empty
    poisoned = run_once(recipe, [*common, "learners.count=4",
                                 'learners.poison=["none", "none", "none", "sign_flip"]'], timeout_s=280)
    print(f"baseline: {base}\npoisoned: {poisoned}")
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
    assert_progress_kept(poisoned, base)
