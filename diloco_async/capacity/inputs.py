"""What a capacity plan is asked about: the model, the learners, the schedule and the links.

Plain frozen dataclasses; :meth:`PlanInputs.check` refuses a value no run could have, with a
message that names the field and the value (``ValueError``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from diloco_async.codec.wire import CODECS
from diloco_async.policy.fragments import FRAGMENTATIONS, TensorSpec

__all__ = ["ModelShape", "LearnerSetup", "SyncSetup", "LinkSetup", "PlanInputs", "PARALLELISMS", "PRECISIONS",
           "GRAD_DTYPE_BYTES", "OUTER_OPTIMIZERS"]

PARALLELISMS = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16")
#: bytes per element of the gradients the DDP baseline all-reduces
GRAD_DTYPE_BYTES = {"fp32": 4, "bf16": 2}
OUTER_OPTIMIZERS = ("nesterov", "sgd", "delayed-nesterov")


@dataclass(frozen=True)
class ModelShape:
    """The model as the plan sees it.

    Attributes:
        n_params: trainable parameters (what the fragments cover).
        tensors: every trainable tensor's spec; empty for a bare parameter count (each fragment is
            then ``n_params / P`` elements, and its codec scales are counted as one tensor's).
        n_layer, d_model, mlp_width: transformer blocks, width and MLP width (for the activations);
            None: activations are not modelled.
        gated_mlp: the MLP has a gate (SwiGLU: four saved MLP activations per token, not two).
        vocab_size: tokens of the output head (its logits are saved for the loss).
        source: where the shape came from, for the printout.
    """

    n_params: int
    tensors: tuple[TensorSpec, ...] = ()
    n_layer: int | None = None
    d_model: int | None = None
    mlp_width: int | None = None
    gated_mlp: bool = False
    vocab_size: int | None = None
    source: str = ""

    @property
    def activations_known(self) -> bool:
        return None not in (self.n_layer, self.d_model, self.mlp_width, self.vocab_size)


@dataclass(frozen=True)
class LearnerSetup:
    """The learners (DESIGN §3).

    Attributes:
        count: M, learner processes (or torchrun groups).
        devices: N, ranks per learner (``learners.nproc_per_learner`` × ``nnodes``).
        parallelism: ``ddp`` (every rank holds the whole model; this project's) or ``fsdp``
            (for planning only: each rank holds 1/N of the state and of each fragment).
        accelerator: ranks on GPUs: parameters, gradients, moments and activations in device
            memory, base copies in pinned host memory; False: a CPU learner (everything in RAM,
            base copies in local files).
        batch_per_rank, context: windows of ``context`` tokens per rank per micro-batch (what the
            activations hold).
        grad_accum_steps: micro-batches per inner step (``learners.grad_accum_steps``).
        precision: ``fp32`` or ``bf16`` (autocast: activations in bf16, the state stays fp32).
        step_s: compute seconds of one inner step (forward, backward, AdamW; no network wait);
            None: no rates, speed-ups or bytes per second.
    """

    count: int
    devices: int = 1
    parallelism: str = "ddp"
    accelerator: bool = False
    batch_per_rank: int = 16
    context: int = 64
    precision: str = "fp32"
    step_s: float | None = None
    grad_accum_steps: int = 1

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one inner step of one learner (every rank's micro-batches)."""
        return self.batch_per_rank * self.context * self.devices * self.grad_accum_steps


@dataclass(frozen=True)
class SyncSetup:
    """The schedule and the synchronizer (``[synchronizer]``, ``learners.codec``).

    Attributes:
        sync_every: H, inner steps between two rounds of one fragment.
        fragments: P, fragments of the model.
        overlap: τ (``synchronizer.max_open_rounds``), inner steps a round overlaps: a fragment's
            contribution and its new version should cross within τ steps.
        shards: S, synchronizer processes, each the owner of 1/S of the fragments (fragment p on
            shard p mod S).
        codec, download_codec: the wire codecs up (outer gradients) and down (published versions).
        download_block_size: quantization block of int8/int4/int2 downloads (uploads use the
            codec's default, :data:`diloco_async.codec.wire.DEFAULT_BLOCK_SIZE`).
        fragmentation: how tensors are cut into fragments (:data:`FRAGMENTATIONS`).
        outer_optimizer: ``nesterov`` / ``delayed-nesterov`` (one fp32 momentum) or ``sgd`` (none).
        merges_in_flight, verifies_in_flight: the synchronizer's worker threads (memory each).
    """

    sync_every: int = 24
    fragments: int = 4
    overlap: int = 2
    shards: int = 1
    codec: str = "bf16"
    download_codec: str = "fp32"
    download_block_size: int = 64
    fragmentation: str = "balanced"
    outer_optimizer: str = "nesterov"
    merges_in_flight: int = 1
    verifies_in_flight: int = 2


@dataclass(frozen=True)
class LinkSetup:
    """Regions and the links that join each region to the synchronizer's (the hub).

    Attributes:
        regions: R; learner i runs in region i mod R (as ``run.regions``).
        gbps: each region's link rate, Gbit/s (SI, each direction, IP packets); one value for
            every region, or none (no times on the links, no speed-up).
        ddp_grad_dtype: what the DDP baseline's ring all-reduce moves (``fp32`` or ``bf16``).
    """

    regions: int = 1
    gbps: tuple[float, ...] = ()
    ddp_grad_dtype: str = "fp32"

    def rate_gbps(self, region: int) -> float | None:
        """Region ``region``'s link rate (Gbit/s), or None when no rate was given."""
        if not self.gbps:
            return None
        return self.gbps[0] if len(self.gbps) == 1 else self.gbps[region]


def _count(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a finite number > 0")


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: unknown; expected one of {', '.join(allowed)}")


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan is computed from (:func:`diloco_async.capacity.make_plan`).

    ``budget_tokens``: tokens of the whole run (all learners); with it, the bytes per token are
    also given over the run, with each learner's one-time traffic (the fp32 model downloaded when
    it joins, the last round of every fragment at the stop) spread over its share of the tokens.
    """

    model: ModelShape
    learners: LearnerSetup
    sync: SyncSetup = field(default_factory=SyncSetup)
    links: LinkSetup = field(default_factory=LinkSetup)
    budget_tokens: int | None = None

    def check(self) -> None:
        """Refuse inputs no run could have.

        Raises:
            ValueError: naming the field and its value: a count below 1 (parameters, learners,
                devices, batch, context, H, P, τ, S, regions, threads), S greater than P, P greater
                than the model's tensors, an unknown codec, parallelism, precision, fragmentation or
                outer optimizer, a link rate or step time that is not a number > 0, a number of link
                rates other than 1 or R, more regions than learners.
        """
        m, lr, s, ln = self.model, self.learners, self.sync, self.links
        _count("params", m.n_params)
        for name, value in (("learners", lr.count), ("devices_per_learner", lr.devices), ("batch", lr.batch_per_rank),
                            ("context", lr.context), ("sync_every (H)", s.sync_every), ("fragments (P)", s.fragments),
                            ("overlap (tau)", s.overlap), ("shards (S)", s.shards), ("regions", ln.regions),
                            ("download_block_size", s.download_block_size), ("merges_in_flight", s.merges_in_flight),
                            ("verifies_in_flight", s.verifies_in_flight)):
            _count(name, value)
        if self.budget_tokens is not None:
            _count("budget_tokens", self.budget_tokens)
        _one_of("parallelism", lr.parallelism, PARALLELISMS)
        _one_of("precision", lr.precision, PRECISIONS)
        _one_of("codec", s.codec, CODECS)
        _one_of("download_codec", s.download_codec, CODECS)
        _one_of("fragmentation", s.fragmentation, FRAGMENTATIONS)
        _one_of("outer_optimizer", s.outer_optimizer, OUTER_OPTIMIZERS)
        _one_of("ddp_grad_dtype", ln.ddp_grad_dtype, tuple(GRAD_DTYPE_BYTES))
        if lr.step_s is not None:
            _positive("step_s", lr.step_s)
        if s.shards > s.fragments:
            raise ValueError(f"shards (S)={s.shards} exceeds fragments (P)={s.fragments}: each synchronizer shard "
                             "owns at least one fragment")
        if m.tensors and s.fragments > len(m.tensors):
            raise ValueError(f"fragments (P)={s.fragments} exceeds the model's {len(m.tensors)} trainable tensors")
        if m.tensors and sum(t.numel for t in m.tensors) != m.n_params:
            total = sum(t.numel for t in m.tensors)
            raise ValueError(f"params={m.n_params} differs from the tensors' {total} elements")
        if ln.regions > lr.count:
            raise ValueError(f"regions={ln.regions} exceeds learners={lr.count}: a region without a learner")
        if len(ln.gbps) not in (0, 1, ln.regions):
            raise ValueError(f"link_gbps has {len(ln.gbps)} rates {list(ln.gbps)}: give one, or one per region "
                             f"({ln.regions})")
        for i, rate in enumerate(ln.gbps):
            _positive(f"link_gbps[{i}]", rate)
