"""Model construction for every ``model.kind`` (byte-gpt, hf, factory; LoRA), the section of the
recipe that chooses it, and the saved artifacts of a finished run."""

from diloco_async.config.model import MODEL_KINDS, HfModelConfig, LoraSettings, ModelConfig
from diloco_async.models.build import (
    build_model,
    build_run_model,
    embedding_names,
    frozen_digest,
    identity_of,
    plan_of,
    run_vocab_size,
    trainable_parameters,
)
from diloco_async.models.export import load_saved_model, save_final_model, upload_folder
from diloco_async.models.wrapper import CausalLM

__all__ = [
    "MODEL_KINDS", "ModelConfig", "HfModelConfig", "LoraSettings", "CausalLM", "build_model", "build_run_model",
    "run_vocab_size", "trainable_parameters", "embedding_names", "identity_of", "plan_of", "frozen_digest",
    "save_final_model", "load_saved_model", "upload_folder",
]
