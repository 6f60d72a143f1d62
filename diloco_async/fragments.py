"""Balanced tensor fragmentation and the round schedule offsets (paper §3, DESIGN §4.6).

Pure: no I/O. Every process derives the same plan from the same tensor specs, so the plan can be
checked by its schema hash instead of being trusted.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["TensorSpec", "FragmentPlan", "plan_fragments", "specs_of", "fragment_offset"]


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one model tensor (dtype as torch spells it, e.g. ``"float32"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: Mapping) -> TensorSpec:
        return cls(name=str(d["name"]), shape=tuple(int(s) for s in d["shape"]), dtype=str(d["dtype"]))


def specs_of(state: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """Tensor specs of a state dict (the names, shapes and dtypes; values are not read)."""
    return [TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in state.items()]


@dataclass(frozen=True)
class FragmentPlan:
    """Which tensor belongs to which fragment.

    Attributes:
        fragments: ``fragments[p]`` is the tuple of tensor specs of fragment ``p``, sorted by name.
        embedding_names: tensors merged with the plain weighted mean instead of RDA (token
            embeddings and a tied output head, DESIGN §4.4).
    """

    fragments: tuple[tuple[TensorSpec, ...], ...]
    embedding_names: frozenset[str] = frozenset()

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def names(self, p: int) -> list[str]:
        return [s.name for s in self.fragments[p]]

    def numel(self, p: int) -> int:
        return sum(s.numel for s in self.fragments[p])

    def numel_fraction(self, p: int) -> float:
        """Share of all parameters that fragment ``p`` holds, in [0, 1]."""
        total = sum(self.numel(q) for q in range(self.num_fragments))
        return self.numel(p) / total if total else 0.0

    def spec(self, name: str) -> TensorSpec:
        for frag in self.fragments:
            for s in frag:
                if s.name == name:
                    return s
        raise KeyError(name)

    def fragment_of(self, state: Mapping[str, torch.Tensor], p: int) -> dict[str, torch.Tensor]:
        """The tensors of fragment ``p`` taken from a full state dict (no copy)."""
        return {n: state[n] for n in self.names(p)}

    def to_json(self) -> dict:
        return {
            "fragments": [[s.to_json() for s in frag] for frag in self.fragments],
            "embedding_names": sorted(self.embedding_names),
        }

    @classmethod
    def from_json(cls, d: Mapping) -> FragmentPlan:
        frags = tuple(tuple(TensorSpec.from_json(s) for s in frag) for frag in d["fragments"])
        return cls(fragments=frags, embedding_names=frozenset(d.get("embedding_names", [])))

    @property
    def schema_hash(self) -> str:
        """sha256 (hex) of the canonical JSON of the plan: equal plans have equal hashes."""
        blob = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


def plan_fragments(
    specs: Sequence[TensorSpec], num_fragments: int, embedding_names: Sequence[str] = ()
) -> FragmentPlan:
    """Balanced tensor fragmentation (paper §3, DESIGN §4.6).

    Sort tensors by size, largest first (ties by name), and put each into the fragment with the
    smallest running size (ties: lowest fragment index). Deterministic for a given set of specs.

    Raises:
        ValueError: ``num_fragments`` < 1, more fragments than tensors, or duplicate names.
    """
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    if num_fragments > len(specs):
        raise ValueError(f"num_fragments={num_fragments} exceeds the number of tensors ({len(specs)})")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in the specs")
    unknown = set(embedding_names) - set(names)
    if unknown:
        raise ValueError(f"embedding_names not in the model: {sorted(unknown)}")
    order = sorted(specs, key=lambda s: (-s.numel, s.name))
    buckets: list[list[TensorSpec]] = [[] for _ in range(num_fragments)]
    sizes = [0] * num_fragments
    for s in order:
        p = min(range(num_fragments), key=lambda i: (sizes[i], i))
        buckets[p].append(s)
        sizes[p] += s.numel
    frags = tuple(tuple(sorted(b, key=lambda s: s.name)) for b in buckets)
    return FragmentPlan(fragments=frags, embedding_names=frozenset(embedding_names))


def fragment_offset(p: int, num_fragments: int, sync_every: int) -> int:
    """Offset o_p = floor(p·H/P) of fragment ``p`` in the staggered schedule (DESIGN §3.2)."""
    if not 0 <= p < num_fragments:
        raise ValueError(f"fragment {p} out of range [0, {num_fragments})")
    return (p * sync_every) // num_fragments
