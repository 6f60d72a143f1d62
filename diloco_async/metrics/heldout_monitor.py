"""Held-out loss of the published global model while a run trains: a background evaluator.

The synchronizer publishes each fragment's versions as immutable objects
(``{run_id}/globals/p{p:03d}/v{v:08d}.safetensors``, DESIGN §5). A key appears in a listing only
once its object is whole (docs/storage.md: written under a temporary name, published atomically,
temporary names never listed), so reading a listed version never sees half an object; the codec's
header and shape checks refuse anything else. :class:`HeldoutMonitor` lists the newest version of
every fragment every ``every_s`` seconds, loads them into one model and evaluates it on the run's
fixed held-out windows, in one thread that runs torch on one intra-op thread, off the learners' and
the synchronizer's paths. Its points use the metric-stream format (``key``, ``value``, ``step``,
``timestamp_ms``) with step = Σ_p v_p, the number of merges whose results the model holds (each
merge publishes one version of one fragment), the same x-axis as the synchronizer's series. With a
``sampler`` (a Hugging Face model's :func:`~diloco_async.metrics.samples.generate_samples` on fixed
prompts), each evaluation also carries the text the model generates (:meth:`HeldoutMonitor.drain_samples`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from diloco_async.codec import wire
from diloco_async.data.tokens import HeldoutSplit
from diloco_async.models import trainable_parameters
from diloco_async.models.transformer import evaluate_loss
from diloco_async.policy.fragments import FragmentPlan
from diloco_async.storage import keys
from diloco_async.storage.store import ObjectStore

__all__ = ["newest_versions", "load_versions", "HeldoutMonitor", "EvalPoint"]

log = logging.getLogger("diloco.heldout_monitor")


def newest_versions(store: ObjectStore, run_id: str, num_fragments: int) -> dict[int, int] | None:
    """``{fragment: newest published version}`` from one listing of the run's global versions;
    None until every fragment ``0 .. num_fragments - 1`` has one."""
    newest: dict[int, int] = {}
    for key in store.list(keys.versions_prefix(run_id)):
        parsed = keys.parse_version_key(run_id, key)
        if parsed is not None and parsed[0] < num_fragments:
            newest[parsed[0]] = max(parsed[1], newest.get(parsed[0], -1))
    return newest if len(newest) == num_fragments else None


def load_versions(model: torch.nn.Module, store: ObjectStore, run_id: str, plan: FragmentPlan,
                  versions: Mapping[int, int]) -> None:
    """Copy version ``versions[p]`` of every fragment ``p`` into the trainable tensors of ``model``
    (fp32 values, the plan's shapes). All fragments are read and decoded before any tensor is
    written, so a failed read leaves ``model`` as it was.

    Raises:
        FileNotFoundError: a version is gone (garbage-collected since it was listed).
        ValueError: a version does not decode to the plan's tensors (codec, names, shapes), or the
            plan names a tensor the model does not train.
    """
    params = trainable_parameters(model)
    decoded: dict[str, torch.Tensor] = {}
    for p, v in sorted(versions.items()):
        shapes = {s.name: s.shape for s in plan.fragments[p]}
        tensors, meta = wire.decode_from_bytes(store.get_unverified(keys.version_key(run_id, p, v)), "fp32", shapes)
        if meta.get("fragment") != str(p) or meta.get("version") != str(v):
            raise ValueError(f"fragment {p} version {v}: its header names fragment {meta.get('fragment')} "
                             f"version {meta.get('version')}")
        decoded.update(tensors)
    unknown = sorted(set(decoded) - set(params))
    if unknown:
        raise ValueError(f"the plan names tensors the model does not train: {unknown[:5]}")
    with torch.no_grad():
        for name, tensor in decoded.items():
            params[name].copy_(tensor)


@dataclass(frozen=True)
class EvalPoint:
    """One evaluation of the published global model.

    Attributes:
        step: Σ_p v_p over the versions evaluated (merges so far).
        versions: the version of each fragment, by fragment index.
        loss_nats: mean held-out cross-entropy, nats per token.
        bits_per_byte: the same in bits per byte of held-out text.
        eval_s: seconds the read and the evaluation took.
        timestamp_ms: wall-clock time of the evaluation, ms since the epoch.
        samples: the sampler's texts for this model (empty without a sampler, or when it failed).
    """

    step: int
    versions: tuple[int, ...]
    loss_nats: float
    bits_per_byte: float
    eval_s: float
    timestamp_ms: int
    samples: tuple[str, ...] = field(default=())

    def metric_points(self) -> list[dict]:
        """``eval/loss`` (nats/token), ``eval/bits_per_byte`` and ``eval/duration_s`` as metric-stream
        points at :attr:`step`."""
        return [{"key": key, "value": value, "step": self.step, "timestamp_ms": self.timestamp_ms}
                for key, value in (("eval/loss", self.loss_nats), ("eval/bits_per_byte", self.bits_per_byte),
                                   ("eval/duration_s", self.eval_s))]


class HeldoutMonitor:
    """Evaluates the newest published global model every ``every_s`` seconds in a daemon thread.

    Args:
        model: a model of the run's kind (built once; its trainable tensors are overwritten).
        split: the run's fixed held-out windows (:func:`~diloco_async.metrics.evaluation.heldout_split`).
        store, run_id: where the versions are published; the plan is read from ``plan.json``.
        every_s: seconds between the starts of two passes (> 0).
        after_step: evaluate only models past this step (the caller logged that one itself).
        clock: monotonic seconds, for :attr:`EvalPoint.eval_s`.
        sampler: called with the model after each evaluation, returns texts it generated
            (:attr:`EvalPoint.samples`); an error in it is logged and counted in
            :attr:`sample_errors`, and the loss point is kept.

    A pass that finds no newer versions than the last evaluated (or no plan yet) evaluates
    nothing. Any error (the store, a version gone between listing and reading) skips the pass
    (logged, counted in :attr:`errors`); the thread goes on. :meth:`drain` hands the points over to one consumer.
    """

    def __init__(self, model: torch.nn.Module, split: HeldoutSplit, store: ObjectStore, run_id: str, every_s: float,
                 *, after_step: int = 0, clock: Callable[[], float] = time.monotonic,
                 sampler: Callable[[torch.nn.Module], list[str]] | None = None) -> None:
        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, not {every_s}")
        self.model, self.split, self.store, self.run_id = model, split, store, run_id
        self.every_s, self.clock, self.sampler = every_s, clock, sampler
        self.last_step = after_step
        self.errors = 0
        self.sample_errors = 0
        self._plan: FragmentPlan | None = None
        self._points: list[EvalPoint] = []
        self._samples: list[tuple[int, tuple[str, ...]]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def evaluate_newest(self) -> EvalPoint | None:
        """One pass: the point of the newest published model, or None when there is nothing new.

        Raises:
            OSError, ValueError: the store could not be read or a version did not decode.
            KeyError: ``plan.json`` holds no plan.
        """
        if self._plan is None:
            if not self.store.exists(keys.plan_key(self.run_id)):
                return None
            self._plan = FragmentPlan.from_json(self.store.get_json(keys.plan_key(self.run_id))["plan"])
        t0 = self.clock()
        versions = newest_versions(self.store, self.run_id, self._plan.num_fragments)
        if versions is None or sum(versions.values()) <= self.last_step:
            return None
        load_versions(self.model, self.store, self.run_id, self._plan, versions)
        with torch.no_grad():
            nats = evaluate_loss(self.model, self.split.batches)
        step = sum(versions.values())
        self.last_step = step
        return EvalPoint(step, tuple(versions[p] for p in sorted(versions)), nats, self.split.bits_per_byte(nats),
                         self.clock() - t0, int(time.time() * 1000), self._sample(step))

    def _sample(self, step: int) -> tuple[str, ...]:
        if self.sampler is None:
            return ()
        try:
            return tuple(self.sampler(self.model))
        except Exception as err:  # noqa: BLE001 - samples are a view of the model; the loss point stands
            self.sample_errors += 1
            log.warning("no text samples at step %d (%s: %s)", step, type(err).__name__, err)
            return ()

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="heldout-monitor", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one core's share at most: the learners own the machine
        try:
            while not self._stop.is_set():
                started = self.clock()
                try:
                    point = self.evaluate_newest()
                except Exception as err:  # noqa: BLE001 - a view of the run: log, count, try again next pass
                    self.errors += 1
                    log.warning("held-out evaluation skipped (%s: %s)", type(err).__name__, err)
                    point = None
                if point is not None:
                    with self._lock:
                        self._points.append(point)
                        if point.samples:
                            self._samples.append((point.step, point.samples))
                self._stop.wait(max(0.0, self.every_s - (self.clock() - started)))
        finally:
            torch.set_num_threads(threads)

    def drain(self) -> list[dict]:
        """The metric points (:meth:`EvalPoint.metric_points`) evaluated since the last call."""
        with self._lock:
            points, self._points = self._points, []
        return [m for p in points for m in p.metric_points()]

    def drain_samples(self) -> list[tuple[int, tuple[str, ...]]]:
        """``(step, samples)`` of the evaluations with samples since the last call, oldest first."""
        with self._lock:
            out, self._samples = self._samples, []
        return out

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stop the thread after its current pass (waits at most ``timeout_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("held-out evaluation still running after %.0f s; left behind", timeout_s)
