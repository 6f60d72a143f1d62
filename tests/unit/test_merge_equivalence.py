"""The in-place, chunked merge (diloco_async.merge.core) against the previous implementation
(tests/merge_reference.py, frozen): bit-for-bit equal results (``torch.equal``) on random
fragments, weights, M and dtypes, the RDA fallback, embeddings, zero deltas, anchoring, and outer
steps over several rounds with momentum, restore and refused steps."""

from __future__ import annotations

import json
import random

import pytest
import torch

import diloco_async.merge.buffers as buffers
import diloco_async.merge.core as merge
from tests import merge_reference as ref


def _fragment(rng: random.Random, gen: torch.Generator, dtype: torch.dtype, big: bool) -> dict[str, torch.Tensor]:
    shapes = [(rng.randint(1, 40),), (rng.randint(1, 30), rng.randint(1, 30)), (rng.randint(1, 5), 3, 7)]
    if big:  # over one chunk, not a multiple of it
        shapes.append((rng.choice([2, 3]) * buffers.CHUNK_ELEMENTS // 512 + rng.randint(1, 600), 512))
    rng.shuffle(shapes)
    names = [f"t{i}" for i in range(len(shapes))]
    return {n: torch.randn(s, generator=gen, dtype=dtype) * rng.choice([1e-3, 1.0, 30.0])
            for n, s in zip(names, shapes, strict=True)}


def _like(frag, gen, scale=1.0):
    return {n: torch.randn(t.shape, generator=gen, dtype=t.dtype) * scale for n, t in frag.items()}


def _weights(rng: random.Random, m: int) -> list[float]:
    ws = [rng.choice([0.0, 1.0, rng.uniform(0.01, 5e6), float(rng.randint(1, 900))]) for _ in range(m)]
    if sum(ws) <= 0:
        ws[rng.randrange(m)] = 3.5
    return ws


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert torch.equal(a[n], b[n]), f"{n}: {int((a[n] != b[n]).sum())} elements differ"


@pytest.fixture(params=[None, 4096, 1000], ids=["chunk-default", "chunk-4096", "chunk-1000"])
def chunk(request, monkeypatch):
    if request.param is not None:
        monkeypatch.setattr(buffers, "CHUNK_ELEMENTS", request.param)
    return buffers.CHUNK_ELEMENTS


@pytest.mark.parametrize("seed", range(6))
def test_random_merges_and_outer_steps_equal_previous_implementation(seed, chunk):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if seed % 3 == 2 else torch.float32
    cur = _fragment(rng, gen, dtype, big=seed % 2 == 0)
    names = list(cur)
    old_opt, new_opt = ref.OuterOptimizer(cur), merge.OuterOptimizer(cur)
    versions = [cur]
    for rnd in range(4):
        m = rng.choice([1, 2, 3, 8, 16]) if rnd else 16
        deltas, bases = [], []
        for _ in range(m):
            base = rng.choice(versions[-3:])
            deltas.append(_like(cur, gen, rng.choice([1e-4, 0.1, 2.0])))
            bases.append(base)
        if rnd == 1:  # a zero delta anchored on the current value (norm 0, left out of the direction)
            deltas[0] = {n: torch.zeros_like(t) for n, t in cur.items()}
            bases[0] = cur
        if rnd == 2 and m >= 2:  # two that cancel: the RDA fallback to the weighted mean
            deltas[1] = {n: -t for n, t in deltas[0].items()}
            bases[0] = bases[1] = cur
        weights = _weights(rng, m)
        if rnd == 2 and m >= 2:
            weights[:2] = [5.0, 5.0]
            weights[2:] = [0.0] * (m - 2)
        emb = rng.sample(names, rng.randint(0, 2))
        mode = rng.choice(["rda", "rda", "mean"])
        old_anchored = [ref.anchor(d, cur, b) for d, b in zip(deltas, bases, strict=True)]
        new_lazy = [merge.AnchoredDelta(d, cur, b) for d, b in zip(deltas, bases, strict=True)]
        _assert_equal(merge.anchor(deltas[-1], cur, bases[-1]), old_anchored[-1])
        for a, lazy in zip(old_anchored, new_lazy, strict=True):
            assert lazy.check() == {}
            _assert_equal(lazy.materialize(), a)
        g_old = ref.merge_outer_gradients(old_anchored, weights, mode=mode, embedding_names=emb)
        g_new = merge.merge_outer_gradients(new_lazy, weights, mode=mode, embedding_names=emb)
        _assert_equal(g_new, g_old)
        _assert_equal(merge.merge_outer_gradients(old_anchored, weights, mode=mode, embedding_names=emb), g_old)
        out = {n: torch.full_like(t, float("nan")) for n, t in g_old.items()}  # reused buffers are overwritten
        _assert_equal(merge.merge_outer_gradients(new_lazy, weights, mode=mode, embedding_names=emb, out=out), g_old)
        name = names[0]
        column = [a[name] for a in old_anchored]
        assert torch.equal(merge.rda(column, weights), ref.rda(column, weights))
        assert torch.equal(merge.weighted_mean(column, weights), ref.weighted_mean(column, weights))
        if rnd % 2:  # as the synchronizer does it: the merged buffers become the momentum
            new_value = new_opt.step_shared({n: t.clone() for n, t in g_new.items()}, require_finite=True,
                                            consume=True)
        else:
            new_value = new_opt.step(g_new)
        _assert_equal(new_value, old_opt.step(g_old))
        _assert_equal(new_opt.momentum(), old_opt.momentum())
        _assert_equal(new_opt.params(), old_opt.params())
        cur = new_opt.params()
        versions.append(cur)
    consumed = {n: t.clone() for n, t in g_new.items()}
    shared = merge.OuterOptimizer(cur)
    shared.load_state(new_opt.params(), new_opt.momentum(), steps_taken=new_opt.steps_taken)
    first = merge.OuterOptimizer(cur)  # a first step consuming g: b = g is g's own buffer
    _assert_equal(first.step_shared(consumed, consume=True), ref.OuterOptimizer(cur).step(g_new))
    _assert_equal(first.momentum(), g_new)
    restored = merge.OuterOptimizer(cur)
    restored.load_state(old_opt.params(), old_opt.momentum(), steps_taken=old_opt.steps_taken)
    g = _like(cur, gen, 0.05)
    _assert_equal(restored.step(g), old_opt.step(g))
    _assert_equal(restored.momentum(), old_opt.momentum())


def test_cancelling_fallback_and_all_zero_equal_previous_implementation(chunk):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3 * chunk + 5, generator=gen)
    for deltas, weights in [([x, -x], [2.0, 2.0]), ([x, -x, x * 0], [1.0, 1.0, 4.0]),
                            ([x * 0, x * 0], [1.0, 2.0]), ([x, 2 * x, -3 * x], [1.0, 1.0, 1.0])]:
        assert torch.equal(merge.rda(deltas, weights), ref.rda(deltas, weights))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_refused_steps_leave_the_state_as_the_previous_implementation(bad, chunk):
    gen = torch.Generator().manual_seed(3)
    theta = {"a": torch.randn(2 * chunk + 3, generator=gen), "b": torch.randn(7, 5, generator=gen)}
    old_opt, new_opt = ref.OuterOptimizer(theta), merge.OuterOptimizer(theta)
    g = _like(theta, gen, 0.1)
    _assert_equal(new_opt.step(g), old_opt.step(g))
    poisoned = {n: t.clone() for n, t in g.items()}
    poisoned["a"][-1] = bad
    for opt in (old_opt, new_opt):
        with pytest.raises(ValueError, match="non-finite"):
            opt.step(poisoned)
    huge = {n: torch.full_like(t, 3e38) for n, t in theta.items()}  # finite, but the step overflows
    before = new_opt.shared_state()
    with pytest.raises(ValueError, match="after the outer step"):
        new_opt.step_shared(huge, require_finite=True)
    after = new_opt.shared_state()  # the very same tensors: nothing switched, nothing written
    assert after.steps_taken == before.steps_taken
    assert all(after.params[n] is t for n, t in before.params.items())
    assert all(after.momentum[n] is t for n, t in before.momentum.items())
    assert new_opt.steps_taken == old_opt.steps_taken == 1
    _assert_equal(new_opt.params(), old_opt.params())
    _assert_equal(new_opt.momentum(), old_opt.momentum())
    _assert_equal(new_opt.step(g), old_opt.step(g))
    kept = new_opt.shared_state()
    new_opt.step(g)
    new_opt.restore(kept)
    _assert_equal(new_opt.step(g), old_opt.step(g))
    _assert_equal(new_opt.momentum(), old_opt.momentum())


def test_check_counts_non_finite_anchored_values_like_the_previous_screen():
    cur = {"w": torch.ones(5), "v": torch.ones(3)}
    base = {"w": torch.zeros(5), "v": torch.zeros(3)}
    delta = {"w": torch.tensor([1.0, float("nan"), 2.0, float("inf"), 0.0]), "v": torch.full((3,), 3e38)}
    lazy = merge.AnchoredDelta(delta, cur, base)
    assert lazy.check() == {"w": 2}  # v overflows its norm but every value is finite


def test_anchored_on_the_current_value_equals_previous_implementation_with_signed_zeros(chunk):
    """Δ' is taken as Δ when the base is the current value: -0.0 and 0.0 elements included, RDA,
    its fallback and the mean give the previous bits."""
    gen = torch.Generator().manual_seed(11)
    cur = {"w": torch.randn(2 * chunk + 9, generator=gen), "e": torch.randn(6, 4, generator=gen)}
    older = {n: t + 0.5 for n, t in cur.items()}
    deltas = []
    for k in range(4):
        d = {n: torch.randn(t.shape, generator=gen) for n, t in cur.items()}
        d["w"][k::3] = -0.0
        d["e"][0] = 0.0
        deltas.append(d)
    deltas.append({n: torch.full_like(t, -0.0) for n, t in cur.items()})
    deltas.append({n: -t for n, t in deltas[0].items()})
    for bases, weights in [([cur] * 6, [1.0, 2.0, 3.0, 4.0, 5.0, 1.0]), ([cur, older] * 3, [2.0] * 6),
                           ([cur] * 6, [1.0, 0.0, 0.0, 0.0, 3.0, 1.0])]:
        for mode in ("rda", "mean"):
            old = ref.merge_outer_gradients([ref.anchor(d, cur, b) for d, b in zip(deltas, bases, strict=True)],
                                            weights, mode=mode, embedding_names=["e"])
            lazy = [merge.AnchoredDelta(d, cur, b) for d, b in zip(deltas, bases, strict=True)]
            assert merge.check_anchored(lazy) == [{}] * 6
            _assert_equal(merge.merge_outer_gradients(lazy, weights, mode=mode, embedding_names=["e"]), old)


def test_published_version_bytes_equal_the_codec_encoding():
    """Publishing serializes the new value straight from the optimizer's tensors: the same header
    (as JSON: safetensors writes the metadata in hash order) and data bytes as
    codec.encode_to_bytes (fp32), which every reader decodes."""
    from diloco_async.codec import wire as codec
    from diloco_async.sync.work import _fp32_bytes

    gen = torch.Generator().manual_seed(5)
    opt = merge.OuterOptimizer({"b": torch.randn(3, 5, generator=gen), "a": torch.randn(70001, generator=gen)})
    new = opt.step_shared({"b": torch.randn(3, 5, generator=gen), "a": torch.randn(70001, generator=gen)})
    meta = {"fragment": "2", "version": "7", "lease_epoch": "1", "round": "9"}
    data = _fp32_bytes(new, meta)
    assert _parts(data) == _parts(codec.encode_to_bytes(new, "fp32", meta))
    decoded, got_meta = codec.decode_from_bytes(data, "fp32", {n: tuple(t.shape) for n, t in new.items()})
    assert got_meta["version"] == "7"
    _assert_equal(dict(sorted(decoded.items())), dict(sorted(new.items())))
    non_contiguous = {"a": torch.randn(4, 6, generator=gen).t()}
    assert _parts(_fp32_bytes(non_contiguous, meta)) == _parts(codec.encode_to_bytes(non_contiguous, "fp32", meta))


def _parts(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]
