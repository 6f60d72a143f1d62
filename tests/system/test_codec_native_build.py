"""The codecs' C kernels (diloco_async/kernels/codec_kernels.c) with a compiler that fails: the torch code is
used, with the reason logged (the kernels' bytes are tests/unit/test_codec_native.py's)."""

from __future__ import annotations

import torch
from test_codec_native import _bits  # noqa: F401, F811 (shared with unit/test_codec_native.py; fixtures among them)

from diloco_async.codec import native as codec_native
from diloco_async.codec import wire as codec
from diloco_async.kernels import build as native_build


def test_a_broken_compiler_falls_back_to_the_torch_code_with_a_reason(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DILOCO_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "false")  # exits 1 without output
    x = torch.randn(1000)
    want = codec.encode({"w": x}, "int4")
    native_build.reset()
    codec_native.reset()
    try:
        with caplog.at_level("WARNING", logger="diloco.native"):
            assert not codec_native.available()
            got = codec.encode({"w": x}, "int4")
        assert "exited with 1" in native_build.unavailable_reason(codec_native.SOURCE)
        assert any("codec_kernels.c" in r.getMessage() for r in caplog.records)
        assert all(_bits(got[k]) == _bits(want[k]) for k in want)
    finally:
        monkeypatch.undo()
        native_build.reset()
        codec_native.reset()
