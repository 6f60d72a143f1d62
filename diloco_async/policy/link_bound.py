"""How a link-bound learner adapts (issue 47, "a link-bound learner adapts"; DESIGN §3).

Two decisions, pure (plain figures in, a decision with its reason out):

* **Upload codec step-down** (:func:`upload_codec_step`). A learner whose link cannot carry one
  fragment's sync per H/P inner steps (:class:`~diloco_async.learner.link.LinkMeter`'s verdict)
  queues its uploads: each contribution reaches the store later than the one before, and once
  that is past the round's grace window every one of them is *late* and its compute is lost. The
  learner then encodes its outer gradients with the next, more compressed codec of a configured
  ladder (``learners.codec`` first, then ``learners.link_codecs``), so each fragment's upload
  carries 2-4x fewer bytes, and steps back up when the link would keep up with margin at the less
  compressed codec. The synchronizer decodes the codec each announcement names (DESIGN §6), so
  nothing changes on its side. The learner's comms thread owns the state
  (:class:`~diloco_async.learner.link.UploadCodecs`).
* **Uploads first** (:func:`download_yields`). On a saturated link every answer the learner
  waits for (the store's reply to its PUT, the announcement's acknowledgement) queues behind the
  version downloads in the shaper, and a contribution spends most of its upload waiting. A
  link-bound learner starts no download while a contribution is waiting for or in its upload
  lane, for at most ``max_wait_s``: versions arrive a little later (a contribution is anchored to
  the current value, §4.1, up to S versions back), contributions in time for their round.

Neither alone was enough on a 4 Mbit/s link (docs/log/2026-12-06.md); both are on when
``learners.link_codecs`` is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from diloco_async.codec import wire

__all__ = ["CodecStep", "LinkFigures", "bytes_per_value", "check_ladder", "download_yields", "upload_codec_step"]

#: the codecs from the least to the most compressed (bytes per value, block scales included)
_ORDER = ("fp32", "bf16", "int8", "int4", "int2")


@cache
def bytes_per_value(codec: str) -> float:
    """Bytes one float32 value of an outer gradient takes on the wire in ``codec`` (block scales
    included, header left out; :func:`~diloco_async.codec.wire.encoded_nbytes`).

    Raises:
        ValueError: an unknown codec.
    """
    n = 1 << 16
    return wire.encoded_nbytes(codec, {"x": (n,)}) / n


def check_ladder(codecs: Sequence[str]) -> tuple[str, ...]:
    """``codecs`` (the configured codec, then the step-downs) as a tuple.

    Raises:
        ValueError: an unknown codec, or one not more compressed than the one before it (naming both).
    """
    for c in codecs:
        if c not in _ORDER:
            raise ValueError(f"unknown codec {c!r} in the upload codec ladder; expected one of {_ORDER}")
    for a, b in zip(codecs, codecs[1:], strict=False):
        if _ORDER.index(b) <= _ORDER.index(a):
            raise ValueError(f"upload codec ladder {list(codecs)}: {b!r} is not more compressed than {a!r} before it")
    return tuple(codecs)


@dataclass(frozen=True)
class LinkFigures:
    """What the link meter measured (:class:`~diloco_async.learner.link.LinkMeter`).

    ``bound``: its verdict (hysteresis included): the link cannot carry one fragment's upload and
    download per H/P inner steps. ``need_s``: seconds per fragment, upload plus download (EMA; None:
    not measured yet), of which ``up_s`` the upload's at the current codec (None: no upload yet).
    ``budget_s``: seconds of H/P inner steps (None: step time unknown)."""

    bound: bool
    need_s: float | None
    up_s: float | None
    budget_s: float | None


@dataclass(frozen=True)
class CodecStep:
    """The rung of the ladder to encode uploads with (``index``) and why."""

    index: int
    reason: str


def upload_codec_step(ladder: Sequence[str], index: int, link: LinkFigures, uploads_since_change: int,
                      settle_uploads: int, up_margin: float = 0.8) -> CodecStep:
    """The codec of the next uploads, one rung at a time.

    Args:
        ladder: codecs from the configured one to the most compressed (:func:`check_ladder`).
        index: the rung used now.
        link: the link meter's figures.
        uploads_since_change: uploads measured since the rung last changed.
        settle_uploads: uploads to measure at a rung before changing it again (the meter's
            averages still carry the previous rung's seconds until then).
        up_margin: step up only when the need predicted at the less compressed rung is below
            ``up_margin`` x the budget (below the meter's own 0.9 release, so it does not flap).

    Returns:
        one rung down when bound (and not at the bottom), one rung up when the upload at that
        rung would still fit with margin, else the same rung; each with the figures that decided.
    """
    if not 0 <= index < len(ladder):
        raise ValueError(f"rung {index} is not on the upload codec ladder {list(ladder)}")
    here = ladder[index]
    bound, need_s, up_s, budget_s = link.bound, link.need_s, link.up_s, link.budget_s
    if need_s is None or up_s is None or budget_s is None:
        return CodecStep(index, f"{here}: link not measured yet")
    if uploads_since_change < settle_uploads:
        return CodecStep(index, f"{here}: {uploads_since_change}/{settle_uploads} uploads measured at this codec")
    figures = f"needs {need_s:.3f} s per fragment (upload {up_s:.3f} s), has {budget_s:.3f} s"
    if bound:
        if index + 1 < len(ladder):
            return CodecStep(index + 1, f"link-bound ({figures}): {here} -> {ladder[index + 1]}")
        return CodecStep(index, f"link-bound ({figures}) at the most compressed codec {here}")
    if index > 0:
        up = ladder[index - 1]
        predicted_s = need_s + up_s * (bytes_per_value(up) / bytes_per_value(here) - 1)
        if predicted_s < up_margin * budget_s:
            return CodecStep(index - 1, f"link keeps up ({figures}; {predicted_s:.3f} s at {up}): {here} -> {up}")
        return CodecStep(index, f"{here}: {up} would need {predicted_s:.3f} s of {budget_s:.3f} s")
    return CodecStep(index, f"{here}: link keeps up ({figures})")


def download_yields(bound: bool, uploads_pending: int, waited_s: float, max_wait_s: float) -> tuple[bool, str]:
    """Should the download lane wait before it starts its next read? (yes, why) or (no, why).

    Args:
        bound: the link meter's verdict. uploads_pending: contributions queued or uploading.
        waited_s: seconds this read has waited so far. max_wait_s: the most it waits (a version
            must not fall more than a few behind: contributions on a base older than S are refused).
    """
    if not bound:
        return False, "link keeps up"
    if uploads_pending <= 0:
        return False, "no upload pending"
    if waited_s >= max_wait_s:
        return False, f"waited {waited_s:.2f} s for {uploads_pending} upload(s), the most it waits"
    return True, f"link-bound: {uploads_pending} upload(s) first"
