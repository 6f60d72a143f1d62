"""`make bench-wan`, last step: the bars of issue 13 from the reports of ``diloco-async wan --out``.

* time to target: DDP's time to its own final held-out loss / Decoupled DiLoCo's time to it, over
  the same shaped links (the wan-4-regions run): >= 10;
* bytes on the wire per token, uploads plus downloads: DDP's fp32 ring all-reduce of the same
  model (2 x 2 (N - 1) / N x fp32 bytes per worker-token, or DDP's measured wire bytes when fewer)
  / Decoupled DiLoCo's measured bytes per token (mean of the compressed runs): >= 150;
* ... at a held-out loss within 2% of the bf16-up / fp32-down runs at equal tokens (means of the
  seeds; each mean's 95% interval in the detail): compressed / bf16-fp32 <= 1.02;
* learner tokens/s over links that carry one fragment per H/P steps comfortably / the same run
  unshaped (loopback, no namespaces): >= 0.95, from :mod:`benchmarks.wan_tokens` (shaped and
  unshaped runs interleaved ABBA, same seed and budget, steady-state tokens/s): the ratio of the
  two series' means, with both series and the per-pair ratios' 95% interval in the detail.

Exit status 1 when a bar is missed or a figure is missing.

Usage: python -m benchmarks.wan_bars MAIN.json --compressed A.json [B.json ...] --baseline X.json [...]
       --tokens-ab T.json [--equal-tokens N]
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.args import description
from benchmarks.bars import Bar, print_bars
from benchmarks.stats import mean_interval
from diloco_async.chaos.measure import eval_at

__all__ = ["wan_bars", "main"]


def _row(report: dict, method: str) -> dict | None:
    return next((r for r in report["rows"] if r["method"] == method), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _losses(reports: list[dict], tokens: float) -> list[float]:
    """Held-out loss of each report's decoupled run at ``tokens`` (runs that never got there left out)."""
    out = []
    for rep in reports:
        row = _row(rep, "decoupled")
        if row and row.get("eval_curve"):
            loss = eval_at(row["eval_curve"], tokens)[1]
            if loss is not None:
                out.append(loss)
    return out


def _codec_bars(main: dict, compressed: list[dict], baseline: list[dict], equal_tokens: float) -> list[Bar]:
    ddp = _row(main, "ddp")
    ring = main["ddp_ring_bytes_per_token"]
    ref = min(ring, ddp["bytes_per_token"]) if ddp and ddp.get("bytes_per_token") else ring
    per_token = [r["bytes_per_token"] for r in (_row(x, "decoupled") for x in compressed) if r]
    bpt = mean_interval(per_token) if per_token else None
    bytes_bar = Bar("bytes/token up+down: DDP fp32 ring / decoupled", _ratio(ref, bpt[0] if bpt else None), 150.0,
                    detail=(f"DDP ring {ring:.0f}, DDP measured "
                            f"{ddp['bytes_per_token']:.0f} B/token; " if ddp else f"DDP ring {ring:.0f} B/token; ")
                    + (f"decoupled {bpt[0]:.1f} +- {bpt[1]:.1f} over {len(per_token)} runs" if bpt else "no runs"))
    lc, lb = _losses(compressed, equal_tokens), _losses(baseline, equal_tokens)
    mc, mb = (mean_interval(lc) if lc else None), (mean_interval(lb) if lb else None)
    complete = len(lc) == len(compressed) and len(lb) == len(baseline) and mc and mb
    loss_bar = Bar(f"held-out loss @ {equal_tokens:,.0f} tokens: compressed / bf16-fp32",
                   _ratio(mc[0], mb[0]) if complete else None, 1.02, kind="max",
                   detail=(f"compressed {mc[0]:.4f} +- {mc[1]:.4f} (n={len(lc)}), bf16-up/fp32-down "
                           f"{mb[0]:.4f} +- {mb[1]:.4f} (n={len(lb)})") if mc and mb else "a run never got there")
    return [bytes_bar, loss_bar]


def _tokens_bar(main: dict, dec: dict | None, ab: dict | None) -> Bar:
    """Shaped / unshaped learner tokens/s from :mod:`benchmarks.wan_tokens`'s report ``ab``."""
    needed = (f"; needed {dec['needed_mbit']:.2f} Mbit/s of {min(x['up_mbit'] for x in main['links']):g}"
              if dec else "")
    if not ab:
        return Bar("learner tokens/s: shaped / unshaped (ABBA)", None, 0.95, detail="no ABBA report" + needed)
    series = "; ".join(f"{k} " + ", ".join("n/a" if x is None else f"{x:.0f}" for x in ab[f"{k}_tokens_per_s"])
                       for k in ("shaped", "unshaped"))
    interval = (f"; per-pair ratio {ab['pair_ratio_mean']:.3f} +- {ab['pair_ratio_halfwidth']:.3f}"
                if ab.get("pair_ratio_mean") is not None else "")
    return Bar(f"learner tokens/s: shaped / unshaped (ABBA, {ab['pairs']} pairs)", ab.get("ratio_of_means"), 0.95,
               detail=f"tokens/s per learner, {series}{interval}{needed}")


def wan_bars(main: dict, compressed: list[dict], baseline: list[dict], tokens_ab: dict | None,
             equal_tokens: float) -> list[Bar]:
    """The bars (module docstring) from the reports of ``diloco-async wan --out``: ``main`` (the
    scenario's run with every method), ``compressed`` and ``baseline`` (decoupled runs per seed,
    the scenario's codecs and bf16-up/fp32-down), and ``tokens_ab``, the report of
    :mod:`benchmarks.wan_tokens` (interleaved shaped and unshaped decoupled runs)."""
    ddp, dec, sync = _row(main, "ddp"), _row(main, "decoupled"), _row(main, "sync-diloco")
    target = dec["target_loss"] if dec else None
    out = [Bar("time to DDP's final loss: DDP / decoupled",
               _ratio(ddp and ddp["time_to_target_s"], dec and dec["time_to_target_s"]), 10.0,
               detail=f"target {target:.4f}" if target else "no target")]
    if sync:
        out.append(Bar("time to DDP's final loss: DDP / sync-diloco (shown)",
                       _ratio(ddp and ddp["time_to_target_s"], sync["time_to_target_s"]), 0.0, shown=True))
    out += _codec_bars(main, compressed, baseline, equal_tokens)
    out.append(_tokens_bar(main, dec, tokens_ab))
    if ddp and dec:
        out.append(Bar("link rate needed to keep learners busy: DDP / decoupled (shown)",
                       _ratio(ddp["needed_mbit"], dec["needed_mbit"]), 0.0, shown=True,
                       detail=f"DDP {ddp['needed_mbit']:.1f} Mbit/s, decoupled {dec['needed_mbit']:.2f} Mbit/s"))
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.wan_bars", description=description(__doc__))
    ap.add_argument("main")
    ap.add_argument("--compressed", nargs="+", required=True)
    ap.add_argument("--baseline", nargs="+", required=True)
    ap.add_argument("--tokens-ab", required=True, help="the report of benchmarks.wan_tokens (ABBA tokens/s)")
    ap.add_argument("--equal-tokens", type=float, default=1_000_000.0)
    a = ap.parse_args(argv)

    def load(p: str) -> dict:
        return json.loads(open(p).read())

    bars = wan_bars(load(a.main), [load(p) for p in a.compressed], [load(p) for p in a.baseline],
                    load(a.tokens_ab), a.equal_tokens)
    return print_bars(bars, title="bench-wan (issue 13)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
