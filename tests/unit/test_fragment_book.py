"""The fragment book over the whole fragment plan and over a subset of it (issue 40 item 5): a book
of some fragments holds exactly those, each as the whole book holds it, and merges them to the
same versions bit for bit."""

from __future__ import annotations

import uuid

import pytest
import torch

from diloco_async.config.schema import load_config
from diloco_async.merge.buffer_pool import SMALL_SPARE_BYTES
from diloco_async.policy.fragments import plan_fragments, specs_of
from diloco_async.protocol.messages import Announcement
from diloco_async.storage.store import ObjectStore
from diloco_async.sync.fragment_book import FragmentBook
from diloco_async.sync.state import MERGE_POOL_FRAGMENTS, Contribution
from diloco_async.sync.work import merge_and_publish


def _model() -> tuple[dict[str, torch.Tensor], object]:
    torch.manual_seed(0)
    # fragments of 168, 144, 168 and 168 elements (t5; t4; t0 and t3; t1 and t2): fragment 1 is the smallest
    params = {f"t{i}": torch.randn(8 + 4 * i, 6) for i in range(6)}
    sc = load_config(None, ["synchronizer.num_fragments=4"]).synchronizer
    return params, sc


def _contribution(lid: str, p: int, shapes: dict, seed: int) -> Contribution:
    g = torch.Generator().manual_seed(seed)
    ann = Announcement(learner_id=lid, fragment=p, round_n=1, base_version=0, c_steps=4, c_tokens=4 * 64,
                       compute_s=1.0, key=f"k/{lid}", nbytes=1, sha256="0" * 64, codec="fp32", update_id=f"u-{lid}")
    return Contribution(ann, {n: torch.randn(s, generator=g) * 1e-2 for n, s in shapes.items()})


def test_a_book_of_some_fragments_holds_them_as_the_whole_book_does():
    params, sc = _model()
    plan = plan_fragments(specs_of(params), 4)
    whole = FragmentBook.build(plan, params, sc)
    part = FragmentBook.build(plan, params, sc, indices=[3, 1])
    assert whole.indices == (0, 1, 2, 3) and len(whole) == 4
    assert part.indices == (1, 3) and [f.p for f in part] == [1, 3] and len(part) == 2
    assert 1 in part and 0 not in part and part.get(0) is None
    with pytest.raises(KeyError):
        part[0]
    assert part.versions() == {1: 0, 3: 0}
    assert set(part.numel()) == set(plan.names(1)) | set(plan.names(3))
    for p in part.indices:
        a, b = whole[p], part[p]
        assert (a.names, a.shapes, a.share, a.embedding_names) == (b.names, b.shapes, b.share, b.embedding_names)
        for n in a.names:
            assert torch.equal(a.current[n], b.current[n]) and torch.equal(a.momentum[n], b.momentum[n])
    # the merge pool of a book's optimizers is sized by the largest fragment it holds (fp32 bytes)
    assert part[1].optimizer.pool is part[3].optimizer.pool
    assert part[1].optimizer.pool.max_free_bytes == MERGE_POOL_FRAGMENTS * 168 * 4 + SMALL_SPARE_BYTES
    alone = FragmentBook.build(plan, params, sc, indices=[1])  # the smallest fragment alone
    assert alone[1].optimizer.pool.max_free_bytes == MERGE_POOL_FRAGMENTS * 144 * 4 + SMALL_SPARE_BYTES


def test_a_fragment_merges_to_the_same_version_in_a_book_of_some_fragments():
    params, sc = _model()
    plan = plan_fragments(specs_of(params), 4)
    results = []
    for indices in (None, [3]):
        book = FragmentBook.build(plan, params, sc, indices=indices)
        f = book[3]
        contribs = [_contribution(lid, 3, f.shapes, seed) for seed, lid in enumerate("abc")]
        store = ObjectStore(f"memory://book-{uuid.uuid4().hex}")
        res = merge_and_publish(store, "run1", f, 1, contribs, sc.merge)
        assert res.ok, res.reason
        book.adopt(f, res, sc.max_staleness)
        assert f.current is res.new and f.momentum is res.momentum and f.outer_steps == 1
        assert f.history[1] is res.new and f.refs[1] == res.ref and not f.busy
        results.append((f.version, {n: t.clone() for n, t in f.current.items()},
                        {n: t.clone() for n, t in f.momentum.items()}, res.ref.sha256))
    (v0, cur0, mom0, sha0), (v1, cur1, mom1, sha1) = results
    assert v0 == v1 == 1 and sha0 == sha1  # the same published object, byte for byte
    assert all(torch.equal(cur0[n], cur1[n]) and torch.equal(mom0[n], mom1[n]) for n in cur0)


