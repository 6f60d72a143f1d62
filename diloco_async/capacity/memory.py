"""Memory of one learner rank and of one synchronizer shard, part by part (issue 40 item 6).

Every part is a formula over the plan's inputs and the buffers the code holds; the constants
below mirror the code's own (``tests/unit/test_capacity_plan.py`` checks they still agree) and
none is fitted. The formulas, and how they compare with ``make bench``'s RSS rows, are in
``docs/capacity-plan.md``.

Learner rank (rank 0 of a group: the one that talks to the synchronizer; ``fsdp`` divides the
state and each fragment's buffers by N):

* parameters, gradients: 4 bytes per parameter each (fp32 also under bf16 autocast); AdamW
  moments: 8 (the fused kernel keeps no temporaries, ``inner/workload.py``);
* activations of one step: ``tokens × n_layer × d_model × words × bytes``, ``words = 8 + 2·W/d``
  (``8 + 4·W/d`` with a gated MLP) saved per token and block (norm inputs and outputs, q, k, v,
  attention output, residual, the MLP's inner activations of width W; attention through SDPA keeps
  no score matrix), plus the logits and their log-softmax (2 × vocab per token, fp32);
* base copies Θ^base: fp32, in pinned host memory on an accelerator, in local files on a CPU
  learner (``inner/base_file.py``);
* comms: one fragment's upload (fp32 Δ, its encoding and the payload bytes) or one download (the
  payload and its fp32 decoding), never both at once (one I/O slot, ``learner/uploads.py``), plus
  one more contribution encoded while an upload waits; one store part of the inner-state upload;
  the heap the learner keeps at its top (its trim threshold, ``learner/main.py``).

Synchronizer shard: fp32 value and outer momentum of its fragments (and the published value when
downloads are compressed, ``codec/versions.py``); the merge's buffers (the pool keeps three of the
largest fragment's fp32 free, a merge uses three, plus the small chunks, ``sync/state.py``,
``merge/buffer_pool.py``); the contributions of its open rounds held in their wire encoding until
merged (M per round, at most τ rounds); one tensor decoded per verification in flight; one store
part of a checkpoint upload. Published versions live in the store (0 in RAM).
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_async.capacity.inputs import PlanInputs
from diloco_async.capacity.sizes import FragmentSizes, shard_fragments

__all__ = ["MemoryPart", "ProcessMemory", "learner_rank_memory", "synchronizer_shard_memory", "activation_bytes",
           "LEARNER_HEAP_KEPT_BYTES", "STORE_PART_BYTES", "MERGE_POOL_FRAGMENTS", "MERGE_FRAGMENTS_IN_USE",
           "MERGE_SMALL_SPARE_BYTES", "CHECKPOINT_PARTS_IN_FLIGHT"]

MiB = 1 << 20
#: the learner's glibc trim threshold: free memory at the top of its heap it may keep
#: (``diloco_async.learner.main.LEARNER_TRIM_THRESHOLD_BYTES``)
LEARNER_HEAP_KEPT_BYTES = 64 * MiB
#: one part of a multipart upload (``diloco_async.storage.store.ObjectStore``'s ``part_nbytes``)
STORE_PART_BYTES = 16 * MiB
#: largest fragments' fp32 the merge pool keeps free (``diloco_async.sync.state.MERGE_POOL_FRAGMENTS``)
MERGE_POOL_FRAGMENTS = 3
#: fp32 fragments one merge writes (new value, merged outer gradient, kept anchored gradients;
#: ``synchronizer.merges_in_flight``'s description)
MERGE_FRAGMENTS_IN_USE = 3
#: small chunk buffers the pool keeps besides (``diloco_async.merge.buffer_pool.SMALL_SPARE_BYTES``)
MERGE_SMALL_SPARE_BYTES = 32 * MiB
#: checkpoint parts uploaded at once (``diloco_async.sync.checkpoints.CHECKPOINT_PARTS_IN_FLIGHT``)
CHECKPOINT_PARTS_IN_FLIGHT = 1

FP32 = 4


@dataclass(frozen=True)
class MemoryPart:
    """One part of a process's memory: ``nbytes`` in ``where`` (``device``, ``host`` or ``disk``)
    and the formula that gave it (``why``)."""

    name: str
    nbytes: int
    where: str
    why: str


@dataclass(frozen=True)
class ProcessMemory:
    """A process's memory by part; ``notes`` say what is not modelled."""

    parts: tuple[MemoryPart, ...]
    notes: tuple[str, ...] = ()

    def total(self, where: str) -> int:
        """Bytes of every part in ``where`` (``device``, ``host`` or ``disk``)."""
        return sum(p.nbytes for p in self.parts if p.where == where)

    @property
    def host_bytes(self) -> int:
        return self.total("host")

    @property
    def device_bytes(self) -> int:
        return self.total("device")

    @property
    def disk_bytes(self) -> int:
        return self.total("disk")


def _share(inp: PlanInputs) -> int:
    """N for fsdp (each rank holds 1/N), else 1."""
    return inp.learners.devices if inp.learners.parallelism == "fsdp" else 1


