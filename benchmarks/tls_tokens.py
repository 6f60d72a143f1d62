"""`make bench-tls`: a learner's tokens/s in a run whose synchronizer serves mutual TLS, against
the same run in ``direct`` mode (plain HTTP), both measured in this process's session.

Each pair runs the recipe with one learner twice, ``direct`` and ``tls`` (HTTPS and WSS with a
run CA, the learner's client certificate checked: ``network.client_ca``; certificates from
:func:`flows.certs.make_run_certificates`), in alternating order (direct first in even pairs, tls
first in odd ones), so a drift of the machine's load falls on both sides. Tokens/s of each run come
from the learner's timeline (:func:`benchmarks.hf_learner.in_run_tokens_per_s`: everything between
two steps, the comms thread's TLS work included, counts against the learner).

Bar: tls / direct tokens/s >= 0.98, on the mean of the pairs' ratios, printed with its 95%
t-interval. Exit status 1 on a miss.

Usage: python -m benchmarks.tls_tokens [--config configs/default.toml] [--run-s 60] [--pairs 3]
       [--set section.field=value ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.args import description, non_negative_int, positive_float, positive_int
from benchmarks.bars import Bar, print_bars
from benchmarks.hf_learner import in_run_tokens_per_s
from benchmarks.stats import mean_interval
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config, load_config
from flows.certs import make_run_certificates

GOAL = 0.98


def tls_config(cfg: Config, certs: Path) -> Config:
    """``cfg`` in mode ``tls`` with mutual TLS, its certificates made under ``certs``."""
    paths = make_run_certificates(certs, [cfg.synchronizer.host], ["learner-0"], days=1)
    return with_fields(cfg, {"network.mode": "tls", "network.server_cert": str(paths["server_cert"]),
                             "network.server_key": str(paths["server_key"]), "network.ca": str(paths["ca"]),
                             "network.client_ca": str(paths["ca"]), "network.client_certs": str(paths["client_certs"])})


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tls_tokens", description=description(__doc__))
    ap.add_argument("--config", default="configs/default.toml")
    ap.add_argument("--run-s", type=positive_float, default=60.0, help="wall seconds of each run (budget.wall_s)")
    ap.add_argument("--warmup-steps", type=non_negative_int, default=5)
    ap.add_argument("--pairs", type=positive_int, default=3, help="interleaved (direct, tls) pairs, for an interval")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="a recipe setting for both modes (repeatable)")
    args = ap.parse_args(argv)
    try:  # a bad --set or recipe is the command line's error, before anything starts
        cfg = load_config(args.config, args.overrides)
    except (OSError, ValueError) as err:
        ap.error(str(err))
    t0 = time.monotonic()
    ratios, by_mode = [], {"direct": [], "tls": []}
    with tempfile.TemporaryDirectory() as tmp:
        modes = {"direct": cfg, "tls": tls_config(cfg, Path(tmp) / "certs")}
        for pair in range(args.pairs):
            order = ["direct", "tls"] if pair % 2 == 0 else ["tls", "direct"]
            got = {}
            for mode in order:
                got[mode], steps = in_run_tokens_per_s(modes[mode], Path(tmp) / f"{mode}-{pair}", args.run_s,
                                                       args.warmup_steps)
                print(f"[{pair}] {mode:6s} {got[mode]:9.1f} tokens/s over {steps} steps", flush=True)
                by_mode[mode].append(got[mode])
            ratios.append(got["tls"] / got["direct"])
    ratio, half = mean_interval(ratios)
    shown = ", ".join(f"{r:.3f}" for r in ratios)
    print(f"({time.monotonic() - t0:.0f} s)")
    return print_bars([
        Bar("learner tokens/s, direct (mean)", sum(by_mode["direct"]) / args.pairs, 0.0, shown=True),
        Bar("learner tokens/s, tls + mTLS (mean)", sum(by_mode["tls"]) / args.pairs, 0.0, shown=True),
        Bar("learner tokens/s, tls + mTLS / direct", ratio, GOAL,
            detail=f"mean of {args.pairs} interleaved pairs +- {half:.3f} (95%): {shown}"),
    ], title="make bench-tls: bars")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
