"""The ``diloco-async`` command line.

Subcommands import lazily so that ``diloco-async --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _train(args: argparse.Namespace) -> int:
    import os

    if os.environ.get("PREFECT_HOME"):
        os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)
    from flows.train import run_train_cli

    return run_train_cli(args.config, overrides=args.set or [])


def _resume(args: argparse.Namespace) -> int:
    import os

    if os.environ.get("PREFECT_HOME"):
        os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)
    from flows.train import run_resume_cli

    return run_resume_cli(args.checkpoint_url, args.config, overrides=args.set or [])


def _simulate(argv: list[str]) -> int:
    from diloco_async.sim.cli import main as sim_main

    return sim_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `simulate` owns its own flags; hand the rest of the line to it untouched.
    if argv and argv[0] == "simulate":
        return _simulate(argv[1:])
    parser = argparse.ArgumentParser(prog="diloco-async", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="run a training job (Prefect flow `train`)")
    p_train.add_argument("--config", default="configs/default.toml", help="recipe file (TOML)")
    p_train.add_argument(
        "--set", action="append", metavar="KEY=VALUE",
        help="override a config field, e.g. --set learners.count=2 (repeatable)",
    )
    p_train.set_defaults(func=_train)
    p_resume = sub.add_parser("resume", help="continue a run from a checkpoint (Prefect flow `resume`)")
    p_resume.add_argument("checkpoint_url", help="{store}/{run_id}/checkpoints/{seq}, or {store}/{run_id} for the newest")
    p_resume.add_argument("--config", default=None, help="recipe (default: the run's own config from the store)")
    p_resume.add_argument("--set", action="append", metavar="KEY=VALUE",
                          help="override a field, e.g. --set budget.tokens=12000000 to extend the run")
    p_resume.set_defaults(func=_resume)
    sub.add_parser("simulate", help="goodput simulator at paper scale (see `simulate --help`)")
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
