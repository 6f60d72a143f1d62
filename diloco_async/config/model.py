"""The ``[model]`` section of a recipe: which model the learners train (``model.kind``).

* ``byte-gpt``: the project's own small byte-level transformer (:class:`~diloco_async.models.transformer.ByteGPT`),
  shaped by ``vocab_size``, ``n_layer``, ``n_head``, ``d_model``, ``tie_embeddings``.
* ``hf``: a Hugging Face ``transformers`` causal LM, either built from ``[model.hf]``
  ``architecture`` + ``[model.hf.config]`` (random init with the run's seed) or loaded with
  ``from_pretrained`` from ``model.hf.pretrained``: a local folder, an fsspec URL (copied once
  into ``model.hf.cache_dir``) or a Hugging Face Hub id ``org/name`` (``model.hf.revision``),
  downloaded once per run by the flow before any process starts; learners only read local copies.
  ``[model.hf.pretrain]`` builds a local ``pretrained`` folder that is missing (a short pre-training).
* ``factory``: ``model.factory = "package.module:function"``, called as ``function(model_cfg,
  vocab_size)``; it returns an ``nn.Module`` (see :mod:`diloco_async.models.factory`).

``[model.lora]`` (``hf`` only) trains a LoRA adapter with ``peft`` on a frozen base instead of
every parameter. ``model.context`` is the window length of every kind.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ModelConfig", "HfModelConfig", "LoraSettings", "PretrainSettings", "MODEL_KINDS", "hub_repo_id"]

MODEL_KINDS = ("byte-gpt", "hf", "factory")
_FACTORY_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def hub_repo_id(pretrained: str | None) -> str | None:
    """The Hugging Face Hub repository a ``model.hf.pretrained`` value names, else None: ``hf://org/name``,
    or ``org/name`` (one slash, the Hub's characters) that is not a local folder (a folder of that name
    wins, as in ``from_pretrained``). Pure but for that one existence check."""
    if pretrained is None:
        return None
    if pretrained.startswith("hf://"):
        name = pretrained.removeprefix("hf://").strip("/")
        return name if _HUB_ID.match(name) else None
    if _HUB_ID.match(pretrained) and not Path(pretrained).is_dir():
        return pretrained
    return None


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PretrainSettings(_Section):
    """How a missing local ``model.hf.pretrained`` folder is built: ``architecture`` with ``config``,
    randomly initialised with ``run.seed``, trained ``steps`` AdamW steps on the recipe's corpus
    tokenized with ``tokenizer``, then saved there with that tokenizer (``tokenizer.json``)."""

    architecture: str = Field(description="transformers model type of the base (e.g. 'llama').")
    config: dict[str, Any] = Field(default_factory=dict, description="Fields of its transformers config "
                                   "(as [model.hf.config]); vocab_size defaults to model.vocab_size.")
    tokenizer: str = Field("bytes", description="data.tokenizer spec the base is trained with and saved "
                           "beside it ('bpe:<vocab>' or 'bytes').")
    steps: int = Field(200, ge=0, le=1_000_000, description="AdamW steps of the pre-training (0: random init).")
    batch_size: int = Field(16, ge=1, le=4096, description="Windows of model.context tokens per step.")
    lr: float = Field(3e-3, gt=0, le=1.0, description="AdamW learning rate of the pre-training.")


class HfModelConfig(_Section):
    architecture: str | None = Field(
        None, description="transformers model type of a randomly initialised model (e.g. 'llama', 'gpt2'); "
        "its fields come from [model.hf.config]."
    )
    config: dict[str, Any] = Field(
        default_factory=dict, description="Fields of the transformers config (hidden_size, num_hidden_layers, ...). "
        "vocab_size defaults to the tokenizer's; max_position_embeddings (n_positions) to model.context."
    )
    pretrained: str | None = Field(
        None, description="Local folder, fsspec URL (s3://, gs://, file://; copied once into cache_dir) or Hugging "
        "Face Hub id 'org/name' (downloaded once per run by the flow into cache_dir/hub) of a save_pretrained model."
    )
    revision: str | None = Field(None, max_length=256, description="Hub branch, tag or commit of a Hub id "
                                 "(default 'main'); only with a Hub id in pretrained.")
    cache_dir: str = Field(".local/models", description="Where pretrained models from URLs (by URL) and the Hub "
                           "(under hub/, huggingface_hub's layout) are cached.")
    pretrain: PretrainSettings | None = Field(None, description="Build a missing local pretrained folder by a short "
                                              "pre-training (see PretrainSettings); only with a local folder.")

    @model_validator(mode="after")
    def _one_source(self) -> HfModelConfig:
        if self.pretrained is not None and self.architecture is not None:
            raise ValueError(f"model.hf: set either architecture ({self.architecture!r}) or pretrained "
                             f"({self.pretrained!r}), not both")
        if self.pretrained is not None and self.config:
            raise ValueError(f"model.hf.config {sorted(self.config)} cannot change a pretrained model "
                             f"({self.pretrained!r})")
        hub = hub_repo_id(self.pretrained)
        if self.revision is not None and hub is None:
            raise ValueError(f"model.hf.revision={self.revision!r} needs a Hub id ('org/name') in model.hf.pretrained "
                             f"(got {self.pretrained!r})")
        if self.pretrain is not None and (self.pretrained is None or hub is not None or "://" in self.pretrained):
            raise ValueError(f"model.hf.pretrain builds a local folder: model.hf.pretrained must name one "
                             f"(got {self.pretrained!r})")
        return self


class LoraSettings(_Section):
    r: int = Field(8, ge=1, description="Rank of the adapter matrices.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(
        min_length=1, description="Module names (suffixes, as peft matches them) that get an adapter, "
        "e.g. ['q_proj', 'v_proj']."
    )


class ModelConfig(_Section):
    kind: Literal["byte-gpt", "hf", "factory"] = Field("byte-gpt", description="Which model (see module doc).")
    vocab_size: int = Field(256, ge=2, description="Tokens of the vocabulary (256: bytes).")
    n_layer: int = Field(2, ge=1, description="byte-gpt: transformer blocks.")
    n_head: int = Field(4, ge=1, description="byte-gpt: attention heads.")
    d_model: int = Field(128, ge=8, description="byte-gpt: width.")
    context: int = Field(64, ge=2, description="Tokens per training window.")
    tie_embeddings: bool = Field(True, description="byte-gpt: share the token embedding with the output head.")
    hf: HfModelConfig = Field(default_factory=HfModelConfig, description="kind = 'hf': the transformers model.")
    factory: str | None = Field(None, description="kind = 'factory': 'package.module:function'.")
    options: dict[str, Any] = Field(default_factory=dict, description="kind = 'factory': free settings it reads.")
    lora: LoraSettings | None = Field(None, description="Train a LoRA adapter on a frozen base (kind = 'hf').")

    @model_validator(mode="after")
    def _kind_fields(self) -> ModelConfig:
        if self.kind == "byte-gpt" and self.d_model % self.n_head:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}")
        if self.kind == "hf" and self.hf.architecture is None and self.hf.pretrained is None:
            raise ValueError("model.kind = 'hf' needs model.hf.architecture (random init) or model.hf.pretrained")
        if self.kind == "factory" and (self.factory is None or not _FACTORY_PATH.match(self.factory)):
            raise ValueError(f"model.factory={self.factory!r} must look like 'package.module:function' "
                             "when model.kind = 'factory'")
        if self.lora is not None and self.kind != "hf":
            raise ValueError(f"model.lora needs model.kind = 'hf' (got {self.kind!r})")
        return self
