"""The tiny recipe of the system tests that run real processes: a 1-layer, 32-wide ByteGPT, three
fragments, H = 12 (a run of a few learners takes seconds on a CPU)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiny_recipe_text(learners: int, *, run: str, budget: str, synchronizer: str = "",
                     checkpoint_every_s: float = 2.0) -> str:
    """The recipe's TOML: ``run`` and ``budget`` are the bodies of those sections (``key = value``
    lines), ``synchronizer`` extra lines of its section."""
    return f"""
[run]
{run}
[data]
cache_dir = "{(ROOT / 'data').resolve()}"
[model]
n_layer = 1
d_model = 32
n_head = 2
context = 32
[learners]
count = {learners}
batch_size = 8
[synchronizer]
{synchronizer}
num_fragments = 3
sync_every = 12
heartbeat_timeout_s = 5.0
checkpoint_every_s = {checkpoint_every_s}
[budget]
{budget}
"""
