"""Fragmentation (balanced tensor, or by tensor count, or by layer) and the round schedule offsets
(paper §3, DESIGN §4.6).

Pure: no I/O. Every process derives the same plan from the same tensor specs, so the plan can be
checked by its schema hash instead of being trusted.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["TensorSpec", "FragmentPlan", "plan_fragments", "specs_of", "fragment_offset", "plan_differences",
           "FRAGMENTATIONS", "layer_of"]

FRAGMENTATIONS = ("balanced", "tensor", "layer")
"""Names of ``synchronizer.fragmentation`` (the ``mode`` of :func:`plan_fragments`)."""


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
        identity: canonical JSON of the model identity (kind, architecture config, LoRA settings,
            digest of the frozen base; ``diloco_async.models.identity_of``); "" when not given.
        mode: the fragmentation that cut the plan, one of :data:`FRAGMENTATIONS`; part of the
            schema hash unless it is ``"balanced"`` (so balanced plans hash as they always did).
    """

    fragments: tuple[tuple[TensorSpec, ...], ...]
    embedding_names: frozenset[str] = frozenset()
    identity: str = ""
    mode: str = "balanced"

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

    @property
    def model_identity(self) -> dict:
        """The model identity as plain data ({} when not given)."""
        return json.loads(self.identity) if self.identity else {}

    def to_json(self) -> dict:
        out = {
            "fragments": [[s.to_json() for s in frag] for frag in self.fragments],
            "embedding_names": sorted(self.embedding_names),
        }
        if self.identity:
            out["model"] = self.model_identity
        if self.mode != "balanced":
            out["fragmentation"] = self.mode
        return out

    @classmethod
    def from_json(cls, d: Mapping) -> FragmentPlan:
        frags = tuple(tuple(TensorSpec.from_json(s) for s in frag) for frag in d["fragments"])
        return cls(fragments=frags, embedding_names=frozenset(d.get("embedding_names", [])),
                   identity=_canonical_json(d["model"]) if d.get("model") else "",
                   mode=str(d.get("fragmentation", "balanced")))

    @property
    def schema_hash(self) -> str:
        """sha256 (hex) of the canonical JSON of the plan: equal plans have equal hashes."""
        blob = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


def _canonical_json(d: Mapping) -> str:
    return json.dumps(d, sort_keys=True, separators=(",", ":"), default=str)


