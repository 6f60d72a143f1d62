"""The learner key of error feedback on compressed uploads (DESIGN §6, "Error feedback").

``learners.error_feedback``: each learner keeps, per fragment, the fp32 residual of what its upload
codec dropped and adds it to the next outer gradient of that fragment before encoding
(:mod:`diloco_async.codec.feedback`). With ``fp32`` as the only upload codec nothing is dropped, so
the setting would do nothing: such a recipe is refused before anything starts, naming both values
(a silent no-op would let an ablation arm measure nothing). The key at its default is left out of
the config hash, so runs and checkpoints from before it existed hash (and resume) as before.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ErrorFeedbackFields", "drop_default_feedback_fields"]


class ErrorFeedbackFields(BaseModel):
    """``learners.error_feedback``; a mixin of :class:`~diloco_async.config.schema.LearnerConfig`,
    whose ``codec`` and ``link_codecs`` it checks against."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    error_feedback: bool = Field(
        False, description="Keep per fragment the fp32 residual of what the upload codec dropped and add it to the "
        "next outer gradient of that fragment before encoding (DESIGN §6 'Error feedback'); spooled with the inner "
        "state. Refused when every upload codec is fp32 (nothing is dropped) and with parallelism='fsdp'.")

    @model_validator(mode="after")
    def _feedback_has_something_to_feed_back(self) -> ErrorFeedbackFields:
        codecs = [getattr(self, "codec", "fp32"), *getattr(self, "link_codecs", [])]
        if self.error_feedback and all(c == "fp32" for c in codecs):
            raise ValueError(f"learners.error_feedback = true with learners.codec = {codecs[0]!r} and "
                             f"learners.link_codecs = {codecs[1:]}: the fp32 codec drops nothing, so there is no "
                             "residual to feed back; pick a lossy codec (bf16, int8, int4, int2) or set "
                             "error_feedback = false")
        return self


#: learner keys left out of the config hash at their default
_DEFAULTS = {"error_feedback": False}


def drop_default_feedback_fields(d: dict) -> None:
    """Remove, in place, the error-feedback key of a public config dict when it holds its default."""
    node = d.get("learners", {})
    for key, default in _DEFAULTS.items():
        if key in node and node[key] == default:
            del node[key]