@pytest.mark.parametrize("indices", [[], [4], [-1], [0, 7]])
def test_a_book_refuses_indices_outside_the_plan(indices):
    params, sc = _model()
    plan = plan_fragments(specs_of(params), 4)
    with pytest.raises(ValueError, match=r"fragment indices \[.*\] are not a non-empty subset of the plan's 4"):
        FragmentBook.build(plan, params, sc, indices=indices)


def test_a_book_refuses_a_fragment_held_twice():
    params, sc = _model()
    plan = plan_fragments(specs_of(params), 4)
    f = FragmentBook.build(plan, params, sc, indices=[2])[2]
    with pytest.raises(ValueError, match="fragment index 2"):
        FragmentBook(plan, [f, f])


def test_persistence_restores_a_book_of_some_fragments_from_a_checkpoint_of_the_whole_run():
    """persistence takes the actor's components, not the actor: a checkpoint written from the
    components of a synchronizer over the whole plan restores a book over fragment 1 alone (with a
    round table, learner registry, reporter and checkpoint book of its own)."""
    import asyncio

    from diloco_async.storage.checkpoint import latest_checkpoint, write_checkpoint
    from diloco_async.sync import persistence
    from diloco_async.sync.context import ActorContext
    from diloco_async.sync.learners import LearnerRegistry
    from diloco_async.sync.lifecycle import Lifecycle
    from diloco_async.sync.reporting import Reporter
    from diloco_async.sync.rounds import RoundTable
    from diloco_async.sync.state import Broadcaster, CheckpointBook, initial_state

    cfg = load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8",
                             "synchronizer.num_fragments=2"])
    store = ObjectStore(f"memory://book-{uuid.uuid4().hex}")

    def components(indices):
        ctx = ActorContext(cfg, "run1", uuid.uuid4().hex[:12], store, 0, lambda: 100.0, 100.0, asyncio.Queue(),
                           lambda coro: coro.close())
        params, plan = initial_state(cfg)
        book = FragmentBook.build(plan, params, cfg.synchronizer, store, indices)
        registry, report = LearnerRegistry(), Reporter(100.0, "run1")
        table = RoundTable(ctx, book, registry, report, Broadcaster(), Lifecycle())
        return ctx, book, table, registry, report

    ctx, book, table, registry, report = components(None)
    persistence.publish_initial(ctx, book)
    f = book[1]  # one merged round of fragment 1, as the round table runs it
    book.begin_round(f, 1)
    res = merge_and_publish(store, "run1", f, 1, [_contribution(lid, 1, f.shapes, seed) for seed, lid in
                                                  enumerate("ab")], cfg.synchronizer.merge)
    assert res.ok, res.reason
    book.adopt(f, res, cfg.synchronizer.max_staleness)
    book.end_round(f)
    report.counters["merges"] += 1
    table.g = 7
    tensors, manifest = persistence.checkpoint_payload(ctx, book=book, table=table, registry=registry, report=report)
    write_checkpoint(store, "run1", 1, tensors, manifest)
    report.close()

    ctx2, part, table2, registry2, report2 = components([1])
    checkpoints = CheckpointBook(100.0)
    persistence.restore(latest_checkpoint(store, "run1"), ctx2, book=part, table=table2, registry=registry2,
                        report=report2, checkpoints=checkpoints)
    report2.close()
    assert part.indices == (1,) and part.versions() == {1: 1} and part[1].next_round == 2
    assert all(torch.equal(part[1].current[n], f.current[n]) and torch.equal(part[1].momentum[n], f.momentum[n])
               for n in f.names)
    assert part[1].optimizer.steps_taken == 1 and part[1].refs[1] == res.ref
    assert table2.g == 7 and report2.counters["merges"] == 1 and checkpoints.resumed_from == 1
