"""What an inner loop trains: a model, its inner optimizer, its batches, and one inner step (DESIGN §3).

:func:`inner_step` is the one inner training step of the project: the learner
(:class:`Workload.step`) and the data-parallel baseline (``diloco_async.baselines.ddp``, which
all-reduces the gradients between backward and clip) both run it.

:class:`Workload` is the seam where another model, device or process group plugs in: the
learner's training thread only uses its ``params`` (by name, as the fragment plan names them),
``model`` (for the plan's embedding names), :meth:`Workload.step`, and the inner-state capture
and restore. :meth:`Workload.from_config` builds the recipe's model (any ``model.kind``,
:mod:`diloco_async.models`) with AdamW over its trainable parameters, on CPU;
:meth:`Workload.place` moves it to its device and precision; a learner that spans several
processes (``diloco_async.learner.group``) then makes it one rank of the group with
:meth:`Workload.join_group`: the rank trains through a ``DistributedDataParallel`` wrapper on its
fixed slice of the batch that one process would draw.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import numpy as np
import torch

from diloco_async.config.schema import Config
from diloco_async.data.tokens import Corpus, open_corpus
from diloco_async.inner.optimizers import MuonWithAdamW, check_muon_model
from diloco_async.inner.state import InnerState, capture, restore
from diloco_async.models import build_run_model, trainable_parameters
from diloco_async.policy.schedules import InnerSchedule, warmup_lr

__all__ = ["Workload", "inner_optimizer", "optimizer_of", "inner_step", "accumulated_step", "warmup_lr",
           "data_generator",
           "jitter_random",
           "emulated_delay_s"]


def inner_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
               targets: torch.Tensor, *, lr: float, grad_clip: float,
               after_backward: Callable[[], None] | None = None, amp_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One inner step on one batch: :func:`accumulated_step` with one micro-batch (``inputs``,
    ``targets``: int64 [B, T]); arguments and result as there."""
    return accumulated_step(model, optimizer, [(inputs, targets)], lr=lr, grad_clip=grad_clip,
                            after_backward=after_backward, amp_dtype=amp_dtype)


