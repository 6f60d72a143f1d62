"""The fused C kernels of the merge (diloco_async/kernels/merge_kernels.c, DESIGN §4.5c) against the torch
code they replace, forced with ``merge_native``'s library set to None: the same bits (compared as
integers, so NaNs and signed zeros count) on random and adversarial float32 inputs of odd sizes,
including NaN/Inf and the errors they raise; the fallback when the compiler is missing or broken
or ``DILOCO_NATIVE=0`` (logged with its reason); concurrent builds into one cache directory."""

from __future__ import annotations

import contextlib
import random
import shutil

import pytest
import torch

import diloco_async.merge.buffers as buffers
import diloco_async.merge.core as merge
from diloco_async.kernels import build as native_build
from diloco_async.merge import native as merge_native

SPECIALS = [0.0, -0.0, 1e-45, -1e-45, 1.2e-38, -3e-39, 3e38, -3e38, 1.0, -1.0, 1e-20, 7e19]


@pytest.fixture(scope="module", autouse=True)
def native():
    """The kernels must be there wherever a compiler is (else the comparisons test nothing)."""
    merge_native.reset()
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the merge runs its torch code only")
    assert merge_native.usable(), native_build.unavailable_reason()
    yield
    merge_native.reset()


@contextlib.contextmanager
def torch_code():
    """The merge with the fused kernels switched off (its torch code)."""
    saved = list(merge_native._lib)
    merge_native._lib[:] = [None]
    try:
        yield
    finally:
        merge_native._lib[:] = saved