def activation_bytes(inp: PlanInputs) -> int | None:
    """Activations one rank saves for the backward of one inner step (bytes; formula in the
    module docstring); None when the model's shape is not known."""
    m, lr = inp.model, inp.learners
    if not m.activations_known:
        return None
    assert m.n_layer and m.d_model and m.mlp_width and m.vocab_size
    tokens = lr.batch_per_rank * lr.context
    word = 2 if lr.precision == "bf16" else 4
    words = 8 + (4 if m.gated_mlp else 2) * m.mlp_width / m.d_model
    blocks = tokens * m.n_layer * m.d_model * words * word
    head = 2 * tokens * m.vocab_size * FP32
    return round(blocks + head)


def learner_rank_memory(inp: PlanInputs, sizes: FragmentSizes) -> ProcessMemory:
    """Memory of a learner's rank 0 (module docstring). ``sizes``: the plan's fragments."""
    n, share = inp.model.n_params, _share(inp)
    state_where = "device" if inp.learners.accelerator else "host"
    f = sizes.largest
    frag_fp32 = FP32 * sizes.numel[f] // share
    up, down = sizes.up_nbytes[f] // share, sizes.down_nbytes[f] // share
    per = "/N" if share > 1 else ""
    parts = [
        MemoryPart("parameters", FP32 * n // share, state_where, f"4 bytes x params{per}"),
        MemoryPart("gradients", FP32 * n // share, state_where, f"4 bytes x params{per}"),
        MemoryPart("adamw_moments", 2 * FP32 * n // share, state_where, f"8 bytes x params{per} (fused AdamW)"),
    ]
    notes = []
    act = activation_bytes(inp)
    if act is None:
        notes.append("activations not modelled: the model's layers and width are unknown (give a recipe or an "
                     "HF config)")
    else:
        parts.append(MemoryPart("activations", act, state_where, "tokens x layers x d_model x (8 + 2 or 4 x mlp/d) "
                                f"x {2 if inp.learners.precision == 'bf16' else 4} bytes + logits"))
    if inp.learners.accelerator:
        parts.append(MemoryPart("base_copies", FP32 * n // share, "host", f"fp32 x params{per}, pinned"))
    else:
        parts.append(MemoryPart("base_copies", FP32 * n // share, "disk", f"fp32 x params{per}, local files"))
    parts += [
        MemoryPart("comms_buffers", max(frag_fp32 + 2 * up, down + frag_fp32), "host",
                   f"largest fragment: max(fp32 + 2 x {inp.sync.codec} up, {inp.sync.download_codec} down + fp32)"),
        MemoryPart("queued_contribution", up, "host", f"one more {inp.sync.codec} contribution while an upload waits"),
        MemoryPart("inner_state_upload", STORE_PART_BYTES, "host", "one store part of the spooled inner state"),
        MemoryPart("heap_kept", LEARNER_HEAP_KEPT_BYTES, "host", "free memory the learner's heap may keep (trim "
                   "threshold)"),
    ]
    return ProcessMemory(tuple(parts), tuple(notes))


def synchronizer_shard_memory(inp: PlanInputs, sizes: FragmentSizes) -> ProcessMemory:
    """Memory of the largest synchronizer shard (module docstring). ``sizes``: the plan's fragments."""
    s = inp.sync
    shards = shard_fragments(s.fragments, s.shards)
    mine = max(shards, key=lambda ps: (sum(sizes.numel[p] for p in ps), -ps[0]))
    numel = sum(sizes.numel[p] for p in mine)
    f = max(mine, key=lambda p: (sizes.numel[p], -p))
    momentum = 0 if s.outer_optimizer == "sgd" else FP32 * numel
    held_rounds = min(s.overlap, len(mine))
    decode = max(sizes.largest_tensor[p] for p in mine)
    parts = [
        MemoryPart("value", FP32 * numel, "host", f"fp32 x its {len(mine)} fragments' params"),
        MemoryPart("outer_momentum", momentum, "host", f"fp32 x params ({s.outer_optimizer})"),
    ]
    if s.download_codec != "fp32":
        parts.append(MemoryPart("published_value", FP32 * numel, "host",
                                f"fp32 x params: what learners rebuild from {s.download_codec} downloads"))
    parts += [
        MemoryPart("merge_buffers", max(MERGE_POOL_FRAGMENTS, MERGE_FRAGMENTS_IN_USE * s.merges_in_flight)
                   * FP32 * sizes.numel[f] + MERGE_SMALL_SPARE_BYTES, "host",
                   f"max({MERGE_POOL_FRAGMENTS}, {MERGE_FRAGMENTS_IN_USE} x merges in flight) x largest fragment fp32 "
                   "+ small chunks"),
        MemoryPart("held_contributions", inp.learners.count * held_rounds * sizes.up_nbytes[f], "host",
                   f"M x min(tau, its fragments) rounds x one {s.codec} contribution"),
        MemoryPart("verify_decoding", s.verifies_in_flight * FP32 * decode, "host",
                   "verifies in flight x largest tensor fp32"),
        MemoryPart("checkpoint_upload", CHECKPOINT_PARTS_IN_FLIGHT * STORE_PART_BYTES, "host",
                   "store parts of a checkpoint in flight"),
    ]
    notes = () if inp.model.tensors else ("a bare parameter count: a fragment's largest tensor is taken as the "
                                          "whole fragment (verify_decoding is an upper bound)",)
    return ProcessMemory(tuple(parts), notes)
