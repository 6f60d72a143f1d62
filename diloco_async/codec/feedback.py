"""Error feedback for compressed uploads: the pure math (DESIGN §6, "Error feedback").

A learner that uploads with a lossy codec keeps, per fragment, the residual of what its codec
dropped: with Δ the outer gradient of a round and e the residual left by the fragment's previous
upload,

    c = Δ + e,   sent = decode(encode(c)),   e' = c − sent.

Over k uploads the decoded values telescope: Σ sent = Σ Δ + e_0 − e_k, so what the synchronizer
receives tracks what the learner computed within one residual (one codec step per element: half a
block's scale for int8/int4, a full scale for int2's ternary levels), where without feedback the
per-round rounding errors accumulate. Used by Psyche, Templar/Covenant and MuLoCo (2-bit deltas
with error feedback) under aggressive compression; Karimireddy et al. 2019 (EF-SGD) give the
argument. The residual is float32 in the outer gradient's own domain, so a codec change (a
link-bound learner stepping ``learners.link_codecs`` down) keeps it.

Nothing here does I/O or keeps state; the learner's holder of the residuals is
:class:`diloco_async.learner.feedback.ErrorFeedback`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diloco_async.codec import wire

__all__ = ["compensate", "residual_bound"]


def compensate(delta: dict[str, torch.Tensor], residual: Mapping[str, torch.Tensor] | None,
               codec: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Encode ``delta`` plus the fragment's residual, and the residual this upload leaves.

    One tensor at a time: c = Δ + e is formed in Δ's own tensor (``delta`` is consumed: its
    tensors are reused), encoded with :func:`wire.encode`, decoded, and c − decode(encode(c)) is
    written into that same tensor, which becomes the new residual (a pinned tensor, a GPU copy's
    host buffer, is not kept: the residual is then a new tensor).

    Args:
        delta: Δ of one fragment, name → float32 CPU tensor (any shape); consumed.
        residual: e of the fragment's previous upload by the same names and shapes (read only,
            never written: a saved inner state may still be reading it), or None (zeros).
        codec: the upload codec, one of :data:`wire.CODECS` (fp32 leaves a zero residual).

    Returns:
        (the encoded contribution as :func:`wire.encode` returns it, the new residual: name →
        float32 CPU tensor of Δ's shapes).

    Raises:
        ValueError: an unknown codec, or a residual whose shape differs from Δ's (names both).
        KeyError: ``residual`` lacks a name of ``delta``.
    """
    encoded: dict[str, torch.Tensor] = {}
    new_residual: dict[str, torch.Tensor] = {}
    for name, d in delta.items():
        c = d if d.dtype == torch.float32 and d.device.type == "cpu" else d.to("cpu", torch.float32)
        if residual is not None:
            e = residual[name]
            if e.shape != c.shape:
                raise ValueError(f"error-feedback residual of {name!r} has shape {tuple(e.shape)}, the outer "
                                 f"gradient {tuple(c.shape)}")
            c.add_(e)
        one = wire.encode({name: c}, codec)
        sent = wire.decode(one, codec, {name: tuple(c.shape)})[name]
        encoded.update(one)
        new_residual[name] = c.sub(sent) if c.is_pinned() else c.sub_(sent)
    delta.clear()
    return encoded, new_residual


def residual_bound(residual: Mapping[str, torch.Tensor]) -> float:
    """The largest |e| over a fragment's residual (0.0 for an empty one): what an upload's decoded
    sum may lag behind the true sum by, per element (see the module docstring)."""
    return max((float(t.abs().max()) for t in residual.values() if t.numel()), default=0.0)
