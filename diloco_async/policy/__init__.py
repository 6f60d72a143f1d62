"""The synchronizer's pure policies (paper §3, §3.2; DESIGN §4.3, §4.6): no I/O, times passed in.

:mod:`~diloco_async.policy.rounds` holds the round schedule, the minimum quorum and the adaptive
grace window; :mod:`~diloco_async.policy.fragments` the fragment plan and the schedule offsets;
:mod:`~diloco_async.policy.guard` the update guard's robust norm bounds;
:mod:`~diloco_async.policy.pace` the limits on how fast a learner's progress may grow; the learner's own:
:mod:`~diloco_async.policy.catchup` which version a slow learner reads and
:mod:`~diloco_async.policy.link_bound` how a link-bound learner adapts its uploads.
"""
