"""The synchronizer's merge on reused buffers (issue 17 item 1): the buffer pool hands a buffer out
again only once nothing references it, and the merge as ``sync/work.py`` runs it (pooled outputs,
anchored outer gradients kept whole, RDA's last multiplication done by the outer step) equals the
previous implementation (tests/merge_reference.py) bit for bit over many rounds."""

from __future__ import annotations

import gc
import random
import threading

import pytest
import torch
from test_merge_equivalence import chunk  # noqa: F401, F811 (fixture: the merge's chunk sizes)

import diloco_async.merge.buffers as buffers
import diloco_async.merge.core as merge
from diloco_async.config.schema import load_config
from diloco_async.merge.buffer_pool import SMALL_SPARE_BYTES, BufferPool
from diloco_async.policy.fragments import plan_fragments, specs_of
from diloco_async.protocol.messages import Announcement
from diloco_async.storage.store import ObjectStore
from diloco_async.sync.state import Contribution, new_fragments
from diloco_async.sync.work import merge_and_publish, merge_workspace
from tests import merge_reference as ref


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert torch.equal(a[n], b[n]), f"{n}: {int((a[n] != b[n]).sum())} elements differ"


def test_pool_reuses_a_buffer_only_once_no_tensor_view_or_array_holds_it():
    pool = BufferPool(spare=1)
    a = pool.empty((4, 8), torch.float32)
    first = a.data_ptr()
    assert a.shape == (4, 8) and a.is_contiguous() and first % 64 == 0
    a.fill_(7.0)
    view = a[1:].view(-1)
    del a
    b = pool.empty((4, 8), torch.float32)  # a's memory is still reachable through the view
    assert b.data_ptr() != first and pool.allocated == 2
    arr = view.numpy()
    del view
    x = pool.empty((32,), torch.float32)  # ... and then through the array alone
    assert x.data_ptr() != first and pool.allocated == 3
    del arr, x
    gc.collect()
    c = pool.empty((8, 4), torch.float32)  # free now: reused, not made
    assert c.data_ptr() == first and pool.allocated == 3
    assert torch.all(c == 7.0)  # its old values: an uninitialised buffer
    del b, c


def test_pool_sees_a_tensor_freed_in_another_thread_and_keeps_only_spare_free_buffers():
    pool = BufferPool(spare=1)
    size = SMALL_SPARE_BYTES // 4  # elements of fp32: buffers over the small-size rule
    held = [pool.empty((size,), torch.float32) for _ in range(4)]
    box = {"t": held}
    t = threading.Thread(target=box.clear)
    del held
    t.start()
    t.join()
    assert pool.free_bytes() == 4 * SMALL_SPARE_BYTES
    x = pool.empty((size,), torch.float32)  # one reused, one kept spare, two given back
    assert pool.allocated == 4 and pool.reused == 1
    assert pool.held_bytes() == 2 * SMALL_SPARE_BYTES and pool.free_bytes() == SMALL_SPARE_BYTES
    del x
    with pytest.raises(ValueError, match="negative"):
        pool.empty((-1, 2), torch.float32)
    with pytest.raises(ValueError, match="spare"):
        BufferPool(spare=-1)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Torch threads: one as in the synchronizer (the fused kernels also give the norms of what
    they write, torch's bits), two (they may split their work; the norms are torch's own)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("per_tensor", [True, False], ids=["merge_and_step", "check-merge-step"])
