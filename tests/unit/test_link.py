"""The learner's link-bound check (diloco_async/learner/link.py, issue 13 item 4)."""

from __future__ import annotations

import logging

import pytest

from diloco_async.learner.link import LinkMeter, link_budget_s


def test_budget_is_h_over_p_inner_steps():
    assert link_budget_s(0.1, 24, 4) == pytest.approx(0.6)
    assert link_budget_s(None, 24, 4) is None


def test_a_slow_link_is_link_bound_with_the_figures_and_recovers(caplog):
    caplog.set_level(logging.INFO, logger="diloco.learner")
    m = LinkMeter("L0", alpha=1.0, confirm=3)
    assert m.check(1.0, now_s=0.0) == (None, False)  # nothing measured yet
    m.record("up", 0, 1000, 0.9)
    m.record("down", 0, 500, 0.6)
    m.record("up", 1, 1000, 0.7)  # fragment 1: no download yet
    assert m.seconds_per_fragment() == pytest.approx((1.5 + 0.7) / 2)
    assert m.bytes_snapshot() == ({0: 1000, 1: 1000}, {0: 500})
    verdicts = [m.check(1.0, now_s=t)[1] for t in (1.0, 2.0, 3.0, 4.0)]
    assert verdicts == [False, False, True, True]  # three checks in a row before the verdict changes
    warnings = [r.getMessage() for r in caplog.records if "link-bound" in r.getMessage()]
    assert warnings == ["L0 link-bound: needs 1.100 s per fragment, has 1.000 s (H/P inner steps); the link cannot "
                        "carry one fragment per H/P steps"]  # once, then at most every log_every_s
    assert [m.check(1.2, now_s=t)[1] for t in (5.0, 6.0, 7.0)] == [True, True, True]  # within 0.9: still bound
    m.record("up", 0, 1000, 0.1)
    m.record("up", 1, 1000, 0.1)
    assert [m.check(1.2, now_s=t)[1] for t in (8.0, 9.0, 10.0)] == [True, True, False]
    assert any("link keeps up again" in r.getMessage() for r in caplog.records)


def test_bad_records_are_refused():
    m = LinkMeter("L0")
    with pytest.raises(ValueError, match="bad transfer"):
        m.record("sideways", 0, 1, 0.1)
    with pytest.raises(ValueError, match="bad transfer"):
        m.record("up", 0, -1, 0.1)
