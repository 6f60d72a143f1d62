"""benchmarks/codec_store.py in quick mode: it measures every row it promises, with the goals of
issue 17 item 4 (no speed is judged here; `make bench` does that)."""

from __future__ import annotations

import math

from benchmarks import codec_store


def test_the_sha256_bound_overlaps_each_hash_with_its_own_io_only():
    phases = {"write": 0.046, "read": 0.036, "unlink": 0.014}  # raw: 96 ms
    # hashing slower than both: the put and the get each take a hash's time at best
    assert math.isclose(codec_store._sha256_bound(0.096, phases, 0.056), 0.096 / (0.056 + 0.056 + 0.014))
    # hashing faster than both: fully hidden, the store could match raw I/O
    assert math.isclose(codec_store._sha256_bound(0.096, phases, 0.020), 1.0)
    # between the two: hidden behind the write, not behind the read
    assert math.isclose(codec_store._sha256_bound(0.096, phases, 0.040), 0.096 / (0.046 + 0.040 + 0.014))


def test_the_order_changes_so_that_no_side_always_runs_first():
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("raw", "store")}
    best = codec_store._best_of_alternating(fns, repeat=6)
    assert sorted(best) == ["raw", "store"] and all(t >= 0 for t in best.values())
    firsts = calls[0::2]
    assert sorted(calls) == ["raw"] * 6 + ["store"] * 6
    assert [firsts[i] != firsts[i + 1] for i in range(0, 6, 2)] == [True] * 3  # each pair: both orders
    calls.clear()
    many = {name: (lambda name=name: calls.append(name)) for name in "abcdef"}
    codec_store._best_of_alternating(many, repeat=20)
    orders = {tuple(calls[i: i + 6]) for i in range(0, 120, 6)}
    assert len(orders) >= 10 and all(sorted(o) == list("abcdef") for o in orders)