def plan_fragments(
    specs: Sequence[TensorSpec], num_fragments: int, embedding_names: Sequence[str] = (),
    identity: Mapping | None = None, mode: str = "balanced",
) -> FragmentPlan:
    """Cut the model's tensors into ``num_fragments`` fragments (paper §3, DESIGN §4.6).

    ``mode`` (``synchronizer.fragmentation``):

    * ``"balanced"`` (the paper's balanced tensor fragmentation): sort tensors by size, largest
      first (ties by name), and put each into the fragment with the smallest running size (ties:
      lowest fragment index).
    * ``"tensor"``: fragments are contiguous runs of whole tensors in model order (the order of
      ``specs``), cut by tensor count: tensor ``i`` of ``T`` goes to fragment ``floor(i·P/T)``.
    * ``"layer"``: whole layers (:func:`layer_of`) stay together; tensors outside any layer
      (embeddings, final norm, head) join the nearest layer in model order (before the first
      layer: the first; after a layer: that one), unless ``P`` exceeds the number of numbered
      layers: then the tensors before the first and after the last are layers of their own;
      layer ``i`` of ``L`` goes to fragment ``floor(i·P/L)``: contiguous runs of layers.

    Deterministic for a given list of specs. ``identity`` (plain JSON data describing the model)
    and a mode other than ``"balanced"`` become part of the schema hash.

    Raises:
        ValueError: ``num_fragments`` < 1, more fragments than tensors (or, for ``"layer"``,
            than layers), duplicate names, unknown embedding names or an unknown ``mode``.
    """
    if mode not in FRAGMENTATIONS:
        raise ValueError(f"unknown fragmentation {mode!r}; expected one of {FRAGMENTATIONS}")
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
    if mode == "balanced":
        buckets = _balanced(specs, num_fragments)
    else:
        units = [[s] for s in specs] if mode == "tensor" else _layers(specs, num_fragments)
        if num_fragments > len(units):
            raise ValueError(f"num_fragments={num_fragments} exceeds the number of layers ({len(units)}) of "
                             "fragmentation='layer'")
        buckets = [[] for _ in range(num_fragments)]
        for i, unit in enumerate(units):
            buckets[i * num_fragments // len(units)].extend(unit)
    frags = tuple(tuple(sorted(b, key=lambda s: s.name)) for b in buckets)
    return FragmentPlan(fragments=frags, embedding_names=frozenset(embedding_names),
                        identity=_canonical_json(identity) if identity else "", mode=mode)


def _balanced(specs: Sequence[TensorSpec], num_fragments: int) -> list[list[TensorSpec]]:
    order = sorted(specs, key=lambda s: (-s.numel, s.name))
    buckets: list[list[TensorSpec]] = [[] for _ in range(num_fragments)]
    sizes = [0] * num_fragments
    for s in order:
        p = min(range(num_fragments), key=lambda i: (sizes[i], i))
        buckets[p].append(s)
        sizes[p] += s.numel
    return buckets


_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_of(name: str) -> str | None:
    """The layer a tensor belongs to: its name up to its first all-digit component
    (``blocks.3.attn.qkv.weight`` → ``blocks.3``, ``model.layers.11.mlp.up_proj.weight`` →
    ``model.layers.11``), or None for a tensor outside the numbered layers (``tok_emb.weight``)."""
    m = _LAYER_INDEX.search(name)
    return None if m is None else name[: m.end(1)]


def _layers(specs: Sequence[TensorSpec], num_fragments: int) -> list[list[TensorSpec]]:
    """The tensors grouped by layer, layers in order of first appearance. A tensor outside the
    numbered layers between two of them joins the one before it; those before the first layer
    (embeddings) and after the last (final norm, head) join the first and the last layer, or,
    when ``num_fragments`` exceeds the number of numbered layers, are layers of their own (the
    input and the output layer). A model without numbered layers is one layer."""
    layers: dict[str, list[TensorSpec]] = {}
    before: list[TensorSpec] = []
    pending: list[TensorSpec] = []  # outside the layers, since the last layered tensor
    current: str | None = None
    for s in specs:
        key = layer_of(s.name)
        if key is None:
            pending.append(s)
            continue
        if current is None:
            before, pending = pending, []
        else:
            layers[current].extend(pending)
            pending = []
        current = key
        layers.setdefault(key, []).append(s)
    units = list(layers.values())
    if not units:
        return [pending]
    if num_fragments > len(units):
        return ([before] if before else []) + units + ([pending] if pending else [])
    units[0][:0] = before
    units[-1].extend(pending)
    return units


def _flat(d: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(d, Mapping):
        return {prefix.rstrip("."): d}
    out: dict[str, object] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def plan_differences(mine: FragmentPlan, theirs: FragmentPlan, limit: int = 3) -> list[str]:
    """Why two plans differ, first differing tensors first (in name order), then the model
    identity fields, then the fragment assignment; at most ``limit`` lines of each kind.

    Returns:
        lines like ``"tensor net.w: shape [4, 8] float32 here, [4, 16] float32 there"``; [] when
        the plans are equal.
    """
    a = {s.name: s for frag in mine.fragments for s in frag}
    b = {s.name: s for frag in theirs.fragments for s in frag}

    def show(s: TensorSpec | None) -> str:
        return "missing" if s is None else f"shape {list(s.shape)} {s.dtype}"

    tensors = [f"tensor {n}: {show(a.get(n))} here, {show(b.get(n))} there"
               for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n)]
    ia, ib = _flat(mine.model_identity), _flat(theirs.model_identity)
    model = [f"model {k}: {ia.get(k, 'missing')!r} here, {ib.get(k, 'missing')!r} there"
             for k in sorted(set(ia) | set(ib)) if ia.get(k) != ib.get(k)]
    out = tensors[:limit] + model[:limit]
    if mine.mode != theirs.mode:
        out.append(f"fragmentation: {mine.mode!r} here, {theirs.mode!r} there")
    if not out and mine.schema_hash != theirs.schema_hash:
        out.append(f"fragment assignment: {mine.num_fragments} fragments here, {theirs.num_fragments} there"
                   if mine.num_fragments != theirs.num_fragments else "fragment assignment or embedding names")
    return out


def fragment_offset(p: int, num_fragments: int, sync_every: int) -> int:
    """Offset o_p = floor(p·H/P) of fragment ``p`` in the staggered schedule (DESIGN §3.2)."""
    if not 0 <= p < num_fragments:
        raise ValueError(f"fragment {p} out of range [0, {num_fragments})")
    return (p * sync_every) // num_fragments
