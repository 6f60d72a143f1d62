"""`make bench-tls`: a learner's tokens/s in a run whose synchronizer serves mutual TLS, against
the same run in ``direct`` mode (plain HTTP), both measured in this process's session.

Each pair runs the recipe with one learner twice, ``direct`` and ``tls`` (HTTPS and WSS with a
run CA, the learner's client certificate checked: ``network.client_ca``; certificates from
:func:`diloco_async.flows.certs.make_run_certificates`), in alternating order (direct first in even pairs, tls
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
from pathlib import Path

from benchmarks.args import description, non_negative_int, positive_float, positive_int
from benchmarks.paired_runs import paired_tokens_per_s
from diloco_async.config.resolved import with_fields
from diloco_async.config.schema import Config, load_config
from diloco_async.flows.certs import make_run_certificates

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
    with tempfile.TemporaryDirectory() as tmp:
        modes = {"direct": cfg, "tls": tls_config(cfg, Path(tmp) / "certs")}
        return paired_tokens_per_s(modes, {"direct": "direct", "tls": "tls + mTLS"}, tmp=Path(tmp),
                                   pairs=args.pairs, run_s=args.run_s, warmup_steps=args.warmup_steps, goal=GOAL,
                                   title="make bench-tls: bars")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
