"""The learner's inner-state spool, written on a thread of its own while training goes on (issue 17).

The training thread captures its inner state without copies (:func:`diloco_async.inner.state.capture`:
the live parameters, AdamW moments and base copies) between two steps and hands it to a
:class:`StateSpooler`, whose thread writes it to a local safetensors file
(:func:`diloco_async.storage.checkpoint.spool_state`) and then queues it for the comms thread to upload.
Writing ~4x the model's fp32 size takes seconds; on the training thread it stalled training for
all of it. Here the next step's forward and backward run while the file is written, and training
waits only where the snapshot would otherwise change under the writer:

* the parameters and the AdamW moments are written first; the optimizer's step and an adoption
  (both mutate them in place) wait for :meth:`StateSpooler.wait_mutable`;
* the base copies Θ^base are never mutated in place (an adoption replaces them), so they are
  written last without a wait; the spool drops each reference once written, so a replaced base
  copy is freed as the spool goes on rather than at its end.

No tensor is copied on a CPU learner: the snapshot is consistent because nothing it holds is
mutated before it is on disk. On a GPU the parameters and moments are copied on the device when
the spool starts (device memory is read at ~TB/s; skipped when the copies would take over half its
free memory), so the optimizer never waits; the spool thread brings them to the host on a CUDA
stream of its own, after an event recorded at the capture, so those copies never hold up the
kernels of training's stream.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time

import psutil
import torch

from diloco_async.inner.state import InnerState
from diloco_async.learner.device_copies import DeviceMark, side_stream_after, snapshot_on_device
from diloco_async.learner.state import Shared, SpooledState
from diloco_async.runtime.priority import BACKGROUND_NICE, lower_thread_priority
from diloco_async.storage.checkpoint import spool_state

__all__ = ["StateSpooler", "MUTABLE_PREFIXES", "new_spool_folder", "remove_dead_spool_folders"]

log = logging.getLogger("diloco.learner")

#: a spool folder's name: the learner's id, then the pid of the process that made it
_FOLDER = re.compile(r"^diloco-(?P<learner>.+)-pid(?P<pid>\d+)-(?:state|base)-[^/]+$")


def new_spool_folder(learner_id: str, parent: str | None = None) -> str:
    """A new local folder for this process's spooled inner states (in ``parent``, default the
    system's temporary folder), named after the learner and this process's pid so that a later
    process can tell that its owner is gone (:func:`remove_dead_spool_folders`)."""
    return tempfile.mkdtemp(prefix=f"diloco-{learner_id}-pid{os.getpid()}-state-", dir=parent)


def remove_dead_spool_folders(learner_id: str, parent: str | None = None) -> list[str]:
    """Remove the spool folders of ``learner_id`` whose process is gone (a learner that was
    killed cannot remove its own: each held up to 5x the model's fp32 size). A folder whose pid
    is alive, whoever it now is, is left alone. Returns the folders removed."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = _FOLDER.match(name)
        if m is None or m["learner"] != learner_id or psutil.pid_exists(int(m["pid"])):
            continue
        path = os.path.join(parent, name)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    if removed:
        log.info("%s removed %d spool folder(s) of processes that are gone: %s", learner_id, len(removed), removed)
    return removed


#: the state's tensors that training mutates in place (optimizer step, adoption)
MUTABLE_PREFIXES = ("param/", "exp_avg/", "exp_avg_sq/", "muon_momentum/")


def _nbytes(t) -> int:
    """Bytes of a tensor (or lazy tensor); 0 for None."""
    return 0 if t is None else t.numel() * t.element_size()


def _mutable_first(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """``tensors`` reordered with the in-place-mutated ones first, and the set of those names."""
    mutable = {k for k in tensors if k.startswith(MUTABLE_PREFIXES)}
    ordered = {k: v for k, v in tensors.items() if k in mutable}
    ordered.update((k, v) for k, v in tensors.items() if k not in mutable)
    return ordered, mutable


class StateSpooler:
    """Writes one captured inner state at a time to a local file on its own thread.

    Args:
        learner_id: for the log.
        shared: the learner's shared state: a written spool goes to ``upload_queue`` as a
            :class:`~diloco_async.learner.state.SpooledState`, and ``state_spooled`` is set from
            :meth:`start` until the comms thread uploaded (or dropped) it; a failed spool clears it.
    """

    def __init__(self, learner_id: str, shared: Shared, copy_budget_bytes: int = 0) -> None:
        self.learner_id, self.shared = learner_id, shared
        self.copy_budget_bytes = copy_budget_bytes
        self._mutable_written = threading.Event()
        self._mutable_written.set()
        self._lock = threading.Lock()  # guards the three fields below, shared with the spool thread
        self._tensors: dict[str, torch.Tensor] = {}  # the spool in progress's map (entries dropped as written)
        self._left: set[str] = set()  # mutable entries whose live tensor the spool has still to read
        self._current: str | None = None  # the entry the spool thread reads now
        self._thread: threading.Thread | None = None
        self._reniced = False  # the spool thread lowered its priority (once its mutable part is read)
        self.waited_s = 0.0  # training's total wait for the spool (optimizer steps and adoptions)
        self.copied_bytes = 0  # mutable tensors copied so that training need not wait for them

    def start(self, state: InnerState, path: str) -> None:
        """Write ``state`` (captured without copies, between two steps) to ``path`` on the spool
        thread. The caller must call :meth:`wait_mutable` before it mutates a parameter or an
        AdamW moment in place. Raises RuntimeError while the previous spool is being written."""
        if self.writing():
            raise RuntimeError("the previous inner-state spool is still being written")
        tensors, mutable = _mutable_first(state.tensors)
        state.tensors = {}  # the spool holds the only references, dropped as written
        # on a GPU: the parameters and moments copied there (when they fit), and the point in
        # training's stream after which the spool thread reads them, on a stream of its own
        mark = None
        device = next((tensors[k].device for k in mutable if tensors[k].device.type == "cuda"), None)
        if device is not None:
            mutable -= snapshot_on_device(tensors, mutable)
            mark = DeviceMark.now(device)
        with self._lock:
            self._tensors, self._left, self._current = tensors, set(mutable), None
        self._mutable_written.clear()
        self.shared.state_spooled.set()
        self._thread = threading.Thread(target=self._write, args=(tensors, mutable, path, state.meta, mark),
                                        name=f"{self.learner_id}-spool", daemon=True)
        self._thread.start()

    def writing(self) -> bool:
        """True while the spool thread is writing a state."""
        return self._thread is not None and self._thread.is_alive()

    def wait_mutable(self) -> float:
        """Block until no parameter or moment of the spool in progress is still to be read from
        its live tensor (at once when none is); returns the seconds waited.

        Once the mutable tensors the spool has not started yet fit in ``copy_budget_bytes``, they
        are copied (on the calling thread, between two steps, so the copies hold the captured
        values) and the spool writes the copies: training then waits only for the tensor being
        written now, not for the rest of the mutable part."""
        if self._mutable_written.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._copy_left_if_within_budget()
        while not self._mutable_written.wait(0.01):
            self._copy_left_if_within_budget()
        waited = time.perf_counter() - t0
        self.waited_s += waited
        return waited

    def _copy_left_if_within_budget(self) -> None:
        with self._lock:
            # a copy on a GPU would be queued on training's stream, which the spool's stream does
            # not wait for: tensors there are copied at start (snapshot_on_device) or waited for
            pending = [k for k in self._left if k != self._current and self._tensors[k].device.type == "cpu"]
            nbytes = sum(_nbytes(self._tensors[k]) for k in pending)
            if not pending or nbytes > self.copy_budget_bytes:
                return
            for k in pending:  # the spool thread reads an entry only after starting(k), under the lock
                self._tensors[k] = self._tensors[k].clone()
                self._left.discard(k)
            self.copied_bytes += nbytes
            if not self._left:
                self._mutable_written.set()

    def join(self, timeout_s: float = 120.0) -> None:
        """Wait for the spool in progress to end (a stop), at most ``timeout_s``."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _starting(self, name: str) -> None:
        with self._lock:
            self._current = name

    def _written(self, name: str) -> None:
        with self._lock:
            self._left.discard(name)
            self._current = None
            if self._left:
                return
            self._mutable_written.set()
        if not self._reniced:  # the rest (base copies, copies of moments) is not waited for
            lower_thread_priority(BACKGROUND_NICE)
            self._reniced = True

    def _write(self, tensors: dict[str, torch.Tensor], mutable: set[str], path: str, meta: dict,
               mark: DeviceMark | None) -> None:
        self._reniced = False
        if not mutable:
            self._mutable_written.set()
        t0, waited0, copied0 = time.perf_counter(), self.waited_s, self.copied_bytes
        try:
            with side_stream_after(mark):  # each copy to the host returns once done: then training may mutate
                nbytes = spool_state(tensors, path, written=self._written, consume=True, starting=self._starting)
        except Exception as err:  # logged; training goes on, the next period retries
            log.warning("%s could not spool its inner state (%s: %s)", self.learner_id, type(err).__name__, err)
            self.shared.state_spooled.clear()
            return
        finally:
            self._mutable_written.set()  # never leave training waiting on a spool that ended
            with self._lock:
                tensors.clear()
                self._left.clear()
        log.info("%s spooled its inner state (step %d, %.0f MiB) in %.2f s; training waited %.2f s for it "
                 "(and copied %.0f MiB)", self.learner_id, meta["step"], nbytes / 2**20, time.perf_counter() - t0,
                 self.waited_s - waited0, (self.copied_bytes - copied0) / 2**20)
        self.shared.upload_queue.put(SpooledState(path, nbytes, meta))
        self.shared.large_frees.set()
