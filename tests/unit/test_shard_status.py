"""The run's figures from its shards' (diloco_async.metrics.shards; issue 40 item 3, DESIGN §2.2):
what every shard sees is taken once, what a shard owns is summed, and a run split over two shards
reads as the same run on one."""

from __future__ import annotations

import pytest

from diloco_async.metrics.goodput import LearnerLedger, totals
from diloco_async.metrics.shards import aggregate_learner, aggregate_status


def learner(provisioned_s: float, useful_s: float, tokens: int, merged: float, *, thrown_s: float = 0.0,
            stalled_s: float = 0.0, outcomes: dict | None = None, up: int = 0, down: int = 0, live: bool = True,
            step: int = 10, age_s: float = 0.5) -> dict:
    led = LearnerLedger(provisioned_s=provisioned_s, useful_s=useful_s, tokens_processed=tokens, tokens_merged=merged,
                        contributions=dict(outcomes or {}), badput_s={"thrown_away": thrown_s, "stalled": stalled_s})
    return {**led.to_json(), "live": live, "step": step, "incarnation": 0, "compute_goodput": led.compute_goodput,
            "token_goodput": led.token_goodput, "bytes_up": up, "bytes_down": down, "heartbeat_age_s": age_s}


def shard_doc(p: int, learners: dict[str, dict], *, merges: int, epoch: str, version: int, uptime: float = 1.0,
              phase: str = "running", finished: bool = False, stop: str | None = None, wall_s: float = 10.0,
              up: int = 0, down: int = 0, rejected: dict | None = None, age_s: float = 1.0) -> dict:
    ledgers = {lid: LearnerLedger.from_json(row) for lid, row in learners.items()}
    tokens = sum(led.tokens_processed for led in ledgers.values())
    return {"run_id": "r", "epoch": epoch, "stop_reason": stop, "stopping": stop, "wall_s": wall_s,
            **totals(ledgers), "uptime": uptime, "merges": merges, "contributions_merged": merges,
            "contributions_late": 1, "contributions_rejected": 0, "rejected_by_reason": dict(rejected or {}),
            "versions": {str(p): version}, "bytes_in": up, "bytes_out": down, "global_step": 40,
            "bytes_by_fragment": {str(p): {"bytes_up": up, "bytes_down": down}, str(1 - p): {"bytes_up": 0,
                                                                                             "bytes_down": down}},
            "bytes_up_per_token": up / tokens, "learners": learners, "phase": phase, "finished": finished,
            "rounds": [{"fragment": p, "round": version + 1}], "metrics_total": 5,
            "recent_merges": [{"fragment": p, "round": version, "version": version, "learners": [], "age_s": age_s}]}


def test_one_shard_reads_exactly_as_its_own_status():
    doc = shard_doc(0, {"L": learner(10, 5, 100, 50)}, merges=3, epoch="e0", version=3)
    assert aggregate_status([doc]) == doc
    assert aggregate_status([doc]) is not doc  # a copy: the caller may change it


def test_a_learner_seen_by_two_shards_counts_its_time_and_tokens_once_and_its_merges_twice():
    a = learner(10.0, 3.0, 1000, 400.0, thrown_s=1.0, stalled_s=2.0, outcomes={"merged": 2}, up=30, down=50,
                age_s=0.9)
    b = learner(10.4, 4.0, 1010, 500.0, thrown_s=0.5, stalled_s=2.5, outcomes={"merged": 3, "late": 1}, up=20,
                down=55, live=False, step=12, age_s=0.2)
    row = aggregate_learner([a, b])
    assert (row["provisioned_s"], row["tokens_processed"], row["step"]) == (10.4, 1010, 12)  # seen by both: largest
    assert (row["useful_s"], row["tokens_merged"], row["bytes_up"]) == (7.0, 900.0, 50)  # owned: summed
    assert row["badput_s"]["thrown_away"] == 1.5 and row["badput_s"]["stalled"] == 2.5
    assert row["contributions"] == {"merged": 5, "late": 1}
    assert row["compute_goodput"] == pytest.approx(7.0 / 10.4) and row["token_goodput"] == pytest.approx(900 / 1010)
    assert row["live"] and row["heartbeat_age_s"] == 0.2 and row["bytes_down"] == 55
    with pytest.raises(ValueError, match="at least one shard"):
        aggregate_learner([])


