"""The inner loop (paper §3, DESIGN §3): what a learner trains between two outer steps.

:mod:`~diloco_async.inner.workload` holds the model, its inner AdamW, its batches and one inner
step; :mod:`~diloco_async.inner.state` the learner's own inner state for an exact restore;
:mod:`~diloco_async.inner.base_file` the base copies Θ^base kept in local files.
"""