def _adversarial(n: int, gen: torch.Generator, rng: random.Random, bad: bool = False) -> torch.Tensor:
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 8).clamp(max=1e30)
    for _ in range(max(1, n // 9)):
        x[rng.randrange(n)] = rng.choice(SPECIALS)
    if bad:
        x[rng.randrange(n)] = rng.choice([float("nan"), float("inf"), -float("inf")])
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _same(a, b) -> None:
    if isinstance(a, dict):
        assert list(a) == list(b)
        for n in a:
            assert torch.equal(_bits(a[n]), _bits(b[n])), f"{n}: {int((_bits(a[n]) != _bits(b[n])).sum())} differ"
    else:
        assert torch.equal(_bits(a), _bits(b)), f"{int((_bits(a) != _bits(b)).sum())} elements differ"


def _round(seed: int, bad_at: int | None):
    """One synchronizer round of float32 tensors of odd sizes: current, an older version, M
    outer gradients (half on the older version), weights; with ``bad_at``, the last one gets a
    NaN/Inf."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    sizes = [rng.choice([1, 7, 31, 33, 1001]), 2 * buffers.CHUNK_ELEMENTS + rng.randint(1, 99), rng.randint(40, 5000)]
    cur = {f"t{i}": _adversarial(n, gen, rng) for i, n in enumerate(sizes)}
    older = {k: t + _adversarial(t.numel(), gen, rng) * 1e-3 for k, t in cur.items()}
    m = rng.choice([1, 2, 3, 5])
    deltas = [{k: _adversarial(t.numel(), gen, rng, bad=bad_at is not None and i == m - 1 and k == "t1")
               for k, t in cur.items()}
              for i in range(m)]
    weights = [rng.choice([0.0, 1.0, rng.uniform(0.01, 5e6)]) for _ in range(m)]
    weights[0] = 3.5
    return cur, older, deltas, weights


def _outcome(fn):
    try:
        return fn()
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"


def _merge_round(cur, older, deltas, weights, mode, require_finite):
    """check_anchored, the merge into pool buffers with the deferred scale and the consuming outer
    step, as work.py runs them; returns (bad counts, g or error, new params or error, momentum)."""
    opt = merge.OuterOptimizer(cur)
    opt.step({k: torch.full_like(t, 1e-3) for k, t in cur.items()})
    ws = merge.MergeWorkspace(opt.pool, keep_bytes=sum(t.numel() * 4 for t in cur.values()) // 2)
    anchored = [merge.AnchoredDelta(d, cur, older if i % 2 else cur) for i, d in enumerate(deltas)]
    bad = merge.check_anchored(anchored, workspace=ws)
    scales: dict = {}
    g = _outcome(lambda: merge.merge_outer_gradients(anchored, weights, mode, embedding_names=["t2"],
                                                     out=opt.empty_like_params(), workspace=ws,
                                                     deferred_scales=scales))
    if isinstance(g, str):
        return bad, g, None, None
    g_copy = {k: t.clone() for k, t in g.items()}
    new = _outcome(lambda: opt.step_shared(g, require_finite=require_finite, consume=True, grad_scales=scales))
    return bad, g_copy, {k: v.clone() for k, v in scales.items()}, (new, opt.momentum())


@pytest.mark.parametrize("seed", range(8))
def test_merge_round_same_bits_fused_and_torch(seed, monkeypatch):
    if seed % 2:
        monkeypatch.setattr(buffers, "CHUNK_ELEMENTS", 1000)
    bad_at = 1 if seed % 4 == 3 else None
    args = _round(seed, bad_at)
    mode = "mean" if seed % 3 == 0 else "rda"
    fused = _merge_round(*args, mode, require_finite=seed % 2 == 0)
    with torch_code():
        plain = _merge_round(*args, mode, require_finite=seed % 2 == 0)
    assert fused[0] == plain[0]
    assert bool(fused[0][-1]) == (bad_at is not None)
    for a, b in zip(fused[1:], plain[1:], strict=True):
        if isinstance(a, tuple):
            for x, y in zip(a, b, strict=True):
                assert type(x) is type(y) and (x == y if isinstance(x, str) else _same(x, y) is None)
        elif isinstance(a, str) or a is None:
            assert a == b
        else:
            _same(a, b)


@pytest.mark.parametrize("n", [1, 5, 31, 32, 33, 95, 1000, 65537, 131072 + 77])
def test_kernels_same_bits_as_torch_ops(n):
    gen, rng = torch.Generator().manual_seed(n), random.Random(n)
    xs, curs, bases = ([_adversarial(n, gen, rng) for _ in range(3)] for _ in range(3))
    curs[1] = bases[1] = None
    probs, norms = [0.25, 0.6, 0.15], [3.0, 1e-30, 7e20]
    for divide in (True, False):
        want = torch.zeros(n)
        for x, c, b, p, nj in zip(xs, curs, bases, probs, norms, strict=True):
            src = x if c is None else torch.add(torch.sub(c, b), x)
            want.add_(torch.div(src, torch.tensor(nj)) if divide else src, alpha=p)
        got = merge_native.accumulate(torch.empty(n), xs, curs, bases, norms if divide else None, probs)
        _same(got, want)
    _same(merge_native.anchor_into(torch.empty(n), curs[0], bases[0], xs[0]), torch.sub(curs[0], bases[0]).add_(xs[0]))


def _norm_bits(t: torch.Tensor) -> int:
    return int(t.view(torch.int32))


@pytest.fixture()
def one_thread():
    """One torch thread, as the synchronizer runs (the kernels give norms only then)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("n", [8, 16, 40, 1000, 8192, 2 * 8192 + 24, 131072 + 72, 13, 1001])
@pytest.mark.parametrize("pattern", ["plain-pair", "pair-then-anchored", "anchored-first", "one", "three-plain"])
def test_kernel_norms_are_torchs_and_the_sums_unchanged(n, pattern, one_thread):
    """``want_norm``: the 2-norm the kernels compute as they write their output is
    ``torch.linalg.vector_norm``'s, bit for bit (huge values whose squares overflow included), or
    None where they cannot reproduce it (a size that is not a multiple of torch's lanes); the
    outputs are the torch ops' (the first two plain sources go in one pass, the others one by one)."""
    gen, rng = torch.Generator().manual_seed(n), random.Random(n)
    m = {"one": 1, "three-plain": 3}.get(pattern, 2 if pattern != "pair-then-anchored" else 3)
    xs = [_adversarial(n, gen, rng) for _ in range(m)]
    curs: list = [None] * m
    bases: list = [None] * m
    if pattern in ("pair-then-anchored", "anchored-first"):
        k = 2 if pattern == "pair-then-anchored" else 0
        curs[k], bases[k] = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    probs, norms = [0.25, 0.6, 0.15][:m], [3.0, 1e-30, 7e20][:m]
    lanes = merge_native.norm_lanes()
    assert lanes in (8, 16)
    for divide in (True, False):
        want = torch.zeros(n)
        for x, c, b, p, nj in zip(xs, curs, bases, probs, norms, strict=True):
            src = x if c is None else torch.add(torch.sub(c, b), x)
            want.add_(torch.div(src, torch.tensor(nj)) if divide else src, alpha=p)
        got, norm = merge_native.accumulate(torch.empty(n), xs, curs, bases, norms if divide else None, probs,
                                            want_norm=True)
        _same(got, want)
        if n % lanes:
            assert norm is None
        else:
            assert _norm_bits(norm) == _norm_bits(torch.linalg.vector_norm(want))
    cur, base = torch.randn(n, generator=gen), _adversarial(n, gen, rng)
    out, norm = merge_native.anchor_into(torch.empty(n), cur, base, xs[0], want_norm=True)
    _same(out, torch.sub(cur, base).add_(xs[0]))
    assert norm is None if n % lanes else _norm_bits(norm) == _norm_bits(torch.linalg.vector_norm(out))


def test_kernel_norms_only_on_one_thread(one_thread):
    """With more than one torch thread the kernels may split their work, so they give no norm
    (the merge then takes torch's); the merged values are the same."""
    x, y = torch.randn(4096), torch.randn(4096)
    torch.set_num_threads(2)
    assert merge_native.norm_lanes() == 0
    out, norm = merge_native.accumulate(torch.empty(4096), [x, y], [None, None], [None, None], [2.0, 5.0],
                                        [0.5, 0.5], want_norm=True)
    assert norm is None
    torch.set_num_threads(1)
    again, norm = merge_native.accumulate(torch.empty(4096), [x, y], [None, None], [None, None], [2.0, 5.0],
                                          [0.5, 0.5], want_norm=True)
    _same(again, out)
    assert _norm_bits(norm) == _norm_bits(torch.linalg.vector_norm(out))


@pytest.mark.parametrize("case", ["finite", "nan-grad", "inf-result", "overflow-then-nan", "nan-then-overflow"])
@pytest.mark.parametrize("require_finite", [True, False])
@pytest.mark.parametrize("consume", [True, False])
def test_outer_step_errors_and_bits_as_torch(case, require_finite, consume, monkeypatch):
    """Non-finite values in different chunks: the same error (or refusal) and, when it steps, the
    same bits, whichever chunk comes first."""
    monkeypatch.setattr(buffers, "CHUNK_ELEMENTS", 64)
    gen, rng = torch.Generator().manual_seed(7), random.Random(7)
    def tame(n):  # finite results unless a case puts a NaN/Inf or a huge value in
        x = torch.randn(n, generator=gen)
        for _ in range(n // 9):
            x[rng.randrange(n)] = rng.choice(SPECIALS[:6])
        return x

    params = {"w": tame(64 * 5 + 13), "b": tame(17)}
    g = {k: tame(t.numel()).view(t.shape) * 1e-3 for k, t in params.items()}
    if case in ("nan-grad", "nan-then-overflow"):
        g["w"][64 * 3 + 5] = float("nan")
    if case == "inf-result":
        g["w"][64 * 2 + 1] = 3e38
    if case == "overflow-then-nan":
        g["w"][64 * 1 + 9] = 3e35  # finite, also times the scale; the result overflows
        g["w"][64 * 4 + 2] = float("nan")
    if case == "nan-then-overflow":
        g["w"][64 * 4 + 60] = -3e35

    def run():
        opt = merge.OuterOptimizer(params, lr=0.7, momentum=0.9)
        opt.step({k: torch.full_like(t, 1e-3) for k, t in params.items()})
        mine = {k: t.clone() for k, t in g.items()}
        scales = {"w": torch.tensor(1.0e3)}
        out = _outcome(lambda: opt.step_shared(mine, require_finite=require_finite, consume=consume,
                                               grad_scales=scales))
        return out, opt.params(), opt.momentum(), opt.steps_taken

    fused = run()
    with torch_code():
        plain = run()
    assert type(fused[0]) is type(plain[0])
    if isinstance(fused[0], str):
        assert fused[0] == plain[0]
    else:
        _same(fused[0], plain[0])
    _same(fused[1], plain[1])
    _same(fused[2], plain[2])
    assert fused[3] == plain[3]
    if case != "finite":
        assert isinstance(fused[0], str), "a non-finite step must be refused"


def test_norm_lanes_fall_back_to_the_width_torch_folds(one_thread, monkeypatch):
    """Torch does not always fold its float32 norm at its CPU capability's width (8 lanes on an
    AMD EPYC it reports as AVX512): the check tries that width first, then the others, and
    takes the one whose norm is torch's; none of them: 0 (the callers take torch's norm)."""
    merge_native.reset()
    found = merge_native.norm_lanes()
    assert found in (8, 16)
    cap = torch.backends.cpu.get_cpu_capability()
    try:
        monkeypatch.setattr(merge_native, "NORM_LANES", {cap: 4, "OTHER": found})
        merge_native.reset()
        assert merge_native.norm_lanes() == found  # 4 first (not torch's), then the width that is
        monkeypatch.setattr(merge_native, "NORM_LANES", {cap: 4})
        merge_native.reset()
        assert merge_native.norm_lanes() == 0
    finally:
        monkeypatch.undo()
        merge_native.reset()
