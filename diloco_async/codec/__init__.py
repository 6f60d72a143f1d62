"""Wire encoding of outer gradients and of published versions (DESIGN §6).

:mod:`~diloco_async.codec.wire` encodes and decodes (fp32, bf16, int8, int4, int2, top-k);
:mod:`~diloco_async.codec.blocks` and :mod:`~diloco_async.codec.int2` hold the blockwise
quantization and its packing, :mod:`~diloco_async.codec.native` the same in C;
:mod:`~diloco_async.codec.held` keeps a contribution in its encoding until the merge needs it;
:mod:`~diloco_async.codec.versions` compresses the downloads of published fragment versions.
"""
