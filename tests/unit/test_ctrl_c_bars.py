"""The Ctrl-C bars of ``make bench-kill`` (benchmarks/ctrl_c.py): the median over the repeats of
the seconds from Ctrl-C to the prompt, per command, and every stop exit status 130 without a
traceback. The stops themselves are tests/system/test_stop.py's."""

from __future__ import annotations

from benchmarks.ctrl_c import CtrlCTimes, ctrl_c_bars


def _rows(times: CtrlCTimes, repeats: int) -> dict[str, tuple[float, bool]]:
    return {figure: (value, ok) for figure, value, _goal, ok in ctrl_c_bars(times, repeats)}


def test_the_median_of_each_command_is_held_to_10_s():
    # one slow train stop in three: the median is 4 s
    rows = _rows(CtrlCTimes(train_s=[3.0, 4.0, 20.0], watch_s=[0.1, 0.2, 0.1], resume_s=[2.0, 3.0, 2.5]), 3)
    assert rows["Ctrl-C on train -> prompt, median of 3 (s)"] == (4.0, True)
    assert rows["Ctrl-C on train -> prompt, slowest (s)"] == (20.0, True)  # shown
    assert rows["Ctrl-C on resume -> prompt, median of 3 (s)"] == (2.5, True)
    assert rows["Ctrl-C stops not exiting 130 without a traceback"] == (0, True)
    assert all(ok for _value, ok in rows.values())
    # two slow resume stops in three: missed
    rows = _rows(CtrlCTimes(train_s=[3.0] * 3, watch_s=[0.1] * 3, resume_s=[11.0, 2.0, 12.0]), 3)
    assert rows["Ctrl-C on resume -> prompt, median of 3 (s)"] == (11.0, False)


def test_a_missing_repeat_or_a_bad_stop_misses():
    rows = _rows(CtrlCTimes(train_s=[3.0, 3.0], watch_s=[0.1] * 3, resume_s=[2.0] * 3,
                            bad_stops=["train: exit 1"]), 3)
    assert rows["Ctrl-C on train -> prompt, median of 2 (s)"] == (3.0, False)  # a repeat never got to its Ctrl-C
    assert rows["Ctrl-C stops not exiting 130 without a traceback"] == (1, False)
    assert rows["Ctrl-C on status --watch -> prompt, median of 3 (s)"][1]
    rows = _rows(CtrlCTimes(), 2)
    assert rows["Ctrl-C on train -> prompt, median of 0 (s)"] == (-1.0, False)
