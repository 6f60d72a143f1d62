"""Artifacts of a finished training run, logged to its MLflow run: a loss-curve PNG, samples of
generated text, and the final global model (safetensors, plus an MLflow-logged torch model that
``mlflow.pytorch.load_model`` loads back)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import mlflow  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from diloco_async.model import ByteGPT, generate  # noqa: E402
from flows.tracking import MlflowSink  # noqa: E402

__all__ = ["loss_curve_png", "text_samples", "log_run_artifacts", "SAMPLE_PROMPTS"]

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
    ax_train.legend(fontsize=8)
    hist = sorted(sink.client.get_metric_history(sink.run_id, "eval/loss"), key=lambda m: m.step)
    ax_eval.plot([m.step for m in hist], [m.value for m in hist], "o-")
    ax_eval.set(title="global model, held-out loss", xlabel="merges", ylabel="nats / token")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def text_samples(model: ByteGPT, n_bytes: int = 200, seed: int = 0) -> str:
    """A few continuations of fixed prompts, as readable text."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for prompt in SAMPLE_PROMPTS:
        out = generate(model, prompt, n_bytes, temperature=0.8, generator=gen)
        parts.append(f"--- prompt {prompt.decode()!r}\n{(prompt + out).decode('utf-8', errors='replace')}\n")
    return "\n".join(parts)


def log_run_artifacts(sink: MlflowSink, model: ByteGPT, samples: bool = True) -> str:
    """Log the loss curve, text samples (only when ``samples``: the sampler speaks bytes) and the
    final model to the sink's MLflow run.

    Returns:
        the URI of the logged torch model (``mlflow.pytorch.load_model`` takes it).
    """
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sink.log_artifact(loss_curve_png(sink, folder / "loss_curve.png"))
        (folder / "samples.txt").write_text(text_samples(model) if samples else
                                            "no samples: the sampler only speaks the bytes tokenizer\n")
        sink.log_artifact(folder / "samples.txt")
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()},
                  str(folder / "global_model.safetensors"))
        sink.log_artifact(folder / "global_model.safetensors")
    mlflow.set_tracking_uri(sink.uri)
    with mlflow.start_run(run_id=sink.run_id):
        info = mlflow.pytorch.log_model(model, name="model", serialization_format="pickle",
                                        pip_requirements=["torch==2.13.0"])
    sink.client.set_tag(sink.run_id, "diloco.model_uri", info.model_uri)
    return info.model_uri
