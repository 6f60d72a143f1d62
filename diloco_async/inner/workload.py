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

import random
from collections.abc import Callable

import numpy as np
import torch

from diloco_async.config.schema import Config
from diloco_async.data.tokens import Corpus, open_corpus
from diloco_async.inner.state import InnerState, capture, restore
from diloco_async.models import build_run_model, trainable_parameters

__all__ = ["Workload", "inner_optimizer", "inner_step", "warmup_lr", "data_generator", "jitter_random",
           "emulated_delay_s"]


def warmup_lr(base_lr: float, step: int, warmup_steps: int) -> float:
    """Inner learning rate of the step that follows ``step`` done steps: linear warm-up over
    ``warmup_steps``, ``base_lr * min(1, (step + 1) / max(1, warmup_steps))``. A restarted learner
    continues its step count, so it does not warm up a second time."""
    return base_lr * min(1.0, (step + 1) / max(1, warmup_steps))


def inner_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
               targets: torch.Tensor, *, lr: float, grad_clip: float,
               after_backward: Callable[[], None] | None = None, amp_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One inner step: set the learning rate, forward and loss (under ``torch.autocast`` with
    ``amp_dtype`` on the inputs' device, when given), backward, ``after_backward()`` (e.g. a
    gradient all-reduce), clip the gradient norm to ``grad_clip``, optimizer step. The gradients
    are zeroed in place, not released: their buffers live across steps, so each step does not
    allocate and free a model's worth of memory (which the C heap keeps, issue 17 item 3). Parameters,
    gradients and the optimizer state keep their dtype (float32): autocast only lowers the
    precision of the forward's matrix products.

    Args:
        model: has ``loss(inputs, targets)`` returning a scalar loss (nats/token).
        optimizer: the inner optimizer (AdamW) over ``model``'s parameters.
        inputs, targets: int64 [B, T] token windows and their next tokens.
        lr: learning rate of every parameter group for this step.
        grad_clip: max global L2 norm of the gradients.
        after_backward: called once the gradients are computed, before clipping.
        amp_dtype: autocast dtype (``torch.bfloat16``), or None for plain float32.

    Returns:
        The loss, a detached 0-dim float32 tensor.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast(inputs.device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
        loss = model.loss(inputs, targets)
    optimizer.zero_grad(set_to_none=False)  # the gradients keep their buffers (no allocator churn)
    loss.backward()
    if after_backward is not None:
        after_backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.detach().float()


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


class Workload:
    """A model, its inner optimizer and its data, stepped by the learner's training thread.

    Args:
        model: the model; ``model.loss(inputs, targets)`` gives the training loss.
        optimizer: its inner optimizer.
        generator: the window sampler's RNG (part of the inner state).
        batch_size, context: windows per step (of one rank) and tokens per window.
        lr, warmup_steps, grad_clip: inner learning rate, its linear warm-up, gradient clipping.

    Attributes:
        device, amp_dtype: where the inner steps run and their autocast dtype (see :meth:`place`).
        rank, world: this process's rank in the learner's group and the group's size (0, 1 alone).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator, *,
                 batch_size: int, context: int, lr: float, warmup_steps: int, grad_clip: float) -> None:
        self.model = model
        self.optimizer = optimizer
        self.generator = generator
        self.params: dict[str, torch.nn.Parameter] = trainable_parameters(model)  # what the plan covers
        self.batch_size, self.context = batch_size, context
        self.lr, self.warmup_steps, self.grad_clip = lr, warmup_steps, grad_clip
        self.shard: np.ndarray | None = None
        self.device, self.amp_dtype = torch.device("cpu"), None
        self.rank, self.world = 0, 1
        self.train_model: torch.nn.Module = model  # what inner_step calls: the model, or its DDP wrapper
        self.mean_loss: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def from_config(cls, cfg: Config, index: int, incarnation: int) -> Workload:
        """Learner ``index``'s workload of a run: the recipe's model (``build_run_model``: every
        learner builds the same frozen base), AdamW over its trainable parameters with
        ``learners.lr``/``weight_decay`` (:func:`inner_optimizer`), and the sampler seeded by
        (run seed, index, incarnation)."""
        lc = cfg.learners
        model = build_run_model(cfg)
        opt = inner_optimizer(trainable_parameters(model).values(), lr=lc.lr, weight_decay=lc.weight_decay)
        return cls(model, opt, data_generator(cfg.run.seed, index, incarnation), batch_size=lc.batch_size_of(index),
                   context=cfg.model.context, lr=lc.lr, warmup_steps=lc.warmup_steps, grad_clip=lc.grad_clip)

    def place(self, device: torch.device, amp_dtype: torch.dtype | None = None) -> None:
        """Move the model to ``device`` (its parameters stay float32 and keep their identity, so the
        optimizer and ``params`` still refer to them) and run the forward under autocast with
        ``amp_dtype`` (None: float32). Call before the optimizer has state."""
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
        """Tokens one step of the whole learner trains on: ``world * batch_size * context``."""
        return self.world * self.batch_size * self.context

    def load_data(self, cfg: Config, index: int) -> int:
        """Map the tokenized corpus (:func:`~diloco_async.data.tokens.open_corpus`, built once per machine)
        and keep shard ``index`` of ``learners.count``; returns its size in tokens.

        Raises:
            ValueError: the tokenizer has more tokens than ``model.vocab_size`` (or another data error).
        """
        corpus = open_corpus(cfg.data, cfg.model.context, model_vocab=cfg.model.vocab_size)
        self.shard = corpus.shard(index, cfg.learners.count)
        return len(self.shard)

    def step(self, step: int) -> float:
        """One inner step on a batch of the shard, the ``step``-th of this learner (it sets the
        warm-up); returns the training loss (nats/token).

        Raises:
            RuntimeError: :meth:`load_data` was not called.
        """
        if self.shard is None:
            raise RuntimeError("Workload.step before load_data")
        b = self.batch_size
        x, y = Corpus.sample(self.shard, self.world * b, self.context, self.generator)
        if self.world > 1:
            x, y = x[self.rank * b:(self.rank + 1) * b], y[self.rank * b:(self.rank + 1) * b]
        if self.device.type != "cpu":
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        loss = inner_step(self.train_model, self.optimizer, x, y, lr=warmup_lr(self.lr, step, self.warmup_steps),
                          grad_clip=self.grad_clip, amp_dtype=self.amp_dtype)
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
