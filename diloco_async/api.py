"""The Python API (issue 46 item 1): ``diloco_async.train(...)`` and ``diloco_async.resume(...)``
run the same processes as the ``train`` and ``resume`` commands (a synchronizer per shard and the
learners, supervised and restarted as there) from a notebook or a script, with no Prefect server
and no MLflow, and return the run's summary.

What the flows add on top (flow runs, MLflow runs and artifacts, the held-out curve while it
trains) is left out: call :func:`diloco_async.flows.train.train` for those. The summary is the synchronizer's
(``summary.json``) with the held-out loss of the model it started from and of the final one
(``eval_loss_initial``, ``eval_loss_final``, in nats per token, and bits per byte). A
KeyboardInterrupt (the notebook's stop button) stops the run cleanly as Ctrl-C does: the
synchronizer writes its final checkpoint, and the summary (``stop_reason`` ``signal SIGINT``, no
final evaluation) names it, for :func:`resume`.

A bad config raises the ``ValueError`` (or ``FileNotFoundError``) whose one-line message the CLI
prints after ``error:``, naming the field: both come from :func:`load_run_config`.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from diloco_async.config.schema import Config, load_config

__all__ = ["train", "resume", "load_run_config"]

log = logging.getLogger("diloco.api")


def load_run_config(config: str | Path | None, overrides: Sequence[str] = ()) -> tuple[Config, str]:
    """The recipe (a path, or a shipped name such as ``"default"``; None: ``default``) with
    ``overrides`` (``section.field=value``), validated, and its local data URLs resolved (a URL
    that matches no file is refused); (config, the recipe's path).

    Raises:
        ValueError: an invalid field or override (the message names it), or data URLs matching nothing.
        FileNotFoundError: no such recipe.
    """
    from diloco_async.data.sources import resolve_sources
    from diloco_async.validate import resolve_recipe

    path = str(resolve_recipe(str(config) if config is not None else "default"))
    cfg = load_config(path, list(overrides))
    local = [u for u in cfg.data.urls if not u.startswith("hf://")] if cfg.data.source == "urls" else []
    if local:  # Hub data is fetched by prepare(); local URLs must match files now
        resolve_sources(cfg.data.model_copy(update={"urls": local}))
    return cfg, path


def _evaluate(cfg: Config, model: Any) -> tuple[float, float]:
    from diloco_async.metrics.evaluation import heldout_loss, heldout_split

    split = heldout_split(cfg)
    nats = heldout_loss(model, split.batches)
    return nats, split.bits_per_byte(nats)


def _prepare(cfg: Config, say: Callable[[str], None]) -> None:
    """What the flows' prepare tasks do: Hub downloads and base models, the corpus, the token cache."""
    from diloco_async.data.sources import corpus_urls
    from diloco_async.data.tokens import open_corpus
    from diloco_async.policy.slices import check_corpus_slices
    from diloco_async.prerequisites import prepare

    prepare(cfg, say=say)
    corpus_urls(cfg.data)
    corpus = open_corpus(cfg.data, cfg.model.context, model_vocab=cfg.model.vocab_size)
    if cfg.data.slices:  # too few slices for the learners is refused here, naming data.slice_tokens
        check_corpus_slices(cfg, len(corpus.train))


def _run(run: Any, eval_start: tuple[float, float], on_status: Callable[[dict], None] | None,
         poll_s: float, incarnations: dict[int, int]) -> dict:
    """Start the synchronizer(s) and learners of ``run``, supervise them until the synchronizer
    exits, then evaluate the final model (not after a stop by a signal)."""
    from diloco_async.metrics.evaluation import model_from_checkpoint

    run.start_synchronizer()
    for i in range(run.cfg.learners.count):
        run.start_learner(i, incarnations.get(i, 0))
    while run.synchronizer_running():
        try:
            if on_status is not None and (st := run.status()) is not None:
                on_status(st)
            run.supervise()
            run.pause_while_running(poll_s)
        except KeyboardInterrupt:
            log.warning("KeyboardInterrupt: stopping the run cleanly (final checkpoint)")
            run.signal_synchronizers(signal.SIGINT)
    code = run.wait_synchronizers()
    run.finished_cleanly = code == 0
    if code != 0:
        raise RuntimeError(f"synchronizer exited with code {code}; logs: {run.workdir / 'logs'}")
    summary = run.final_summary()
    summary.update(eval_loss_initial=eval_start[0], eval_bits_per_byte_initial=eval_start[1],
                   eval_loss_final=None, eval_bits_per_byte_final=None, store_url=run.store.url,
                   logs=str(run.workdir / "logs"), learner_restarts=len(run.supervisor.restarts))
    if str(summary.get("stop_reason") or "").startswith("signal"):
        run.learner_exit_wait_s = 2.0
        return summary
    ckpt = run.final_checkpoint()
    if ckpt is None:
        raise RuntimeError("no verified checkpoint at the end of the run")
    final = _evaluate(run.cfg, model_from_checkpoint(run.cfg, ckpt))
    summary.update(eval_loss_final=final[0], eval_bits_per_byte_final=final[1], checkpoint_seq=ckpt.seq)
    return summary


def train(config: str | Path | None = None, overrides: Sequence[str] = (), *,
          on_status: Callable[[dict], None] | None = None, poll_s: float = 2.0) -> dict:
    """Run one training job end to end (see the module docstring) and return its summary.

    Args:
        config: a recipe path or shipped name (None: ``default``).
        overrides: ``section.field=value`` strings applied on top, as ``--set`` takes them.
        on_status: called with the synchronizer's ``/status`` document every ``poll_s`` seconds
            (progress bars, early stopping by the caller's own rule: raise KeyboardInterrupt).
        poll_s: seconds between supervision passes (a dead learner is restarted within one).

    Raises:
        ValueError, FileNotFoundError: a bad config (:func:`load_run_config`).
        RuntimeError: the synchronizer failed (the message names its log folder).
    """
    from diloco_async.models import build_run_model
    from diloco_async.run import RunProcesses

    cfg, _ = load_run_config(config, overrides)
    _prepare(cfg, log.info)
    eval_start = _evaluate(cfg, build_run_model(cfg))
    run = RunProcesses(cfg)
    log.info("run %s: initial held-out loss %.4f nats/token; logs in %s", run.run_id, eval_start[0],
             run.workdir / "logs")
    try:
        return _run(run, eval_start, on_status, poll_s, {})
    finally:
        run.stop_all()


def resume(checkpoint_url: str, config: str | Path | None = None, overrides: Sequence[str] = (), *,
           on_status: Callable[[dict], None] | None = None, poll_s: float = 2.0) -> dict:
    """Continue a run from a checkpoint (``{store}/{run_id}``: its newest that verifies; or
    ``{store}/{run_id}/checkpoints/{seq}``) and return its summary. ``config``/``overrides``: as
    ``diloco-async resume`` takes them (training fields must match the checkpoint's; a budget may
    be extended); by default the run's own config from the store.

    Raises:
        ValueError: the URL, the store's run or an override is invalid (the message names it).
        RuntimeError: the synchronizer failed.
    """
    from diloco_async.metrics.evaluation import model_from_checkpoint
    from diloco_async.run import RunProcesses, next_incarnations
    from diloco_async.storage import keys
    from diloco_async.storage.options import storage_options_from_env
    from diloco_async.sync import open_run, stored_config
    from diloco_async.validate import resolve_recipe

    env = storage_options_from_env()
    given = None
    if config is not None or overrides:
        base = stored_config(checkpoint_url, env) if config is None else None
        path = None if config is None else str(resolve_recipe(str(config)))
        given = load_config(path, list(overrides), base=base)
    cfg, store, run_id, ckpt = open_run(checkpoint_url, given, env)
    _prepare(cfg, log.info)
    eval_start = _evaluate(cfg, model_from_checkpoint(cfg, ckpt))
    run = RunProcesses(cfg, run_id=run_id, resume_url=keys.checkpoint_url(store.url, run_id, ckpt.seq))
    incarnations = next_incarnations(ckpt.manifest)
    started = time.monotonic()
    try:
        summary = _run(run, eval_start, on_status, poll_s, incarnations)
    finally:
        run.stop_all()
    log.info("run %s resumed from checkpoint %d for %.0f s", run_id, ckpt.seq, time.monotonic() - started)
    return summary
