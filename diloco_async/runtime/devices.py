"""Where and how a learner computes: its device, precision, batch size and process group (DESIGN §3).

:class:`LearnerDeviceFields` holds the ``learners.*`` keys of this concern (``LearnerConfig`` in
:mod:`diloco_async.config.schema` inherits them): ``device``, ``precision``, ``batch_size`` (one value
or one per learner), ``nproc_per_learner``, ``nnodes``, ``rdzv_endpoint``, ``group_timeout_s``.
The syntax is checked when the config is validated; :func:`check_devices` checks the hardware of
the machine that runs the learners, before anything starts; :func:`resolve_device` picks the
``torch.device`` of one rank. The outer side never changes with these: outer gradients,
fragments, the base copies a learner keeps and the synchronizer's outer state stay float32 on
CPU (a learner on a GPU takes Δ there and copies it back, bit for bit the CPU's:
:mod:`diloco_async.learner.device_copies`); the inner steps run on the device, under
``torch.autocast`` with ``bf16``.
"""

from __future__ import annotations

import re
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["DEVICE_PATTERN", "LearnerDeviceFields", "check_devices", "resolve_device", "amp_dtype",
           "cuda_device_count", "mps_available", "set_cpu_math"]

#: A valid ``learners.device`` entry.
DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


class LearnerDeviceFields(BaseModel):
    """The learner keys of devices, precision, batch size and the learner's process group."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: int | list[int] = Field(
        16, description="Windows per inner step of one rank; a list gives one value per learner (heterogeneous "
        "fleets: token weights then differ). A learner's step covers nproc_per_learner x nnodes x this windows.")
    device: str | list[str] = Field(
        "cpu", description="'auto' (cuda, else mps, else cpu) | 'cpu' | 'cuda' (rank r of a group uses cuda:r) | "
        "'cuda:N' | 'mps'; a list gives one value per learner.")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="Inner steps in float32, or under torch.autocast with bfloat16. Parameters, outer "
        "gradients and the synchronizer's state stay float32.")
    nproc_per_learner: int = Field(
        1, ge=1, description="Ranks per node of each learner: >1 runs the learner as a torchrun group with DDP "
        "inside (gloo on CPU, NCCL on CUDA); rank 0 talks to the synchronizer.")
    parallelism: Literal["ddp", "fsdp"] = Field(
        "ddp", description="How a learner group of several ranks holds the model: 'ddp' (every rank the whole model, "
        "DistributedDataParallel) or 'fsdp' (torch's fully_shard, FSDP2: each rank 1/N of the parameters, "
        "gradients, AdamW moments and base copies, and of each outer gradient; DESIGN §3.1). fsdp needs "
        "nproc_per_learner x nnodes >= 2.")
    nnodes: int = Field(1, ge=1, description="Nodes of each learner's torchrun group (multi-node needs rdzv_endpoint).")
    rdzv_endpoint: str = Field("", description="host:port of the c10d rendezvous of a multi-node learner group.")
    group_timeout_s: float = Field(
        300.0, gt=0, description="Timeout of one collective inside a learner group (rank 0 may wait this long "
        "for the synchronizer while the other ranks wait for it).")
    flush_denormal: bool = Field(
        True, description="The learner's CPU math flushes subnormal floats (below 1.2e-38 in magnitude) to zero "
        "(x86 FTZ/DAZ, torch.set_flush_denormal): as a model trains, some of its backward values underflow, and "
        "x86 computes on subnormals many times slower. No effect on a GPU's kernels.")

    @model_validator(mode="after")
    def _check_device_fields(self) -> LearnerDeviceFields:
        count = getattr(self, "count", None)
        for key in ("device", "batch_size"):
            value = getattr(self, key)
            if isinstance(value, list) and count is not None and len(value) != count:
                raise ValueError(f"learners.{key} lists {len(value)} values {value} but learners.count={count}")
        sizes = self.batch_size if isinstance(self.batch_size, list) else [self.batch_size]
        if not sizes or any(b < 1 for b in sizes):
            raise ValueError(f"learners.batch_size must be >= 1 (or a list of such), got {self.batch_size!r}")
        specs = self.device if isinstance(self.device, list) else [self.device]
        bad = [d for d in specs if not DEVICE_PATTERN.match(d)]
        if bad or not specs:
            raise ValueError(f"unknown learners.device {bad[0] if bad else self.device!r}: expected auto, cpu, "
                             "cuda, cuda:N or mps (or a list of them, one per learner)")
        if self.nproc_per_learner > 1:
            single = [d for d in specs if d == "mps" or d.startswith("cuda:")]
            if single:
                raise ValueError(f"learners.device={single[0]!r} is one device, it cannot hold "
                                 f"nproc_per_learner={self.nproc_per_learner} ranks; use 'cuda' (rank r takes "
                                 "cuda:r) or 'cpu'")
        if self.parallelism == "fsdp" and self.nproc_per_learner * self.nnodes < 2:
            raise ValueError(f"learners.parallelism='fsdp' with nproc_per_learner={self.nproc_per_learner} x "
                             f"nnodes={self.nnodes} = 1 rank: one rank cannot shard the model; use 'ddp' or at "
                             "least 2 ranks")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"learners.nnodes={self.nnodes} needs learners.rdzv_endpoint (host:port)")
        return self

    def batch_size_of(self, index: int) -> int:
        """Windows per inner step of one rank of learner ``index``."""
        return self.batch_size[index] if isinstance(self.batch_size, list) else self.batch_size

    def device_of(self, index: int) -> str:
        """The ``device`` entry of learner ``index``."""
        return self.device[index] if isinstance(self.device, list) else self.device

    @property
    def ranks_per_learner(self) -> int:
        """World size of one learner: ``nproc_per_learner * nnodes``."""
        return self.nproc_per_learner * self.nnodes


def cuda_device_count() -> int:
    """CUDA devices visible to this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def mps_available() -> bool:
    """Whether Apple's Metal backend is usable here."""
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def resolve_device(spec: str, local_rank: int = 0, nproc: int = 1, *, cuda_count: int | None = None,
                   has_mps: bool | None = None) -> torch.device:
    """The device of local rank ``local_rank`` (of ``nproc`` on this node) for one ``learners.device`` entry.

    ``auto`` is ``cuda`` if every local rank gets its own GPU, else ``mps`` (one process only),
    else ``cpu``; ``cuda`` is ``cuda:{local_rank}``. The hardware facts default to this machine's.

    Raises:
        ValueError: the entry is unknown, or names hardware that is absent (``cuda`` without a
            GPU, ``cuda:N`` or ``cuda`` with a rank beyond the visible GPUs, ``mps`` without MPS).
    """
    n_cuda = cuda_device_count() if cuda_count is None else cuda_count
    mps = mps_available() if has_mps is None else has_mps
    if not DEVICE_PATTERN.match(spec):
        raise ValueError(f"unknown learners.device {spec!r}: expected auto, cpu, cuda, cuda:N or mps")
    if spec == "auto":
        spec = "cuda" if n_cuda >= max(nproc, 1) else "mps" if mps and nproc == 1 else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "mps":
        if not mps:
            raise ValueError("learners.device='mps' but MPS is not available on this machine")
        return torch.device("mps")
    ordinal = int(spec.split(":", 1)[1]) if ":" in spec else local_rank
    if n_cuda == 0:
        raise ValueError(f"learners.device={spec!r} but no CUDA GPU is visible here (use 'auto' or 'cpu')")
    if ordinal >= n_cuda:
        raise ValueError(f"learners.device={spec!r} needs cuda:{ordinal} but only {n_cuda} CUDA device(s) are "
                         "visible here")
    return torch.device("cuda", ordinal)


