"""The ``[tracking]`` section of the config: where a run is logged in MLflow and how often.

Kept apart from :mod:`diloco_async.config.schema` (which references :class:`TrackingConfig`) so
that module stays small.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["TrackingConfig"]


class TrackingConfig(BaseModel):
    """MLflow tracking of a run: the server or database, the experiment, the sampling periods."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    mlflow_uri: str = Field("sqlite:///.local/mlflow.db", description="MLflow tracking URI.")
    experiment: str = Field("diloco-async", description="MLflow experiment the runs are logged to.")
    artifact_location: str = Field(
        "", max_length=4096,
        description="Artifact root of a new experiment (a URI, or a local path); '': a URI other hosts can use, "
        "MLflow's artifact proxy (mlflow-artifacts:) with an http(s) tracking server, else {run.store}/mlartifacts. "
        "An existing experiment keeps the location it was created with.",
    )
    poll_s: float = Field(2.0, gt=0, description="How often the flow pulls metrics from the synchronizer.")
    system_metrics_s: float = Field(
        5.0, ge=0, le=3600, description="Seconds between samples of the flow machine's CPU, memory, disk, "
        "network (and GPUs, through NVML) in the MLflow run's System metrics; 0: off.")
    goodput_series_s: float = Field(
        5.0, gt=0, le=3600, description="Seconds between points of the synchronizer's goodput time series "
        "(goodput/compute, goodput/token, their rolling windows, goodput/uptime), while merges go on.")
    eval_every_s: float = Field(
        10.0, ge=0, le=86400, description="Seconds between evaluations of the newest published global model on "
        "the held-out windows while the run trains (eval/loss, eval/bits_per_byte; one thread of the flow "
        "process); 0: only at the start and the end.")
    eval_samples: int = Field(
        3, ge=0, le=16, description="Held-out prompts the global model continues at each periodic evaluation, "
        "greedily, for model.kind = 'hf' with a tokenizer (data.tokenizer not 'bytes'): logged as the MLflow "
        "text artifact eval_samples/step-<merges>.txt; 0: none.")
    eval_sample_tokens: int = Field(
        32, ge=1, le=1024, description="Tokens generated per prompt of eval_samples, at most half of "
        "model.context (a prompt is the first min(16, context / 2) tokens of a held-out window).")
    register_model: str | None = Field(
        None, min_length=1, max_length=256, pattern=r"^[^/:]*[^/:\s][^/:]*$",
        description="Register the final global model under this name in MLflow's model registry "
        "(a new version per run); None: log it, register nothing. No '/' or ':' (MLflow's rule).")
    ui_url: str | None = Field(
        None, pattern=r"^https?://[^\s]+[^\s.,;:)]$",
        description="Base address of the MLflow UI that shows this tracking store, for the links a run "
        "prints and publishes (the Prefect artifact); None: mlflow_uri when it is an http(s) server, else "
        "http://127.0.0.1:5000 (what `make ui` serves).")
