"""The held-out curve of a training run in MLflow, and what the model writes.

While the run trains, :func:`heldout_curve` evaluates the newest published global model every
``tracking.eval_every_s`` (:class:`~diloco_async.metrics.heldout_monitor.HeldoutMonitor`, one
thread of the flow process): ``eval/*`` metric points, and for ``model.kind = "hf"`` with a
tokenizer the greedy continuations of ``tracking.eval_samples`` fixed held-out prompts
(:mod:`diloco_async.metrics.samples`), one MLflow text artifact per evaluation,
``eval_samples/step-<merges>.txt``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from diloco_async.config.schema import Config
from diloco_async.data.tokenizer import transformers_tokenizer
from diloco_async.data.tokens import HeldoutSplit, open_corpus
from diloco_async.flows.tracking import MlflowSink
from diloco_async.metrics.evaluation import heldout_split
from diloco_async.metrics.heldout_monitor import HeldoutMonitor
from diloco_async.metrics.samples import format_samples, generate_samples, heldout_prompts
from diloco_async.models import build_run_model

__all__ = ["MONITOR_STOP_WAIT_S", "PROMPT_TOKENS", "hf_tokenizer", "eval_sampler", "samples_artifact",
           "heldout_curve", "final_samples"]

log = logging.getLogger("diloco.flows.heldout")

MONITOR_STOP_WAIT_S = 3.0
"""At the end, an evaluation pass of the held-out monitor still running after this long is left
behind (a daemon thread): a Ctrl-C must not wait out a pass on a loaded machine."""
#: tokens of a sample prompt, at most (and at most half the context)
PROMPT_TOKENS = 16


def hf_tokenizer(cfg: Config) -> Any | None:
    """The run's tokenizer as a transformers tokenizer, saved beside an ``hf`` model (None for
    bytes, or for another model kind)."""
    tok = open_corpus(cfg.data, cfg.model.context).tokenizer if cfg.model.kind == "hf" else None
    return transformers_tokenizer(tok) if tok is not None else None


def eval_sampler(cfg: Config, split: HeldoutSplit) -> tuple[Callable[[Any], list[str]] | None, list[str]]:
    """(sampler, prompts) of the run's periodic evaluations: the sampler continues the prompts
    (``tracking.eval_samples`` of them, from ``split``) by ``tracking.eval_sample_tokens`` tokens,
    capped at half the context; (None, []) when the run has no samples (not ``hf``, the bytes
    tokenizer, or ``eval_samples = 0``)."""
    tok = hf_tokenizer(cfg) if cfg.tracking.eval_samples else None
    if tok is None:
        return None, []
    new_tokens = max(1, min(cfg.tracking.eval_sample_tokens, cfg.model.context // 2))
    prompts = heldout_prompts(split.batches, tok, cfg.tracking.eval_samples,
                              max(1, min(PROMPT_TOKENS, cfg.model.context - new_tokens)))
    return (lambda model: generate_samples(model, tok, prompts, new_tokens)), prompts


def samples_artifact(step: int) -> str:
    """The artifact path of the samples of the evaluation at ``step`` merges."""
    return f"eval_samples/step-{step:08d}.txt"


def _log_samples(sink: MlflowSink, prompts: list[str], drained: list[tuple[int, tuple[str, ...]]]) -> None:
    for step, samples in drained:
        sink.log_text(format_samples(step, prompts, samples), samples_artifact(step))


@contextmanager
def heldout_curve(cfg: Config, store: Any, run_id: str, sink: MlflowSink) -> Iterator[Callable[[], list[dict]]]:
    """While the run trains, evaluate the newest published global model of run ``run_id`` in
    ``store`` every ``tracking.eval_every_s``; yields the callable that logs the new samples and
    hands the new ``eval/*`` points over, and logs the rest at the end."""
    every_s = cfg.tracking.eval_every_s
    if every_s <= 0:
        yield list
        return
    split = heldout_split(cfg)
    sampler, prompts = eval_sampler(cfg, split)
    monitor = HeldoutMonitor(build_run_model(cfg), split, store, run_id, every_s, sampler=sampler)
    monitor.start()

    def pending() -> list[dict]:
        _log_samples(sink, prompts, monitor.drain_samples())
        return monitor.drain()

    try:
        yield pending
    finally:
        monitor.stop(timeout_s=MONITOR_STOP_WAIT_S)
        sink.log_points(pending())


def final_samples(cfg: Config, model: Any, step: int, sink: MlflowSink) -> str | None:
    """The final model's samples of the same prompts (``samples.txt``), or None when the run has
    none (see :func:`eval_sampler`) or the generation failed (logged, counted in ``sink.errors``:
    the run is finished either way)."""
    try:
        sampler, prompts = eval_sampler(cfg, heldout_split(cfg))
        return None if sampler is None else format_samples(step, prompts, sampler(model))
    except Exception as err:  # noqa: BLE001 - samples are a view of a finished model
        sink.errors += 1
        log.warning("no text samples of the final model (%s: %s)", type(err).__name__, err)
        return None
