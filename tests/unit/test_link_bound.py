"""Upload codec step-down of a link-bound learner (diloco_async/policy/link_bound.py; issue 47)."""

from __future__ import annotations

import logging

import pytest

from diloco_async.learner.link import LinkMeter, UploadCodecs
from diloco_async.policy.link_bound import (
    LinkFigures,
    bytes_per_value,
    check_ladder,
    download_yields,
    upload_codec_step,
)

LADDER = ("bf16", "int8", "int4")


def step(index: int, bound: bool, need_s: float | None = 1.2, up_s: float | None = 0.4, budget_s: float | None = 0.44,
         since: int = 4):
    return upload_codec_step(LADDER, index, LinkFigures(bound, need_s, up_s, budget_s), since, settle_uploads=4)


def test_bytes_per_value_of_each_codec_with_its_block_scales():
    assert bytes_per_value("fp32") == 4.0 and bytes_per_value("bf16") == 2.0
    assert bytes_per_value("int8") == pytest.approx(1 + 4 / 64)
    assert bytes_per_value("int4") == pytest.approx(0.5 + 4 / 64)


def test_a_bound_link_steps_down_one_rung_at_a_time_to_the_bottom():
    s = step(0, bound=True)
    assert s.index == 1 and "link-bound" in s.reason and "bf16 -> int8" in s.reason and "has 0.440 s" in s.reason
    assert step(1, bound=True).index == 2
    s = step(2, bound=True)
    assert s.index == 2 and "most compressed codec int4" in s.reason


def test_no_change_before_the_rung_is_measured():
    assert step(0, bound=True, since=3).index == 0  # 3 of 4 uploads measured at this codec
    assert "3/4 uploads" in step(0, bound=True, since=3).reason
    assert step(0, bound=True, up_s=None).index == 0  # nothing uploaded yet
    assert step(1, bound=False, budget_s=None).index == 1  # the step time is unknown
    assert "not measured" in step(0, bound=True, need_s=None).reason


def test_steps_up_only_when_the_less_compressed_codec_fits_with_margin():
    # at int4 the upload takes 0.1 s; int8 carries 1.0625/0.5625 = 1.89x its bytes
    ratio = bytes_per_value("int8") / bytes_per_value("int4")
    fits = step(2, bound=False, need_s=0.2, up_s=0.1, budget_s=0.44)  # 0.2 + 0.1 * 0.89 = 0.289 < 0.8 * 0.44
    assert fits.index == 1 and "int4 -> int8" in fits.reason
    tight_s = 0.8 * 0.44 - 0.1 * (ratio - 1) + 0.01  # just over the margin at int8
    stays = step(2, bound=False, need_s=tight_s, up_s=0.1, budget_s=0.44)
    assert stays.index == 2 and "int8 would need" in stays.reason
    assert step(0, bound=False, need_s=0.1, up_s=0.05).index == 0  # the top rung: nowhere to go


def test_the_ladder_must_compress_further_at_each_rung():
    assert check_ladder(["bf16", "int8", "int4"]) == LADDER
    with pytest.raises(ValueError, match="'int8' is not more compressed than 'int4'"):
        check_ladder(["bf16", "int4", "int8"])
    with pytest.raises(ValueError, match="unknown codec 'fp8'"):
        check_ladder(["bf16", "fp8"])
    with pytest.raises(ValueError, match="rung 3"):
        upload_codec_step(LADDER, 3, LinkFigures(True, 1.0, 0.5, 0.4), 9, 4)


