"""The C kernels of the merge and the codecs (DESIGN §4.5c, §6): their sources and their one-time build.

:mod:`~diloco_async.kernels.build` compiles a source with the system compiler into a per-user
cache and loads it with ``ctypes``; the merge (:mod:`diloco_async.merge.native`) and the codecs
(:mod:`diloco_async.codec.native`) fall back to their torch code, bit for bit the same, when it
cannot.
"""