def test_synchronizer_merge_path_equals_previous_implementation_over_rounds(seed, chunk, per_tensor,  # noqa: F811
                                                                            threads):
    """work.py's path: workspace from the optimizer's pool with Δ' kept whole (a budget that
    keeps some and not others), merge into pooled buffers with the scale deferred, step consuming
    them; bases alone, shared and current; the values of earlier versions are never written.
    Tensor by tensor (``merge_and_step``, as work.py runs it) and as three whole-fragment calls;
    on one torch thread and on two."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shapes = [(rng.randint(1, 40),), (rng.randint(1, 30), 17), (2 * buffers.CHUNK_ELEMENTS // 64 + 5, 64)]
    cur = {f"t{i}": torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
    old_opt, new_opt = ref.OuterOptimizer(cur), merge.OuterOptimizer(cur)
    cur = new_opt.shared_state().params
    versions, frozen = [cur], [{n: t.clone() for n, t in cur.items()}]
    for _round in range(6):
        m = rng.choice([1, 2, 3, 5, 8])
        bases = [rng.choice(versions[-3:]) for _ in range(m)]
        deltas = [{n: torch.randn(t.shape, generator=gen) * rng.choice([1e-3, 0.1]) for n, t in cur.items()}
                  for _ in range(m)]
        weights = [float(rng.randint(1, 900)) for _ in range(m)]
        mode = rng.choice(["rda", "rda", "mean"])
        ws = merge_workspace(new_opt)
        ws._keep_bytes = rng.choice([0, 4 * shapes[2][0] * 64, 10**9])  # none, one big tensor, all
        lazy = [merge.AnchoredDelta(d, cur, b) for d, b in zip(deltas, bases, strict=True)]
        g = None
        if per_tensor:
            new_value = merge.merge_and_step(new_opt, lazy, weights, mode, workspace=ws)
        else:
            assert merge.check_anchored(lazy, workspace=ws) == [{}] * m
            scales: dict[str, torch.Tensor] = {}
            g = merge.merge_outer_gradients(lazy, weights, mode=mode, out=new_opt.empty_like_params(), workspace=ws,
                                            deferred_scales=scales)
            new_value = new_opt.step_shared(g, require_finite=True, consume=True, grad_scales=scales)
        g_old = ref.merge_outer_gradients([ref.anchor(d, cur, b) for d, b in zip(deltas, bases, strict=True)],
                                          weights, mode=mode)
        _assert_equal(new_value, old_opt.step(g_old))
        _assert_equal(new_opt.momentum(), old_opt.momentum())
        del g, lazy, ws
        cur = new_value
        versions.append(cur)
        frozen.append({n: t.clone() for n, t in cur.items()})
        for v, kept in zip(versions, frozen, strict=True):  # every version still referenced is intact
            _assert_equal(v, kept)
    assert new_opt.pool.reused > 0


def test_deferred_scales_equal_the_scaled_result_for_every_outer_optimizer():
    gen = torch.Generator().manual_seed(3)
    cur = {"a": torch.randn(300, 7, generator=gen), "b": torch.randn(5, generator=gen)}
    deltas = [{n: torch.randn(t.shape, generator=gen) for n, t in cur.items()} for _ in range(3)]
    lazy = [merge.AnchoredDelta(d, cur, cur) for d in deltas]
    for kind in merge.OUTER_OPTIMIZERS:
        for dtype in (torch.float32, torch.float64):
            plain = merge.make_outer_optimizer(kind, cur, 0.7, 0.9, period=2, dtype=dtype)
            fused = merge.make_outer_optimizer(kind, cur, 0.7, 0.9, period=2, dtype=dtype)
            for _ in range(3):
                scales: dict[str, torch.Tensor] = {}
                g = merge.merge_outer_gradients(lazy, [1.0, 2.0, 3.0], deferred_scales=scales)
                assert set(scales) == {"a", "b"}
                expected = plain.step_shared(merge.merge_outer_gradients(lazy, [1.0, 2.0, 3.0]), consume=True)
                _assert_equal(fused.step_shared(g, consume=kind == "nesterov", grad_scales=scales), expected)
                _assert_equal(fused.momentum(), plain.momentum())


def test_repeated_merges_of_a_fragment_reuse_buffers_and_keep_published_versions_intact():
    """merge_and_publish round after round, adopting each version as the actor does: after a
    warm-up the pool makes no new buffer, and every version kept in RAM keeps its values."""
    torch.manual_seed(1)
    params = {"w": torch.randn(700, 600), "b": torch.randn(600)}
    sc = load_config(None, ["synchronizer.num_fragments=1"]).synchronizer
    store = ObjectStore(f"memory://pool-{id(params)}")
    f = new_fragments(plan_fragments(specs_of(params), 1), params, sc, store)[0]  # as the actor: versions in the store
    published: dict[int, dict[str, torch.Tensor]] = {0: {n: t.clone() for n, t in f.current.items()}}
    allocated = []
    for n in range(1, 9):
        contribs = []
        for i, base in enumerate(sorted({f.version, max(0, f.version - 1)})):
            ann = Announcement(learner_id=f"l{i}", fragment=0, round_n=n, base_version=base, c_steps=4,
                               c_tokens=256, compute_s=1.0, key=f"k/{n}/{i}", nbytes=1, sha256="0" * 64,
                               codec="fp32", update_id=f"u-{n}-{i}")
            contribs.append(Contribution(ann, {k: torch.randn(t.shape) * 1e-2 for k, t in f.current.items()}))
        res = merge_and_publish(store, "r", f, n, contribs, "rda")
        assert res.ok, res.reason
        f.version, f.current, f.momentum, f.outer_steps = res.version, res.new, res.momentum, res.outer_steps
        f.published = res.published
        f.history[f.version], f.refs[f.version] = f.published, res.ref
        for old in [v for v in f.history if v < f.version - sc.max_staleness]:
            del f.history[old]
        published[f.version] = {k: t.clone() for k, t in f.current.items()}
        for v in f.history:
            _assert_equal(f.history[v], published[v])
        allocated.append(f.optimizer.pool.allocated)
    assert allocated[-1] == allocated[-4], allocated  # warm after a few merges: nothing new
    assert f.optimizer.pool.reused > 0


def test_pool_with_a_budget_keeps_at_most_that_many_free_bytes_and_never_an_used_one():
    """The synchronizer's fragments share one pool whose free buffers stay within a budget
    (their memory at rest), trimmed whenever the pool makes a new buffer and after each merge."""
    mib = 1 << 20
    pool = BufferPool(max_free_bytes=2 * mib)
    held = [pool.empty((mib // 4,), torch.float32) for _ in range(4)]  # 4 buffers of 1 MiB, in use
    small = pool.empty((1024,), torch.float32)
    assert pool.trim() == 0 and pool.held_bytes() == 4 * mib + 4096  # none is free: none given back
    held[0].fill_(1.0)
    keep = held[3]
    del held
    assert pool.free_bytes() == 3 * mib
    assert pool.trim() == mib  # 3 MiB free, 2 MiB budget: one buffer given back, the larger sizes first
    assert pool.free_bytes() == 2 * mib and pool.held_bytes() == 3 * mib + 4096
    again = pool.empty((mib // 4,), torch.float32)  # reuses a free one: no new buffer
    assert pool.allocated == 5 and pool.reused == 1
    keep.fill_(2.0)  # the buffer still in use was never closed or handed out
    assert float(keep.sum()) == 2.0 * (mib // 4) and again.data_ptr() != keep.data_ptr()
    del small
    assert pool.free_bytes() == mib + 4096 and pool.trim() == 0
    with pytest.raises(ValueError, match="max_free_bytes"):
        BufferPool(max_free_bytes=-1)


@pytest.mark.parametrize("codec", ["bf16", "int4", "fp32"])
def test_contributions_wait_for_their_merge_as_encoded_and_merge_bit_for_bit_as_decoded(codec):
    """fetch_and_verify keeps a bf16/int4 contribution in its encoding (a fraction of fp32's bytes)
    and an fp32 one decoded; merging those gives the same version, bit for bit, as merging the
    decoded tensors, and the held payload is left as it was for a retry. The float32 norms the
    verification returns are exactly the merge's, and merging with them (as the synchronizer does)
    gives the same version as computing them again."""
    from diloco_async.codec import wire
    from diloco_async.codec.held import EncodedTensors
    from diloco_async.storage.store import ObjectRef
    from diloco_async.sync.work import fetch_and_verify

    torch.manual_seed(2)
    params = {"w": torch.randn(300, 64), "b": torch.randn(64)}
    sc = load_config(None, ["synchronizer.num_fragments=1"]).synchronizer
    store = ObjectStore(f"memory://held-{codec}-{id(params)}")
    shapes = {k: tuple(t.shape) for k, t in params.items()}
    held, decoded, verified_norms = [], [], []
    for i in range(3):
        data = wire.encode_to_bytes({k: torch.randn(s) * 1e-2 for k, s in shapes.items()}, codec)
        ref = store.put(f"c/{i}", data)
        delta, norms, norms32 = fetch_and_verify(store, ObjectRef(ref.key, ref.nbytes, ref.sha256), codec, shapes)
        plain, _ = wire.decode_from_bytes(data, codec, shapes)
        assert norms == pytest.approx({k: float(torch.linalg.vector_norm(t)) for k, t in plain.items()}, rel=1e-5)
        assert set(norms32) == set(plain) and all(
            torch.equal(norms32[k], torch.linalg.vector_norm(t)) and norms32[k].dtype == torch.float32
            for k, t in plain.items())
        verified_norms.append(norms32)
        if codec == "fp32":
            assert isinstance(delta, dict)
        else:
            assert isinstance(delta, EncodedTensors)
            assert delta.nbytes < 0.6 * sum(t.numel() * 4 for t in plain.values())
        held.append(delta)
        decoded.append(plain)
    results = []
    for deltas in (held, decoded):
        f = new_fragments(plan_fragments(specs_of(params), 1), params, sc, store)[0]
        contribs = [Contribution(Announcement(
            learner_id=f"l{i}", fragment=0, round_n=1, base_version=0, c_steps=4, c_tokens=256 * (i + 1),
            compute_s=1.0, key=f"c/{i}", nbytes=1, sha256="0" * 64, codec=codec, update_id=f"u-{i}"), d,
            norms=verified_norms[i] if deltas is held else {})
            for i, d in enumerate(deltas)]
        res = merge_and_publish(store, f"r-{len(results)}", f, 1, contribs, "rda")
        assert res.ok, res.reason
        results.append(res.new)
    _assert_equal(results[0], results[1])
    if codec != "fp32":  # the held payload is unchanged: it decodes to the same tensors again
        for h, plain in zip(held, decoded, strict=True):
            _assert_equal(h.decode(), plain)


def _overflowing_base(cur: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A finite older version whose ``Θcur − Θbase`` overflows to Inf in the last tensor only."""
    base = {n: t - 1e-3 for n, t in cur.items()}
    last = list(cur)[-1]
    base[last] = torch.full_like(cur[last], -3e38)
    return base


def test_merge_and_step_stops_at_a_non_finite_anchored_tensor_and_leaves_the_optimizer_as_it_was():
    torch.manual_seed(5)
    opt = merge.OuterOptimizer({"a": torch.randn(64, 8), "z": torch.full((32,), 3e38)})
    cur = opt.shared_state().params
    before = opt.shared_state()
    lazy = [merge.AnchoredDelta({n: torch.randn(t.shape) * 1e-2 for n, t in cur.items()}, cur, base)
            for base in (cur, _overflowing_base(cur))]
    with pytest.raises(merge.AnchoredNotFinite) as err:
        merge.merge_and_step(opt, lazy, [1.0, 2.0])
    other = {"a": torch.zeros(8, 64), "z": torch.zeros(32)}  # same names and sizes, another shape
    with pytest.raises(ValueError, match="shape of 'a' differs: \\(8, 64\\) vs \\(64, 8\\)"):
        merge.merge_and_step(opt, [merge.AnchoredDelta(other, other, other)], [1.0])
    assert err.value.bad == [{}, {"z": 32}]
    after = opt.shared_state()
    assert after.steps_taken == before.steps_taken == 0 and after.momentum is None
    assert all(after.params[n] is before.params[n] for n in cur)


@pytest.mark.parametrize("case, error, match", [
    ("integer", TypeError, "outer gradient 'a' must be a floating tensor, got torch.int64"),
    ("plain-dict", TypeError, "contribution 0 must be an AnchoredDelta, got dict"),
    ("huge-weights", ValueError, "total weight overflows"),
    ("nan-weight", ValueError, "weight 1 must be finite"),
    ("one-weight-short", ValueError, "2 outer gradients but 1 weights"),
    ("no-contribution", ValueError, "empty list"),
    ("unknown-mode", ValueError, "unknown merge mode 'median'"),
])
def test_merge_and_step_rejects_bad_input_by_name_before_touching_the_optimizer(case, error, match):
    """Bad input to the per-tensor merge is named with the right error type (found by the
    fresh-clone check: integers raised torch's RuntimeError, weights of 1e308 an OverflowError
    from fsum, a dict an AttributeError), and the optimizer is left as it was."""
    opt = merge.OuterOptimizer({"a": torch.randn(16, 8), "b": torch.randn(8)})
    cur = opt.shared_state().params
    before = opt.shared_state()
    good = merge.AnchoredDelta({n: torch.randn(t.shape) for n, t in cur.items()}, cur, cur)
    anchored, weights, mode = [good, good], [1.0, 2.0], "rda"
    if case == "integer":
        anchored = [merge.AnchoredDelta({n: torch.ones(t.shape, dtype=torch.int64) for n, t in cur.items()}, cur, cur)]
        weights = [1.0]
    elif case == "plain-dict":
        anchored, weights = [{n: torch.randn(t.shape) for n, t in cur.items()}], [1.0]
    elif case == "huge-weights":
        weights = [1e308, 1e308]
    elif case == "nan-weight":
        weights = [1.0, float("nan")]
    elif case == "one-weight-short":
        weights = [1.0]
    elif case == "no-contribution":
        anchored, weights = [], []
    else:
        mode = "median"
    with pytest.raises(error, match=match):
        merge.merge_and_step(opt, anchored, weights, mode)
    after = opt.shared_state()
    assert after.steps_taken == 0 and after.momentum is None
    assert all(after.params[n] is before.params[n] for n in cur)


def test_merge_and_publish_drops_a_contribution_whose_anchored_value_overflows_and_merges_the_rest():
    """work.py merges tensor by tensor, checking as it goes; a Δ' that is not finite (found in the
    last tensor, after others were merged) makes it screen again with the checks first, as before:
    that contribution is dropped with its reason, the others merge as if it had never come."""
    torch.manual_seed(6)
    params = {"a": torch.randn(64, 8), "z": torch.full((32,), 3e38)}
    sc = load_config(None, ["synchronizer.num_fragments=1"]).synchronizer
    store = ObjectStore(f"memory://overflow-{id(params)}")
    deltas = [{n: torch.randn(t.shape) * 1e-2 for n, t in params.items()} for _ in range(3)]
    results = []
    for with_bad in (True, False):
        f = new_fragments(plan_fragments(specs_of(params), 1), params, sc, store)[0]
        f.history[7] = _overflowing_base(f.published)
        contribs = [Contribution(Announcement(
            learner_id=f"l{i}", fragment=0, round_n=1, base_version=7 if i == 1 else 0, c_steps=4,
            c_tokens=256 * (i + 1), compute_s=1.0, key=f"c/{i}", nbytes=1, sha256="0" * 64, codec="fp32",
            update_id=f"u-{i}"), d) for i, d in enumerate(deltas) if with_bad or i != 1]
        res = merge_and_publish(store, f"r-{with_bad}", f, 1, contribs, "rda")
        assert res.ok, res.reason
        results.append(res)
    bad, clean = results
    assert bad.merged == ["l0", "l2"] and bad.dropped == [("l1", "ValueError: weight 6.554e+04, non-finite anchored "
                                                                  "tensors ['z']")]
    _assert_equal(bad.new, clean.new)
    _assert_equal(bad.momentum, clean.momentum)


def test_anchored_delta_takes_known_norms_only_where_its_value_is_the_outer_gradient_itself():
    """Norms known from the verification stand for the norm of Δ' only where Δ' is Δ (anchored on
    the current value) and they are 0-dim of Δ's dtype; check_anchored and the merge then use them
    as given (they are never computed again there)."""
    cur = {"a": torch.randn(8, 4), "b": torch.randn(5)}
    old = {n: t + 1 for n, t in cur.items()}
    delta = {n: torch.randn(t.shape) for n, t in cur.items()}
    marked = {"a": torch.tensor(7.0), "b": torch.tensor(9.0)}  # not the true norms: shows which are used
    on_current = merge.AnchoredDelta(delta, cur, dict(cur, b=old["b"]), norms=marked)
    assert set(on_current._norms) == {"a"} and on_current._norms["a"] is marked["a"]
    assert merge.AnchoredDelta(delta, cur, cur, norms={"a": torch.tensor(7.0, dtype=torch.float64)})._norms == {}
    assert merge.check_anchored([on_current]) == [{}]
    assert on_current._norms["a"] is marked["a"]
    assert torch.equal(on_current._norms["b"], torch.linalg.vector_norm(delta["b"] + (cur["b"] - old["b"])))
