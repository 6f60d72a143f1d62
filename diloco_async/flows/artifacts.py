"""Artifacts of a finished training run, logged to its MLflow run: a loss-curve PNG, samples of
generated text, and the final global model: for ``model.kind = "hf"`` a ``save_pretrained``
folder ``hf_model/`` (also written to the store) that ``AutoModelForCausalLM.from_pretrained``
(or, for a LoRA adapter, ``diloco_async.models.load_saved_model``) loads back; for the other
kinds safetensors plus an MLflow-logged torch model in MLflow's non-pickle ``pt2`` format
(``torch.export``) that ``mlflow.pytorch.load_model`` loads back as a module giving the same logits;
:func:`register_final_model` registers either in MLflow's model registry."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import mlflow  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from diloco_async.flows.tracking import MlflowSink  # noqa: E402
from diloco_async.metrics.run_timeline import read_contributions, read_merges, rounds_table  # noqa: E402
from diloco_async.models import ModelConfig, save_final_model, upload_folder  # noqa: E402
from diloco_async.models.transformer import ByteGPT, generate  # noqa: E402
from diloco_async.storage.store import ObjectStore  # noqa: E402

__all__ = ["loss_curve_png", "text_samples", "log_run_artifacts", "log_rounds", "register_final_model",
           "SAMPLE_PROMPTS"]

SAMPLE_PROMPTS = (b"ROMEO:\n", b"To be, or not", b"KING HENRY.\n")


def loss_curve_png(sink: MlflowSink, path: Path) -> Path:
    """Train loss of every learner (against its local step) and the global held-out loss (against
    merges), read back from the MLflow run."""
    run = sink.client.get_run(sink.run_id)
    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted(k for k in run.data.metrics if k.startswith("learner/") and k.endswith("/train_loss")):
        hist = sorted(sink.client.get_metric_history(sink.run_id, key), key=lambda m: m.step)
        ax_train.plot([m.step for m in hist], [m.value for m in hist], label=key.split("/")[1], lw=0.8)
    ax_train.set(title="train loss per learner", xlabel="local step", ylabel="nats / token")
    if ax_train.lines:  # a run too short for any learner to report a loss has nothing to label
        ax_train.legend(fontsize=8)
    hist = sorted(sink.client.get_metric_history(sink.run_id, "eval/loss"), key=lambda m: m.step)
    ax_eval.plot([m.step for m in hist], [m.value for m in hist], "o-")
    ax_eval.set(title="global model, held-out loss", xlabel="merges", ylabel="nats / token")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def text_samples(model: torch.nn.Module, n_bytes: int = 200, seed: int = 0) -> str:
    """A few continuations of fixed prompts, as readable text (at most 64 bytes each from a model
    other than ByteGPT: a transformers forward costs milliseconds per call even when tiny)."""
    if not isinstance(model, ByteGPT):
        n_bytes = min(n_bytes, 64)
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for prompt in SAMPLE_PROMPTS:
        out = generate(model, prompt, n_bytes, temperature=0.8, generator=gen)
        parts.append(f"--- prompt {prompt.decode()!r}\n{(prompt + out).decode('utf-8', errors='replace')}\n")
    return "\n".join(parts)


def log_run_artifacts(sink: MlflowSink, model: torch.nn.Module, model_cfg: ModelConfig | None = None,
                      store_prefix: tuple[ObjectStore, str] | None = None, samples: bool = True,
                      tokenizer: Any | None = None, sample_text: str | None = None) -> str:
    """Log the loss curve, text samples (``sample_text`` when given, e.g. an ``hf`` model's from
    :func:`diloco_async.flows.heldout.final_samples`; else only when ``samples``: this sampler speaks bytes) and the
    final model to the sink's MLflow run; an ``hf`` model's folder (with ``tokenizer``, a
    transformers tokenizer, when the run has one) also goes to ``store_prefix`` (store, key prefix).

    Returns:
        the URI of the logged model: ``runs:/<id>/hf_model`` (download it, then ``from_pretrained``)
        for ``hf``, else a torch model in MLflow's ``pt2`` format (no pickle) that
        ``mlflow.pytorch.load_model`` takes: a module mapping int64 token ids [B, model.context]
        to float32 logits [B, model.context, vocab]; when MLflow cannot export the model, the
        URI of ``global_model.safetensors`` (the weights, logged before).
    """
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sink.log_artifact(loss_curve_png(sink, folder / "loss_curve.png"))
        if sample_text is None:
            sample_text = text_samples(model) if samples else "no samples: this run's model has no sampler\n"
        (folder / "samples.txt").write_text(sample_text)
        sink.log_artifact(folder / "samples.txt")
        if model_cfg is not None and model_cfg.kind == "hf":
            # the folder's own URL in the store: a LoRA adapter names its base there, not on this machine
            base_url = f"{store_prefix[0].url.rstrip('/')}/{store_prefix[1]}" if store_prefix is not None else None
            hf_dir = save_final_model(model, model_cfg, folder / "hf_model", tokenizer=tokenizer, base_url=base_url)
            sink.log_artifacts(hf_dir, "hf_model")
            if store_prefix is not None:
                upload_folder(store_prefix[0], store_prefix[1], hf_dir)
            uri = f"runs:/{sink.run_id}/hf_model"
            sink.client.set_tag(sink.run_id, "diloco.model_uri", uri)
            return uri
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()},
                  str(folder / "global_model.safetensors"))
        sink.log_artifact(folder / "global_model.safetensors")
    mlflow.set_tracking_uri(sink.uri)
    was_training = model.training
    try:
        model.eval()
        with mlflow.start_run(run_id=sink.run_id):
            info = mlflow.pytorch.log_model(model, name="model", serialization_format="pt2",
                                            input_example=_token_example(model, model_cfg),
                                            pip_requirements=["torch==2.13.0"])
    except Exception as err:  # the tracking store must never fail a finished run: the weights are logged above
        sink.errors += 1
        logging.getLogger("diloco.flows").warning("MLflow could not log the torch model (%s: %s); the weights are "
                                                  "in global_model.safetensors", type(err).__name__, err)
        return f"runs:/{sink.run_id}/global_model.safetensors"
    finally:
        model.train(was_training)
    sink.client.set_tag(sink.run_id, "diloco.model_uri", info.model_uri)
    return info.model_uri


def _token_example(model: torch.nn.Module, model_cfg: ModelConfig | None) -> np.ndarray:
    """Token ids int64 [2, context] that ``torch.export`` traces the model with (batch 2: MLflow
    keeps a batch dimension above 1 dynamic)."""
    context = int(getattr(model, "context", None) or (model_cfg.context if model_cfg is not None else 64))
    vocab = int(getattr(getattr(model, "tok_emb", None), "num_embeddings", 256))
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, min(vocab, 256), (2, context), generator=gen).numpy()


def log_rounds(sink: MlflowSink, store: ObjectStore, run_id: str, epoch: str, name: str = "rounds.jsonl") -> int:
    """Log the per-round artifact ``name``: one JSON line per (fragment, round) of the epoch with
    the version it published and every contribution's learner, fate (merged, zero_weight, late,
    rejected, abandoned), reason, tokens and staleness (:func:`~diloco_async.metrics.run_timeline.rounds_table`,
    from the synchronizer's ``contributions.jsonl`` and ``merges.jsonl``). Returns the rows
    logged; 0 (nothing logged) when the synchronizer wrote neither."""
    rows = rounds_table(read_contributions(store, run_id, epoch), read_merges(store, run_id, epoch))
    if not rows:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        sink.log_artifact(path)
    return len(rows)


def register_final_model(sink: MlflowSink, model_uri: str, name: str | None) -> dict | None:
    """Register ``model_uri`` (what :func:`log_run_artifacts` returned) as a new version of the
    registered model ``name`` in MLflow's model registry and tag the run with it
    (``diloco.registered_model`` = ``name/version``). A ``runs:/`` URI (the ``hf_model/`` folder,
    or the safetensors when the export failed) becomes a version whose source is that artifact;
    ``models:/name/version`` then downloads it.

    Returns:
        ``{"name", "version"}`` (version an int), or None when ``name`` is None or the registry
        refused (counted in ``sink.errors`` and logged, never raised: the run is finished).
    """
    if not name:
        return None
    mlflow.set_tracking_uri(sink.uri)
    tags = {"diloco.run_id": sink.run_id}
    try:
        if model_uri.startswith("runs:/"):  # an artifact folder or file (hf_model/), not an MLflow logged model
            run_id, _, path = model_uri.removeprefix("runs:/").partition("/")
            source = f"{sink.client.get_run(run_id).info.artifact_uri.rstrip('/')}/{path}"
            if sink.client.search_registered_models(f"name = '{name}'") == []:
                sink.client.create_registered_model(name)
            version = sink.client.create_model_version(name, source, run_id=run_id, tags=tags)
        else:
            version = mlflow.register_model(model_uri, name, tags=tags)
    except Exception as err:  # noqa: BLE001 - the registry is a view of a finished run
        sink.errors += 1
        logging.getLogger("diloco.flows").warning("MLflow could not register %s as %r (%s: %s)", model_uri, name,
                                                  type(err).__name__, err)
        return None
    sink.client.set_tag(sink.run_id, "diloco.registered_model", f"{name}/{version.version}")
    return {"name": name, "version": int(version.version)}
