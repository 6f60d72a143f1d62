"""Capacity plans (issue 40 item 6): what a run needs before anything is rented.

:func:`make_plan` turns :class:`PlanInputs` (the model, learners × devices, parallelism, regions
and link rates, codecs, H, P, τ, S) into a :class:`Plan`: memory of a learner rank and of a
synchronizer shard (:mod:`~diloco_async.capacity.memory`), bytes per token and per second on
each link, the link rate that keeps learners from waiting, and DDP over the same links
(:mod:`~diloco_async.capacity.traffic`). Pure math on plain values; the fragments and their bytes
come from the run's own fragmentation and codecs (:mod:`~diloco_async.capacity.sizes`).
:mod:`~diloco_async.capacity.shapes` builds a recipe's or an HF config's model on the meta
device; :mod:`~diloco_async.capacity.paper` plans the paper's 12B run beside its figures.
Formulas and their calibration: ``docs/capacity-plan.md``; the command: ``diloco-async plan``.
"""

from diloco_async.capacity.inputs import LearnerSetup, LinkSetup, ModelShape, PlanInputs, SyncSetup
from diloco_async.capacity.paper import PaperComparison, paper_comparison
from diloco_async.capacity.plan import Plan, make_plan
from diloco_async.capacity.shapes import shape_from_config, shape_from_count, shape_from_hf_config

__all__ = ["ModelShape", "LearnerSetup", "SyncSetup", "LinkSetup", "PlanInputs", "Plan", "make_plan",
           "shape_from_config", "shape_from_hf_config", "shape_from_count", "PaperComparison", "paper_comparison"]
