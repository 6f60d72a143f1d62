"""Baselines measured in the same harness as Decoupled DiLoCo (DESIGN §8).

* :mod:`diloco_async.baselines.ddp`: one rank of synchronous data-parallel training
  (``torch.distributed``, gloo, gradients all-reduced every step, ``torchrun``-style
  checkpoints).
* :mod:`diloco_async.baselines.ddp_checkpoints`: reading those checkpoints back (the chaos
  harness evaluates the DDP curve from them).
* :mod:`diloco_async.baselines.ddp_group`: :class:`DdpGroup`, which starts, signals and stops
  the M rank processes of one incarnation.
"""