def test_a_run_split_over_two_shards_reads_as_the_same_run_on_one():
    """One synchronizer's learner ledger, split by fragment share (0.25 / 0.75) over two shards that
    both hear every heartbeat: the aggregate has the one synchronizer's goodputs and badput."""
    whole = {"L0": learner(20.0, 12.0, 4000, 3000.0, thrown_s=2.0, stalled_s=1.0),
             "L1": learner(18.0, 6.0, 2000, 1000.0, thrown_s=4.0, stalled_s=3.0)}
    one = shard_doc(0, whole, merges=10, epoch="e", version=5)

    def part(share: float) -> dict[str, dict]:
        return {lid: learner(r["provisioned_s"], r["useful_s"] * share, r["tokens_processed"],
                             r["tokens_merged"] * share, thrown_s=r["badput_s"]["thrown_away"] * share,
                             stalled_s=r["badput_s"]["stalled"])
                for lid, r in whole.items()}

    run = aggregate_status([shard_doc(0, part(0.25), merges=4, epoch="a", version=2),
                            shard_doc(1, part(0.75), merges=6, epoch="b", version=3)])
    for key in ("compute_goodput", "token_goodput", "useful_s", "provisioned_s", "tokens_merged", "tokens_processed"):
        assert run[key] == pytest.approx(one[key]), key
    assert run["badput_s"] == pytest.approx(one["badput_s"]) and run["badput"] == pytest.approx(one["badput"])
    assert run["merges"] == 10 and run["contributions_late"] == 2 and run["metrics_total"] == 10
    assert run["versions"] == {"0": 2, "1": 3} and run["epoch"] == "a+b"


def test_run_figures_bytes_rounds_and_a_row_per_shard():
    l0 = {"L": learner(10, 5, 100, 50, up=40, down=70)}
    s0 = shard_doc(0, l0, merges=3, epoch="e0", version=3, uptime=1.0, up=40, down=70, rejected={"stale": 2},
                   wall_s=11.0, age_s=3.0)
    s1 = shard_doc(1, l0, merges=1, epoch="e1", version=1, uptime=0.5, up=60, down=60, rejected={"stale": 1, "x": 1},
                   phase="draining", stop="budget: tokens 100 >= 100", age_s=0.5)
    run = aggregate_status([s0, s1], urls=["http://a", "http://b"])
    assert run["bytes_by_fragment"]["0"]["bytes_up"] == 40 and run["bytes_by_fragment"]["1"]["bytes_up"] == 60
    assert run["bytes_by_fragment"]["1"]["bytes_down"] == 70  # downloads every shard heard of: the largest
    assert run["bytes_up_per_token"] == pytest.approx(100 / 100) and run["bytes_in"] == 100 and run["bytes_out"] == 70
    assert run["rejected_by_reason"] == {"stale": 3, "x": 1}
    assert run["uptime"] == pytest.approx(0.75) and run["wall_s"] == 11.0
    assert run["stop_reason"] == "budget: tokens 100 >= 100" and run["phase"] == "running/draining"
    assert [r["fragment"] for r in run["rounds"]] == [0, 1]
    assert [m["fragment"] for m in run["recent_merges"]] == [1]  # the newest of all, as many as a shard lists
    assert [(r["shard"], r["url"], r["merges"], r["versions"]) for r in run["shards"]] == [
        (0, "http://a", 3, {"0": 3}), (1, "http://b", 1, {"1": 1})]
    assert not run["finished"]


def test_a_shard_that_does_not_answer_is_a_row_not_a_failure():
    s0 = shard_doc(0, {"L": learner(10, 5, 100, 50)}, merges=3, epoch="e0", version=3, finished=True)
    run = aggregate_status([s0, None], urls=["http://a", "http://b"])
    assert run["shards"][1] == {"shard": 1, "url": "http://b", "reachable": False}
    assert run["merges"] == 3 and run["epoch"] == "e0+?" and not run["finished"]  # not every shard is done
    with pytest.raises(ValueError, match="none of the 2 synchronizer shard"):
        aggregate_status([None, None])
    with pytest.raises(ValueError, match="1 shard URL"):
        aggregate_status([s0, None], urls=["http://a"])


def test_undeliverable_contributions_counted_once_by_the_fragments_owner():
    """Learners tell every shard what they could not deliver: each fragment's count is the largest
    any shard heard (the owner may be the one they cannot reach); a shard's row counts its fragments."""
    l0 = {"L": {**learner(10, 5, 100, 50), "undeliverable": 3}}
    s0 = shard_doc(0, l0, merges=3, epoch="e0", version=3)
    s1 = shard_doc(1, {"L": learner(10, 5, 100, 50)}, merges=1, epoch="e1", version=1)
    s0["undeliverable_by_fragment"], s1["undeliverable_by_fragment"] = {"1": 3}, {"1": 1}
    run = aggregate_status([s0, s1])
    assert run["undeliverable_by_fragment"] == {"1": 3} and run["contributions_undeliverable"] == 3
    assert [r["contributions_undeliverable"] for r in run["shards"]] == [0, 3]
    assert run["learners"]["L"]["undeliverable"] == 3


def test_a_learners_undeliverable_counts_survive_its_restarts_and_the_shards_resume():
    from diloco_async.sync.undeliverable import Undeliverable

    u = Undeliverable()
    assert u.heartbeat("L", 0, {1: 2}) == 2 and u.heartbeat("L", 0, {1: 2}) == 0  # the same report again
    assert u.heartbeat("L", 1, {1: 1, 0: 1}) == 2  # a new incarnation reports from 0
    assert u.by_fragment() == {"0": 1, "1": 3} and u.total({1}) == 3 and u.learner_total("L") == 4
    again = Undeliverable()
    again.restore(u.to_json())  # a checkpoint: the next report adds only what is new
    assert again.heartbeat("L", 1, {1: 2, 0: 1}) == 1 and again.by_fragment() == {"0": 1, "1": 4}