def test_upload_codecs_follow_the_meter_and_log_each_change(caplog):
    caplog.set_level(logging.INFO, logger="diloco.learner")
    meter = LinkMeter("L4", alpha=1.0, confirm=1)
    codecs = UploadCodecs("L4", LADDER, settle_uploads=2)
    budget_s = 0.44
    for p in (0, 1):  # bf16: 0.4 s up and 0.8 s down per fragment
        meter.record("up", p, 220_000, 0.4)
        meter.record("down", p, 440_000, 0.8)
    need_s, bound = meter.check(budget_s, now_s=0.0)
    assert bound and codecs.update(meter, bound, need_s, budget_s) == "int8"
    assert meter.upload_s_per_fragment() is None  # bf16's upload seconds are forgotten
    need_s, bound = meter.check(budget_s, now_s=1.0)
    assert codecs.update(meter, bound, need_s, budget_s) == "int8"  # int8's uploads not measured yet
    for p in (0, 1):
        meter.record("up", p, 117_000, 0.21)
    need_s, bound = meter.check(budget_s, now_s=2.0)
    assert codecs.update(meter, bound, need_s, budget_s) == "int4"
    for p in (0, 1):  # the download got fast (another learner left the link), the upload too
        meter.record("up", p, 62_000, 0.05)
        meter.record("down", p, 440_000, 0.1)
    need_s, bound = meter.check(budget_s, now_s=3.0)
    assert not bound and codecs.update(meter, bound, need_s, budget_s) == "int8"
    changes = [r.getMessage() for r in caplog.records if "upload codec" in r.getMessage()]
    assert [c.split(": ")[0] for c in changes] == ["L4 upload codec bf16 -> int8", "L4 upload codec int8 -> int4",
                                                   "L4 upload codec int4 -> int8"]
    assert codecs.changes == 3


def test_a_one_codec_ladder_never_changes():
    meter = LinkMeter("L0", alpha=1.0, confirm=1)
    meter.record("up", 0, 1, 9.0)
    codecs = UploadCodecs("L0", ["bf16"])
    need_s, bound = meter.check(0.1, now_s=0.0)
    assert codecs.update(meter, True, need_s, 0.1) == "bf16"


def test_a_bound_learner_reads_after_its_pending_uploads_for_a_bounded_time():
    assert download_yields(True, 2, 0.0, 2.0) == (True, "link-bound: 2 upload(s) first")
    assert download_yields(True, 1, 1.99, 2.0)[0]
    wait, why = download_yields(True, 1, 2.0, 2.0)
    assert not wait and "the most it waits" in why  # a version must not fall more than S behind
    assert download_yields(True, 0, 0.0, 2.0) == (False, "no upload pending")
    assert download_yields(False, 3, 0.0, 2.0) == (False, "link keeps up")


def test_the_config_refuses_a_ladder_that_does_not_compress_further():
    from pydantic import ValidationError

    from diloco_async.config.schema import LearnerConfig

    assert LearnerConfig(link_codecs=["int8", "int4"]).link_codecs == ["int8", "int4"]
    with pytest.raises(ValidationError, match=r"'int8' is not more compressed than 'int4'"):
        LearnerConfig(link_codecs=["int4", "int8"])
    with pytest.raises(ValidationError, match=r"'bf16' is not more compressed than 'bf16'.*learners.codec"):
        LearnerConfig(link_codecs=["bf16"])


def test_a_contribution_travels_in_its_own_codec(tmp_path):
    """A step-down codec chosen at the snapshot is the payload's codec (the synchronizer checks the
    payload against the codec the announcement names); a job without one takes learners.codec."""
    import asyncio

    import torch

    from diloco_async.codec import wire
    from diloco_async.learner.state import Shared, UploadJob
    from diloco_async.learner.uploads import Uploads
    from diloco_async.storage.store import ObjectStore

    store = ObjectStore(f"file://{tmp_path}/s")
    up = Uploads("learner-4", 0, store, Shared())
    up.configure(store, "bf16", 10.0)
    delta = {"w": torch.linspace(-1.0, 1.0, 256)}
    for codec, key in (("int4", "run/a"), (None, "run/b")):
        job = UploadJob(0, 1, 0, 3, 48, 0.1, dict(delta), codec=codec)
        ref = asyncio.run(up._encode_and_put(job, key, {"fragment": "0"}))
        want = codec or "bf16"
        assert up.codec_of(job) == want
        got, _ = wire.decode_from_bytes(store.get(ref), want, {"w": (256,)})
        assert torch.allclose(got["w"], delta["w"], atol=0.15)
        assert ref.nbytes < 400 if want == "int4" else ref.nbytes > 600  # 128 + 16 bytes of values and scales, or 512