def check_devices(lc: LearnerDeviceFields, *, cuda_count: int | None = None,
                  has_mps: bool | None = None) -> list[torch.device]:
    """Check, before anything starts, that this machine has the devices every learner asks for
    (every local rank of its group); returns the device of local rank 0 of each learner.

    Raises:
        ValueError: the first learner whose device is absent, naming the value (see :func:`resolve_device`).
    """
    count = getattr(lc, "count", 1)
    out = []
    for index in range(count):
        spec = lc.device_of(index)
        try:
            devs = [resolve_device(spec, r, lc.nproc_per_learner, cuda_count=cuda_count, has_mps=has_mps)
                    for r in range(lc.nproc_per_learner)]
        except ValueError as err:
            raise ValueError(f"learner {index}: {err}") from None
        out.append(devs[0])
    return out


def amp_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``learners.precision``: None for ``fp32``, ``torch.bfloat16`` for ``bf16``.

    Raises:
        ValueError: an unknown precision.
    """
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    raise ValueError(f"unknown learners.precision {precision!r}: expected fp32 or bf16")


def set_cpu_math(threads: int, flush_denormal: bool) -> bool:
    """Set the calling thread's CPU math for inner steps: subnormal floats flushed to zero or not
    (``learners.flush_denormal``), then ``threads`` intra-op threads (``learners.threads``).

    The flush mode is a per-thread CPU register. It is set first, so that the intra-op threads
    started afterwards inherit it; call this before any operation that ran on more than one
    thread in this process (a learner runs everything before it on one thread).

    Returns:
        whether subnormals are flushed now (False where asked not to, or where the CPU cannot).
    """
    flushed = torch.set_flush_denormal(flush_denormal) and flush_denormal
    torch.set_num_threads(threads)
    return flushed
