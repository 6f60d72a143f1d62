"""``diloco-async ablate``: its arguments, and the checks made before anything starts (kept out of
:mod:`diloco_async.flows.cli` so that the command line stays small; Prefect is imported when it runs)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

__all__ = ["add_ablate_parser"]


def _ablate(args: argparse.Namespace, run_flow: Callable[..., int], weak_secret: Callable[[], bool]) -> int:
    """Check the suite file and every arm's recipe, then run the ``ablate`` flow."""
    from diloco_async.ablation.suite import load_suite
    from diloco_async.flows.outpath import check_out
    from diloco_async.flows.resolve import check_arms

    if weak_secret():
        return 2
    try:
        check_arms(load_suite(args.suite), args.set or [])
        check_out(args.out, "dir")
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from diloco_async.flows.ablate import run_ablate_cli

    return run_flow(run_ablate_cli, args.suite, args.set or [], args.out, args.json)


def add_ablate_parser(sub, run_flow: Callable[..., int], weak_secret: Callable[[], bool]) -> None:
    """Add the ``ablate`` subcommand to ``sub``; ``run_flow`` runs a flow entry the way the CLI does
    (embedded Prefect server, Ctrl-C), ``weak_secret`` refuses a weak ``$DILOCO_RUN_TOKEN``."""
    p = sub.add_parser("ablate", help="run an ablation suite of the paper (configs/ablations/*.toml): every arm "
                                      "and seed a real run, a table with 95%% intervals and a verdict per claim")
    p.add_argument("--suite", required=True, help="suite file, e.g. configs/ablations/merge.toml")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="records and report (default .local/ablate/<suite>); finished runs there are not re-run")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a field of every run, e.g. --set run.store=file:///tmp/store (repeatable)")
    p.add_argument("--json", action="store_true", help="also print the rows as a JSON list")
    p.set_defaults(func=lambda args: _ablate(args, run_flow, weak_secret))
