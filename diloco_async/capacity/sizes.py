"""The fragments of a plan and their sizes on the wire, from the project's own fragmentation and codecs.

A model with its tensor specs is cut by :func:`diloco_async.policy.fragments.plan_fragments` (the
run's own plan); a bare parameter count is cut into ``P`` equal fragments. Each fragment's bytes
up and down come from :func:`diloco_async.codec.wire.encoded_nbytes` (values and block scales;
the safetensors header of a few hundred bytes is left out), never from a table of bytes per
parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_async.capacity.inputs import ModelShape, SyncSetup
from diloco_async.codec.wire import DEFAULT_BLOCK_SIZE, encoded_nbytes
from diloco_async.policy.fragments import TensorSpec, plan_fragments
from diloco_async.policy.shards import assignment

__all__ = ["FragmentSizes", "fragment_sizes", "shard_fragments"]


@dataclass(frozen=True)
class FragmentSizes:
    """Per fragment p: ``numel[p]`` elements, ``up_nbytes[p]`` bytes of one contribution in the
    upload codec, ``down_nbytes[p]`` bytes of one published version in the download codec (a
    version-to-version delta in the same layout, or the fp32 value), ``largest_tensor[p]``
    elements of its largest tensor (the whole fragment for a bare count)."""

    numel: tuple[int, ...]
    up_nbytes: tuple[int, ...]
    down_nbytes: tuple[int, ...]
    largest_tensor: tuple[int, ...]

    @property
    def largest(self) -> int:
        """Index of the fragment with the most elements (the lowest index on a tie)."""
        return max(range(len(self.numel)), key=lambda p: (self.numel[p], -p))


def _groups(shape: ModelShape, sync: SyncSetup) -> list[list[TensorSpec]]:
    if shape.tensors:
        plan = plan_fragments(shape.tensors, sync.fragments, mode=sync.fragmentation)
        return [list(f) for f in plan.fragments]
    base, extra = divmod(shape.n_params, sync.fragments)  # equal fragments; the first ones one element more
    return [[TensorSpec(f"fragment{p}", (base + (p < extra),))] for p in range(sync.fragments)]


def fragment_sizes(shape: ModelShape, sync: SyncSetup) -> FragmentSizes:
    """The sizes of the ``sync.fragments`` fragments of ``shape`` (see the module docstring).

    Raises:
        ValueError: more fragments than tensors, an unknown fragmentation or codec.
    """
    groups = _groups(shape, sync)
    specs = [{t.name: t.shape for t in g} for g in groups]
    return FragmentSizes(
        numel=tuple(sum(t.numel for t in g) for g in groups),
        up_nbytes=tuple(encoded_nbytes(sync.codec, s, DEFAULT_BLOCK_SIZE) for s in specs),
        down_nbytes=tuple(encoded_nbytes(sync.download_codec, s, sync.download_block_size) for s in specs),
        largest_tensor=tuple(max((t.numel for t in g), default=0) for g in groups))


def shard_fragments(num_fragments: int, shards: int) -> list[list[int]]:
    """Fragments of each synchronizer shard: the synchronizer's own assignment, fragment p on shard
    p mod S (:func:`diloco_async.policy.shards.assignment`; balanced fragments are near equal, so
    the sizes follow).

    Raises:
        ValueError: more shards than fragments (a shard would own nothing).
    """
    return list(assignment(shards, num_fragments).values())
