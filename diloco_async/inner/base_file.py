"""A learner's base copies Θ^base kept in local files, not in RAM (issue 17 item 3).

A learner needs Θ^base of a fragment only now and then: to take its outer gradient Δ = Θ^base − θ
when it contributes, to apply a compact delta download to the version it holds, to ``rebase`` at
an adoption, and to save its inner state. Held in RAM as fp32 they were one model's size for the
whole run; here each version of a fragment is written once, as the raw bytes of its tensors, to a
file of its own in a per-process local folder (:func:`base_folder`), and read back one tensor at
a time with a plain file read into a fresh tensor of that one tensor's size. No mmap: pages of a
mapping that were touched count in the RSS.

Exactness: the bytes read back are the bytes written, and each tensor's checksum (XXH3-128 of
its bytes, taken when it is written, kept in RAM) is checked on every read, so Δ from the file is
bit for bit Δ from RAM; a missing, short or altered file raises :class:`BaseFileError` and never
yields a value. The file is this process's own scratch copy, so the check is against torn or
damaged bytes, not against an adversary (objects in the store keep their sha256): XXH3 checks
50 MB in ~2 ms on the 2-core machine where sha256 took ~28 ms, and both reads of a contribution
cycle (Δ, and an adoption) run on the training thread.

A :class:`BaseFile` is a read-only ``Mapping[str, Tensor]`` (each lookup reads the file), so
code written for dicts of tensors (:func:`~diloco_async.learner.rules.outer_gradient`,
:func:`~diloco_async.codec.versions.apply_decoded`) takes it as it is. Its file is deleted when
the last reference to it goes (an adopted version replaces the previous one).

A learner whose parameters live on an accelerator keeps its base copies in RAM instead
(:class:`HeldBase`, chosen by :func:`keep_base`): its host memory holds no other copy of the model,
and the file read and sha256 of every tensor at every contribution and adoption, on the training
thread, were the largest cost between its inner steps on a GPU.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import xxhash

__all__ = ["BaseFile", "BaseFileError", "HeldBase", "LazyTensor", "base_folder", "keep_base", "overwrite_param",
           "to_base_file"]

log = logging.getLogger("diloco.learner")

_folders: dict[str, str] = {}
_folders_lock = threading.Lock()
_seq = itertools.count()


class BaseFileError(RuntimeError):
    """A base file is missing, short or does not hold the bytes written to it (its ``reason``:
    ``missing``, ``short`` or ``checksum``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def base_folder(learner_id: str, parent: str | None = None) -> str:
    """This process's local folder of base files for ``learner_id`` (made on first use, named
    after the learner and the pid like the spool folders, so that
    :func:`~diloco_async.learner.spool.remove_dead_spool_folders` removes it once the process is gone)."""
    with _folders_lock:
        key = f"{learner_id}\0{parent}"
        folder = _folders.get(key)
        if folder is None or not os.path.isdir(folder):
            folder = tempfile.mkdtemp(prefix=f"diloco-{learner_id}-pid{os.getpid()}-base-", dir=parent)
            _folders[key] = folder
            atexit.register(shutil.rmtree, folder, True)  # its files are not needed past the process
        return folder


@dataclass(frozen=True)
class _Entry:
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    checksum: str  # XXH3-128 of the bytes, hex


def _raw(t: torch.Tensor):
    """The bytes of ``t`` (on CPU, contiguous) as a writable numpy uint8 array (no copy for a
    contiguous CPU tensor)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _checksum(raw) -> str:
    """XXH3-128 of the bytes of ``raw`` (a numpy uint8 array), hex."""
    return xxhash.xxh3_128_hexdigest(memoryview(raw))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class BaseFile(Mapping[str, torch.Tensor]):
    """One fragment version's tensors in a local file; ``base[name]`` reads that tensor (a new
    CPU tensor of its shape and dtype, bit for bit what was written).

    Build one with :meth:`write`. Raises :class:`BaseFileError` on a lookup whose bytes are
    missing or differ from those written; KeyError for a name it does not hold.
    """

    fresh_reads = True  # every lookup is a new tensor its caller owns (and may write into)

    def __init__(self, path: str, entries: dict[str, _Entry]) -> None:
        self.path = path
        self._entries = entries
        self._finalizer = weakref.finalize(self, _unlink, path)

    @classmethod
    def write(cls, tensors: Mapping[str, torch.Tensor], folder: str) -> BaseFile:
        """Write ``tensors`` (any dtype, any device: brought to CPU one at a time) to a new file
        in ``folder``; each tensor's checksum is kept for the reads.

        Raises:
            OSError: the write failed (nothing is left behind).
        """
        path = os.path.join(folder, f"base-{os.getpid()}-{next(_seq)}.bin")
        entries: dict[str, _Entry] = {}
        offset = 0
        try:
            with open(path, "wb") as fh:
                for name, value in tensors.items():
                    t = value.detach().to("cpu").contiguous()
                    raw = _raw(t)
                    fh.write(memoryview(raw))
                    entries[name] = _Entry(offset, raw.nbytes, tuple(t.shape), t.dtype, _checksum(raw))
                    offset += raw.nbytes
                    del t, raw
        except BaseException:
            _unlink(path)
            raise
        return cls(path, entries)

    def __getitem__(self, name: str) -> torch.Tensor:
        e = self._entries[name]
        out = torch.empty(e.shape, dtype=e.dtype)
        self._read(name, e, out)
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Read tensor ``name`` straight into ``out`` (a contiguous CPU tensor of its shape and
        dtype, e.g. a parameter at an adoption): no new tensor, no second copy.

        Raises:
            KeyError: a name it does not hold. ValueError: ``out`` is not such a tensor.
            BaseFileError: as a lookup; ``out`` then holds some of the bytes read (the learner
            stops on this error and restarts from its inner state).
        """
        e = self._entries[name]
        if not self.can_read_into(name, out):
            raise ValueError(f"read_into {name}: needs a contiguous CPU {e.dtype} tensor of shape {e.shape}, "
                             f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        self._read(name, e, out.detach())

    def can_read_into(self, name: str, out: torch.Tensor) -> bool:
        """Whether :meth:`read_into` takes ``out`` for tensor ``name``: a contiguous CPU tensor of
        its shape and dtype. KeyError for an unknown name."""
        e = self._entries[name]
        return (out.device.type == "cpu" and out.dtype == e.dtype and tuple(out.shape) == e.shape
                and out.is_contiguous())

    def _read(self, name: str, e: _Entry, out: torch.Tensor) -> None:
        raw = _raw(out)
        try:
            with open(self.path, "rb", buffering=0) as fh:
                fh.seek(e.offset)
                got = fh.readinto(memoryview(raw)) if e.nbytes else 0
        except FileNotFoundError:
            raise BaseFileError("missing", f"base file {self.path} of tensor {name} is missing") from None
        if got != e.nbytes:
            raise BaseFileError("short", f"base file {self.path}: tensor {name} has {got} of its {e.nbytes} bytes")
        if _checksum(raw) != e.checksum:
            raise BaseFileError("checksum", f"base file {self.path}: tensor {name} does not hold the bytes written "
                                "(checksum differs)")

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` (no read). KeyError for an unknown name."""
        return self._entries[name].shape

    def lazy(self, name: str) -> LazyTensor:
        """Tensor ``name`` as a :class:`LazyTensor` (read when written out)."""
        e = self._entries[name]
        return LazyTensor(self, name, e.shape, e.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of all its tensors (on disk; none of them in RAM)."""
        return sum(e.nbytes for e in self._entries.values())


@dataclass(frozen=True)
class LazyTensor:
    """A tensor of a :class:`BaseFile` not read yet: what a safetensors writer needs to lay it
    out (shape, dtype, sizes) and :meth:`load` to read it (:func:`diloco_async.storage.checkpoint.spool_state`)."""

    source: BaseFile
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def load(self) -> torch.Tensor:
        """The tensor, read from its file (raises :class:`BaseFileError` as a lookup does)."""
        return self.source[self.name]


class HeldBase(dict[str, torch.Tensor]):
    """One fragment version's tensors held in RAM, on CPU: a dict with :class:`BaseFile`'s
    ``shape_of`` and ``nbytes``. The base copies of a learner whose parameters, gradients and
    moments live on an accelerator, so that its host memory holds this one copy of the model and
    nothing else of that size.

    ``base[name]`` is the held tensor itself, not a copy: the learner's code only reads its base
    copies (:func:`~diloco_async.learner.rules.outer_gradient`, ``adopt``, ``apply_decoded``).
    With ``pin_device`` (a CUDA device) the tensors are in pinned host memory, so that copies to
    that device are asynchronous (:mod:`diloco_async.learner.device_copies`).
    Measured on an H200 with GPT-2 small (98M parameters, 8 fragments): with base files, reading
    them back took 12% of the learner's wall time on the training thread (py-spy), most of the
    between-step time of a learner at 0.80 of its plain loop's tokens/s.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], pin_device: torch.device | None = None) -> None:
        super().__init__((name, _held(t, pin_device)) for name, t in tensors.items())

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``. KeyError for an unknown name."""
        return tuple(self[name].shape)

    @property
    def nbytes(self) -> int:
        """Bytes of all its tensors (in RAM)."""
        return sum(t.numel() * t.element_size() for t in self.values())


def _held(t: torch.Tensor, pin_device: torch.device | None) -> torch.Tensor:
    """``t`` on the host, contiguous, and pinned for ``pin_device`` (a CUDA device; pinned memory
    is registered with that device's context, so no other GPU's context is made)."""
    t = t.detach().to("cpu").contiguous()
    if pin_device is None or pin_device.type != "cuda" or t.is_pinned():
        return t
    with torch.cuda.device(pin_device):
        return t.pin_memory()


def keep_base(tensors: Mapping[str, torch.Tensor], learner_id: str, *, in_ram: bool,
              pin_device: torch.device | None = None) -> BaseFile | HeldBase:
    """A learner's base copy of a fragment version: held in RAM (:class:`HeldBase`, pinned for
    ``pin_device`` when given) when ``in_ram`` (the learner's parameters are on an accelerator),
    else in a local file (:func:`to_base_file`). A BaseFile or HeldBase is returned as it is."""
    if isinstance(tensors, BaseFile | HeldBase):
        return tensors
    return HeldBase(tensors, pin_device) if in_ram else to_base_file(tensors, learner_id)


def to_base_file(tensors: Mapping[str, torch.Tensor], learner_id: str) -> BaseFile:
    """``tensors`` written to a new :class:`BaseFile` in ``learner_id``'s folder (a BaseFile is
    returned as it is). The caller drops its references to ``tensors`` to free their RAM."""
    if isinstance(tensors, BaseFile):
        return tensors
    return BaseFile.write(tensors, base_folder(learner_id))


def overwrite_param(param: torch.Tensor, new: Mapping[str, torch.Tensor], name: str) -> None:
    """θ ← Θ^new of one tensor: read from a base file straight into a CPU parameter (no new tensor, no second
    copy; the learner stops if the bytes are not those written), else copied (to a GPU: queued, not waited)."""
    if isinstance(new, BaseFile) and new.can_read_into(name, param):
        new.read_into(name, param)
    else:
        param.copy_(new[name], non_blocking=True)