def accumulated_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, lr: float, grad_clip: float,
                     after_backward: Callable[[], None] | None = None, amp_dtype: torch.dtype | None = None,
                     no_sync: Callable[[], AbstractContextManager] | None = None) -> torch.Tensor:
    """One inner step over ``k = len(micro_batches)`` micro-batches (gradient accumulation,
    ``learners.grad_accum_steps``): set the learning rate, then for each micro-batch forward and
    loss (under ``torch.autocast`` with ``amp_dtype`` on the inputs' device, when given) and
    backward of loss / k, so the gradients add up to those of the mean loss of one batch of all of
    them; then ``after_backward()`` (e.g. a gradient all-reduce), clip the gradient norm to
    ``grad_clip``, optimizer step. With k = 1 this is the one-batch step, bit for bit (no division).
    The gradients are zeroed in place, not released: their buffers live across steps, so each step does not
    allocate and free a model's worth of memory (which the C heap keeps, issue 17 item 3). Parameters,
    gradients and the optimizer state keep their dtype (float32): autocast only lowers the
    precision of the forward's matrix products.

    Args:
        model: has ``loss(inputs, targets)`` returning a scalar loss (nats/token).
        optimizer: the inner optimizer (AdamW, or :class:`~diloco_async.inner.optimizers.MuonWithAdamW`)
            over ``model``'s parameters.
        micro_batches: (inputs, targets) pairs, int64 [B, T] token windows and their next tokens
            (equal B: the mean of the micro-batch means is the batch's mean).
        lr: learning rate of every parameter group for this step.
        grad_clip: max global L2 norm of the gradients.
        after_backward: called once the gradients of every micro-batch are summed, before clipping.
        amp_dtype: autocast dtype (``torch.bfloat16``), or None for plain float32.
        no_sync: a ``DistributedDataParallel``'s ``no_sync``: the backward of every micro-batch but
            the last runs under it, so the group all-reduces once per step.

    Returns:
        The mean loss over the micro-batches, a detached 0-dim float32 tensor.

    Raises:
        ValueError: no micro-batch.
    """
    k = len(micro_batches)
    if k < 1:
        raise ValueError("accumulated_step needs at least one micro-batch")
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=False)  # the gradients keep their buffers (no allocator churn)
    total: torch.Tensor | None = None
    for i, (inputs, targets) in enumerate(micro_batches):
        quiet = no_sync is not None and i < k - 1
        with no_sync() if quiet else contextlib.nullcontext():
            with torch.autocast(inputs.device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                loss = model.loss(inputs, targets)
            (loss / k if k > 1 else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    if after_backward is not None:
        after_backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    assert total is not None
    return (total / k if k > 1 else total).float()


def inner_optimizer(params, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """The inner optimizer: AdamW over ``params`` (an iterable of parameters), fused
    implementation (``fused=True``: one kernel per parameter, no temporaries). The multi-tensor
    one materializes temporaries of the size of all parameters at once (up to 2x the model in
    RAM during each step, issue 17 item 3); the single-tensor one makes several per parameter,
    each fresh pages under the learner's fixed mmap threshold (``learner/main.py``): at 33M
    parameters on one thread its step took 275-285 ms there, 83-105 ms with glibc's default
    threshold, the fused one 21-27 ms either way. Where torch has no fused kernel for the
    parameters' device or dtype, the single-tensor one."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    except RuntimeError:  # no fused kernel for this device or dtype
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False)


def optimizer_of(kind: str, model: torch.nn.Module, *, lr: float, weight_decay: float,
                 what: str = "") -> torch.optim.Optimizer | MuonWithAdamW:
    """The inner optimizer ``kind`` (``learners.optimizer``) over ``model``'s trainable parameters:
    ``"adamw"`` (:func:`inner_optimizer`), or ``"muon"``: Muon for the 2-D hidden weight matrices and
    AdamW for the rest (:class:`~diloco_async.inner.optimizers.MuonWithAdamW`).

    Raises:
        ValueError: ``"muon"`` on a model (``what`` names it) with no 2-D hidden weight matrix;
            an unknown ``kind``.
    """
    params = trainable_parameters(model)
    if kind == "adamw":
        return inner_optimizer(params.values(), lr=lr, weight_decay=weight_decay)
    if kind == "muon":
        return MuonWithAdamW(params, check_muon_model(model, what), lr=lr, weight_decay=weight_decay,
                             adamw=inner_optimizer)
    raise ValueError(f"learners.optimizer = {kind!r}: unknown; expected 'adamw' or 'muon'")


def data_generator(seed: int, index: int, incarnation: int) -> torch.Generator:
    """The window sampler's generator of learner (or DDP rank) ``index``: both draw the same
    windows of the same shard."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index * 1009 + incarnation)


def jitter_random(seed: int, index: int, incarnation: int) -> random.Random:
    """The per-step jitter RNG of learner (or DDP rank) ``index``, so a jitter schedule is the
    same for every method."""
    return random.Random(seed * 65537 + index * 257 + incarnation)


def emulated_delay_s(dt_s: float, speed: float, jitter: float, rng: random.Random) -> float:
    """Extra seconds a step of compute time ``dt_s`` sleeps on hardware of relative ``speed``.

    ``dt_s * (1/speed - 1) + dt_s * jitter * |N(0, 1)|``, never negative (a speed above 1 cannot
    make a step faster than the real compute). ``rng`` is drawn once per call, also when
    ``jitter`` is 0, so a schedule does not depend on whether jitter is on.

    Raises:
        ValueError: ``speed`` <= 0 or ``jitter`` < 0.
    """
    if speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    if jitter < 0:
        raise ValueError(f"jitter must be >= 0, got {jitter}")
    noise = abs(rng.gauss(0.0, 1.0))
    return max(0.0, dt_s * (1.0 / speed - 1.0)) + dt_s * jitter * noise


def _model_to_shard(cfg: Config) -> torch.nn.Module | None:
    """The run's model built on the meta device (no memory) for a group sharded with FSDP2, which
    allocates only its own shards after ``fully_shard`` (``to_empty``,
    :func:`diloco_async.learner.fsdp.shard_workload`) and fills them from the versions it adopts at
    start, or a restored inner state: the model's seeded init would be overwritten whole. Only where
    every value the model holds is a trainable parameter those fill (no buffer, no frozen
    parameter) and the model is not a Hugging Face one (whose build reads files and computes
    buffers); None otherwise (built on the CPU)."""
    if cfg.model.kind == "hf":
        return None
    with torch.device("meta"):
        model = build_run_model(cfg)
    if any(True for _ in model.buffers()) or not all(p.requires_grad for p in model.parameters()):
        return None
    return model


class Workload:
    """A model, its inner optimizer and its data, stepped by the learner's training thread.

    Args:
        model: the model; ``model.loss(inputs, targets)`` gives the training loss.
        optimizer: its inner optimizer.
        generator: the window sampler's RNG (part of the inner state).
        batch_size, context: windows per step (of one rank) and tokens per window.
        schedule: the inner learning rate, its warm-up and schedule
            (:class:`~diloco_async.policy.schedules.InnerSchedule`).
        grad_clip: max global L2 norm of each step's gradients.
        grad_accum_steps: micro-batches of ``batch_size`` windows per optimizer step (gradient accumulation).

    Attributes:
        device, amp_dtype: where the inner steps run and their autocast dtype (see :meth:`place`).
        rank, world: this process's rank in the learner's group and the group's size (0, 1 alone).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator, *,
                 batch_size: int, context: int, schedule: InnerSchedule, grad_clip: float,
                 grad_accum_steps: int = 1) -> None:
        self.model = model
        self.optimizer = optimizer
        self.generator = generator
        self.params: dict[str, torch.nn.Parameter] = trainable_parameters(model)  # what the plan covers
        self.batch_size, self.context = batch_size, context
        self.schedule, self.grad_clip = schedule, grad_clip
        self.grad_accum_steps = grad_accum_steps
        self.last_lr = 0.0  # the learning rate of the last step
        self.shard: np.ndarray | None = None
        self.stream: np.ndarray | None = None  # data.slices: the whole training stream, read by leased slice
        self.device, self.amp_dtype = torch.device("cpu"), None
        self.rank, self.world = 0, 1
        self.train_model: torch.nn.Module = model  # what inner_step calls: the model, or its DDP wrapper
        self.mean_loss: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def from_config(cls, cfg: Config, index: int, incarnation: int) -> Workload:
        """Learner ``index``'s workload of a run: the recipe's model (``build_run_model``: every
        learner builds the same frozen base), its inner optimizer (``learners.optimizer``,
        :func:`optimizer_of`) with ``learners.lr``/``weight_decay``, the run's inner learning-rate schedule
        and gradient accumulation, and the sampler seeded by (run seed, index, incarnation)."""
        lc = cfg.learners
        model = _model_to_shard(cfg) if lc.parallelism == "fsdp" else None
        model = model if model is not None else build_run_model(cfg)
        opt = optimizer_of(lc.optimizer, model, lr=lc.lr, weight_decay=lc.weight_decay, what=repr(cfg.model.kind))
        return cls(model, opt, data_generator(cfg.run.seed, index, incarnation), batch_size=lc.batch_size_of(index),
                   context=cfg.model.context, schedule=InnerSchedule.from_config(cfg), grad_clip=lc.grad_clip,
                   grad_accum_steps=lc.grad_accum_steps)

    def place(self, device: torch.device, amp_dtype: torch.dtype | None = None) -> None:
        """Move the model to ``device`` (its parameters stay float32 and keep their identity, so the
        optimizer and ``params`` still refer to them) and run the forward under autocast with
        ``amp_dtype`` (None: float32). Call before the optimizer has state."""
        if not any(p.is_meta for p in self.model.parameters()):  # on meta: allocated where it is sharded
            self.model.to(device)
        self.device, self.amp_dtype = device, amp_dtype

    def join_group(self, rank: int, world: int, train_model: torch.nn.Module,
                   mean_loss: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Make this workload rank ``rank`` of a learner of ``world`` ranks: each step it draws the
        batch of ``world * batch_size`` windows that one process would draw and trains on its
        slice ``[rank * batch_size, (rank + 1) * batch_size)`` through ``train_model`` (a
        ``DistributedDataParallel`` wrapper of the model with a ``loss``), and reports the loss
        averaged over the group by ``mean_loss``."""
        self.rank, self.world = rank, world
        self.train_model, self.mean_loss = train_model, mean_loss

    @property
    def tokens_per_step(self) -> int:
        """Tokens one step of the whole learner trains on: ``grad_accum_steps * world * batch_size * context``."""
        return self.grad_accum_steps * self.world * self.batch_size * self.context

    def load_data(self, cfg: Config, index: int) -> int:
        """Map the tokenized corpus (:func:`~diloco_async.data.tokens.open_corpus`, built once per machine)
        and keep shard ``index`` of ``learners.count``; returns its size in tokens. With ``data.slices``
        the whole training stream is kept mapped instead (only the pages of the slices trained are
        read) and each step names its tokens (:meth:`step`'s ``first_token``).

        Raises:
            ValueError: the tokenizer has more tokens than ``model.vocab_size`` (or another data error).
        """
        corpus = open_corpus(cfg.data, cfg.model.context, model_vocab=cfg.model.vocab_size)
        if cfg.data.slices:
            self.stream = corpus.train
            return len(self.stream)
        self.shard = corpus.shard(index, cfg.learners.count)
        return len(self.shard)

    def step(self, step: int, run_tokens: float = 0.0, first_token: int | None = None) -> float:
        """One inner step, the ``step``-th of this learner (it sets the warm-up), at ``run_tokens``
        tokens processed by the run (the schedule's progress): ``grad_accum_steps`` micro-batches of the
        shard, each of ``world * batch_size`` windows of which this rank takes its slice, under the
        group's ``no_sync`` but the last; returns the training loss (nats/token, the mean over them).
        With ``first_token`` (leased slices, DESIGN §5.2) the windows are the stream's next
        :attr:`tokens_per_step` tokens from there, in order, instead of random windows of the shard.

        Raises:
            RuntimeError: :meth:`load_data` was not called (or no ``first_token`` with leased slices).
        """
        if self.shard is None and (self.stream is None or first_token is None):
            raise RuntimeError("Workload.step before load_data (or without first_token on leased slices)")
        b, batches = self.batch_size, []
        for k in range(self.grad_accum_steps):
            if first_token is not None and self.stream is not None:
                x, y = Corpus.windows(self.stream, first_token + k * self.world * b * self.context, self.world * b,
                                      self.context)
            else:
                assert self.shard is not None
                x, y = Corpus.sample(self.shard, self.world * b, self.context, self.generator)
            if self.world > 1:
                x, y = x[self.rank * b:(self.rank + 1) * b], y[self.rank * b:(self.rank + 1) * b]
            if self.device.type != "cpu":
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            batches.append((x, y))
        no_sync = getattr(self.train_model, "no_sync", None) if self.world > 1 else None
        self.last_lr = self.schedule.lr(step, run_tokens)
        loss = accumulated_step(self.train_model, self.optimizer, batches, lr=self.last_lr,
                                grad_clip=self.grad_clip, amp_dtype=self.amp_dtype, no_sync=no_sync)
        if self.mean_loss is not None:
            loss = self.mean_loss(loss)
        return float(loss)

    def capture(self, *, step: int, base_tensors: dict[int, dict[str, torch.Tensor]], base_versions: dict[int, int],
                counters: dict[int, tuple[int, int, float]]) -> InnerState:
        """The inner state to save (see :func:`diloco_async.inner.state.capture`)."""
        return capture(self.params, self.optimizer, self.generator, step=step, base_tensors=base_tensors,
                       base_versions=base_versions, counters=counters)

    def restore(self, state: InnerState) -> tuple[int, dict[int, dict[str, torch.Tensor]], dict[int, int],
                                                   dict[int, tuple[int, int, float]]]:
        """Write a saved inner state back (see :func:`diloco_async.inner.state.restore`)."""
        return restore(state, self.params, self.optimizer, self.generator)
