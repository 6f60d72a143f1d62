"""The ByteGPT sizes of the memory benchmarks (``make bench-memory``), by millions of parameters.

Each is a dict of typed config fields (``with_fields(Config(), SIZES[50])``): ``SIZES[50]`` is a 10-layer,
640-wide model of 49M parameters (:mod:`benchmarks.memory`, :mod:`benchmarks.memory_tokens`).
"""

from __future__ import annotations

__all__ = ["SIZES"]

#: model fields by nominal size in millions of parameters (ByteGPT: 12 L d^2 + 256 d)
SIZES: dict[int, dict[str, int]] = {
    1: {"model.n_layer": 2, "model.d_model": 192, "model.n_head": 4},
    25: {"model.n_layer": 8, "model.d_model": 512, "model.n_head": 8},
    50: {"model.n_layer": 10, "model.d_model": 640, "model.n_head": 10},
    100: {"model.n_layer": 14, "model.d_model": 768, "model.n_head": 12},
}
