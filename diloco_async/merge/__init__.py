"""The merge of Decoupled DiLoCo (paper §3.2, DESIGN §4.5): token weights, anchoring on Θ^base,
Radial-Directional Averaging and the outer step, in place and by chunks.

:mod:`~diloco_async.merge.core` is the math; :mod:`~diloco_async.merge.buffers` its in-place
buffers and :mod:`~diloco_async.merge.buffer_pool` the reused CPU buffers;
:mod:`~diloco_async.merge.outer_step` the outer Nesterov step and
:mod:`~diloco_async.merge.outer_optimizers` the other outer optimizers;
:mod:`~diloco_async.merge.native` the fused float32 passes in C. Pure: no I/O but the kernels'
one-time build.
"""
