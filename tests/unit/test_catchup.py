"""The catch-up policies of a learner slower than the versions (issue 47): which version it
downloads, and which versions garbage collection keeps for the learners' reads."""

from __future__ import annotations

import pytest

from diloco_async.policy.catchup import ReadLeases, version_to_fetch


def test_the_newest_version_told_is_fetched_and_the_ones_between_are_skipped():
    choice = version_to_fetch(told=9, held=4)
    assert (choice.version, choice.skipped) == (9, 4)  # v5..v8 never downloaded
    assert "newest told v9" in choice.reason and "skipping 4" in choice.reason
    assert (version_to_fetch(told=5, held=4).version, version_to_fetch(told=5, held=4).skipped) == (5, 0)


def test_nothing_is_fetched_that_is_held_or_known_collected():
    assert version_to_fetch(told=None, held=-1).version is None
    held = version_to_fetch(told=4, held=4)
    assert held.version is None and held.reason == "v4 told, v4 held"
    assert version_to_fetch(told=3, held=4).version is None  # a late answer told an older one
    gone = version_to_fetch(told=7, held=4, gone=7)
    assert gone.version is None and "collected" in gone.reason  # never retried: wait for a newer one
    newer = version_to_fetch(told=8, held=4, gone=7)
    assert (newer.version, newer.skipped) == (8, 0)  # v5, v6 were skipped before v7 was tried


def test_a_lease_keeps_the_read_in_progress_and_everything_from_the_known_version_up():
    leases = ReadLeases(max_behind=64)
    leases.joined("A", {0: 3, 1: 5})
    assert leases.keep(["A"], {0: 6, 1: 5}) == {0: {3, 4, 5, 6}, 1: {5}}
    leases.heartbeat("A", known={0: 6}, fetching={0: 3})  # still reading v3; told of v6; fragment 1 unnamed
    assert leases.keep(["A"], {0: 9, 1: 7}) == {0: {3, 6, 7, 8, 9}, 1: {5, 6, 7}}
    leases.heartbeat("A", known={0: 9, 1: 7}, fetching={})  # the read ended
    assert leases.keep(["A"], {0: 9, 1: 7}) == {0: {9}, 1: {7}}


def test_leases_are_the_union_over_live_learners_only():
    leases = ReadLeases(max_behind=64)
    leases.joined("A", {0: 2})
    leases.joined("B", {0: 5})
    leases.heartbeat("B", known={0: 6}, fetching={0: 4})
    assert leases.keep(["A", "B"], {0: 7}) == {0: {2, 3, 4, 5, 6, 7}}
    assert leases.keep(["B"], {0: 7}) == {0: {4, 6, 7}}  # A's heartbeats lapsed: its lease ended
    assert leases.keep([], {0: 7}) == {}
    assert leases.keep(["C"], {0: 7}) == {}  # never joined: no claim


def test_a_lease_holds_nothing_further_behind_than_max_behind():
    leases = ReadLeases(max_behind=2)
    leases.joined("liar", {0: 0})  # claims it may still read v0 of a run at v100
    leases.heartbeat("liar", known={0: 0}, fetching={0: 1})
    assert leases.keep(["liar"], {0: 100}) == {0: {98, 99, 100}}
    assert ReadLeases(max_behind=0).keep([], {0: 1}) == {}
    with pytest.raises(ValueError, match="max_behind must be >= 0 versions, got -1"):
        ReadLeases(max_behind=-1)
