"""Exactly once, under chaos (issue 45; DESIGN §5.2): leased slices in runs of real processes whose
learners are SIGKILLed, some in the middle of an upload (the kill matrix's held ``put``: the key
never appears), and that a token budget stops (diloco_async/chaos/exactly_once.py).

1. On Shakespeare, the budget ends long before the corpus: every slice is trained exactly once,
   or back in the pool (thrown away or never named), or never reached; none trained twice, none
   lost; the summary's counters agree with the merge log, the version headers and the ledger.
2. On a corpus of 16 slices the budget reaches past the first epoch: every slice of a finished
   epoch was trained in it exactly once or is still owed by it (one thrown away after the epoch
   moved on is leased again under it first), none twice, none lost.

Which learner leases which slice and where the kills land depend on timing: the assertions hold
for every order. Whether the first epoch is complete when the budget ends does not (the clean-clone
CI of 222aa18, under make test's load, ended with all 16 slices' epochs short and 26 owed, where
four quiet runs had completed epoch 0): ``make bench-exactly-once`` reports it as a bar.
"""

from __future__ import annotations

from diloco_async.chaos.exactly_once import (
    SLICE_TOKENS,
    exactly_once_fields,
    merge_log_slices,
    run_exactly_once,
    small_corpus,
    version_slices,
)
from diloco_async.storage.store import ObjectStore


def _check(res, acc) -> None:
    """What holds for any run of :func:`run_exactly_once`."""
    assert res.mid_upload_confirmed >= 1, f"no kill landed inside an upload: nothing shown ({res})"
    assert acc.stop_reason.startswith("token budget"), acc.stop_reason
    assert acc.trained_twice == 0, acc.counts()
    assert acc.lost == 0 and acc.leased_at_end == 0, acc.counts()
    assert not acc.disagreements, acc.disagreements
    assert acc.trained_now + acc.returned + acc.never_reached == acc.slices  # the last epoch, partitioned
    assert acc.requeued >= 1  # the killed learners' leases came back to the pool


def test_learner_kills_mid_upload_train_no_slice_twice_and_lose_none(tmp_path):
    res, acc = run_exactly_once(tmp_path, 3, exactly_once_fields(tmp_path, 64 * SLICE_TOKENS), timeout_s=300,
                                mid_upload_share=0.67, fork_server=False)
    print(f"\nexactly once, Shakespeare: kills {res.learner_kills} ({res.mid_upload_confirmed} confirmed "
          f"mid-upload), {acc.counts()}")
    assert res.learner_kills >= 3
    _check(res, acc)
    assert acc.epoch == 0 and acc.never_reached > 0  # the budget ended before the corpus
    store = ObjectStore(f"file://{tmp_path}/store")
    by_log = merge_log_slices(store, acc.run_id, acc.lifetime)
    assert set(by_log) == set(version_slices(store, acc.run_id))  # the headers name the same slices, nothing collected
    assert len(by_log) == acc.trained_now == acc.trained_once


def test_past_the_first_epoch_under_kills_no_slice_is_trained_twice_or_lost(tmp_path):
    corpus = small_corpus(tmp_path / "corpus", slices=16)
    res, acc = run_exactly_once(tmp_path, 2, exactly_once_fields(tmp_path, 48 * SLICE_TOKENS, corpus),
                                timeout_s=300, mid_upload_share=1.0, fork_server=False)
    print(f"\nexactly once, full epoch: kills {res.learner_kills} ({res.mid_upload_confirmed} confirmed "
          f"mid-upload), {acc.counts()}")
    assert acc.slices == 16
    _check(res, acc)
    assert acc.epoch >= 1, "the budget ended inside the first epoch"
    assert acc.epochs_complete + len(acc.epochs_short) == acc.epoch  # each finished epoch: complete, or owes
    assert (acc.owed > 0) == bool(acc.epochs_short), acc.counts()  # what a short epoch lacks is owed, not lost
