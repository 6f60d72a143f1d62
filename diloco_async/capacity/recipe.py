"""A plan's inputs from a run's config: the recipe's learners, schedule, codecs and budget."""

from __future__ import annotations

from diloco_async.capacity.inputs import LearnerSetup, LinkSetup, ModelShape, PlanInputs, SyncSetup
from diloco_async.capacity.shapes import shape_from_config
from diloco_async.config.schema import Config

__all__ = ["inputs_from_config"]


def inputs_from_config(cfg: Config, *, model: ModelShape | None = None, step_s: float | None = None,
                       links: LinkSetup | None = None, shards: int = 1) -> PlanInputs:
    """What ``cfg`` runs: M, ranks per learner, device (anything but ``cpu`` counts as an
    accelerator), the largest batch of a heterogeneous list, context, precision, H, P, τ
    (``max_open_rounds``), codecs, the synchronizer's threads and ``budget.tokens``.

    Args:
        model: the model (default: ``cfg``'s, built on the meta device).
        step_s: compute seconds of one inner step (a config does not know it).
        links: regions and link rates (default: one region, no rate).
        shards: S.

    Raises:
        ValueError: the model cannot be built.
    """
    lc, sc = cfg.learners, cfg.synchronizer
    devices = [lc.device] if isinstance(lc.device, str) else lc.device
    return PlanInputs(
        model=model if model is not None else shape_from_config(cfg),
        learners=LearnerSetup(
            count=lc.count, devices=lc.nproc_per_learner * lc.nnodes, accelerator=any(d != "cpu" for d in devices),
            batch_per_rank=max(lc.batch_size) if isinstance(lc.batch_size, list) else lc.batch_size,
            context=cfg.model.context, precision=lc.precision, step_s=step_s, grad_accum_steps=lc.grad_accum_steps),
        sync=SyncSetup(
            sync_every=sc.sync_every, fragments=sc.num_fragments, overlap=sc.max_open_rounds, shards=shards,
            codec=lc.codec, download_codec=sc.download_codec, download_block_size=sc.download_block_size,
            fragmentation=sc.fragmentation, outer_optimizer=sc.outer_optimizer, merges_in_flight=sc.merges_in_flight,
            verifies_in_flight=sc.verifies_in_flight),
        links=links if links is not None else LinkSetup(),
        budget_tokens=cfg.budget.tokens)
