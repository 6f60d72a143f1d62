"""`make bench-wan`, the tokens/s step: learner tokens/s over shaped links against the same run
unshaped, measured so that the machine's load of the moment cancels (issue 13: "with links shaped
to carry comfortably one fragment per H/P steps, learner tokens/s >= 0.95 of the unshaped run").

Decoupled DiLoCo runs of the WAN scenario, shaped (the scenario's namespaces and links, built and
verified once) and unshaped (the same processes on loopback, moto on loopback), interleaved in
ABBA order (pair k: shaped then unshaped for even k, unshaped then shaped for odd k), every run
with the same seed and the same short token budget, one right after the other: slow drifts of the
machine's load hit both kinds alike.

Each run's figure is its learners' **steady-state** tokens/s (:func:`steady_tokens_per_s`): the
window from the moment every learner has done its first ``skip`` of steps (start-up, first
downloads, compilation of nothing but still cold caches) to the moment the first learner did its
last step (after that the survivors get more CPU), each learner's tokens in that window over the
window's span, the mean over learners. The result: both series, the ratio of their means, and the
95% interval of the per-pair ratios.

Usage: python -m benchmarks.wan_tokens [--scenario FILE] [--pairs 2] [--tokens 400000] [--seed 0]
       [--set KEY=VALUE ...] --out FILE      (needs root, like every shaped WAN run)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.args import description
from benchmarks.stats import mean_interval
from diloco_async.metrics.timeline import Timeline

__all__ = ["steady_tokens_per_s", "abba_order", "summarize", "run_abba", "main"]


def abba_order(pairs: int) -> list[str]:
    """``["shaped", "unshaped", "unshaped", "shaped", ...]``: ``pairs`` pairs, alternating which
    kind goes first. Raises ValueError for ``pairs`` < 1."""
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    return [k for i in range(pairs) for k in (("shaped", "unshaped") if i % 2 == 0 else ("unshaped", "shaped"))]


def steady_tokens_per_s(tl: Timeline, skip: float = 0.25) -> float | None:
    """Mean over learners of tokens per second in the steady window (module docstring): the
    window opens once every learner finished the first ``skip`` (a fraction) of its steps and
    closes when the first learner finished its last step; a learner's rate is the tokens of its
    steps inside the window over the span from the first one's start to the last one's end.
    None when a learner has no step inside the window (a run too short to measure)."""
    by: dict[str, list] = {}
    for st in tl.steps:
        by.setdefault(st.learner, []).append(st)
    if not by:
        return None
    for steps in by.values():
        steps.sort(key=lambda st: st.t0)
    opens = max(steps[min(len(steps) - 1, int(len(steps) * skip))].t0 for steps in by.values())
    closes = min(steps[-1].t1 for steps in by.values())
    rates = []
    for steps in by.values():
        inside = [st for st in steps if st.t0 >= opens and st.t1 <= closes]
        span = (inside[-1].t1 - inside[0].t0) if inside else 0.0
        if span <= 0:
            return None
        rates.append(sum(st.tokens for st in inside) / span)
    return statistics.fmean(rates)


def summarize(runs: list[dict]) -> dict:
    """Both series (run order), the ratio of their means and the per-pair ratios with their 95%
    interval, from ``runs`` (``{"kind", "pair", "tokens_per_s"}`` each; None figures drop their pair)."""
    shaped = [r["tokens_per_s"] for r in runs if r["kind"] == "shaped"]
    unshaped = [r["tokens_per_s"] for r in runs if r["kind"] == "unshaped"]
    pairs: dict[int, dict[str, float | None]] = {}
    for r in runs:
        pairs.setdefault(r["pair"], {})[r["kind"]] = r["tokens_per_s"]
    ratios = [p["shaped"] / p["unshaped"] for p in pairs.values()
              if p.get("shaped") is not None and p.get("unshaped")]
    complete = len(ratios) == len(pairs) and len(pairs) > 0
    out: dict = {"shaped_tokens_per_s": shaped, "unshaped_tokens_per_s": unshaped, "pair_ratios": ratios,
                 "ratio_of_means": None, "pair_ratio_mean": None, "pair_ratio_halfwidth": None}
    if complete:
        out["ratio_of_means"] = statistics.fmean(shaped) / statistics.fmean(unshaped)
        out["pair_ratio_mean"], out["pair_ratio_halfwidth"] = mean_interval(ratios)
    return out


def _scenario(path: str, tokens: int, overrides: list[str]):
    from diloco_async.chaos.scenario import check_user_overrides
    from diloco_async.wan.scenario import load_wan_scenario

    sc = load_wan_scenario(path)
    check_user_overrides(sc, overrides)
    return sc.model_copy(update={"budget": sc.budget.model_copy(update={"tokens": int(tokens)}),
                                 "scenario": sc.scenario.model_copy(
                                     update={"overrides": [*sc.scenario.overrides, *overrides]})})


def run_abba(scenario: str, pairs: int, tokens: int, seed: int, overrides: list[str]) -> dict:
    """Run the interleaved Decoupled DiLoCo runs (module docstring); returns the report
    (``runs`` in order with their figures, :func:`summarize`'s figures, the links as verified).

    Raises:
        RuntimeError: not root / no ``tc`` (the reason), or a run's processes failed.
        LinkRateError: a link failed its verification.
    """
    import torch

    from diloco_async.config.schema import load_config
    from diloco_async.data.sources import corpus_urls
    from diloco_async.metrics.evaluation import heldout_batches
    from diloco_async.wan.methods import run_method
    from diloco_async.wan.place import placement
    from diloco_async.wan.scenario import wan_config

    sc = _scenario(scenario, tokens, overrides)
    base = load_config(sc.scenario.config, list(sc.scenario.overrides))  # the one parse of the recipe
    cfg = wan_config(sc, "decoupled", base, seed)
    corpus_urls(cfg.data)  # the corpus on disk before any learner starts (no Prefect: not a flow)
    batches = heldout_batches(cfg)[:1]  # the loss curve is not this benchmark's figure: one batch
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    runs: list[dict] = []
    with placement(sc, shaped=True) as shaped, placement(sc, shaped=False) as unshaped:
        for i, kind in enumerate(abba_order(pairs)):
            t0 = time.time()
            wire, run = run_method(sc, "decoupled", base, shaped if kind == "shaped" else unshaped, batches, seed)
            runs.append({"kind": kind, "pair": i // 2, "tokens_per_s": steady_tokens_per_s(run.timeline),
                         "tokens_per_s_whole_run": wire.tokens_per_s_per_learner, "tokens": wire.tokens,
                         "t_start_unix": t0, "wall_s": time.time() - t0})
            print(f"run {i + 1}/{2 * pairs} {kind}: {runs[-1]['tokens_per_s'] or float('nan'):.0f} tokens/s per "
                  f"learner (steady), {wire.tokens_per_s_per_learner:.0f} (whole run), {runs[-1]['wall_s']:.0f} s",
                  file=sys.stderr, flush=True)
        verified = dict(shaped.net.verified)
    return {"scenario": sc.scenario.name, "seed": seed, "tokens": int(tokens), "pairs": pairs,
            "links": [dict(zip(("region", "up_mbit", "down_mbit", "delay_ms"), x, strict=True))
                      for x in sc.link_settings()], "verified": verified, "runs": runs, **summarize(runs)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.wan_tokens", description=description(__doc__))
    ap.add_argument("--scenario", default="configs/wan/wan-4-regions.toml")
    ap.add_argument("--pairs", type=int, default=2, help="shaped/unshaped pairs, ABBA order (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=400_000, help="token budget of every run (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", required=True, metavar="FILE")
    a = ap.parse_args(argv)
    if a.pairs < 2:
        print("error: --pairs must be >= 2 (an interval needs two pairs)", file=sys.stderr)
        return 2
    rep = run_abba(a.scenario, a.pairs, a.tokens, a.seed, a.set)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rep, indent=1))
    fmt = lambda xs: ", ".join("n/a" if x is None else f"{x:.0f}" for x in xs)  # noqa: E731
    print(f"shaped tokens/s per learner (run order):   {fmt(rep['shaped_tokens_per_s'])}")
    print(f"unshaped tokens/s per learner (run order): {fmt(rep['unshaped_tokens_per_s'])}")
    if rep["ratio_of_means"] is not None:
        print(f"shaped / unshaped: ratio of means {rep['ratio_of_means']:.3f}; per-pair ratios "
              f"{', '.join(f'{r:.3f}' for r in rep['pair_ratios'])}: {rep['pair_ratio_mean']:.3f} "
              f"+- {rep['pair_ratio_halfwidth']:.3f} (95%)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
